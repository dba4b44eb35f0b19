"""The rows of ``tools/user_paths.py`` that run processes: 1 (the README's example), 5
(``ppc serve``), 6 (``ppc generate``) and 7 (``ppc precompute``).

Each runs what a user runs, as a subprocess, on a model folder written by
``tiny_model.write_tiny_model``, against the same work without a cache in the same run:
mlx-lm's ``load`` and prefill, ``mlx_lm server``, ``mlx_lm generate``, and prefill +
``save_prompt_cache`` + fsync or a raw write + fsync of the same KV bytes. Servers listen
on free ports of 127.0.0.1 and are stopped in ``finally``; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import bench  # tools/bench.py: raw_write, fsync_path, settle
import bench_serve  # tools/bench_serve.py: Server (a server subprocess on a free port)
from user_paths_bench import Bench, clock, interleave, kv_bytes, median, mlx_prefill, per_round

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the store keeps every block of a prompt on disk so that a server restarted later restores its "
         "prefix instead of computing it again while the model reads a long document about caches memory "
         "tokens layers values keys and the time each request waits").split()  # fmt: skip
RUN_TIMEOUT = 900

PLAIN_EXAMPLE = """\
# The README's example without a cache: mlx-lm's load and its prefill (generate_step).
from mlx_lm import load
from mlx_lm.generate import generate_step
import mlx.core as mx

model, tokenizer = load("path/to/model")
prompt = {prompt}
for _ in generate_step(mx.array(prompt), model, max_tokens=0):
    pass
"""

# Row 7's baseline as a program of its own, as `ppc precompute` runs in one: mlx-lm's load,
# then per prompt its prefill, `save_prompt_cache` and an fsync. It prints the seconds after
# the load, which is what `ppc precompute` reports of itself (a process's first forwards
# are slower, and both pay them).
MLX_SAVE_PROGRAM = """\
import json, os, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

folder, prompts, out = sys.argv[1:4]
model, _ = load(folder)
with open(prompts) as f:
    ids = json.load(f)
started = time.perf_counter()
for i, x in enumerate(ids):
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(x), model, max_tokens=0, prompt_cache=cache):
        pass
    path = os.path.join(out, f"{i}.safetensors")
    save_prompt_cache(path, cache)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
print(json.dumps({"seconds": time.perf_counter() - started}))
"""


def ppc_command() -> list[str]:
    """``ppc`` as installed beside this interpreter, else ``python -m persistent_prefix_cache``."""
    exe = Path(sys.executable).parent / "ppc"
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [sys.executable, "-m", "persistent_prefix_cache"]


def user_env(**extra: str) -> dict[str, str]:
    """The environment a user's command sees: ours without ``$PPC_STORE``, plus `extra`.

    Without ``$PYTHONDONTWRITEBYTECODE`` too: a user's Python caches compiled modules (pip
    compiles an installed package's, and an editable checkout's are written on first
    import), as mlx-lm's installed modules are here. Set (as this project's VM sets it), every
    process of ours compiled the package's ~25k lines again: ~0.13 s of a ~2 s run that the
    baseline, importing mlx-lm's compiled modules, never paid."""
    env = {k: v for k, v in os.environ.items() if k not in ("PPC_STORE", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_timed(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Wall seconds of a command, from its start to its exit, and its stdout.

    Raises:
        RuntimeError: If it exits non-zero (with the end of its stderr).
    """
    started = time.perf_counter()
    cwd = cwd or Path(tempfile.gettempdir())  # a user's folder, not a checkout (see bench_serve.Server)
    proc = subprocess.run(cmd, cwd=cwd, env=env or user_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {proc.stderr[-3000:]}")
    return seconds, proc.stdout


def tokenizer_of(folder: Path) -> Any:
    from mlx_lm.tokenizer_utils import load

    return load(Path(folder))


def texts(tokenizer: Any, tokens: int, count: int, seed: int) -> list[str]:
    """`count` distinct texts of random words, each about `tokens` tokens long."""
    rng = random.Random(seed)
    sample = " ".join(rng.choice(WORDS) for _ in range(400))
    per_word = len(tokenizer.encode(sample)) / 400
    words = max(1, round(tokens / per_word))
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


# -- row 1: the README's library example ---------------------------------------------------


def readme_example(readme: Path) -> str:
    """The ``<!-- runnable -->`` python block of the README's "Use it as a library"."""
    section = readme.read_text().split("## Use it as a library", 1)[-1]
    found = re.search(r"<!-- runnable -->\n```python\n(.*?)\n```", section, re.S)
    if not found:
        raise RuntimeError(f"{readme}: no runnable python block under 'Use it as a library'")
    return found.group(1) + "\n"


def row_readme(b: Bench) -> None:
    example = readme_example(ROOT / "README.md")
    prompt = re.search(r"^prompt = (.+)$", example, re.M)
    if not prompt:
        raise RuntimeError("the README's example has no 'prompt = ...' line to give the plain run")
    site = b.scratch("readme")
    (site / "path" / "to").mkdir(parents=True)
    (site / "path" / "to" / "model").symlink_to(b.folder)  # the path the example names
    (site / "example.py").write_text(example)
    (site / "plain.py").write_text(PLAIN_EXAMPLE.format(prompt=prompt.group(1)))
    printed: list[str] = []

    def plain() -> dict[str, float]:
        home = b.scratch("home")
        home.mkdir()
        seconds, _ = run_timed([sys.executable, "plain.py"], cwd=site, env=user_env(HOME=str(home)))
        return {"plain": seconds}

    def example_twice() -> dict[str, float]:
        home = b.scratch("home")  # ~/.cache/my-app/kv lands here: empty, then written by the 1st run
        home.mkdir()
        env = user_env(HOME=str(home))
        first, out1 = run_timed([sys.executable, "example.py"], cwd=site, env=env)
        second, out2 = run_timed([sys.executable, "example.py"], cwd=site, env=env)
        printed[:] = [out1.strip(), out2.strip()]
        shutil.rmtree(home)
        return {"first": first, "second": second}

    rounds = b.plan.readme_repeat or b.plan.repeat
    times = interleave({"plain": plain, "example": example_twice}, rounds, b.plan.warmup)
    for which, label in (("first", "1st run, empty store"), ("second", "2nd run, a new process")):
        b.add(1, f"README example ({label}) ÷ mlx-lm load + prefill", median(times[which]),
              median(times["plain"]), per_round(times[which], times["plain"]), "<= 1.05",
              baseline_is="the same script without a cache (process wall time)", printed=printed,
              runs_s={which: times[which], "plain": times["plain"]})  # fmt: skip


# -- row 5: ppc serve, restarted -------------------------------------------------------------


def target_serve(n: int) -> str:
    return "<= 0.3" if n >= 8192 else "<= 0.5" if n >= 2048 else "<= 1.05"


def row_serve(b: Bench) -> None:
    folder = b.folder
    tok = tokenizer_of(folder)
    lengths, repeat = b.plan.serve_tokens, b.plan.repeat
    seen = {n: texts(tok, n, repeat, seed=100 + n) for n in lengths}
    unseen = {n: texts(tok, n, repeat, seed=200 + n) for n in lengths}
    warm = texts(tok, max(lengths), 1, seed=300)[0]
    store = b.scratch("serve-store")
    ppc = [*ppc_command(), "serve", "--model", str(folder), "--store", str(store)]
    plain = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder)]
    b.log(f"ppc serve: {len(lengths) * repeat} prompts, then a restart ...")
    server = bench_serve.Server(ppc, b.scratch("serve").with_suffix(".log"))
    try:
        for n in lengths:
            for text in seen[n]:
                server.complete(text)
    finally:
        server.stop()  # SIGTERM: ppc serve flushes its writes and exits
    servers: list[bench_serve.Server] = []

    def ask(server: bench_serve.Server, text: str) -> tuple[float, dict]:
        started = time.perf_counter()
        reply = server.complete(text)
        return time.perf_counter() - started, reply["usage"]

    try:
        servers.append(bench_serve.Server(ppc, b.scratch("serve-restarted").with_suffix(".log")))
        servers.append(bench_serve.Server(plain, b.scratch("mlx-server").with_suffix(".log")))
        ours, theirs = servers
        if b.plan.warmup:  # a never-seen prompt on each: the first request's setup, for both
            ask(ours, warm)
            ask(theirs, warm)
        times: dict[int, dict[str, list[float]]] = {n: {} for n in lengths}
        usage: dict[int, dict[str, list]] = {n: {} for n in lengths}
        for r in range(repeat):
            for n in lengths:
                steps = [("seen", ours, seen[n][r]), ("unseen", ours, unseen[n][r]), ("mlx", theirs, unseen[n][r])]
                if r % 2:  # interleaved: the order turns every round
                    steps.reverse()
                for name, server, text in steps + [("again", ours, seen[n][r])]:
                    seconds, used = ask(server, text)
                    times[n].setdefault(name, []).append(seconds)
                    details = used.get("prompt_tokens_details") or {}
                    usage[n].setdefault(name, []).append((used["prompt_tokens"], details.get("cached_tokens", 0)))
    finally:
        for server in servers:
            server.stop()
        if servers:  # the restarted server's restores and its store's decisions (why a seen prompt missed)
            lines = servers[0].log_path.read_text(errors="replace").splitlines()
            b.extra["serve_restarted_log"] = [line for line in lines if "persistent" in line or "store " in line][-40:]
    for n in lengths:
        t, u = times[n], usage[n]
        for name in ("seen", "again"):
            missed = sum(1 for prompt, cached in u[name] if cached < prompt // 2)
            if missed:
                b.note(f"row 5, ~{n} tokens: {missed} of {len(u[name])} {name} prompts came back with less than "
                       f"half their tokens cached (cached_tokens {[c for _, c in u[name]]})")  # fmt: skip
        label = f"~{n} tokens"
        detail = dict(usage_prompt_and_cached_tokens=u, runs_s=t)
        b.add(5, f"{label}: ppc serve restarted, seen-before ÷ never-seen prompt", median(t["seen"]),
              median(t["unseen"]), per_round(t["seen"], t["unseen"]), target_serve(n),
              baseline_is="a never-seen prompt, same server, over HTTP", **detail)  # fmt: skip
        b.add(5, f"{label}: ppc serve, seen-before, asked again ÷ never-seen", median(t["again"]),
              median(t["unseen"]), per_round(t["again"], t["unseen"]), "-",
              baseline_is="a never-seen prompt, same server")  # fmt: skip
        b.add(5, f"{label}: ppc serve never-seen ÷ mlx_lm server never-seen", median(t["unseen"]),
              median(t["mlx"]), per_round(t["unseen"], t["mlx"]), "<= 1.05",
              baseline_is="mlx_lm server, same flags, same prompt")  # fmt: skip


# -- row 6: ppc generate ---------------------------------------------------------------------


def prompt_speed(stdout: str) -> float | None:
    """The "Prompt: N tokens, X tokens-per-sec" figure both commands print."""
    found = re.search(r"Prompt: \d+ tokens, ([\d.]+) tokens-per-sec", stdout)
    return float(found.group(1)) if found else None


def row_generate(b: Bench) -> None:
    folder = b.folder
    text = texts(tokenizer_of(folder), b.plan.generate_tokens, 1, seed=400)[0]
    flags = ["--model", str(folder), "--prompt", text, "--max-tokens", str(b.plan.generate_max_tokens)]
    speeds: dict[str, list] = {}

    def plain() -> dict[str, float]:
        seconds, out = run_timed([sys.executable, "-m", "mlx_lm", "generate", *flags])
        speeds.setdefault("mlx_lm", []).append(prompt_speed(out))
        return {"plain": seconds}

    def ours() -> dict[str, float]:
        store = b.scratch("generate-store")  # the same flags; the store from $PPC_STORE
        cold, out1 = run_timed([*ppc_command(), "generate", *flags], env=user_env(PPC_STORE=str(store)))
        warm, out2 = run_timed([*ppc_command(), "generate", *flags], env=user_env(PPC_STORE=str(store)))
        speeds.setdefault("ppc_cold", []).append(prompt_speed(out1))
        speeds.setdefault("ppc_warm", []).append(prompt_speed(out2))
        shutil.rmtree(store)
        return {"cold": cold, "warm": warm}

    times = interleave({"plain": plain, "ours": ours}, b.plan.repeat, b.plan.warmup)
    for which, label, target in (("cold", "cold store", "<= 1.05"), ("warm", "2nd run, warm store", "-")):
        b.add(6, f"~{b.plan.generate_tokens} tokens: ppc generate ({label}) ÷ mlx_lm generate", median(times[which]),
              median(times["plain"]), per_round(times[which], times["plain"]), target,
              baseline_is="mlx_lm generate, same flags (process wall time)",
              prompt_tokens_per_s=speeds, runs_s={which: times[which], "plain": times["plain"]})  # fmt: skip


# -- row 7: ppc precompute -------------------------------------------------------------------


def row_precompute(b: Bench) -> None:
    from mlx_lm import load

    folder = b.folder
    model = b.library()[0] if b.mode != "gpu" else load(str(folder))[0]
    tok = tokenizer_of(folder)
    prompts = texts(tok, b.plan.precompute_tokens, b.plan.precompute_prompts, seed=500)
    inputs = b.scratch("precompute-inputs")
    inputs.mkdir()
    files = []
    for i, text in enumerate(prompts):
        files.append(inputs / f"prompt-{i}.txt")
        files[-1].write_text(text)
    ids = [list(tok.encode(text)) for text in prompts]
    per_token = kv_bytes(mlx_prefill(model, ids[0])) / len(ids[0])
    sizes = [int(per_token * len(x)) for x in ids]
    junk = np.random.default_rng(0).integers(0, 256, size=max(sizes), dtype=np.uint8)
    total = sum(map(len, ids))
    reported: list[dict] = []

    def ours() -> dict[str, float]:
        store = b.scratch("precompute-store")
        bench.settle()
        wall, out = run_timed([*ppc_command(), "precompute", "--model", str(folder), "--store", str(store),
                               "--json", "--no-progress", *map(str, files)])  # fmt: skip
        summary = json.loads(out)
        reported.append(
            {k: summary[k] for k in ("tokens", "tokens_computed", "seconds", "tokens_per_second")} | {"wall_s": wall}
        )
        shutil.rmtree(store)
        # Seconds per computed token, as ppc reports it (load and process start are not in it).
        return {"ours": summary["seconds"] / summary["tokens_computed"]}

    prompt_ids = inputs / "ids.json"
    prompt_ids.write_text(json.dumps(ids))

    def mlx_save() -> dict[str, float]:
        folder_ = b.scratch("mlx-save")
        folder_.mkdir()
        bench.settle()
        _, out = run_timed([sys.executable, "-c", MLX_SAVE_PROGRAM, str(folder), str(prompt_ids), str(folder_)])
        shutil.rmtree(folder_)
        return {"mlx_save": json.loads(out.strip().splitlines()[-1])["seconds"] / total}

    def prefill_alone() -> dict[str, float]:
        return {"prefill": sum(clock(lambda: mlx_prefill(model, x))[0] for x in ids) / total}

    def disk() -> dict[str, float]:
        folder_ = b.scratch("raw-write")
        folder_.mkdir()
        bench.settle()
        started = time.perf_counter()
        for i, size in enumerate(sizes):
            bench.raw_write(str(folder_ / f"{i}.bin"), junk[:size])  # write + fsync
        seconds = time.perf_counter() - started
        shutil.rmtree(folder_)
        return {"disk": seconds / total}

    ops = {"ours": ours, "mlx_save": mlx_save, "prefill": prefill_alone, "disk": disk}
    times = interleave(ops, b.plan.repeat, b.plan.warmup)
    speed = {k: [1 / s for s in v] for k, v in times.items()}  # tokens/s
    # What no precompute can beat: the slower of the model's prefill and the disk, per round.
    speed["attainable"] = [min(p, d) for p, d in zip(speed["prefill"], speed["disk"])]
    what = f"{len(ids)} x ~{b.plan.precompute_tokens} tokens: ppc precompute"
    detail = dict(kv_bytes_per_token=per_token, ppc_reported=reported, tokens=total)
    b.add(7, f"{what} ÷ the disk's limit (tokens/s)", median(speed["ours"]), median(speed["disk"]),
          per_round(speed["ours"], speed["disk"]), ">= 0.9", unit="tokens/s",
          baseline_is="raw write + fsync of the same KV bytes", **detail)  # fmt: skip
    b.add(7, f"{what} ÷ min(prefill alone, the disk's limit)", median(speed["ours"]), median(speed["attainable"]),
          per_round(speed["ours"], speed["attainable"]), ">= 0.9", unit="tokens/s",
          baseline_is="the slower of mlx-lm's prefill alone and the disk's limit, per round",
          prefill_alone_tokens_per_s=median(speed["prefill"]))  # fmt: skip
    b.add(7, f"{what} ÷ prefill + save_prompt_cache + fsync", median(speed["ours"]), median(speed["mlx_save"]),
          per_round(speed["ours"], speed["mlx_save"]), ">= 1.0", unit="tokens/s",
          baseline_is="mlx-lm prefill + save_prompt_cache + fsync, a program of its own (seconds after its load)")  # fmt: skip
    model = None  # the weights go before clear_cache (the closures above ran already)
    mx.clear_cache()

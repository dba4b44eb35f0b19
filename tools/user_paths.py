#!/usr/bin/env python3
"""The paths users run, each against no cache in the same run (issue 28, item 6).

Only what users call, as they call it: the public API with default options
(`PersistentPrefixCache`, `prefill`, `fetch`, `store`), ``ppc`` as subprocesses and
``ppc serve`` over HTTP. No private attribute, module setting or hand-set rate is
touched, so the same tool measures any version of the library. Each row is a ratio
against no cache measured in the same run (mlx-lm's own code: ``generate_step``'s
prefill in 2048-token steps, ``mlx_lm generate``, ``mlx_lm server``, its
``save_prompt_cache``, or the disk's limit):

1. the README's library example (its ``<!-- runnable -->`` block, read from README.md
   and run unchanged in a fresh process, first on an empty store, then again) ÷ the same
   load + prefill with plain mlx-lm, process wall time;
2. ``prefill(model, tokens, store)`` on an empty store ÷ mlx-lm's prefill, per length;
3. ``prefill()`` after a restart (a new process): its 1st, 2nd, 3rd call ÷ a cold
   mlx-lm prefill timed in that process before the store is opened (and ÷ one right
   after the open);
4. a chat growing over 8 turns, ``prefill()`` after each, restored after a restart:
   the restore ÷ the same KV stored by one ``store()``, ÷ recomputing it, and the
   restore speed of the prompt stored one ``store()`` per block ÷ stored at once;
5. ``ppc serve`` restarted: a prompt seen before the restart ÷ a never-seen one, and a
   never-seen prompt ÷ the same on ``mlx_lm server`` (``tools/user_paths_cli.py``);
6. ``ppc generate`` ÷ ``mlx_lm generate``, cold store and warm store;
7. ``ppc precompute`` tokens/s ÷ the disk's limit and ÷ prefill + ``save_prompt_cache``.

Modes: the default runs a small llama (``tiny_model.write_tiny_model``, hidden size
256, 2 layers) on MLX's default device in a few minutes on a 2-core VM; ``--smoke`` is
a tiny run for CI; ``--gpu`` runs an 8B-shaped llama in bf16 built in-process
(``tools/gpu_bench.py``'s ``SHAPE_8B``) for rows 2-4 and a 3B-shaped model folder for
the others. Every timed figure is the median of ``--repeat`` runs after a warm-up (row 1,
whole processes, 5 in the default mode unless ``--repeat`` is given), the compared
operations interleaved; each ratio is the median of per-round ratios.

    python tools/user_paths.py                 # the small model (CPU: ~5-8 minutes)
    python tools/user_paths.py --smoke --json  # what CI runs
    python tools/user_paths.py --gpu --rows 2,3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
try:
    import persistent_prefix_cache  # noqa: F401
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))
from persistent_prefix_cache import PersistentPrefixCache, prefill  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from user_paths_bench import (  # noqa: E402  (tools/user_paths_bench.py: the measuring kit)
    ROW_NAMES, Bench, Plan, clock, fmt_value, interleave, kv_bytes, load_library_model, median, mlx_prefill, per_round,
    prompt_ids,
)  # fmt: skip

# -- row 2: prefill() on an empty store ------------------------------------------------------


def target_restart(n: int, call: str) -> str:
    """Issue 28's targets for a restarted process (H200 lengths; never worse elsewhere)."""
    if n >= 16384:
        return "<= 0.3" if call == "1st" else "<= 0.1" if call == "3rd" else "<= 1.05"
    if n >= 4096:
        return "<= 0.5" if call == "1st" else "<= 0.15" if call == "3rd" else "<= 1.05"
    return "<= 1.05"


def row_prefill_empty(b: Bench) -> None:
    model, options, _ = b.library()
    vocab = model.args.vocab_size
    for n in b.plan.prefill_tokens:
        ids = prompt_ids(vocab, n, seed=n)
        kept: list[Path] = []
        closes: list[float] = []

        def ours() -> dict[str, float]:
            path = b.scratch(f"prefill-empty-{n}")
            store = PersistentPrefixCache(path, model, **options)  # the README's open, defaults
            try:
                seconds, _ = clock(lambda: prefill(model, ids, store))
            finally:
                closes.append(clock(store.close)[0])  # its writes finish outside the timing
            for old in kept:
                shutil.rmtree(old, ignore_errors=True)
            kept[:] = [path]
            return {"ours": seconds}

        def plain() -> dict[str, float]:
            return {"plain": clock(lambda: mlx_prefill(model, ids))[0]}

        # A whole warm-up round at the first length (kernels); later lengths warm the
        # device's buffers with the cheap side only (prefill() can take 20 s at 16k).
        warmup = b.plan.warmup
        if n != b.plan.prefill_tokens[0] and warmup:
            plain()
            warmup = 0
        times = interleave({"ours": ours, "plain": plain}, b.plan.prefill_repeat or b.plan.repeat, warmup)
        b.prefilled[n] = kept[0]
        b.add(2, f"{n} tokens: prefill() ÷ mlx-lm prefill", median(times["ours"]), median(times["plain"]),
              per_round(times["ours"], times["plain"]), "<= 1.05", baseline_is="mlx-lm generate_step prefill",
              runs_s=times, close_after_s=closes)  # fmt: skip


# -- rows 3 and 4: restarted processes -------------------------------------------------------


def chat_tokens(vocab: int, plan: Plan) -> list[list[int]]:
    """The conversation after each turn: user text and its answer appended (seeded)."""
    conv: list[int] = []
    out = []
    for turn in range(plan.chat_turns):
        conv = (
            conv
            + prompt_ids(vocab, plan.chat_user, seed=1000 + turn)
            + prompt_ids(vocab, plan.chat_answer, seed=2000 + turn)
        )
        out.append(conv)
    return out


def build_chat_stores(b: Bench) -> dict:
    """Three stores of one conversation: prefill() after each turn (as an app does), one
    store() of the whole, and one store() per block (as prefill did up to ed6cf38)."""
    model, options, _ = b.library()
    from mlx_lm.models.cache import make_prompt_cache

    turns = chat_tokens(model.args.vocab_size, b.plan)
    conv = turns[-1]
    paths = {name: b.scratch(f"chat-{name}") for name in ("turns", "once", "blocks")}
    started = time.perf_counter()
    with PersistentPrefixCache(paths["turns"], model, **options) as store:
        for ids in turns:
            cache, _ = prefill(model, ids, store)
    per_turn_s = time.perf_counter() - started
    with PersistentPrefixCache(paths["once"], model, **options) as store:
        store.store(conv, cache)
    with PersistentPrefixCache(paths["blocks"], model, **options) as store:
        block, part = store.block_size, make_prompt_cache(model)
        for at in range(0, len(conv), block):
            end = min(at + block, len(conv))
            model(mx.array(conv[at:end])[None], cache=part)
            mx.eval([c.state for c in part])
            store.store(conv[:end], part)
    # How each store's bytes lie (a restore reads per segment): the segment files' sizes.
    segments = {k: sorted(f.stat().st_size for f in (Path(v) / "segments").rglob("*.seg")) for k, v in paths.items()}
    return {"paths": {k: str(v) for k, v in paths.items()}, "tokens": conv, "kv_bytes": kv_bytes(cache),
            "build_turns_s": per_turn_s, "segment_bytes": segments}  # fmt: skip


def rows_restarted(b: Bench, rows: set[int]) -> None:
    """Rows 3 and 4: `repeat` restarted processes (``--child``), each measuring both."""
    model, options, spec = b.library()
    vocab = model.args.vocab_size
    job: dict[str, Any] = {"model": spec, "rounds": b.plan.chat_rounds}
    if 3 in rows:
        restart = []
        for n in b.plan.prefill_tokens:
            if n not in b.prefilled:  # row 2 did not run: fill a store the way it would have
                path = b.scratch(f"prefill-empty-{n}")
                with PersistentPrefixCache(path, model, **options) as store:
                    prefill(model, prompt_ids(vocab, n, seed=n), store)
                b.prefilled[n] = path
            restart.append({"tokens": prompt_ids(vocab, n, seed=n), "store": str(b.prefilled[n])})
        job["restart"] = restart
    job["warmup"] = prompt_ids(vocab, max(b.plan.prefill_tokens), seed=7)
    if 4 in rows:
        chat = build_chat_stores(b)
        job["chat"] = chat
    results = [b.run_child(job, f"restarted-{r}") for r in range(b.plan.repeat)]
    if 3 in rows:
        for i, n in enumerate(b.plan.prefill_tokens):
            runs = [r["restart"][i] for r in results]
            cold = [r["cold_s"] for r in runs]
            cold_after_open = [r["cold_after_open_s"] for r in runs]
            for k, call in enumerate(("1st", "2nd", "3rd")):
                t = [r["calls_s"][k] for r in runs]
                b.add(3, f"{n} tokens: {call} prefill() in a new process ÷ cold prefill", median(t), median(cold),
                      per_round(t, cold), target_restart(n, call), baseline_is="mlx-lm prefill in the same process",
                      vs_cold_after_open=per_round(t, cold_after_open), cold_after_open_s=median(cold_after_open),
                      restored_tokens=[r["restored"][k] for r in runs], open_s=[r["open_s"] for r in runs],
                      decisions=[r["decisions"] for r in runs])  # fmt: skip
                short = [x for x in (r["restored"][k] for r in runs) if x < n - 1]
                if short:
                    b.note(f"row 3, {n} tokens, {call} call: restored {short} of {n - 1} stored tokens in "
                           f"{len(short)} of {len(runs)} processes (the rest computed)")  # fmt: skip
    if 4 in rows:
        chats = [r["chat"] for r in results]
        restore = {k: [t for c in chats for t in c["restore_s"][k]] for k in ("turns", "once", "blocks")}
        restored = {k: sorted({t for c in chats for t in c["restored"][k]}) for k in restore}
        n = len(chat["tokens"])
        detail = dict(
            tokens=n, kv_bytes=chat["kv_bytes"], restored_tokens=restored, build_turn_by_turn_s=chat["build_turns_s"]
        )
        # Restore speed: tokens restored per second (the same bytes a token, so bytes/s alike).
        speed = {k: [max(restored[k]) / t for t in v] for k, v in restore.items()}
        b.add(4, f"{n} tokens: restore, chat stored every turn ÷ stored at once", median(restore["turns"]),
              median(restore["once"]), per_round(restore["turns"], restore["once"]), "<= 1.1",
              baseline_is="the same KV stored by one store()", restore_options="cost_model=False", **detail)  # fmt: skip
        recompute = [c["recompute_s"] for c in chats]
        turns_first = [c["restore_s"]["turns"][0] for c in chats]
        b.add(4, f"{n} tokens: restore, chat stored every turn ÷ recomputing it", median(turns_first),
              median(recompute), per_round(turns_first, recompute), "<= 1.05",
              baseline_is="mlx-lm prefill in the same process", restore_options="cost_model=False")  # fmt: skip
        resume = [c["resume_s"] for c in chats]
        b.add(4, f"{n} tokens: prefill() of the chat (default options) ÷ recomputing it", median(resume),
              median(recompute), per_round(resume, recompute), "<= 1.05",
              baseline_is="mlx-lm prefill in the same process", resumed_tokens=[c["resumed"] for c in chats],
              resume_costs=[c["resume_costs"] for c in chats], runs_s={"resume": resume, "recompute": recompute})  # fmt: skip
        b.add(4, f"{n} tokens: restore speed, stored block by block ÷ at once", median(speed["blocks"]),
              median(speed["once"]), per_round(speed["blocks"], speed["once"]), ">= 0.9", unit="tokens/s",
              baseline_is="the same KV stored by one store()", restore_options="cost_model=False",
              segment_bytes=chat["segment_bytes"], restore_s={k: restore[k] for k in ("once", "blocks")})  # fmt: skip
        b.note("row 4 segments (MiB): " + "; ".join(
            f"{k} {[round(x / 2**20) for x in v]}" for k, v in chat["segment_bytes"].items()))  # fmt: skip


def child(spec_path: str) -> int:
    """A restarted process: rows 3 and 4 measured on stores a previous process wrote."""
    from mlx_lm.models.cache import make_prompt_cache  # noqa: F401  (imported before timing)

    job = json.loads(Path(spec_path).read_text())
    model, options = load_library_model(job["model"])
    out: dict[str, Any] = {}
    # Kernels and buffers, for both sides alike: without it the first timed call (the
    # chat's resume) compiled the kernels the recompute after it found ready.
    mlx_prefill(model, job["warmup"])
    if "restart" in job:
        out["restart"] = []
        for case in job["restart"]:
            ids = case["tokens"]
            cold, _ = clock(lambda: mlx_prefill(model, ids))
            opened, store = clock(lambda: PersistentPrefixCache(case["store"], model, **options))
            cold_after_open, _ = clock(lambda: mlx_prefill(model, ids))
            calls, restored = [], []
            try:
                for _ in range(3):
                    before = store.stats()["tokens_saved"]
                    calls.append(clock(lambda: prefill(model, ids, store))[0])
                    restored.append(store.stats()["tokens_saved"] - before)
                stats = store.stats()
            finally:
                store.close()
            decisions = {
                k: stats[k] for k in ("restored_all", "restored_ram_only", "restored_shorter", "skipped_slower")
            }
            out["restart"].append({"cold_s": cold, "cold_after_open_s": cold_after_open, "open_s": opened,
                                   "calls_s": calls, "restored": restored, "decisions": decisions})  # fmt: skip
    if "chat" in job:
        chat = job["chat"]
        conv, paths = chat["tokens"], chat["paths"]
        # The resume's last forward (one token over the restored cache) is the process's
        # first at this cache length, which costs 55-90 ms on an H100 for mlx-lm too
        # (docs/performance.md, eighteenth day), and the recompute after it found those
        # kernels ready: a prefill of other tokens of this length warms both sides alike.
        vocab = model.args.vocab_size
        mlx_prefill(model, [(t + 1) % vocab for t in conv])
        # First what a user does after a restart: resume the conversation (default options).
        with PersistentPrefixCache(paths["turns"], model, **options) as store:
            resume, _ = clock(lambda: prefill(model, conv, store))
            stats = store.stats()
            resumed = stats["tokens_saved"]
            # What the cost model knew and decided (a skipped restore is explained by these).
            costs = {k: v for k, v in stats.items() if k.startswith(("restore", "first_", "prefill_", "skipped"))}
        recompute, _ = clock(lambda: mlx_prefill(model, conv))
        restore: dict[str, list[float]] = {k: [] for k in paths}
        restored: dict[str, list[int]] = {k: [] for k in paths}
        names = list(paths)
        for round_ in range(job["rounds"]):
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                # A fresh handle (empty RAM tier) that restores whatever is stored.
                with PersistentPrefixCache(paths[name], model, cost_model=False, **options) as store:

                    def fetch() -> int:
                        cache, rest = store.fetch(conv)
                        if cache is not None:
                            mx.eval([c.state for c in cache])
                        return len(conv) - len(rest)

                    seconds, n = clock(fetch)
                restore[name].append(seconds)
                restored[name].append(n)
        out["chat"] = {"resume_s": resume, "resumed": resumed, "resume_costs": costs, "recompute_s": recompute,
                       "restore_s": restore, "restored": restored}  # fmt: skip
    print(json.dumps(out))
    return 0


# -- the report -------------------------------------------------------------------------------


def table(result: dict) -> str:
    plan = result["plan"]
    rounds = f"{plan['repeat']}" + "".join(
        f" (row {row}: {plan[key]})" for row, key in ((1, "readme_repeat"), (2, "prefill_repeat")) if plan.get(key)
    )
    lines = [
        f"persistent_prefix_cache: the paths users run ({result['mode']}; mlx {result['mlx']} on {result['device']}, "
        f"mlx-lm {result['mlx_lm']}; median of {rounds} after {plan['warmup']} warm-up)",
        f"{'row':<3} {'path':<72} {'ours':>14} {'no cache':>14} {'ratio':>7}  target",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['row']:<3} {r['what']:<72} {fmt_value(r['figure'], r['unit']):>14} "
            f"{fmt_value(r['baseline'], r['unit']):>14} {r['ratio']:>7.3f}  {r['target']}"
        )
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def parse_rows(text: str) -> set[int]:
    rows: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        rows.update(range(int(lo), int(hi or lo) + 1))
    if not rows <= set(ROW_NAMES):
        raise SystemExit(f"error: --rows takes numbers 1-7, got {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="an 8B-shaped model (rows 2-4) and a 3B folder (the others)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    p.add_argument(
        "--small", action="store_true", help="with --gpu: its paths with small shapes (to check them on a CPU)"
    )
    p.add_argument("--rows", default="1-7", help="which rows, e.g. 2,3 or 5-7 (default: all)")
    p.add_argument(
        "--repeat", type=int, default=0, help="timed rounds per figure (default: 3; 2 with --gpu; 1 with --smoke)"
    )
    p.add_argument("--tokens", default="", help="prompt lengths of rows 2 and 3, comma-separated")
    p.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    p.add_argument("--dir", default=None, help="scratch folder's parent (default: the system's temp folder)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    sys.modules.setdefault("user_paths", sys.modules[__name__])  # one copy of this module, run or imported
    import user_paths_cli  # tools/user_paths_cli.py: rows 1, 5, 6, 7

    rows = parse_rows(args.rows)
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="ppc-user-paths-", dir=args.dir))
    try:
        b = Bench(args, work)
        steps: list[tuple[int, Callable[[], None]]] = [
            (1, lambda: user_paths_cli.row_readme(b)),
            (2, lambda: row_prefill_empty(b)),
            (3, lambda: rows_restarted(b, rows & {3, 4})),
            (5, lambda: user_paths_cli.row_serve(b)),
            (6, lambda: user_paths_cli.row_generate(b)),
            (7, lambda: user_paths_cli.row_precompute(b)),
        ]
        for row, step in steps:
            if row in rows or (row == 3 and 4 in rows):
                step()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from importlib.metadata import version

    result = {
        "mode": b.mode + (" (small)" if b.small else ""),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "plan": asdict(b.plan),
        "rows": b.rows,
        "notes": b.notes,
        "wall_s": time.perf_counter() - started,
        **b.extra,
    }
    report = table(result)
    if args.json:
        print(report, file=sys.stderr)
        print(json.dumps(result, indent=1))
    else:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

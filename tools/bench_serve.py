#!/usr/bin/env python3
"""Memory of ``ppc serve`` beside ``mlx_lm server`` with the same flags, in one run.

Each server runs as a real subprocess on 127.0.0.1 with a tiny random-weight model
(``tiny_model.write_tiny_model``, wider than the tests' so that its KV dominates the
process's memory) and ``--prompt-cache-bytes B --prompt-cache-size 1000``. Each gets:

1. N distinct long prompts (random words, seeded; ``/v1/completions``, one token each),
2. then N requests of one long prompt (a hit from the second on).

The process's resident memory (``VmRSS`` in ``/proc/<pid>/status``) is read after the
first third of phase 1, at the end of phase 1 and at the end of phase 2, and its peak
(``VmHWM``) at the end. Linux only (``/proc``). The servers run one after the other, the
same prompts in the same order; a fresh store per ``ppc serve`` run.

Examples::

    python tools/bench_serve.py                      # the default (a few minutes here)
    python tools/bench_serve.py --prompts 6 --json   # smaller, JSON on stdout
    python tools/bench.py --serve ...                # the same, as an optional row of bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Wider than the tests' model: 8 KiB of KV per token (4 layers x 4 KV heads x 64 x k,v x f32).
MODEL_SHAPE = dict(family="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=512)
WORDS = "cache prompt memory budget server block store restore token layer value key trie prefix".split()
START_TIMEOUT = 120
REQUEST_TIMEOUT = 300


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Server:
    """A server subprocess on a free port of 127.0.0.1, up once ``/health`` answers.

    Args:
        cmd: The command, without ``--host``/``--port`` (added here).
        log_path: Where its stdout and stderr go.

    Raises:
        RuntimeError: If it exits or is not up within ``START_TIMEOUT`` seconds
            (it is stopped then).
    """

    def __init__(self, cmd: list[str], log_path: Path):
        self.port = free_port()
        self._log = open(log_path, "w")
        env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
        cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        # From the log's folder, as a user's server runs from theirs: never from a checkout,
        # whose package folder would shadow the installed one (`python -m`).
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)
        self.log_path = log_path
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # closes the log
                raise RuntimeError(f"server exited {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not up after {START_TIMEOUT} s")

    def complete(self, prompt: str) -> dict:
        """``/v1/completions`` of `prompt`, one token, greedy: the reply's JSON."""
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 60 s; closes the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def run_one(name: str, cmd: list[str], prompts: list[str], hot: str, log_path: Path) -> dict[str, Any]:
    """Phase 1 (distinct prompts) and phase 2 (hits of one prompt) against one server."""
    server = Server(cmd, log_path)
    try:
        third = max(1, len(prompts) // 3)
        row: dict[str, Any] = {"server": name, "prompt_tokens": 0, "cached_tokens_hits": []}
        for i, prompt in enumerate(prompts, 1):
            reply = server.complete(prompt)
            row["prompt_tokens"] += reply["usage"]["prompt_tokens"]
            if i == third:
                row["rss_after_third"] = _status(server.proc.pid)["VmRSS"]
        row["rss_after_distinct"] = _status(server.proc.pid)["VmRSS"]
        for _ in range(len(prompts)):
            reply = server.complete(hot)
            details = reply["usage"].get("prompt_tokens_details") or {}
            row["cached_tokens_hits"].append(details.get("cached_tokens", 0))
        status = _status(server.proc.pid)
        row["rss_after_hits"], row["peak_rss"] = status["VmRSS"], status["VmHWM"]
    finally:
        server.stop()
    return row


def serve_figures(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """RSS rows of every server configuration on the same prompts.

    Args:
        args: ``prompts``, ``words``, ``cache_bytes`` and ``servers`` (see `parse_args`).
        workdir: Scratch folder (model, stores, logs).

    Returns:
        ``{"config", "rows"}``, one row per server.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from persistent_prefix_cache.tiny_model import write_tiny_model

    model = write_tiny_model(workdir / "model", seed=0, **MODEL_SHAPE)
    rng = random.Random(7)
    prompts = [_prompt(rng, args.words) for _ in range(args.prompts)]
    hot = _prompt(rng, args.words)
    flags = ["--model", str(model), "--prompt-cache-size", "1000"]
    if args.cache_bytes:
        flags += ["--prompt-cache-bytes", str(args.cache_bytes)]
    configs = {
        "mlx_lm server": [sys.executable, "-m", "mlx_lm", "server", *flags],
        "ppc serve": [sys.executable, "-m", "persistent_prefix_cache", "serve", *flags],
    }
    rows = []
    for i, (name, cmd) in enumerate(configs.items()):
        if name not in args.servers:
            continue
        if name.startswith("ppc"):
            cmd = [*cmd, "--store", str(workdir / f"store{i}")]
        print(f"bench_serve: {name} ...", file=sys.stderr, flush=True)
        rows.append(run_one(name, cmd, prompts, hot, workdir / f"server{i}.log"))
    config = {"prompts": args.prompts, "words": args.words, "cache_bytes": args.cache_bytes, "model": MODEL_SHAPE}
    return {"config": config, "rows": rows}


def format_serve(result: dict[str, Any] | None) -> list[str]:
    """The table of `serve_figures` as lines of text (empty if it did not run)."""
    if not result:
        return []
    c = result["config"]
    lines = [
        "",
        f"Server memory: {c['prompts']} distinct prompts of {c['words']} words, then {c['prompts']} hits "
        f"of one; --prompt-cache-bytes {c['cache_bytes'] or '(not given)'} --prompt-cache-size 1000 (RSS, MB)",
        f"{'server':<16} {'after 1/3':>10} {'after N':>10} {'after hits':>11} {'peak':>8}  cached tokens of the hits",
    ]
    for r in result["rows"]:
        mb = lambda key: f"{r[key] / 1e6:.0f}"  # noqa: E731
        hits = r["cached_tokens_hits"]
        lines.append(
            f"{r['server']:<16} {mb('rss_after_third'):>10} {mb('rss_after_distinct'):>10} "
            f"{mb('rss_after_hits'):>11} {mb('peak_rss'):>8}  {hits[0]}, then {min(hits[1:], default=0)}-{max(hits[1:], default=0)}"
        )
    return lines


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The options of this benchmark (`prefix` names them inside tools/bench.py)."""
    p.add_argument(f"--{prefix}prompts", type=int, default=12, help="distinct prompts, and hits of one")
    p.add_argument(f"--{prefix}words", type=int, default=600, help="words per prompt")
    p.add_argument(
        f"--{prefix}cache-bytes", type=int, default=32_000_000,
        help="--prompt-cache-bytes of both servers (0: not given)",
    )  # fmt: skip
    p.add_argument(
        f"--{prefix}servers", default="mlx_lm server,ppc serve", help="comma-separated: which servers to run"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="JSON on stdout (table on stderr)")
    p.add_argument("--dir", help="scratch folder (default: the system temp folder)")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",")]
    with tempfile.TemporaryDirectory(prefix="ppc-bench-serve-", dir=args.dir) as tmp:
        result = serve_figures(args, Path(tmp))
    report = "\n".join(format_serve(result))
    if args.json:
        print(report, file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

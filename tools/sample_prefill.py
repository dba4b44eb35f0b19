#!/usr/bin/env python3
"""Where prefill()'s wall time goes, time in C calls included (a diagnostic).

A thread samples every thread's Python stack every 0.5 ms while `prefill()` runs and
counts, per line, the time spent there: a line that waits in MLX (an evaluation, a copy)
shows as that line, which `cProfile` cannot tell apart. Two modes:

- default: per length, 5 calls of `prefill()` on an empty store, each on a handle opened
  for it and then on one handle reused, each followed by mlx-lm's prefill of the same
  prompt (untimed by the sampler); ``--keep DIR`` keeps the first store of each length
  there as ``DIR/s<n>``;
- ``--restart DIR N``: in this new process, a cold mlx-lm prefill of the prompt of length
  `N` that the default mode stored in ``DIR/s<N>``, then 3 calls of `prefill()` on that
  store (its restores), each sampled.

    python tools/sample_prefill.py [--small] [--tokens 256,16384] [--keep /tmp/kept]
    python tools/sample_prefill.py --restart /tmp/kept 16384
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from user_paths_bench import mlx_prefill, prompt_ids  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache, prefill  # noqa: E402

MAIN = threading.get_ident()


class Sampler:
    """Counts stacks of every thread but its own while `on` (the main thread's 6 innermost
    frames; the others' 3)."""

    def __init__(self) -> None:
        self.on = False
        self.main: collections.Counter = collections.Counter()
        self.other: collections.Counter = collections.Counter()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        me = threading.get_ident()
        while True:
            time.sleep(0.0005)
            if not self.on:
                continue
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                while frame is not None and len(stack) < 6:
                    stack.append(
                        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}"
                    )
                    frame = frame.f_back
                (self.main if tid == MAIN else self.other)[" < ".join(stack if tid == MAIN else stack[:3])] += 1

    def show(self, seconds: float) -> None:
        for title, counter, k in (("main thread", self.main, 25), ("other threads", self.other, 10)):
            total = sum(counter.values()) or 1
            print(f"--- {title}: {total} samples over {seconds * 1000:.0f} ms")
            for key, c in counter.most_common(k):
                print(f"{c * seconds * 1000 / total:8.1f} ms  {key}")
        self.main.clear()
        self.other.clear()


def timed(sampler: Sampler, fn) -> float:
    mx.synchronize()
    started = time.perf_counter()
    sampler.on = True
    fn()
    mx.synchronize()
    sampler.on = False
    return time.perf_counter() - started


def empty_store(model, sampler: Sampler, lengths: list[int], keep: str | None) -> None:
    vocab, work = model.args.vocab_size, Path(tempfile.mkdtemp(prefix="ppc-sample-"))
    try:
        for n in lengths:
            mlx_prefill(model, prompt_ids(vocab, n, seed=n))  # kernels of this length
            for fresh in (True, False):
                reused = None if fresh else PersistentPrefixCache(work / f"reused-{n}", model)
                if reused is not None:
                    prefill(model, prompt_ids(vocab, n, seed=999), reused)
                ours = plain = 0.0
                for i in range(5):
                    ids = prompt_ids(vocab, n, seed=n * 10 + i)
                    path = work / f"s{n}-{i}"
                    store = PersistentPrefixCache(path, model) if reused is None else reused
                    ours += timed(sampler, lambda: prefill(model, ids, store))
                    if reused is None:
                        store.close()
                        if keep and i == 0:
                            os.makedirs(keep, exist_ok=True)
                            shutil.move(str(path), os.path.join(keep, f"s{n}"))
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        store.flush()
                    mx.synchronize()
                    started = time.perf_counter()
                    mlx_prefill(model, ids)
                    mx.synchronize()
                    plain += time.perf_counter() - started
                if reused is not None:
                    reused.close()
                what = "a handle opened for each call" if fresh else "one handle reused"
                print(
                    f"=== {n} tokens, {what}: prefill() {ours / 5 * 1000:.1f} ms a call, mlx-lm {plain / 5 * 1000:.1f}"
                )
                sampler.show(ours)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def restarted(model, sampler: Sampler, folder: str, n: int) -> None:
    ids = prompt_ids(model.args.vocab_size, n, seed=n * 10)
    cold = timed(sampler, lambda: mlx_prefill(model, ids))
    sampler.main.clear()
    sampler.other.clear()
    mx.clear_cache()
    with PersistentPrefixCache(os.path.join(folder, f"s{n}"), model) as store:
        for call in range(3):
            seconds = timed(sampler, lambda: prefill(model, ids, store))
            print(f"=== restart, {n} tokens, call {call + 1}: {seconds * 1000:.1f} ms, ÷ cold {seconds / cold:.2f}; "
                  f"{store.last_fetch}")  # fmt: skip
            sampler.show(seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a 4-layer model (to check the tool on a CPU)")
    p.add_argument("--tokens", default="256,16384", help="prompt lengths, comma-separated")
    p.add_argument("--keep", help="keep each length's first store in this folder")
    p.add_argument("--restart", nargs=2, metavar=("DIR", "N"), help="restore DIR/s<N> in this new process")
    args = p.parse_args()
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    sampler = Sampler()
    if args.restart:
        restarted(model, sampler, args.restart[0], int(args.restart[1]))
    else:
        empty_store(model, sampler, [int(t) for t in args.tokens.split(",")], args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())

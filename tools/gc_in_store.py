#!/usr/bin/env python3
"""What Python's cyclic garbage collector costs the caller of `store()` (a diagnostic).

Stores prompts of one length, one after another, on one handle with default options
(each flushed before the next), from a synthetic cache of an 8B model's KV shape (32
layers, 8 KV heads of 128, bf16; a narrow model computes nothing here), and prints:

- ``store()``'s wall time on the caller's thread (median, max);
- the collections of each generation that ran inside those calls, and their time (a
  full, generation-2 collection walks every tracked object of the process, and the
  RAM tier keeps tens of them per block: every MLX array is one);
- those that ran elsewhere (the writer's thread, which holds the GIL meanwhile);
- the tracked objects the handle keeps per stored block.

    python tools/gc_in_store.py [--tokens 4096] [--prompts 30]

Runs on a CPU in seconds to minutes (no forward is run); on a GPU the same code runs.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402

# The KV of the 8B shape; the rest narrow (nothing is computed).
SHAPE = dict(gpu_bench.SHAPE_8B, hidden_size=256, intermediate_size=512, vocab_size=1024, head_dim=128)


class Collections:
    """Times every collection, by generation, inside the marked spans and outside them."""

    def __init__(self) -> None:
        self.inside = self._empty()
        self.outside = self._empty()
        self.collected = self._empty()  # objects each collection found unreachable (in cycles)
        self.marked = False
        self._began = 0.0
        gc.callbacks.append(self._callback)

    @staticmethod
    def _empty() -> dict[int, list[float]]:
        return {0: [], 1: [], 2: []}

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            where = self.inside if self.marked else self.outside
            where[info["generation"]].append(time.perf_counter() - self._began)
            self.collected[info["generation"]].append(info["collected"])

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per prompt")
    p.add_argument("--prompts", type=int, default=30, help="prompts stored")
    args = p.parse_args()
    model = gpu_bench.build(SHAPE)
    cache = make_prompt_cache(model)
    for layer in cache:
        kv = mx.random.normal((1, 8, args.tokens, 128)).astype(mx.bfloat16)
        layer.update_and_fetch(kv, kv)
    mx.eval([layer.state for layer in cache])
    work = Path(tempfile.mkdtemp(prefix="ppc-gc-"))
    seen = Collections()
    calls: list[float] = []
    try:
        with PersistentPrefixCache(work / "s", model) as store:
            gc.collect()
            tracked = len(gc.get_objects())
            for r in range(args.prompts):
                ids = [(i * 7 + r) % 1024 for i in range(args.tokens)]
                ids[0] = r % 1024  # another prompt each time (its first block differs)
                seen.marked = True
                started = time.perf_counter()
                store.store(ids, cache)
                calls.append(time.perf_counter() - started)
                seen.marked = False
                store.flush()
            started = time.perf_counter()
            gc.collect()
            walk = time.perf_counter() - started
            blocks = store.stats()["blocks_in_memory"]
            kept = len(gc.get_objects()) - tracked
            print(
                f"{args.prompts} prompts of {args.tokens} tokens, device {mx.default_device()}: "
                f"store() {statistics.median(calls) * 1000:.1f} ms median, {max(calls) * 1000:.1f} max"
            )
            for title, spans in (("inside store()", seen.inside), ("elsewhere", seen.outside)):
                for gen, times in spans.items():
                    print(
                        f"  generation {gen} {title}: {len(times)} collections, {sum(times) * 1000:.1f} ms "
                        f"({sum(times) * 1000 / args.prompts:.2f} ms a prompt), longest {max(times, default=0) * 1000:.1f}"
                    )
            print(
                f"  objects in cycles found by the collections: {dict((g, sum(n)) for g, n in seen.collected.items())}"
            )
            print(f"  one full collection after the run (nothing queued): {walk * 1000:.1f} ms")
            print(f"  tracked objects: {len(gc.get_objects()):,}; the RAM tier holds {blocks} blocks, "
                  f"{kept / max(blocks, 1):.0f} tracked objects kept per block")  # fmt: skip
    finally:
        seen.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

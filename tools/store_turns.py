#!/usr/bin/env python3
"""What `store()` costs its caller: a new prompt, and a chat stored a turn at a time.

Two cases, each on handles opened with default options (a given fingerprint), from
synthetic caches of a 32-layer model (no forward is run):

- ``prompt``: one prompt of each length of ``--tokens`` stored on a new handle (its first
  store), then two more of that length on the same handle (its later stores);
- ``chat``: one conversation stored after every turn of ``--turn`` tokens, up to
  ``--chat`` tokens, on one handle (each store extends the stored path by one turn).

Each store is flushed before the next, so only the caller's thread is timed. The KV is
narrow by default (2 heads of 16, float32), so that what is timed is the store's own work
per layer and block rather than copying; ``--shape 8b`` gives each layer the 8B shape's KV
(8 heads of 128, bf16). A store's copy of new KV is fresh memory where the RAM tier still
holds the copies before it: on this project's VM its first touch (page faults) was most of
a later store of 4096 narrow tokens (~20 of ~23 ms).

    python tools/store_turns.py [--tokens 256,1024,4096] [--chat 8192] [--turn 256] [--rounds 5]

Prints the median of ``--rounds`` per figure, in ms. Runs on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402
from persistent_prefix_cache.tiny_model import write_tiny_model  # noqa: E402

LAYERS = 32
SHAPES = {"narrow": (2, 16, mx.float32), "8b": (8, 128, mx.bfloat16)}


class Caches:
    """Caches of the first `n` tokens of one synthetic conversation, as mlx-lm builds them."""

    def __init__(self, longest: int, shape: str):
        heads, width, dtype = SHAPES[shape]
        self.kv = [mx.random.normal((1, heads, longest, width)).astype(dtype) for _ in range(LAYERS)]
        mx.eval(self.kv)

    def of(self, n: int) -> list:
        cache = [KVCache() for _ in range(LAYERS)]
        for layer, kv in zip(cache, self.kv):
            layer.update_and_fetch(kv[..., :n, :], kv[..., :n, :])
        mx.eval([layer.state for layer in cache])
        return cache


def timed_store(store: PersistentPrefixCache, tokens: list[int], cache: list, blocks: list[int]) -> float:
    """Seconds `store()` held its caller (the writer then finishes before the next); the
    blocks it stored are appended to `blocks`."""
    started = time.perf_counter()
    blocks.append(store.store(tokens, cache))
    seconds = time.perf_counter() - started
    store.flush()
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="256,1024,4096", help="prompt lengths of the prompt case")
    p.add_argument("--chat", type=int, default=8192, help="the conversation's length (0: no chat case)")
    p.add_argument("--turn", type=int, default=256, help="tokens a turn adds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shape", choices=sorted(SHAPES), default="narrow")
    args = p.parse_args()
    lengths = [int(t) for t in args.tokens.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="ppc-store-turns-") as work:
        model, _ = load(str(write_tiny_model(Path(work) / "model", num_layers=LAYERS, hidden_size=64)))
        caches = Caches(max([*lengths, args.chat]), args.shape)
        store_dir = Path(work) / "store"

        def handle() -> PersistentPrefixCache:
            shutil.rmtree(store_dir, ignore_errors=True)
            return PersistentPrefixCache(store_dir, model, fingerprint="store-turns")

        print(f"store_turns: {LAYERS} layers of KVCache, {args.shape} KV; medians of {args.rounds} rounds, ms")
        for n in lengths:
            first, later, blocks = [], [], []
            for r in range(args.rounds):
                with handle() as store:
                    for k in range(3):
                        tokens = [1 + (k * 1_000_003 + r * 7_919 + i) % 30_000 for i in range(n)]
                        (later if k else first).append(timed_store(store, tokens, caches.of(n), blocks))
            print(f"prompt {n:>6} tokens: first store {statistics.median(first) * 1e3:7.2f}, "
                  f"later stores {statistics.median(later) * 1e3:7.2f} ({sum(blocks)} blocks stored)")  # fmt: skip
        if args.chat:
            turns: dict[int, list[float]] = {}
            blocks = []
            for r in range(args.rounds):
                conversation = [1 + (r * 7_919 + i) % 30_000 for i in range(args.chat)]
                with handle() as store:
                    for end in range(args.turn, args.chat + 1, args.turn):
                        seconds = timed_store(store, conversation[:end], caches.of(end), blocks)
                        turns.setdefault(end, []).append(seconds)
            medians = {end: statistics.median(t) * 1e3 for end, t in turns.items()}
            shown = sorted({min(medians), *(e for e in medians if e & (e - 1) == 0), max(medians)})
            print("chat, a store after each turn of", args.turn, "tokens:",
                  ", ".join(f"at {e} {medians[e]:.2f}" for e in shown))  # fmt: skip
            print(f"chat, all {len(medians)} turns: {sum(medians.values()):.1f} ({sum(blocks)} blocks stored)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

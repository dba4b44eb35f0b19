#!/usr/bin/env python3
"""What the RAM tier's admission of a restore costs on the caller's thread (a diagnostic).

A store holds one prompt of synthetic KV of the 8B llama's shape (32 layers, 8 KV heads of
128, bf16; 128 KiB a token) behind a thin llama of that cache shape (hidden size 256, so
that no 8B weights are needed: the cache is what admission handles). Fresh handles with a
RAM tier large enough fetch it twice (the second disk hit admits where the copy is not a
device one) and a third time (from the tier); each fetch prints its phases on the caller's
thread (`first_restore.FETCH_PHASES`), `join_admitted` and its `_copies` among them:
what `join_admitted` costs beyond its copies is the tier's bookkeeping.

    python3 tools/admit_cost.py [--tokens 16384] [--rounds 2] [--join mlx|numpy]

``--join mlx`` joins and copies with MLX operations, as on a GPU (`device.target.RAM_JOIN`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_restore import FETCH_PHASES, phases_in_order  # noqa: E402
from user_paths_bench import Phases  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402
from persistent_prefix_cache.device import target  # noqa: E402

THIN_8B = dict(
    model_type="llama", hidden_size=256, num_hidden_layers=32, intermediate_size=512, num_attention_heads=8,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=1000, tie_word_embeddings=True,
)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="the prompt's length")
    p.add_argument("--rounds", type=int, default=2, help="fresh handles, three fetches each")
    p.add_argument("--join", choices=["mlx", "numpy"], default=None, help="how RAM-tier blocks are joined")
    args = p.parse_args()
    if args.tokens < 2 or args.rounds < 1:
        p.error("--tokens needs at least 2 and --rounds at least 1")
    target.RAM_JOIN = args.join
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**THIN_8B))
    mx.eval(model.parameters())
    cache = make_prompt_cache(model)
    for layer in cache:
        kv = [mx.random.normal((1, 8, args.tokens, 128)).astype(mx.bfloat16) for _ in range(2)]
        layer.update_and_fetch(*kv)
    mx.eval([layer.state for layer in cache])
    ids = [i % 1000 for i in range(args.tokens)]
    folder = tempfile.mkdtemp(prefix="ppc-admit-cost-")
    phaser = Phases(FETCH_PHASES)
    try:
        with PersistentPrefixCache(folder, model, fingerprint="admit-cost") as store:
            store.store(ids, cache)
        del cache
        for r in range(args.rounds):
            with PersistentPrefixCache(
                folder, model, fingerprint="admit-cost", memory_bytes=4 * args.tokens << 17
            ) as store:
                for f in range(3):
                    phaser.on = True
                    started = time.perf_counter()
                    restored, _ = store.fetch(ids + [1])
                    mx.eval([layer.state for layer in restored])
                    seconds = time.perf_counter() - started
                    phaser.on = False
                    tier = store.last_fetch.tier if store.last_fetch else None
                    spent = phases_in_order(phaser.take())
                    print(f"round {r + 1}, fetch {f + 1} (from {tier}): {seconds * 1000:.1f} ms")
                    print("  phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in spent.items()))
                    del restored
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

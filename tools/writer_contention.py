#!/usr/bin/env python3
"""What a busy writer takes from a caller's thread (a diagnostic; CPU or GPU).

A caller that launches kernels (a GPU prefill of a short prompt: its forward's Python,
not the device, sets the pace) shares the GIL with the handle's writer thread, which
writes the previous `store()` meanwhile. Per round this stores a synthetic cache of the
8B shape's KV (32 layers, 8 KV heads of 128, bf16; the model itself is small, nothing
is evaluated through it) and then times the caller's work: building the graphs of six
forwards without evaluating them. Odd rounds wait for the writer first (``flush``), even
rounds do not. Prints the medians of both and their difference.

    python3 tools/writer_contention.py [--tokens 256] [--rounds 40]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from persistent_prefix_cache import PersistentPrefixCache

SHAPE = dict(
    model_type="llama", hidden_size=1024, num_hidden_layers=32, intermediate_size=256, num_attention_heads=8,
    num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=1024, rope_theta=5e5, tie_word_embeddings=False,
)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens per store (default 256)")
    p.add_argument("--rounds", type=int, default=40, help="rounds, half of them with the writer busy (default 40)")
    args = p.parse_args()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**SHAPE))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())

    def cache_for(seed: int) -> list:
        cache = make_prompt_cache(model)
        mx.random.seed(seed)
        for layer in cache:
            k = mx.random.normal((1, 8, args.tokens, 128)).astype(mx.bfloat16)
            layer.update_and_fetch(k, k + 1)
        mx.eval([layer.state for layer in cache])
        return cache

    def work() -> float:
        started = time.perf_counter()
        for _ in range(6):
            model(mx.array([[1, 2, 3, 4]]), cache=make_prompt_cache(model))  # graphs only
        return time.perf_counter() - started

    folder = tempfile.mkdtemp(prefix="ppc-writer-contention-")
    alone, busy = [], []
    try:
        with PersistentPrefixCache(folder, model, fingerprint="given-" + "0" * 26) as store:
            for r in range(args.rounds):
                cache = cache_for(r)
                store.store(np.random.default_rng(r).integers(0, 1000, args.tokens).tolist(), cache)
                if r % 2:
                    store.flush()
                    alone.append(work())
                else:
                    busy.append(work())
                    store.flush()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    a, b = statistics.median(alone) * 1000, statistics.median(busy) * 1000
    print(f"{args.tokens} tokens a store, mlx {mx.__version__} on {mx.default_device()}: the caller's work "
          f"{a:.1f} ms alone, {b:.1f} ms beside the writer (+{b - a:.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

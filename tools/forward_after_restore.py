#!/usr/bin/env python3
"""What the first forward after a restore from disk costs, with the restored arrays as the
fetch hands them and with device copies of them (a diagnostic).

On an H100 (2026-12-06, `docs/performance.md`), the first `prefill()` of a new process spent
60-72 ms in its one-token forward after restoring 1k or 4k tokens of an 8B model from disk,
where a whole call that restored the same tokens from the RAM tier took 12-16 ms. A
restore from disk stages its bytes into buffers whose address the host took (on CUDA, MLX
then keeps them in managed memory); the RAM tier hands back copies the device made. This
times, per length and round, on handles with the RAM tier off (`memory_bytes=0`) and
`cost_model=False`: the fetch, then a forward of the prompt's last token and one more
token, once on the arrays as restored and once after replacing every layer's keys and
values with device copies (`device.buffers.device_copy`; the copy's time is printed).

    python3 tools/forward_after_restore.py [--tokens 1024,4096] [--rounds 3] [--small]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from user_paths_bench import clock, mlx_prefill, prompt_ids  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402
from persistent_prefix_cache.device.buffers import device_copy  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds per length")
    p.add_argument("--small", action="store_true", help="a 4-layer model (to check the tool on a CPU)")
    args = p.parse_args()
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    vocab = model.args.vocab_size
    lengths = [int(t) for t in args.tokens.split(",")]
    root = tempfile.mkdtemp(prefix="ppc-forward-after-restore-")
    try:
        for n in lengths:
            ids = prompt_ids(vocab, n, seed=n)
            with PersistentPrefixCache(os.path.join(root, f"s{n}"), model) as store:
                store.store(ids, mlx_prefill(model, ids))
        mlx_prefill(model, prompt_ids(vocab, max(lengths), seed=7))  # kernels and buffers, as a server's
        for _ in range(args.rounds):
            for n in lengths:
                ids = prompt_ids(vocab, n, seed=n)
                for how in ("as restored", "device copies"):
                    path = os.path.join(root, f"s{n}")
                    with PersistentPrefixCache(path, model, cost_model=False, memory_bytes=0) as store:
                        fetched, (cache, rest) = clock(lambda: store.fetch(ids))
                        tier = store.last_fetch.tier if store.last_fetch else None
                    copied = 0.0
                    if how == "device copies" and cache is not None:

                        def copy() -> None:
                            for layer in cache:
                                layer.keys, layer.values = device_copy(layer.keys), device_copy(layer.values)
                            mx.eval([layer.state for layer in cache])

                        copied, _ = clock(copy)
                    first, _ = clock(lambda: mx.eval(model(mx.array(rest)[None], cache=cache)[:, -1, :]))
                    second, _ = clock(lambda: mx.eval(model(mx.array([5])[None], cache=cache)[:, -1, :]))
                    print(f"{n:>6} tokens, {how:<13}: fetch {fetched * 1000:6.1f} ms (from {tier}), copy "
                          f"{copied * 1000:5.1f}, 1st forward {first * 1000:6.1f}, 2nd {second * 1000:6.1f}")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

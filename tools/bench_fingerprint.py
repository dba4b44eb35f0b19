#!/usr/bin/env python3
"""What verifying a remembered fingerprint costs, against hashing the weights.

Builds a synthetic llama of a realistic width (random bf16 weights; default 2048 wide,
8 layers, 32k vocabulary: ~0.54 B parameters, ~1.1 GB), writes it as a safetensors
file, and times in one run, each the median of ``--repeat``:

- ``fingerprint_model`` in each scheme (``weights_hash``): ``xxh3`` (the host hashes the
  bytes; the CPU's default, and what every open paid before issue 18) and ``lanes1``
  (lane sums on the default device, a GPU's default: by one kernel a weight on CUDA,
  else MLX ops; also by MLX ops, whole and in 1M-word pieces, with the device memory
  each takes at its peak), and, for
  comparison, xxh3 digests of each tensor on threads (``--threads``; a scheme we did
  not adopt: on this VM it was no faster than one stream). What a store without a
  remembered fingerprint pays at every open;
- ``sample_digest``: what every open with a remembered fingerprint pays to verify it;
- ``compare_with_folder``: what the first open of a folder pays once to check the
  loaded model against the folder's files (page cache warm).

``--lanes-only`` times the lanes scheme alone, both ways, its weights' pages where the
model put them (no file written, nothing hashed on the host first: on a GPU, device time
for the open's own scheme only); ``--no-lanes`` leaves it out.

The sample's cost grows with the number of tensors (4 pages each), not their size:
the line ``per tensor`` lets one scale it to a larger model (an 8B llama has 291).

Example::

    .venv/bin/python tools/bench_fingerprint.py --hidden 2048 --layers 8 --repeat 3
    .venv/bin/python tools/bench_fingerprint.py --llama8b --repeat 3   # on a GPU host
    python3 tools/bench_fingerprint.py --llama8b --repeat 3 --lanes-only  # the open's scheme there
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models import llama

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from persistent_prefix_cache.fingerprint import compare_with_folder, fingerprint_model, sample_digest  # noqa: E402
from persistent_prefix_cache import weights_hash  # noqa: E402
from persistent_prefix_cache.weights_hash import LANES_SCHEME, XXH3, bytes_of  # noqa: E402


# The lane sums by MLX ops where the default device would run the kernel (CUDA).
BY_OPS = {"DEVICE_KERNEL": False}


def lanes_memory(model, settings: dict) -> tuple[str, int, int]:
    """One lanes fingerprint under `settings`: (value, device memory it took at its peak
    beyond what was in use before, bytes MLX's buffer cache holds after)."""
    with weights_hash.lane_settings(settings):
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        value = fingerprint_model(model, scheme=LANES_SCHEME)
        return value, mx.get_peak_memory() - before, mx.get_cache_memory()


def threaded_xxh3(params, threads: int) -> str:
    """xxh3 digests of each tensor on `threads` threads (xxhash drops the GIL on large
    inputs), hashed together: the CPU alternative measured, not a scheme."""
    with ThreadPoolExecutor(threads) as pool:
        digests = pool.map(lambda kv: xxhash.xxh3_128_digest(bytes_of(kv[1])), params)
        return xxhash.xxh3_128_hexdigest(b"".join(digests))


def _median_time(fn, repeat: int) -> tuple[float, float]:
    """(the first call, the median of `repeat` more): on a GPU the first call may move
    the pages it reads to the host."""
    times = []
    for _ in range(repeat + 1):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times[0], statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 11/4 of --hidden)")
    parser.add_argument(
        "--llama8b", action="store_true", help="the Llama-3-8B shape (4096 wide, 32 layers, 128k vocab)"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--no-lanes", action="store_true", help="skip the lanes scheme (slow on a CPU: ~0.2 GB/s)")
    parser.add_argument(
        "--lanes-only",
        action="store_true",
        help="only the lanes scheme, both ways (no file written, nothing hashed on the host first)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.no_lanes and args.lanes_only:
        parser.error("--no-lanes and --lanes-only leave nothing to time")
    if args.llama8b:
        args.hidden, args.layers, args.vocab, args.intermediate = 4096, 32, 128256, 14336

    model_args = llama.ModelArgs(
        model_type="llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=args.intermediate or args.hidden * 11 // 4, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), rms_norm_eps=1e-5, vocab_size=args.vocab,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = llama.Model(model_args)
    model.set_dtype(mx.bfloat16)
    params = tree_flatten(model.parameters())
    mx.eval([p for _, p in params])
    nbytes = sum(p.nbytes for _, p in params)
    host = {} if args.lanes_only else host_figures(model, params, args)
    lanes_first = lanes = pieces_first = pieces = ops_first = ops = None
    memory: dict = {}
    if not args.no_lanes:
        lanes_first, lanes = _median_time(lambda: fingerprint_model(model, scheme=LANES_SCHEME), args.repeat)
        ops_first, ops = _median_time(lambda: lanes_memory(model, BY_OPS), args.repeat)
        pieces_first, pieces = _median_time(lambda: lanes_memory(model, weights_hash.SMALL_PIECES), args.repeat)
        memory = {
            name: lanes_memory(model, settings)
            for name, settings in (("lanes", {}), ("ops", BY_OPS), ("pieces", weights_hash.SMALL_PIECES))
        }
        # One value, however reduced: the kernel (CUDA), MLX ops, MLX ops in small pieces.
        assert memory["lanes"][0] == memory["ops"][0] == memory["pieces"][0], memory
    result = {
        "device": str(mx.default_device()),
        "tensors": len(params),
        "bytes": nbytes,
        **host,
        "lanes_s": None if lanes is None else round(lanes, 4),
        "lanes_first_s": None if lanes_first is None else round(lanes_first, 4),
        "lanes_peak_bytes": memory["lanes"][1] if memory else None,
        "lanes_cache_after_bytes": memory["lanes"][2] if memory else None,
        "lanes_kernel": weights_hash._kernel_source() is not None,
        "lanes_ops_s": None if ops is None else round(ops, 4),
        "lanes_ops_first_s": None if ops_first is None else round(ops_first, 4),
        "lanes_ops_peak_bytes": memory["ops"][1] if memory else None,
        "lanes_pieces_s": None if pieces is None else round(pieces, 4),
        "lanes_pieces_first_s": None if pieces_first is None else round(pieces_first, 4),
        "lanes_pieces_peak_bytes": memory["pieces"][1] if memory else None,
        "lanes_pieces_cache_after_bytes": memory["pieces"][2] if memory else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model: {len(params)} tensors, {nbytes / 1e9:.2f} GB (bf16), device {mx.default_device()}")
        if host:
            print_host(host, nbytes)
        if lanes is not None and pieces is not None and ops is not None:
            way = "one kernel a weight" if result["lanes_kernel"] else "MLX ops"
            for name, s, first, (_, peak, cached) in (
                (f"lanes1 (full hash, {way})", lanes, lanes_first, memory["lanes"]),
                ("... by MLX ops", ops, ops_first, memory["ops"]),
                ("... MLX ops in 1M-word pieces", pieces, pieces_first, memory["pieces"]),
            ):
                print(
                    f"{name:31s} {s:8.3f} s   {nbytes / s / 1e9:.2f} GB/s (first {first:.3f} s),"
                    f" peak +{peak / 2**20:.0f} MiB, MLX cache after {cached / 2**20:.0f} MiB"
                )
    return 0


def host_figures(model, params: list, args: argparse.Namespace) -> dict:
    """The figures of the host's side: xxh3 (one stream, and per tensor on threads), the
    sampled digest every reuse pays, and the first open's check against the folder."""
    with tempfile.TemporaryDirectory() as folder:
        mx.save_safetensors(os.path.join(folder, "model.safetensors"), dict(params))
        sample_first, sample = _median_time(lambda: sample_digest(model), args.repeat)
        compare_first, compare = _median_time(lambda: compare_with_folder(model, folder), args.repeat)
        full_first, full = _median_time(lambda: fingerprint_model(model, scheme=XXH3), args.repeat)
        threaded_first, threaded = _median_time(lambda: threaded_xxh3(params, args.threads), args.repeat)
        found = compare_with_folder(model, folder)
        assert found.compared == len(params) and not found.differing
    return {
        "fingerprint_model_s": round(full, 4),  # xxh3, the scheme of every fingerprint before issue 18
        "fingerprint_model_first_s": round(full_first, 4),
        "xxh3_threads": args.threads,
        "xxh3_threads_s": round(threaded, 4),
        "xxh3_threads_first_s": round(threaded_first, 4),
        "sample_digest_s": round(sample, 5),
        "sample_digest_first_s": round(sample_first, 5),
        "compare_with_folder_s": round(compare, 5),
        "compare_with_folder_first_s": round(compare_first, 5),
        "sample_per_tensor_us": round(sample / len(params) * 1e6, 1),
        "full_over_sample": round(full / sample, 1),
    }


def print_host(host: dict, nbytes: int) -> None:
    """The host's figures of `host_figures`, one line each."""
    full, full_first = host["fingerprint_model_s"], host["fingerprint_model_first_s"]
    print(f"xxh3 (full hash, host)          {full:8.3f} s   {nbytes / full / 1e9:.2f} GB/s (first {full_first:.3f} s)")
    threads, threaded = host["xxh3_threads"], host["xxh3_threads_s"]
    print(
        f"xxh3 per tensor, {threads} threads     {threaded:8.3f} s   {nbytes / threaded / 1e9:.2f} GB/s"
        f" (first {host['xxh3_threads_first_s']:.3f} s; measured, not used)"
    )
    sample, cheaper = host["sample_digest_s"], host["full_over_sample"]
    print(
        f"sample_digest (every reuse)     {sample:8.4f} s   {cheaper}x cheaper than xxh3"
        f" (first {host['sample_digest_first_s']:.4f} s)"
    )
    compare = host["compare_with_folder_s"]
    print(f"compare_with_folder (once)      {compare:8.4f} s   (first {host['compare_with_folder_first_s']:.4f} s)")
    print(f"per tensor                      {host['sample_per_tensor_us']} us")


if __name__ == "__main__":
    sys.exit(main())

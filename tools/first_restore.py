#!/usr/bin/env python3
"""How fast a restore from disk runs in a new process, first and later, against what the
machine can read (a diagnostic).

Writes stores of the given lengths (one `store()` each, from mlx-lm's prefill of a random
8B-shaped llama), then runs one new process per mode. Each process fetches the shortest
prompt twice, the longest twice, then the shortest again, every fetch on a handle opened for
it (`cost_model=False`: it restores whatever is stored), and prints each fetch's seconds
and GB/s (fetch + evaluating the cache), then the seconds of one token's forward over the
restored cache (the caller's next step, which reads every restored page). Modes:

- ``before``: nothing runs before the first fetch (then an mlx-lm prefill, then a fetch
  of each length again);
- ``after``: an mlx-lm prefill of the longest prompt first (``after_clear``: and
  ``mx.clear_cache()`` after it); ``+step`` then also runs mlx-lm's next token over its
  own cache (a process's first one-token forward, timed, before any fetch);
- ``sampled``: as ``before``, its first fetch sampled (where each thread's time went);
- a suffix ``+prefetch`` (`device.cuda.MODE` "prefetch"), ``+managed``
  (`device.buffers.GPU_ALLOCATION` "managed"), ``+views`` (the stages copy through the
  buffers' host views, not to their device addresses: `device.addresses.device_addresses`),
  ``+noram`` (no RAM tier: a restore admits nothing, so it makes no copies for it),
  ``+t1`` / ``+t4`` / ``+t12`` / ``+t16`` (reader threads sharing a restore), ``+p8`` /
  ``+p32`` (pinned pieces of 8 / 32 MiB, `device.cuda_driver.STAGE_PIECE`), ``+check`` (each
  restored cache compared bit for bit with mlx-lm's prefill of the prompt, outside the
  timing), ``+phases`` (where each fetch's time goes on the caller's thread:
  `FETCH_PHASES`, each summed over the fetch, nested ones inside their callers').

Last, the machine's own ceiling: the longest store's segment files read from the page
cache in 2 MiB pieces by 1-16 threads, with and without hashing them (xxh3).

    python3 tools/first_restore.py [--tokens 4096,16384] [--small] [MODE ...]

On a GPU the 8B shape needs ~20 GB of device memory; ``--small`` (4 layers) runs on a CPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from user_paths_bench import Phases, clock, mlx_prefill, prompt_ids, threads_seconds  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache  # noqa: E402

DEFAULT_MODES = ["before", "after", "after_clear", "before", "after"]
OPTIONS: dict = {}  # the handles' options beyond the tool's (``+noram``: no RAM tier)
# What ``+phases`` times in a fetch, (module, attribute path): a function imported by name
# is wrapped in the module that calls it.
FETCH_PHASES = [
    ("persistent_prefix_cache.core.fetching", "restore"),
    ("persistent_prefix_cache.core.restore", "read_path"),
    ("persistent_prefix_cache.device.target", "Target.allocate"),
    ("persistent_prefix_cache.device.buffers", "managed_empty"),
    ("persistent_prefix_cache.disk.read_path", "_bind"),
    ("persistent_prefix_cache.device.target", "Target.start_moves"),
    ("persistent_prefix_cache.disk.read_path", "_read_segments"),
    ("persistent_prefix_cache.device.target", "Target.wait_moves"),
    ("persistent_prefix_cache.disk.read_path", "_first_bad"),
    ("persistent_prefix_cache.device.target", "Target.place"),
    ("persistent_prefix_cache.layers.layout", "Layout.rebuild"),
    ("persistent_prefix_cache.core.restore", "admit"),
    ("persistent_prefix_cache.core.restore", "join_admitted"),
    ("persistent_prefix_cache.core.restore", "_copies"),
    ("mlx.core", "eval"),
]
PHASER: Phases | None = None


def fetch(model, path: str, n: int, sampler=None) -> dict:
    """Seconds and GB/s of one fetch of the stored prompt of `n` tokens, on a new handle."""
    args = model.args
    per_token = (
        2 * args.num_hidden_layers * args.num_key_value_heads * (args.hidden_size // args.num_attention_heads) * 2
    )
    ids = prompt_ids(args.vocab_size, n, seed=n)
    cached: list = []  # the restored cache, for the step after the fetch
    with PersistentPrefixCache(path, model, cost_model=False, **OPTIONS) as store:

        def go() -> int:
            if sampler is not None:
                sampler.on = True
            if PHASER is not None:
                PHASER.on = True
            cache, rest = store.fetch(ids)
            if cache is not None:
                mx.eval([c.state for c in cache])
                cached[:] = [cache]
            if sampler is not None:
                sampler.on = False
            if PHASER is not None:
                PHASER.on = False
            return len(ids) - len(rest)

        seconds, got = clock(go)
        tier = store.last_fetch.tier if store.last_fetch else None
        same = same_as_prefill(model, ids, cached[0], got) if CHECK and cached else None
        # The caller's next step: one token's forward over the restored cache (it reads
        # every restored page: pages left on the host would fault over here).
        step = clock(lambda: mx.eval(model(mx.array([ids[-1:]]), cache=cached[0])))[0] if cached else None
    return {
        "tokens": n,
        "s": round(seconds, 4),
        "restored": got,
        "tier": tier,
        "GBps": round(got * per_token / seconds / 1e9, 2),
        "next_s": None if step is None else round(step, 4),
        "bitwise": same,
        "phases": {} if PHASER is None else phases_in_order(PHASER.take()),
    }


CHECK = False  # ``+check``: each restored cache compared with mlx-lm's prefill of the prompt
_REFERENCE: dict[int, list] = {}  # prompt length -> mlx-lm's cache of it (``+check``)


def same_as_prefill(model, ids: list[int], cache: list, got: int) -> bool:
    """Whether the restored `cache` holds bit for bit the KV of mlx-lm's prefill of `ids` (its
    first `got` tokens; computed once per length, outside the timed fetch)."""
    if len(ids) not in _REFERENCE:
        _REFERENCE[len(ids)] = mlx_prefill(model, ids)
    pairs = [(c.keys, r.keys) for c, r in zip(cache, _REFERENCE[len(ids)])]
    pairs += [(c.values, r.values) for c, r in zip(cache, _REFERENCE[len(ids)])]
    same = [mx.array_equal(a[..., :got, :], b[..., :got, :]) for a, b in pairs]
    mx.eval(same)
    return all(x.item() for x in same)


def phases_in_order(spent: dict[str, float]) -> dict[str, float]:
    """`spent` (ms) in `FETCH_PHASES` order, those that ran."""
    return {path: round(spent[path], 2) for _, path in FETCH_PHASES if path in spent}


def child(model, mode: str, root: str, lengths: list[int]) -> None:
    from persistent_prefix_cache.device import addresses, cuda, cuda_driver, readers

    if "+prefetch" in mode:
        cuda.MODE = "prefetch"
    if "+managed" in mode:
        from persistent_prefix_cache.device import buffers

        buffers.GPU_ALLOCATION = "managed"
    if "+noram" in mode:
        OPTIONS["memory_bytes"] = 0
    if "+check" in mode:
        global CHECK
        CHECK = True
    if "+views" in mode:
        addresses._addresses_work = False  # the buffers' host views, not their device addresses
    if "+phases" in mode:
        global PHASER
        PHASER = Phases(FETCH_PHASES)
    for suffix, mib in (("+p8", 8), ("+p32", 32)):
        if suffix in mode:
            cuda_driver.STAGE_PIECE = mib << 20
    for suffix, threads in (("+t1", 1), ("+t4", 4), ("+t12", 12), ("+t16", 16)):
        if suffix in mode:
            readers.READERS = max(readers.READERS, threads)
            readers.READ_THREADS = readers.STAGED_READ_THREADS = threads
    out: dict = {"mode": mode, "fetch": []}
    longest = prompt_ids(model.args.vocab_size, lengths[-1], seed=7)
    if mode.startswith("after"):
        seconds, cache = clock(lambda: mlx_prefill(model, longest))
        out["prefill_s"] = round(seconds, 3)
        if "+step" in mode:  # mlx-lm's own next token: the one-token forward's first use
            out["prefill_next_s"] = round(clock(lambda: mx.eval(model(mx.array([longest[-1:]]), cache=cache)))[0], 4)
        del cache
        if mode.startswith("after_clear"):
            mx.clear_cache()
    sampler = None
    if mode.startswith("sampled"):
        from sample_prefill import Sampler

        sampler = Sampler()
    for n in (lengths[0], lengths[0], lengths[-1], lengths[-1], lengths[0]):
        first = sampler is not None and not out["fetch"]
        out["fetch"].append(fetch(model, os.path.join(root, f"s{n}"), n, sampler if first else None))
        if first:
            sampler.show(out["fetch"][0]["s"])
    if mode.startswith("before"):
        out["prefill_s"] = round(clock(lambda: mlx_prefill(model, longest))[0], 3)
        for n in lengths:
            out["fetch"].append(fetch(model, os.path.join(root, f"s{n}"), n))
    print("RESULT", json.dumps(out))


def ceiling(folder: str) -> None:
    """The page cache's read rate of `folder`'s segment files, with and without xxh3."""
    files = sorted(glob.glob(os.path.join(folder, "segments", "*", "*.seg")))
    total = sum(os.path.getsize(f) for f in files)
    print(f"the machine's ceiling: {len(files)} segment file(s), {total:,} bytes, 2 MiB pieces")
    jobs = [(f, at) for f in files for at in range(0, os.path.getsize(f), 2 << 20)]
    for hashing in (False, True):
        for threads in (1, 2, 4, 8, 16):
            pending, lock = iter(jobs), threading.Lock()

            def work() -> None:
                piece = memoryview(np.empty(2 << 20, np.uint8))
                fds: dict[str, int] = {}
                while True:
                    with lock:
                        job = next(pending, None)
                    if job is None:
                        break
                    name, at = job
                    if name not in fds:
                        fds[name] = os.open(name, os.O_RDONLY)
                    got = os.preadv(fds[name], [piece], at)
                    if hashing:
                        xxhash.xxh3_64(piece[:got]).intdigest()
                for fd in fds.values():
                    os.close(fd)

            rate = total / threads_seconds(work, threads) / 1e9
            print(f"  read{' + xxh3' if hashing else ''}, {threads} thread(s): {rate:.1f} GB/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="*", help=f"modes, one process each (default: {' '.join(DEFAULT_MODES)})")
    p.add_argument("--tokens", default="4096,16384", help="the two prompt lengths, comma-separated")
    p.add_argument("--small", action="store_true", help="a 4-layer model (to check the tool on a CPU)")
    p.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    lengths = sorted(int(t) for t in args.tokens.split(","))
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    if args.child:
        child(model, args.child[0], args.child[1], lengths)
        return 0
    root = tempfile.mkdtemp(prefix="ppc-first-restore-")
    try:
        for n in sorted(set(lengths)):
            ids = prompt_ids(model.args.vocab_size, n, seed=n)
            with PersistentPrefixCache(os.path.join(root, f"s{n}"), model) as store:
                store.store(ids, mlx_prefill(model, ids))
        for mode in args.modes or DEFAULT_MODES:
            command = [sys.executable, __file__, "--tokens", args.tokens, "--child", mode, root]
            done = subprocess.run(command + (["--small"] if args.small else []), capture_output=True, text=True)
            lines = done.stdout.splitlines()
            for line in lines:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT ") :])
                    step = result.get("prefill_next_s")
                    step = "" if step is None else f", its next token {step * 1000:.1f} ms"
                    print(f"{mode}: mlx-lm's prefill (before or after the fetches) {result.get('prefill_s')} s{step}")
                    for f in result["fetch"]:
                        step = "" if f.get("next_s") is None else f", next token {f['next_s'] * 1000:.1f} ms"
                        step += "" if f.get("bitwise") is None else f", bitwise {f['bitwise']}"
                        print(
                            f"  {f['tokens']} tokens: {f['s'] * 1000:.1f} ms, {f['GBps']} GB/s, from {f['tier']}{step}"
                        )
                        if f.get("phases"):
                            print("    phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in f["phases"].items()))
            if mode.startswith("sampled"):  # the first fetch's samples
                print("\n".join(line for line in lines if not line.startswith("RESULT ") and "<frozen" not in line))
            if done.returncode:
                print(f"{mode}: the process failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        ceiling(os.path.join(root, f"s{lengths[-1]}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a restore's time goes after a restart, by how the caller runs it (a diagnostic,
not a benchmark row).

A store holds synthetic KV of a realistic shape (28 layers, 8 KV heads of 128, bf16: a
3B-shaped llama, 112 KiB per token): two prompts stored by one `store()` each, and a
chat stored turn by turn. Fresh processes then fetch them in order, each timed with the
device synchronized: on the main thread right after the open, on another thread (as
`ppc serve` does, whose generation runs on a thread of mlx_lm.server's), 2 s after the
open (a server's first request), and 2 s after with another prompt being written while
each fetch runs (a server storing the last request); with the store's decisions and
learned disk rate after each fetch. A probe process times what a first staged restore
makes (the CUDA driver, rings of pinned pieces).

    python tools/profile_restore.py [--tokens 2048,8192] [--turns 8] [--small]

``--writer A,B`` instead times, in one process, a fetch of A tokens right after a
`store()` of B other tokens (written in the background, as by default), with the writer
giving way to the restore (`disk.reads_first`: "on"), not giving way ("off"), and with
no write ("idle"), interleaved; medians of ``--rounds`` each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from persistent_prefix_cache import PersistentPrefixCache

SHAPE = {"layers": 28, "heads": 8, "dim": 128}
SMALL = {"layers": 4, "heads": 2, "dim": 32}


class _Model:
    """What a store's layout asks of a model: its layers (one KVCache each)."""

    def __init__(self, layers: int):
        self.layers = [None] * layers


def synthetic_cache(tokens: int, shape: dict, seed: int) -> list:
    """KVCache layers holding `tokens` positions of random bf16 KV."""
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    cache = []
    for _ in range(shape["layers"]):
        layer = KVCache()
        k = mx.random.normal((1, shape["heads"], tokens, shape["dim"])).astype(mx.bfloat16)
        layer.update_and_fetch(k, k * 0.5)
        cache.append(layer)
    mx.eval([c.keys for c in cache])
    return cache


def prompts(lengths: list[int], turns: int) -> dict[str, list[int]]:
    out = {f"once-{n}": [(7 * i + n) % 30000 + 1 for i in range(n)] for n in lengths}
    out[f"turns-{lengths[-1]}"] = [(11 * i + 5) % 30000 + 1 for i in range(lengths[-1])]
    return out


def build(path: Path, shape: dict, lengths: list[int], turns: int) -> None:
    """The store: each `once-` prompt by one store(), the chat a turn at a time."""
    with PersistentPrefixCache(path, _Model(shape["layers"]), fingerprint="profile-restore") as store:
        for name, ids in prompts(lengths, turns).items():
            cache = synthetic_cache(len(ids), shape, seed=len(name) + len(ids))
            if name.startswith("once"):
                store.store(ids, cache)
            else:
                for t in range(1, turns + 1):
                    end = len(ids) * t // turns  # a cache longer than the tokens: its first `end` positions are cut
                    store.store(ids[:end], cache)
            store.flush()


def child(spec: str) -> int:
    args = json.loads(spec)
    shape = args["shape"]
    mx.eval(mx.ones((256, 256)) @ mx.ones((256, 256)))  # the process's first kernels: not a restore's
    results = []

    if args.get("probe"):  # what a process's first staged restore made: driver, a ring of pinned pieces
        from persistent_prefix_cache.device import cuda

        probe = {}
        started = time.perf_counter()
        driver = cuda._get_driver()
        probe["driver_s"] = time.perf_counter() - started
        if driver is not None:

            def ring():
                t = time.perf_counter()
                driver.ring()
                probe.setdefault("ring_s", []).append(time.perf_counter() - t)

            for _ in range(3):  # three threads, one after the other
                t = threading.Thread(target=ring)
                t.start()
                t.join()
        print(json.dumps([probe]))
        return 0

    if args.get("allocation"):
        from persistent_prefix_cache.device import buffers

        buffers.GPU_ALLOCATION = args["allocation"]

    def run():
        store = PersistentPrefixCache(args["path"], _Model(shape["layers"]), fingerprint="profile-restore")
        if args.get("settle"):
            time.sleep(args["settle"])  # a server's first request comes later than its open
        for k, (name, ids) in enumerate(prompts(args["lengths"], args["turns"]).items()):
            if args.get("busy"):  # a server stores the last request's prompt while the next one restores
                other = [(13 * i + 17 * k) % 30000 + 1 for i in range(args["lengths"][0])]
                store.store(other, synthetic_cache(len(other), shape, seed=99 + k))
            if args.get("clear"):  # mlx-lm's server empties MLX's buffer cache after every prefill step
                mx.clear_cache()
            before = store.stats()
            mx.synchronize()
            started = time.perf_counter()
            cache, rest = store.fetch(ids + [3])
            if cache is not None:
                mx.eval([c.keys for c in cache])
            mx.synchronize()
            took = time.perf_counter() - started
            after = store.stats()
            grew = {k: after[k] - before[k] for k in ("restored_all", "restored_ram_only", "restored_shorter",
                                                       "skipped_slower", "restored_blocks_disk")}  # fmt: skip
            results.append({"prompt": name, "s": took, "restored": len(ids) + 1 - len(rest), **grew,
                            "disk_bytes_per_s": after["restore_bytes_per_s_disk"]})  # fmt: skip
        store.close()

    if args["thread"]:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    else:
        run()
    print(json.dumps(results))
    return 0


def writer_ab(fetched: int, written: int, shape: dict, rounds: int) -> dict:
    """Fetch times (s) per mode "on" / "off" / "idle" (see the module's docstring)."""
    import contextlib

    from persistent_prefix_cache.disk import reads_first

    work = tempfile.mkdtemp(prefix="ppc-profile-writer-")
    ids = [(7 * i + fetched) % 30000 + 1 for i in range(fetched)]
    times: dict[str, list[float]] = {"on": [], "off": [], "idle": []}
    gives_way = reads_first.ReadsFirst.reading
    try:
        with PersistentPrefixCache(work, _Model(shape["layers"]), fingerprint="profile-writer", memory_bytes=0,
                                   cost_model=False) as store:  # fmt: skip
            store.store(ids, synthetic_cache(fetched, shape, seed=1))
            store.flush()
            others = [synthetic_cache(written, shape, seed=2 + k) for k in range(2)]
            for k in range(3 * rounds):
                mode = ("on", "off", "idle")[k % 3]
                reads_first.ReadsFirst.reading = gives_way if mode == "on" else lambda self: contextlib.nullcontext()
                if mode != "idle":
                    other = [(13 * i + 17 * k) % 30000 + 1 for i in range(written)]
                    store.store(other, others[k % 2])  # the writer writes it while the fetch below runs
                    time.sleep(0.02)
                mx.synchronize()
                started = time.perf_counter()
                cache, _ = store.fetch(ids + [3])
                mx.eval([c.keys for c in cache])
                mx.synchronize()
                times[mode].append(time.perf_counter() - started)
                store.flush()
    finally:
        reads_first.ReadsFirst.reading = gives_way
        shutil.rmtree(work, ignore_errors=True)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1, help="processes per mode (an H200 host ran 9 in more than 170 s)")
    p.add_argument("--small", action="store_true", help="a small shape (to check the tool on a CPU)")
    p.add_argument("--writer", help="FETCHED,WRITTEN tokens: a fetch beside a write, the writer giving way or not")
    p.add_argument("--rounds", type=int, default=4, help="with --writer: fetches per mode")
    p.add_argument("--modes", default="main,thread,settled,busy",
                   help="which processes: main, thread, settled, busy, cleared (MLX's buffer cache emptied "
                   "before each fetch, as mlx-lm's server does), cleared-unwritten (the same, buffers "
                   "allocated by the unwritten load)")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    shape = SMALL if args.small else SHAPE
    if args.writer:
        fetched, written = (int(x) for x in args.writer.split(","))
        times = writer_ab(fetched, written, shape, args.rounds)
        for mode, runs in times.items():
            ms = sorted(1e3 * t for t in runs)
            print(f"{mode}: fetch of {fetched} tokens, median {ms[len(ms) // 2]:.0f} ms (all {[round(t) for t in ms]})")
        print(json.dumps(times))
        return 0
    lengths = [int(x) for x in args.tokens.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ppc-profile-restore-"))
    try:
        build(work / "store", shape, lengths, args.turns)
        out = {}
        modes = ["probe"] + args.modes.split(",") * args.repeat
        for mode in modes:
            spec = json.dumps({"path": str(work / "store"), "shape": shape, "lengths": lengths, "turns": args.turns,
                               "thread": mode == "thread", "settle": 2.0 if mode in ("settled", "busy") else 0,
                               "probe": mode == "probe", "busy": mode == "busy", "clear": mode.startswith("cleared"),
                               "allocation": "unwritten" if mode == "cleared-unwritten" else None})  # fmt: skip
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec],
                                  capture_output=True, text=True, cwd=work)  # fmt: skip
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            out.setdefault(mode, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
        for mode, runs in out.items():
            if mode == "probe":
                print("probe", runs)
                continue
            for run in runs:
                print(mode, " ".join(f"{r['prompt']}: {r['s'] * 1e3:.1f} ms ({r['restored']} tok, disk blocks "
                                     f"{r['restored_blocks_disk']}, skipped {r['skipped_slower']})" for r in run))  # fmt: skip
        print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

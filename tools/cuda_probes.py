#!/usr/bin/env python3
"""What a CUDA host gives a restore, part by part (a diagnostic; CUDA only).

Four probes, each in the process that runs it, each round printed (the first of a
process pays what later ones do not: compare rounds, and rerun with the order swapped):

- ``link``: pinned host memory copied to the device by the copy engine (2 GiB in 2, 32
  and 256 MiB copies, one stream) into device memory (``cuMemAlloc``), into managed
  memory placed on the device, and into an MLX array; and what the MLX array's first
  host view costs (MLX moves a device buffer into managed memory when the host asks
  for its address).
- ``stage``: the read path's staged route alone, 2 GiB of a file in the page cache, 2 MiB
  pieces shared by 1-12 threads: read into plain memory, into pinned pieces, read and
  hashed (xxh3), sent only (copies of pinned pieces to an MLX array), and read, hashed
  and sent, with one copy stream shared by the threads or one each (``--streams``).
- ``alloc``: the 64 buffers a restore of 16k tokens of an 8B llama fills (2 GiB), made
  as zeros on the device and then viewed by the host (``GPU_ALLOCATION`` "zeros", the
  default), or as managed memory from the start ("managed"), then read twice by a kernel
  (a first read of managed pages may cost what the next does not: the caller's first
  forward after a restore), three rounds of each; ``--managed-first`` swaps the order (a
  process's first managed memory costs once). Each round ends with zeros whose device
  addresses a kernel reads (`addresses.device_addresses`: no host view, the read path's route).

- ``calls``: each call a staged read makes per piece (``preadv``, xxh3, a send of 8 rows
  as one 2D copy or a copy each, the 2D copy through a handle that keeps the GIL), timed
  one by one, alone and on 12 threads.

- ``first``: a process's first allocation of the 64 buffers a restore of 4k tokens fills
  (512 MiB, `buffers.allocate`), each way in two new processes: alone; after a forward's
  memory (1 GiB made and freed, MLX's cache cleared or not); right after the reader
  threads' pinned rings are asked for (`cuda.prepare_readers`, as a handle's open does, in
  the background), and after they are made (with how long they took); and both after a
  forward, as in a restarted process (the model ran, then the open). The resume of a
  restarted process spent 20-42 ms in `Target.allocate` on its first restore and ~2 ms
  later (H100): rings being made meanwhile cost 15-43 ms on two hosts (docs/performance.md).

    python3 tools/cuda_probes.py link | stage [--streams] | calls | alloc [--managed-first] | first

Off CUDA it says so and exits 2. The probes call the package's CUDA driver wrapper
(`device.cuda`) and its module settings, not the public API: they measure a route,
not what users run (that is ``tools/user_paths.py --gpu``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import mlx.core as mx
import numpy as np
import xxhash

from persistent_prefix_cache.device import addresses, buffers, cuda, cuda_driver
from user_paths_bench import threads_seconds  # tools/: the measuring kit

TOTAL = 2 << 30  # bytes each probe moves
PIECE = 2 << 20  # the read path's pinned piece (`cuda_driver.STAGE_PIECE`)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000


def _host_address(array: mx.array) -> int:
    """The address of an evaluated MLX array's bytes (on CUDA: MLX moves a device buffer
    into managed memory to give it)."""
    return int(np.frombuffer(memoryview(array).cast("B"), dtype=np.uint8).ctypes.data)  # type: ignore[arg-type]  # MLX stubs: no buffer protocol


def link(driver) -> None:
    lib = driver.lib
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemAllocManaged.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_uint]
    host_bytes = 256 << 20
    host = ctypes.c_void_p()
    driver._check(lib.cuMemHostAlloc(ctypes.byref(host), host_bytes, 0), "cuMemHostAlloc")
    ctypes.memset(host, 7, host_bytes)
    device, managed = ctypes.c_uint64(), ctypes.c_uint64()
    driver._check(lib.cuMemAlloc_v2(ctypes.byref(device), TOTAL), "cuMemAlloc")
    driver._check(lib.cuMemAllocManaged(ctypes.byref(managed), TOTAL, 1), "cuMemAllocManaged")
    driver.prefetch(managed.value, TOTAL)
    driver.wait()
    array = mx.zeros((TOTAL // 4096, 4096), dtype=mx.uint8)
    mx.eval(array)
    started = time.perf_counter()
    address = _host_address(array)
    print(f"the first host view of a 2 GiB MLX array on the device: {_ms(started):.1f} ms", flush=True)
    for name, dst in (("device memory", device.value), ("managed memory", managed.value), ("an MLX array", address)):
        for piece in (2 << 20, 32 << 20, 256 << 20):
            rates = []
            for _ in range(3):
                started = time.perf_counter()
                for at in range(0, TOTAL, piece):
                    driver.copy(dst + at, host.value + at % host_bytes, piece)
                driver.wait()
                rates.append(TOTAL / (time.perf_counter() - started) / 1e9)
            print(f"pinned -> {name}, {piece >> 20} MiB copies: " + ", ".join(f"{r:.1f}" for r in rates) + " GB/s")


def stage(driver, streams: bool) -> None:
    folder = tempfile.mkdtemp(prefix="ppc-cuda-probes-")
    path = os.path.join(folder, "data")
    try:
        chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
        with open(path, "wb") as f:
            for _ in range(TOTAL // len(chunk)):
                f.write(chunk)
        fd = os.open(path, os.O_RDONLY)
        try:
            piece = memoryview(np.empty(PIECE, np.uint8))
            for at in range(0, TOTAL, PIECE):  # into the page cache
                os.preadv(fd, [piece], at)
            dest = mx.zeros((TOTAL // 4096, 4096), dtype=mx.uint8)
            mx.eval(dest)
            base = _host_address(dest)
            ways = (
                ("read into plain memory", dict(pinned=False, hashing=False, send=False)),
                ("read into pinned pieces", dict(hashing=False, send=False)),
                ("read and hashed", dict(send=False)),
                ("sent only", dict(read=False, hashing=False)),
                ("read, hashed and sent", dict()),
            )
            for threads in (1, 4, 8, 12):
                for own in (False, True) if streams else (False,):
                    for name, kw in ways:
                        if own and kw.get("send") is False:
                            continue  # nothing sent: streams do not matter
                        rates = [_staged(driver, fd, base, threads, own, **kw) for _ in range(3)]
                        label = f"{threads} thread(s){', a stream each' if own else ''}, {name}"
                        print(f"{label}: " + ", ".join(f"{r:.1f}" for r in rates) + " GB/s", flush=True)
        finally:
            os.close(fd)
    finally:
        os.remove(path)
        os.rmdir(folder)


def _staged(driver, fd: int, base: int, threads: int, own_stream: bool, *, pinned=True, read=True, hashing=True,
            send=True) -> float:  # fmt: skip
    """GB/s of one pass over the file's 2 MiB pieces by `threads` threads, each piece
    taken by the next free thread."""
    pending = iter(range(0, TOTAL, PIECE))
    lock = threading.Lock()

    def work() -> None:
        ring = driver.ring() if pinned else None
        stream = driver.stream
        if own_stream:
            stream = ctypes.c_void_p()
            driver._check(driver.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
        plain = np.empty(PIECE, np.uint8)
        digest = xxhash.xxh3_64()
        k = 0
        while True:
            with lock:
                at = next(pending, None)
            if at is None:
                break
            slot = ring[k % len(ring)] if ring is not None else None
            k += 1
            if slot is not None and slot[2]:
                driver.wait_event(slot[1])
                slot[2] = False
            bits = slot[0] if slot is not None else plain
            if read:
                os.preadv(fd, [memoryview(bits)], at)
            if hashing:
                digest.update(bits)
            if send and slot is not None:
                driver.lib.cuMemcpyHtoDAsync_v2(base + at, bits.ctypes.data, PIECE, stream)
                driver.record_on(slot[1], stream)
                slot[2] = True
        for slot in ring or ():
            if slot[2]:
                driver.wait_event(slot[1])
                slot[2] = False

    started = time.perf_counter()
    threads_seconds(work, threads)
    driver.wait()  # the last copies land
    return TOTAL / (time.perf_counter() - started) / 1e9


def calls(driver) -> None:
    """Each call a staged read makes per piece, timed one by one: alone, and on 12 threads
    taking pieces at once (as a restore's readers do). A restore of 4k tokens of an 8B
    llama on an H100 spent, summed over its 12 threads, ~0.8 ms per 2 MiB ``preadv`` and
    ~0.6 ms per send whatever its size (docs/performance.md, twentieth day): the GIL
    taken back after each call, or the driver? The enqueue calls are also made through a
    handle that keeps the GIL (``ctypes.PyDLL``: no hand-over, where a call is short)."""
    held = ctypes.PyDLL("libcuda.so.1")  # the same driver; its calls keep the GIL
    for name in ("cuMemcpy2DAsync_v2", "cuEventRecord"):
        getattr(held, name).argtypes = getattr(driver.lib, name).argtypes or [ctypes.c_void_p, ctypes.c_void_p]
    held.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(cuda_driver.Copy2D), ctypes.c_void_p]
    folder = tempfile.mkdtemp(prefix="ppc-cuda-probes-")
    path = os.path.join(folder, "data")
    try:
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())
        fd = os.open(path, os.O_RDONLY)
        os.preadv(fd, [bytearray(64 << 20)], 0)  # into the page cache
        dest = mx.zeros((512 << 20,), dtype=mx.uint8)
        base = addresses.device_addresses([dest])
        if base is None:
            print("calls: no device address for an MLX array here")
            return
        for threads in (1, 12):
            for way in ("preadv", "xxh3", "send 8 rows, 2D", "send 8 rows, a copy each", "send 8 rows, 2D, GIL kept"):
                per = _calls(driver, held, fd, base[0], threads, way)
                print(f"{threads:2d} thread(s), {way}: a call {statistics.median(per) * 1e6:.0f} us (median), "
                      f"{statistics.mean(per) * 1e6:.0f} us (mean) of {len(per)}", flush=True)  # fmt: skip
        os.close(fd)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _calls(driver, held, fd: int, base: int, threads: int, way: str) -> list[float]:
    """Seconds of each call of `way`, 256 pieces of 2 MiB shared by `threads` threads."""
    times: list[float] = []
    lock = threading.Lock()
    pending = iter(range(256))
    rows, width = 8, PIECE // 8

    def work() -> None:
        ring, mine, k = driver.ring(), [], 0
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                break
            slot = ring[k % len(ring)]
            k += 1
            if slot[2]:
                driver.wait_event(slot[1])
                slot[2] = False
            src, dst = slot[0].ctypes.data, base + (i * PIECE) % (500 << 20)
            started = time.perf_counter()
            if way == "preadv":
                os.preadv(fd, [memoryview(slot[0])], (i * PIECE) % (62 << 20))
            elif way == "xxh3":
                xxhash.xxh3_64(slot[0]).intdigest()
            elif way == "send 8 rows, a copy each":
                for r in range(rows):
                    driver.copy(dst + r * width, src + r * width, width)
            else:
                c = cuda_driver.Copy2D(srcMemoryType=1, srcHost=src, srcPitch=width, dstMemoryType=2, dstDevice=dst,
                                 dstPitch=width, WidthInBytes=width, Height=rows)  # fmt: skip
                lib = held if way.endswith("GIL kept") else driver.lib
                driver._check(lib.cuMemcpy2DAsync_v2(ctypes.byref(c), driver.stream), "cuMemcpy2DAsync")
            mine.append(time.perf_counter() - started)
            if way.startswith("send"):
                driver.record(slot[1])
                slot[2] = True
        with lock:
            times.extend(mine)

    threads_seconds(work, threads)
    driver.wait()
    return times


def alloc(managed_first: bool) -> None:
    specs = [(f"f{i}", (1, 8, 16640, 128), "BF16") for i in range(64)]

    def viewed(out: dict, host: bool = True) -> str:
        """The host views of `out`'s buffers (where `host`), then two reads of all of them
        by a kernel (the first read of pages a kernel never touched may cost more than the next)."""
        started = time.perf_counter()
        for a in out.values() if host else ():
            _host_address(a.view(mx.uint16))
        views = _ms(started)
        reads = []
        for _ in range(2):
            started = time.perf_counter()
            mx.eval([mx.max(a.view(mx.uint16)) for a in out.values()])
            reads.append(_ms(started))
        return f"host views {views:.1f} ms, a kernel's 1st / 2nd read {reads[0]:.1f} / {reads[1]:.1f} ms"

    def zeros() -> str:
        buffers.GPU_ALLOCATION = "zeros"
        started = time.perf_counter()
        out = buffers.allocate(specs)
        return f"zeros: made {_ms(started):.1f} ms, {viewed(out)}"

    def managed() -> str:
        started = time.perf_counter()
        out = buffers.managed_empty(specs) or {}
        return f"managed: made and placed {_ms(started):.1f} ms, {viewed(out)}"

    def addressed() -> str:
        buffers.GPU_ALLOCATION = "zeros"
        started = time.perf_counter()
        out = buffers.allocate(specs)
        made = _ms(started)
        started = time.perf_counter()
        got = addresses.device_addresses(list(out.values()))
        if got is None:
            return "zeros + device addresses: this MLX cannot run the address kernel"
        return (
            f"zeros + device addresses: made {made:.1f} ms, addresses {_ms(started):.1f} ms, {viewed(out, host=False)}"
        )

    ways: list[Callable[[], str]] = [managed, zeros] if managed_first else [zeros, managed]
    ways.append(addressed)
    for round_ in range(3):
        for way in ways:
            print(f"round {round_ + 1}, 64 buffers, 2 GiB, {way()}", flush=True)


# How a process's first allocation is preceded: nothing, a forward's memory (MLX's cache
# cleared or not), the reader threads' pinned rings asked for (being made, as a handle's
# open leaves them) or made, and both (a restarted process: the model ran, then the open).
FIRST_WAYS = [
    "alone", "after_forward", "after_forward_cleared", "readers_asked", "readers_made",
    "after_forward_readers_asked", "after_forward_readers_made",
]  # fmt: skip


def first() -> None:
    for way in FIRST_WAYS:
        for _ in range(2):
            done = subprocess.run([sys.executable, __file__, "first", "--way", way], capture_output=True, text=True)
            print(done.stdout.strip() or f"{way}: failed: {done.stderr.strip()[-300:]}", flush=True)


def first_in_this_process(way: str) -> None:
    from persistent_prefix_cache.device import readers

    specs = [(f"f{i}", (1, 8, 4096, 128), "BF16") for i in range(64)]
    if way.startswith("after_forward"):
        x = mx.zeros((1 << 30,), dtype=mx.uint8)
        mx.eval(x)
        del x
        if way == "after_forward_cleared":
            mx.clear_cache()
    rings = ""
    if "readers" in way:
        asked = time.perf_counter()
        cuda.prepare_readers(readers.reader_pool, readers.READERS)
        if way.endswith("readers_made"):
            done = threading.Event()
            readers.reader_pool().submit(done.set)
            done.wait()  # the pool's queue runs in order: the rings were made before this
            rings = f"; the rings made in {_ms(asked):.1f} ms"
    mx.synchronize()
    took = []
    for _ in range(3):
        started = time.perf_counter()
        made = buffers.allocate(specs)
        mx.synchronize()
        took.append(_ms(started))
        del made
    print(f"{way:28s} 64 buffers, 512 MiB: " + " / ".join(f"{t:.1f}" for t in took) + f" ms (1st / 2nd / 3rd){rings}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=["link", "stage", "calls", "alloc", "first"])
    p.add_argument("--way", choices=FIRST_WAYS, help=argparse.SUPPRESS)  # first: one new process
    p.add_argument("--streams", action="store_true", help="stage: also a copy stream per thread")
    p.add_argument("--managed-first", action="store_true", help="alloc: managed buffers before zeros")
    args = p.parse_args()
    driver = cuda._get_driver() if cuda.on_cuda() else None
    if driver is None:
        print(
            f"cuda_probes: needs a CUDA GPU and its driver (MLX's default device here: {mx.default_device()})",
            file=sys.stderr,
        )
        return 2
    mx.eval(mx.ones(1) + 1)  # MLX's context first: the driver calls share it
    driver._on_this_thread()
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    if args.probe == "link":
        link(driver)
    elif args.probe == "stage":
        stage(driver, args.streams)
    elif args.probe == "calls":
        calls(driver)
    elif args.probe == "first":
        first_in_this_process(args.way) if args.way else first()
    else:
        alloc(args.managed_first)
    return 0


if __name__ == "__main__":
    sys.exit(main())

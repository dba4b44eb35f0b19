"""The CUDA driver calls that move restored and stored bytes (libcuda through ``ctypes``:
MLX does not expose them), and the pinned host memory they copy through.

`cuda` owns the process's one `Driver` and the moves made with it; this module holds
only the calls, their structures, and the settings read where pinned memory is made.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from typing import Any, Iterator, cast

import numpy as np

STAGE_PIECE = 2 << 20  # bytes of one pinned piece (read, hashed, copied as one)
STAGE_RING = 4  # pinned pieces per reader thread: reads go on while earlier copies run
# The calls that only queue work on a stream (a copy to the device, an event's record) made
# through a handle that keeps the GIL (``ctypes.PyDLL``): no hand-over and no taking it
# back, which on a restore's 12 reader threads came to ~0.6 ms a call (docs/performance.md,
# twentieth day), at the risk of every Python thread waiting where such a call blocks. Off
# until `tools/cuda_probes.py calls` and `tools/restore_layouts.py --keep-gil` say; read
# when the driver is first made.
ENQUEUE_KEEPS_GIL = False


class Location(ctypes.Structure):
    # CUmemLocation: where a prefetch moves pages to.
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Copy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``: `Height` rows of `WidthInBytes` bytes, each side's rows its pitch apart."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]  # fmt: skip


_MEMORY_HOST, _MEMORY_DEVICE = 1, 2  # CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE
_MAX_PITCH = (1 << 31) - 1  # what a 2D copy's pitch may be (CU_DEVICE_ATTRIBUTE_MAX_PITCH on current GPUs)
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: never waits for MLX's own streams


class Driver:
    """The few CUDA driver calls the moves need (libcuda, loaded once)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self.device = device.value
        self.context = ctypes.c_void_p()
        # The primary context: the one MLX's runtime calls use on this device.
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device), "cuDevicePrimaryCtxRetain")
        self._current()
        stream = ctypes.c_void_p()
        self._check(lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
        self.stream = stream
        try:  # CUDA 12.2 and later: the destination as a location
            self._prefetch_v2: Any = lib.cuMemPrefetchAsync_v2  # None: before CUDA 12.2
            self._prefetch_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, Location, ctypes.c_uint, ctypes.c_void_p]
            self._prefetch_v1: Any = None  # its older form, where v2 is missing
        except AttributeError:
            self._prefetch_v2 = None
            self._prefetch_v1 = lib.cuMemPrefetchAsync
            self._prefetch_v1.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._threads = threading.local()
        self._lanes: list[tuple[list[list], ctypes.c_void_p]] = []  # free (ring, stream) pairs for copies to the host
        self._lanes_lock = threading.Lock()
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        if hasattr(lib, "cuMemcpy2DAsync_v2"):
            lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(Copy2D), ctypes.c_void_p]
        self.queue: Any = lib  # the calls that only queue work (`ENQUEUE_KEEPS_GIL`)
        if ENQUEUE_KEEPS_GIL:
            self.queue = ctypes.PyDLL("libcuda.so.1")
            for name in ("cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuMemcpy2DAsync_v2"):
                if hasattr(lib, name):
                    getattr(self.queue, name).argtypes = getattr(lib, name).argtypes
        self._copy2d: Any = getattr(self.queue, "cuMemcpy2DAsync_v2", None)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise OSError(f"{what} failed: CUDA driver error {status}")

    def _current(self) -> None:
        # Driver calls act on the calling thread's current context: make it the primary one.
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _on_this_thread(self) -> None:
        if not getattr(self._threads, "ready", False):
            self._current()
            self._threads.ready = True

    def ring(self) -> "list[list]":
        """This thread's pinned pieces, each ``[numpy bytes, event, copy pending]``
        (made on first use, kept for the process: pinning costs more than a read)."""
        ring = getattr(self._threads, "ring", None)
        if ring is None:
            self._on_this_thread()
            ring = self._new_ring()
            self._threads.ring, self._threads.next = ring, 0
        return ring

    def _new_ring(self) -> "list[list]":
        ring = []
        for _ in range(STAGE_RING):
            address, event = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.lib.cuMemHostAlloc(ctypes.byref(address), STAGE_PIECE, 0), "cuMemHostAlloc")
            self._check(self.lib.cuEventCreate(ctypes.byref(event), 2), "cuEventCreate")  # no timing
            buffer = (ctypes.c_uint8 * STAGE_PIECE).from_address(cast(int, address.value))  # set by the call
            ring.append([np.frombuffer(buffer, dtype=np.uint8), event, False])  # type: ignore[call-overload]  # a ctypes array is a buffer
        return ring

    @contextmanager
    def lane(self) -> "Iterator[tuple[list[list], ctypes.c_void_p]]":
        """A ring of pinned pieces and a stream of its own for one copy to the host, taken
        from the process's free lanes (made when none is free) and given back after. A
        writer thread lives as long as its handle: rings made per thread were pinned
        again by every handle's first store (pinning waits for the device) and never freed."""
        self._on_this_thread()
        with self._lanes_lock:
            lane = self._lanes.pop() if self._lanes else None
        if lane is None:
            stream = ctypes.c_void_p()
            self._check(self.lib.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING), "cuStreamCreate")
            lane = (self._new_ring(), stream)
        try:
            yield lane
        finally:
            with self._lanes_lock:
                self._lanes.append(lane)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy host bytes to device memory, on the stream."""
        self._check(self.queue.cuMemcpyHtoDAsync_v2(dst, src, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int) -> None:
        """Copy `rows` rows of `width` host bytes, `src_pitch` apart, to device memory,
        `dst_pitch` apart, on the stream: one copy of all (a field's rows were one copy
        each: thousands of small ones for a prompt stored in pieces)."""
        if self._copy2d is None or max(dst_pitch, src_pitch) > _MAX_PITCH:
            for r in range(rows):
                self.copy(dst + r * dst_pitch, src + r * src_pitch, width)
            return
        c = Copy2D(srcMemoryType=_MEMORY_HOST, srcHost=src, srcPitch=src_pitch, dstMemoryType=_MEMORY_DEVICE,
                    dstDevice=dst, dstPitch=dst_pitch, WidthInBytes=width, Height=rows)  # fmt: skip
        self._check(self._copy2d(ctypes.byref(c), self.stream), "cuMemcpy2DAsync")

    def to_host(self, dst: int, src: int, nbytes: int, stream: ctypes.c_void_p) -> None:
        """Start copying device (or managed) bytes to host memory on a lane's `stream` (a
        writer's copy never waits behind a reader's); `record_on` marks it."""
        self._check(self.lib.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def read(self, dst: int, src: int, nbytes: int) -> None:
        """Copy device bytes to host memory and wait (a few bytes: `addresses.device_addresses`' check)."""
        self._on_this_thread()
        self._check(self.lib.cuMemcpyDtoH_v2(dst, src, nbytes), "cuMemcpyDtoH")

    def record_on(self, event, stream: ctypes.c_void_p) -> None:
        """Mark `event` once what `stream` holds now is done."""
        self._check(self.queue.cuEventRecord(event, stream), "cuEventRecord")

    def record(self, event) -> None:
        """Mark `event` once what the stream holds now is done."""
        self._check(self.queue.cuEventRecord(event, self.stream), "cuEventRecord")

    def wait_event(self, event) -> None:
        self._check(self.lib.cuEventSynchronize(event), "cuEventSynchronize")

    def prefetch(self, address: int, nbytes: int) -> None:
        self._on_this_thread()
        if self._prefetch_v2 is not None:
            status = self._prefetch_v2(address, nbytes, Location(_LOCATION_DEVICE, self.device), 0, self.stream)
        else:
            status = self._prefetch_v1(address, nbytes, self.device, self.stream)
        self._check(status, "cuMemPrefetchAsync")

    def wait(self) -> None:
        self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

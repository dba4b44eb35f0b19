"""Restored buffers moved onto a CUDA GPU in bulk, before anything computes on them.

MLX's CUDA backend keeps an array the host can see in managed memory. The read path
and a background fill write restored KV there from the host, so its pages sit in host
memory; the first kernel that reads them (the caller's first forward) then faults them
over to the GPU page by page, at a fraction of what the link carries. That cost lands
outside the timed restore, where the cost model cannot see it: the disk looked faster
than it is, and a restarted server restored 8k tokens at up to 2 x the prefill
(docs/h200-measurements.md §8).

`to_gpu` asks the CUDA driver to migrate whole buffers at once (``cuMemPrefetchAsync``,
through ``ctypes``: MLX does not expose it) and waits, so the restore's time includes
the move and the first forward finds the pages on the device. Where the driver cannot
be reached it touches every page with one small MLX reduction per buffer on the
caller's thread instead: slower, but still inside the timed restore.

`MODE` is a module setting (``tools/gpu_bench.py --gpu-pages`` measures each):
``"prefetch"`` (the driver, else ``"touch"``), ``"touch"``, or ``"none"`` (leave the
pages where the host wrote them: the behaviour before).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Sequence

import numpy as np

MODE = "prefetch"
_TOUCH_BYTES = 4096  # one element read per this many bytes faults every page over
_lock = threading.Lock()
_driver: "_Driver | None | bool" = None  # None: not tried; False: unavailable


class _Location(ctypes.Structure):
    # CUmemLocation: where a prefetch moves pages to.
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: never waits for MLX's own streams


class _Driver:
    """The few CUDA driver calls a bulk migration needs (libcuda, loaded once)."""

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
            self._prefetch_v2 = lib.cuMemPrefetchAsync_v2
            self._prefetch_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
            self._prefetch_v1 = None
        except AttributeError:
            self._prefetch_v2 = None
            self._prefetch_v1 = lib.cuMemPrefetchAsync
            self._prefetch_v1.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._threads = threading.local()

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise OSError(f"{what} failed: CUDA driver error {status}")

    def _current(self) -> None:
        # Driver calls act on the calling thread's current context: make it the primary one.
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def prefetch(self, address: int, nbytes: int) -> None:
        if not getattr(self._threads, "ready", False):
            self._current()
            self._threads.ready = True
        if self._prefetch_v2 is not None:
            status = self._prefetch_v2(address, nbytes, _Location(_LOCATION_DEVICE, self.device), 0, self.stream)
        else:
            status = self._prefetch_v1(address, nbytes, self.device, self.stream)
        self._check(status, "cuMemPrefetchAsync")

    def wait(self) -> None:
        self._check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


def _get_driver() -> "_Driver | None":
    global _driver
    with _lock:
        if _driver is None:
            try:
                _driver = _Driver()
            except (OSError, AttributeError):  # no driver library, or a call it refused
                _driver = False
        return _driver or None


def on_cuda() -> bool:
    """Whether MLX's default device is a CUDA GPU (whose host-written arrays live in
    managed memory; Apple's unified memory needs no move)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def _address(buffer) -> tuple[int, int]:
    view = memoryview(buffer).cast("B")
    if not view.nbytes:
        return 0, 0
    return np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes


def prefetch(buffers: Sequence) -> bool:
    """Start moving each buffer's pages to the GPU (any object with the buffer
    protocol over managed memory: an MLX array's memoryview, a numpy view of one);
    `wait` waits for the moves. Safe on any thread.

    Returns:
        Whether the driver took them (False: `MODE` is not ``"prefetch"``, or the
        driver cannot be reached or refused; nothing was started then).
    """
    driver = _get_driver() if MODE == "prefetch" and on_cuda() else None
    if driver is None:
        return False
    try:
        for buffer in buffers:
            address, nbytes = _address(buffer)
            if nbytes:
                driver.prefetch(address, nbytes)
    except OSError:
        return False
    return True


def wait() -> None:
    """Wait for the moves `prefetch` started (on any thread)."""
    driver = _get_driver() if MODE == "prefetch" else None
    if driver is not None:
        try:
            driver.wait()
        except OSError:
            pass  # a move is a hint: the first kernel faults whatever did not move


def moves() -> bool:
    """Whether `prefetch` moves pages here (`MODE` ``"prefetch"`` on a CUDA GPU): a
    caller may then start moves early, on any thread, and finish with `to_gpu`."""
    return MODE == "prefetch" and on_cuda()


def to_gpu(arrays: Sequence, *, started: bool = False) -> None:
    """Move evaluated MLX arrays the host wrote onto the GPU now, and wait, for them and
    for moves already `started` with `prefetch` (on the thread that owns MLX's stream:
    the touch runs MLX operations). A no-op off CUDA, and with `MODE` ``"none"``."""
    if MODE == "none" or not on_cuda() or not (arrays or started):
        return
    if prefetch([memoryview(a) for a in arrays]):
        wait()
        return
    touch(arrays)
    if started:
        wait()


def touch(arrays: Sequence) -> None:
    """Fault every page of each array over to the GPU: one element read per
    `_TOUCH_BYTES`, summed by one small kernel per array."""
    import mlx.core as mx

    sums = []
    for a in arrays:
        if a.size == 0:
            continue
        flat = a.reshape(-1)
        step = max(1, _TOUCH_BYTES // a.itemsize)
        sums.append(mx.sum(flat[::step].astype(mx.float32) if a.dtype != mx.bool_ else flat[::step]))
    if sums:
        mx.eval(sums)

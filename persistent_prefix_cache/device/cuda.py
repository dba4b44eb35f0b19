"""Restored bytes put on a CUDA GPU by the restore itself, before anything computes on them.

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
``"stage"`` (the default: also `Stager`, below), ``"prefetch"`` (the driver, else
``"touch"``), ``"touch"``, or ``"none"`` (leave the pages where the host wrote them:
the behaviour before).

Writes go the other way (`to_host`): the writer copies a store's new KV, which the GPU
just computed, to the host by the copy engine, rather than reading managed memory in
place (which moves its pages to the host while the caller's next forward runs).

A field the read path reads goes further (`Stager`): each piece is read into a
small pinned host buffer (a whole field's hashed there) and copied to the device by the copy engine,
so no page of managed memory is ever touched by the host (H200, 1 GiB: read into
pinned pieces 45-57 ms, copies 22-30 ms beside them, against 90 ms for reads into
managed memory then 30 ms of migration; a whole 8k-token restore 64-69 ms against
110 ms: docs/h200-measurements.md §9).
"""

from __future__ import annotations

import threading
from typing import Callable, Literal, Sequence

import numpy as np

from . import cuda_driver
from .cuda_driver import Driver

MODE = "stage"
_TOUCH_BYTES = 4096  # one element read per this many bytes faults every page over
_CHECK_BYTES = 256  # bytes at each end of a `to_host` copy compared with its source
_lock = threading.Lock()
_driver: "Driver | Literal[False] | None" = None  # None: not tried; False: unavailable


def _get_driver() -> "Driver | None":
    global _driver
    with _lock:
        if _driver is None:
            try:
                _driver = Driver()
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
    driver = _get_driver() if MODE in ("prefetch", "stage") and on_cuda() else None
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


def to_host(array: np.ndarray, *, pause: Callable[[], None] | None = None) -> np.ndarray:
    """A host copy of `array`, a contiguous numpy view over managed memory (a store's copy
    of new KV, on the GPU), made by the copy engine: the host never touches the managed
    pages, which stay on the device. Read in place, they moved to the host page by page
    while the caller's next forward ran, and its next restore faulted them back. Where
    staging is off or the driver cannot be reached or refuses, `array` itself (read in
    place). The copy's first and last bytes are compared with the source's (a few pages
    read in place): a copy that disagrees is never written, and stops staging for the
    process.

    Args:
        array: The bits to copy.
        pause: Called before each pinned piece is copied (the writer's `ReadsFirst.wait`:
            a restore goes first).
    """
    driver = _get_driver() if MODE == "stage" and _staging and array.nbytes and array.flags.c_contiguous else None
    if driver is None:
        return array
    out = np.empty_like(array)
    try:
        _copy_to_host(driver, out.reshape(-1).view(np.uint8), array.ctypes.data, pause)
    except OSError:
        return array
    got, want = out.reshape(-1).view(np.uint8), array.reshape(-1).view(np.uint8)
    if not (
        np.array_equal(got[:_CHECK_BYTES], want[:_CHECK_BYTES])
        and np.array_equal(got[-_CHECK_BYTES:], want[-_CHECK_BYTES:])
    ):
        _stop_staging()
        return array
    return out


def _copy_to_host(driver: Driver, out: np.ndarray, src: int, pause: Callable[[], None] | None) -> None:
    """Copy ``out.nbytes`` device bytes at `src` into `out` through a lane's ring of pinned
    pieces (`Driver.lane`), calling `pause` before each piece. One copy of a whole field into
    pageable memory was one long driver call: a restore started meanwhile waited for all
    of it (H200: a fetch of 2k tokens took 226 ms beside a store of 8k, 29 ms alone), and
    the writer could not give way between its safe points."""
    with driver.lane() as (ring, stream):
        inflight: list[tuple[list, int, int]] = []  # (slot, offset, length), oldest first

        def land() -> None:
            slot, at, length = inflight.pop(0)
            driver.wait_event(slot[1])
            out[at : at + length] = slot[0][:length]

        try:
            for k, at in enumerate(range(0, out.nbytes, cuda_driver.STAGE_PIECE)):
                if pause is not None:
                    pause()
                if len(inflight) == len(ring):
                    land()
                slot = ring[k % len(ring)]
                length = min(cuda_driver.STAGE_PIECE, out.nbytes - at)
                driver.to_host(slot[0].ctypes.data, src + at, length, stream)
                driver.record_on(slot[1], stream)
                inflight.append((slot, at, length))
            while inflight:
                land()
        finally:
            for slot, _, _ in inflight:  # a failed copy: the lane goes back with nothing in flight
                try:
                    driver.wait_event(slot[1])
                except OSError:
                    pass


def from_device(address: int, nbytes: int, *, pause: Callable[[], None] | None = None) -> np.ndarray | None:
    """``nbytes`` bytes of device memory at `address` (`addresses.device_addresses`) in a new host
    array of bytes, copied by the copy engine through a lane's pinned pieces (`pause` is
    called before each): nothing on the device moves. Its ends are read again by a plain
    driver copy and compared. None where staging does not run here, or where a driver call
    failed or the ends disagree (staging then stops for the process)."""
    driver = _get_driver() if stager_possible() else None
    if driver is None:
        return None
    out = np.empty(nbytes, dtype=np.uint8)
    ends = np.empty(2 * min(nbytes, _CHECK_BYTES), dtype=np.uint8)
    half = len(ends) // 2
    try:
        if nbytes:
            _copy_to_host(driver, out, address, pause)
            driver.read(ends.ctypes.data, address, half)
            driver.read(ends[half:].ctypes.data, address + nbytes - half, half)
    except OSError:
        _stop_staging()
        return None
    if not (np.array_equal(out[:half], ends[:half]) and np.array_equal(out[nbytes - half :], ends[half:])):
        _stop_staging()
        return None
    return out


def wait() -> None:
    """Wait for the moves `prefetch` started (on any thread)."""
    driver = _get_driver() if MODE in ("prefetch", "stage") else None
    if driver is not None:
        try:
            driver.wait()
        except OSError:
            pass  # a move is a hint: the first kernel faults whatever did not move


def moves() -> bool:
    """Whether `prefetch` moves pages here (`MODE` ``"prefetch"`` or ``"stage"`` on a
    CUDA GPU): a caller may then start moves early, on any thread, and `wait` for them."""
    return MODE in ("prefetch", "stage") and on_cuda()


def to_gpu(arrays: Sequence) -> None:
    """Move evaluated MLX arrays the host wrote onto the GPU now, and wait (on the
    thread that owns MLX's stream: the touch runs MLX operations). A no-op off CUDA,
    and with `MODE` ``"none"``."""
    if MODE == "none" or not arrays or not on_cuda():
        return
    if prefetch([memoryview(a) for a in arrays]):
        wait()
        return
    touch(arrays)


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


class Stager:
    """One destination's pieces, read into pinned host memory and copied to the device
    (see the module's docstring): `take` a piece, fill it, `send` it. The module's `wait`
    waits for the copies; until then the destination must stay alive and unread. A
    driver call that fails puts that piece in place from the host instead, and ends
    staging for this process: never a lost piece.

    Args:
        driver: The CUDA driver.
        dest: The destination (managed memory: an MLX array's bytes), or an empty view
            where `address` is given.
        address: The destination's device address (`addresses.device_addresses`); 0: `dest`'s.
    """

    def __init__(self, driver: Driver, dest: memoryview, address: int = 0):
        self.driver, self.dest = driver, dest
        self.base = address or _address(dest)[0]
        self.ring = driver.ring()
        self.size = cuda_driver.STAGE_PIECE
        self._piece = memoryview(b"")  # what `take` gave last
        self._slot: list | None = None

    def take(self, nbytes: int) -> memoryview:
        """The next pinned piece, `nbytes` long (at most `size`), free to fill: its last
        copy has finished."""
        slot = self.ring[self.driver._threads.next]
        try:
            if slot[2]:
                self.driver.wait_event(slot[1])
                slot[2] = False
            self._slot, self._piece = slot, memoryview(slot[0])[:nbytes]
        except OSError:
            _stop_staging()
            self._slot, self._piece = None, memoryview(np.empty(nbytes, dtype=np.uint8))  # type: ignore[arg-type]  # numpy stubs (3.10)
        return self._piece

    def target(self, dest: memoryview, address: int = 0) -> tuple[memoryview, int]:
        """Another destination for `send_to` (as this stager's own: `dest` or its device `address`)."""
        return dest, address or _address(dest)[0]

    def send(self, offsets: list[int], length: int, at: list[int] | None = None) -> None:
        """Put the piece `take` gave into the destination: stretches of `length` bytes
        at `offsets` (rows of a field, strided in the destination), taken from the
        piece back to back, or from the piece's byte offsets `at`."""
        self.send_to([(self.dest, self.base, offsets, length, at)])

    def send_to(self, parts: list[tuple[memoryview, int, list[int], int, list[int] | None]]) -> None:
        """`send` to several destinations from the one piece `take` gave (the fields of a
        small segment read together), each ``(dest, its base address (`target`),
        offsets, length, at)``: one copy per part where its rows are evenly spaced."""
        piece, slot = self._piece, self._slot
        spans = [(d, b, o, n, at if at is not None else [i * n for i in range(len(o))]) for d, b, o, n, at in parts]
        if slot is not None:
            threads = self.driver._threads
            threads.next = (threads.next + 1) % len(self.ring)
            try:
                src = slot[0].ctypes.data
                for _, base, offsets, length, at in spans:
                    if _evenly_spaced(offsets, length) and _evenly_spaced(at, length):  # rows of a field: one copy
                        dst_pitch, src_pitch = offsets[1] - offsets[0], at[1] - at[0]
                        self.driver.copy_rows(
                            base + offsets[0], dst_pitch, src + at[0], src_pitch, length, len(offsets)
                        )
                    else:
                        for offset, where in zip(offsets, at):
                            self.driver.copy(base + offset, src + where, length)
                self.driver.record(slot[1])
                slot[2] = True
                return
            except OSError:
                _stop_staging()
                self.driver.wait()  # the copies that did start land before the host writes
        for dest, _, offsets, length, at in spans:
            if not dest.nbytes:  # device memory without a host view: this read fails, nothing lost
                raise OSError("a staged copy failed and the destination has no host view")
            for offset, where in zip(offsets, at):
                dest[offset : offset + length] = piece[where : where + length]


def _evenly_spaced(offsets: list[int], length: int) -> bool:
    """Whether `offsets` are two or more, the same step apart, and stretches of `length`
    bytes there do not overlap."""
    if len(offsets) < 2:
        return False
    step = offsets[1] - offsets[0]
    return step >= length and all(b - a == step for a, b in zip(offsets, offsets[1:]))


_staging = True  # cleared for the process when a driver call of `Stager` fails


def _stop_staging() -> None:
    global _staging
    _staging = False


_prepared = False


def prepare_readers(pool, threads: int) -> None:
    """Make the rings of pinned pieces of the reader threads now, in the background, once
    per process, where stages run (the first restore of a process made the driver, the
    threads and their pinned memory inside its own time, and the cost model took that
    for the disk's rate). Where pinned memory is refused, staging stops for the process.

    Args:
        pool: Gives the reader threads' executor (`readers.reader_pool`).
        threads: How many threads it has.
    """
    global _prepared
    with _lock:
        if _prepared:
            return
        _prepared = True
    driver = _get_driver() if stager_possible() else None
    if driver is None:
        return
    together = threading.Barrier(threads, timeout=30)  # each task on a thread of its own

    def ready() -> None:
        try:
            driver.ring()
            together.wait()
        except OSError:
            _stop_staging()
            together.abort()
        except threading.BrokenBarrierError:
            pass  # a restore took a thread meanwhile: its ring is made on first use

    executor = pool()
    for _ in range(threads):
        executor.submit(ready)


def stager_possible() -> bool:
    """Whether `stager` can give stagers here (see there)."""
    return MODE == "stage" and _staging and on_cuda() and _get_driver() is not None


def stager(dest: memoryview, address: int = 0) -> Stager | None:
    """A `Stager` for `dest`, where staging runs here (`MODE` ``"stage"``, a CUDA GPU,
    its driver reachable, pinned memory granted); else None (read into `dest`).

    Args:
        dest: The destination's host view (empty where `address` is given).
        address: The destination's device address (`addresses.device_addresses`), if known: the
            copies go there, and a failed one fails the read (no host view to fall back on).
    """
    driver = _get_driver() if stager_possible() else None
    if driver is None:
        return None
    try:
        return Stager(driver, dest, address)
    except OSError:  # no pinned memory, no events: read the plain way
        _stop_staging()
        return None

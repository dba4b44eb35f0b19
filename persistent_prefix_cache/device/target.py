"""Where a handle's restored bytes live (`Target`): chosen once per handle at open
(`device_target`) or by a background fill (`host_target`), passed explicitly to whoever
reads, and asked by them how the bytes get there. Also the device kind the cost model
keys its records by (`device_kind`), and the memory MLX computes in (`device_memory`, which
sizes the RAM tier's and `ppc serve`'s default budgets)."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..blocks import dtype_info, np_uint
from . import addresses, cuda, cuda_driver, readers
from .buffers import Arena, HostBits, WriterRoute, allocate, on_gpu

# How RAM-tier blocks are joined: None by device (`device_target`), or "mlx" / "numpy"
# (tests and ``tools/gpu_bench.py --ram-join`` set it, to measure both).
RAM_JOIN: str | None = None


class Target:
    """Where a read puts the bytes it reads, decided once by whoever reads and passed to
    the read path explicitly: a handle's restores (`device_target`, chosen once at open
    from MLX's device) or a background fill (`host_target`).

    Args:
        host: Numpy buffers, read on the calling thread alone (the reader pool is the
            callers'), handed back as `HostBits`, no MLX work: a background fill.
        join_on_device: Join RAM-tier blocks with MLX operations (a GPU, where CPU
            writes would migrate pages) rather than copying them into host buffers.
        arena: Where host buffers are carved from, if it holds them (else numpy's own):
            MLX memory made on a GPU, so that a fill reads straight into it.

    Attributes:
        device: MLX arrays on a CUDA GPU: made there, restored bytes moved there within
            the restore (`cuda`).
    """

    def __init__(self, *, host: bool = False, join_on_device: bool = False, arena: Arena | None = None):
        self.host, self.join_on_device, self.arena = host, join_on_device, arena
        self.device = not host and cuda.on_cuda()
        self._used = 0  # bytes of the arena handed out

    def writer_route(self, pause: Callable[[], None] | None = None) -> WriterRoute | None:
        """How a writer takes the bits of a store's copy of new KV to the host: on a CUDA
        GPU a `WriterRoute` (by the copy engine from the copy's device address: the
        device's pages stay where the RAM tier and the next forward want them); elsewhere
        None: it reads them in place.

        Args:
            pause: Called before each piece the route copies (the writer's `ReadsFirst.wait`).
        """
        return WriterRoute(pause) if self.device else None

    def allocate(self, specs: list[tuple[str, tuple[int, ...], str]]) -> dict:
        """Buffers of these shapes and safetensors dtypes, contents undefined: MLX arrays
        (`buffers.allocate`), or for a host target numpy arrays of the bits (from the arena
        where they fit; np.empty leaves the pages untouched too)."""
        if not self.host:
            return allocate(specs)
        out = {}
        for name, shape, dtype in specs:
            bits = np_uint(dtype_info(dtype)[1])
            got = self._take(self.arena, shape, bits) if self.arena is not None else None
            out[name] = got if got is not None else np.empty(shape, dtype=bits)
        return out

    def wrap(self, array, dtype: str):
        """What a read hands back for a buffer it filled: the array, or host bits."""
        return HostBits(array, dtype, self.arena) if self.host else array

    def share(self, fn, items: list) -> list:
        """`fn` over `items`, on the reader threads and this one (`readers.share`; more
        of them where reads are staged to a CUDA GPU, `readers.STAGED_READ_THREADS`); a
        host target's on this thread alone."""
        threads = readers.STAGED_READ_THREADS if self.staged() else None
        return readers.share(fn, items, alone=self.host, threads=threads)

    # -- how read bytes reach the device (each a no-op where nothing moves) -------------

    def moves_as_read(self) -> bool:
        """Whether a read's buffers may go to the device while it reads (a CUDA GPU
        where pages move): the read then asks `stages`, `start_moves`, `stager`."""
        return self.device and cuda.moves()

    def stages(self) -> bool:
        """Whether reads go through pinned pieces to the device (`cuda.Stager`)."""
        return cuda.stager_possible()

    def staged(self) -> bool:
        """Whether this target's reads go to the device by stages now (`moves_as_read` and
        `stages`): the one place that decides it."""
        return self.moves_as_read() and self.stages()

    def piece_bytes(self) -> int:
        """Bytes of one pinned piece of a stager (`cuda_driver.STAGE_PIECE`)."""
        return cuda_driver.STAGE_PIECE

    def stager(self, view: memoryview, address: int = 0):
        """A stager for `view`, or for the device memory at `address` where given
        (`cuda.stager`); None: read into `view` itself."""
        return cuda.stager(view, address)

    def addresses(self, arrays: Sequence) -> list[int] | None:
        """The device addresses of a read's evaluated buffers where reads go to the device
        by stages (`addresses.device_addresses`: no host view, which would move them); None:
        the read takes host views."""
        if not self.staged():
            return None
        return addresses.device_addresses(arrays)  # (the module: this method's name is not in scope)

    def start_moves(self, buffers: Sequence) -> bool:
        """Start moving these buffers to the device (`cuda.prefetch`); False: none started."""
        return cuda.prefetch(buffers)

    def wait_moves(self) -> None:
        """Wait for the moves and copies started (`cuda.wait`)."""
        cuda.wait()

    def place(self, arrays: Sequence) -> None:
        """Put evaluated MLX arrays the host wrote where the device computes on them, and
        wait (`cuda.to_gpu`: on a CUDA GPU; a no-op elsewhere)."""
        cuda.to_gpu(arrays)

    def _take(self, arena: Arena, shape: tuple[int, ...], bits: str) -> np.ndarray | None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(bits).itemsize
        start = -(-self._used // 64) * 64
        if start + nbytes > len(arena.bytes):
            return None
        self._used = start + nbytes
        return arena.bytes[start : start + nbytes].view(bits).reshape(shape)


def host_target(arena: Arena | None = None) -> Target:
    """The target of a background fill of the RAM tier: numpy buffers (carved from
    `arena` where it holds them), on the fill's thread alone.

    Args:
        arena: MLX memory made on a GPU for the fill, if any.

    Returns:
        A host `Target`.
    """
    return Target(host=True, arena=arena)


def device_target() -> Target:
    """Where a handle's restores put what they read, decided once at open: MLX arrays on
    MLX's default device, RAM-tier blocks joined with MLX operations on a GPU (where CPU
    writes would migrate pages) and copied into host buffers on the CPU and Apple's
    unified memory (`RAM_JOIN` ``"mlx"`` or ``"numpy"`` overrides, to measure both).

    Returns:
        The handle's `Target` (on a CUDA GPU the reader threads' pinned pieces are
        being made in the background: `cuda.prepare_readers`).
    """
    join = RAM_JOIN == "mlx" if RAM_JOIN in ("mlx", "numpy") else on_gpu()
    target = Target(join_on_device=join)
    if target.device:
        cuda.prepare_readers(readers.reader_pool, readers.READERS)
    return target


def device_kind() -> str:
    """What MLX computes on here: the default device and its name (e.g.
    ``gpu:NVIDIA H200``, ``cpu:Intel(R) Xeon(R) Processor``): the key of the cost
    model's records.

    Returns:
        ``"gpu:<name>"`` or ``"cpu:<name>"`` (the name may be empty).
    """
    import mlx.core as mx

    device = mx.default_device()
    try:
        name = mx.device_info().get("device_name") or ""
    except Exception:  # an MLX without device_info, or a backend that cannot say
        name = ""
    return f"{'gpu' if device.type == mx.DeviceType.gpu else 'cpu'}:{name}"


def forwards_run_beside() -> bool:
    """Whether MLX runs the model's forwards on a device beside the calling thread (a GPU:
    CUDA's or Apple's), which only queues them, so that work of its own (a store's keys,
    index lookup, the graph of its copies) can run while they do; not on a CPU, where
    they share the cores."""
    return on_gpu()


_beside = threading.local()


def beside_stream() -> Any:
    """This thread's stream of the default device for work queued beside its forwards (a
    store's copies while the last forward runs, `forwards_run_beside`): work on it waits
    only for what it reads, not for the forwards queued before it. Made once per thread
    (MLX's streams are not shared between threads that queue work at once)."""
    import mlx.core as mx

    stream = getattr(_beside, "stream", None)
    if stream is None:
        stream = _beside.stream = mx.new_stream(mx.default_device())
    return stream


def room_for(nbytes: int) -> bool:
    """Whether MLX has room for `nbytes` more for a while: its active memory and them within
    3/4 of what it may use (Apple's recommended working set, else `device_memory`). An
    overlap that saves milliseconds must never push a device into memory pressure (a Mac
    near its working set swaps); where the memory cannot be told, there is no room."""
    import mlx.core as mx

    try:
        limit = int(mx.device_info().get("max_recommended_working_set_size") or 0) or device_memory()
        active = int(mx.get_active_memory())
    except Exception:  # an MLX that cannot tell
        return False
    return limit > 0 and active + nbytes <= limit * 3 // 4


def device_memory() -> int:
    """Bytes of memory MLX computes in: the GPU's (Apple's unified memory, a CUDA
    device's) as MLX reports it, else the machine's physical memory (0 if unknown)."""
    import mlx.core as mx

    try:
        size = int(mx.device_info().get("memory_size") or 0)
    except Exception:  # an MLX without device_info
        size = 0
    if size > 0:
        return size
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0

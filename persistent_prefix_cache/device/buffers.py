"""Buffers the read path fills: MLX arrays allocated without a zero-fill, blocks held
as host bits (`HostBits`), and the MLX memory a background fill on a GPU reads into
(`Arena`), and a restore the RAM tier serves alone joined with MLX operations where CPU
writes would migrate pages (`join_on_device`, a GPU). Which of them a read gets is its
`target.Target`'s to say.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, cast

import mlx.core as mx
import numpy as np

from ..blocks import Tensors, dtype_info, is_sliced, mx_dtype, mx_uint
from . import addresses, cuda


# How an `Arena` is made: "cpu" zeros it on MLX's CPU stream, evaluated asynchronously,
# and the fill's thread takes its host view (waiting there for the zeros); "gpu" zeros it
# on the GPU and takes the view on the caller's thread, where MLX then moves the device
# buffer into managed memory. H200, caller's thread: 0.4-0.5 ms for 32-256 MiB ("cpu")
# against 2.2 / 3.6 / 17 ms ("gpu"), paid by the fetch that skipped; until the GPU
# first used it: 14 / 27 / 115 ms against 21 / 37 / 150 ms.
ARENA_ZEROS = "cpu"


class Arena:
    """MLX memory a background fill on a GPU reads into (made on the caller's thread,
    which owns MLX's stream; written by the fill's thread through its bytes, then moved
    to the device).

    Args:
        nbytes: Its size (rounded up to whole 64-byte lines).
    """

    def __init__(self, nbytes: int):
        # 64-byte rows: one axis of MLX holds at most 2**31 - 1 elements, a fill 4 GiB and more.
        shape = (-(-nbytes // 64), 64)
        self._bytes: np.ndarray | None = None
        self._base = 0
        if ARENA_ZEROS == "cpu":
            self.array = mx.zeros(shape, dtype=mx.uint8, stream=mx.cpu)
            mx.async_eval(self.array)
        else:
            self.array = mx.zeros(shape, dtype=mx.uint8)
            mx.eval(self.array)
            _ = self.bytes  # the host view now, on the caller's thread

    @property
    def bytes(self) -> np.ndarray:
        """Its memory as host bytes (the first call waits for the zeros to land)."""
        if self._bytes is None:
            self._bytes = np.frombuffer(memoryview(self.array).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]  # MLX stubs: no buffer protocol
            self._base = self._bytes.ctypes.data
        return self._bytes

    @property
    def base(self) -> int:
        """The address of its first byte."""
        _ = self.bytes
        return self._base

    def to_device(self) -> None:
        """Move its pages to a CUDA GPU and wait, where pages move (a no-op elsewhere):
        the fill's thread wrote them, and a restore's copies would fault them over one
        by one."""
        if cuda.prefetch([self.bytes]):
            cuda.wait()

    def view(self, bits: np.ndarray, dtype: mx.Dtype) -> mx.array | None:
        """The MLX array over the same bytes as `bits` (a view of this arena's memory, as
        strided as `bits`), or None where `bits` lies elsewhere."""
        at = bits.__array_interface__["data"][0] - self.base
        size = bits.itemsize
        if not 0 <= at < len(self.bytes) or at % size or any(st % size for st in bits.strides):
            return None
        # Only the rows it spans (as_strided flattens its input; one MLX axis holds at most
        # 2**31 - 1 elements).
        span = sum((n - 1) * st for n, st in zip(bits.shape, bits.strides)) + size if bits.size else 0
        first, last = at // 64, -(-(at + span) // 64)
        if last > self.array.shape[0]:
            return None
        words = self.array[first : max(last, first + 1)].view(mx_uint(size))
        return mx.as_strided(words, bits.shape, [st // size for st in bits.strides], (at - first * 64) // size).view(
            dtype
        )


# -- allocation without a zero-fill ---------------------------------------------------


class _Unwritten:
    """A safetensors 'file' whose tensor bytes are never written: `mx.load` of it
    allocates evaluated arrays and leaves their memory as the allocator gave it.

    MLX has no ``empty``; ``mx.zeros`` fills every byte the reads overwrite anyway
    (a whole pass over the cache, ~13 ms per 128 MiB here).
    """

    def __init__(self, specs: list[tuple[str, tuple[int, ...], str]]):
        header, offset = {}, 0
        for name, shape, dtype in specs:
            n = int(np.prod(shape, dtype=np.int64)) * dtype_info(dtype)[1]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        self.head = len(text).to_bytes(8, "little") + text
        self.size = len(self.head) + offset
        self.pos = 0
        self.closed = False

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, view) -> int:
        n = len(view)
        if self.pos < len(self.head):  # the header; tensor bytes are left as they are
            k = min(n, len(self.head) - self.pos)
            view[:k] = self.head[self.pos : self.pos + k]
        self.pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else n
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)


_UNWRITTEN_WORKS = True  # cleared if this MLX cannot load from a file object
# A module setting, to measure: True allocates restore buffers zero-filled everywhere.
ALLOCATE_ZEROS = False
# How a GPU allocates them, to measure: "zeros" (on the device), "unwritten" (the
# unwritten file's load, as on the CPU) or "managed" (`managed_empty`: on an H200 a
# restore of 16k tokens 18 % faster, a later one of 4k 30 % slower, and the first
# `prefill()` after a restart slower at 1k and 16k; docs/performance.md, twelfth day).
# Zeros stay in device memory where the stages copy to their device addresses
# (`addresses.device_addresses`): no host view moves them (H100, 16k tokens of an 8B llama:
# 1.5 ms made + 0.5 ms addressed, against 13-25 ms "managed"; seventeenth day).
GPU_ALLOCATION = "zeros"


def on_gpu() -> bool:
    """Whether MLX's default device is a GPU."""
    return mx.default_device() == mx.gpu


def allocate(specs: list[tuple[str, tuple[int, ...], str]]) -> dict[str, mx.array]:
    """Evaluated MLX arrays of the given shapes and safetensors dtypes, contents undefined.

    On the CPU (and Apple's unified memory) `mx.load` of an unwritten file allocates
    them without touching their bytes. Where the default device is a GPU with its own
    memory (CUDA), zeros made on the device stream are cheaper: memory written from the
    CPU first migrates page by page (see docs/h200-measurements.md), and the unwritten
    file's load took 75 ms per GiB there against 1 ms for the zeros (H200, §9).
    """
    global _UNWRITTEN_WORKS
    if not specs:
        return {}
    if on_gpu() and GPU_ALLOCATION == "managed" and _UNWRITTEN_WORKS and not ALLOCATE_ZEROS:
        made = managed_empty(specs)
        if made is not None:
            return made
    if (on_gpu() and GPU_ALLOCATION == "zeros") or not _UNWRITTEN_WORKS or ALLOCATE_ZEROS:
        out = {
            name: mx.zeros(shape, dtype=mx_uint(dtype_info(dtype)[1])).view(mx_dtype(dtype))
            for name, shape, dtype in specs
        }
    else:
        try:
            loaded = mx.load(_Unwritten(specs), format="safetensors")  # type: ignore[arg-type]  # a file object works too
            out = cast(dict[str, mx.array], loaded)
        except (TypeError, ValueError, RuntimeError):  # an MLX without file-object loads
            _UNWRITTEN_WORKS = False
            return allocate(specs)
    mx.eval(list(out.values()))
    return out


def managed_empty(specs: list[tuple[str, tuple[int, ...], str]]) -> dict[str, mx.array] | None:
    """Evaluated MLX arrays in CUDA managed memory whose pages sit on the device, contents
    undefined; None where this MLX cannot load from a file object.

    MLX's CUDA allocator gives an array made on its CPU stream managed memory (no stream
    to allocate on), and the unwritten file's load never touches it; the driver then
    places its pages on the device (`cuda.to_gpu`: no bytes move, none were written). A
    device array's first host view costs a new managed block and a synchronous copy with
    the GIL held (MLX's `Buffer::raw_ptr`, read in MLX 0.32's source); these need neither.
    Each costs a managed allocation and a wait for the driver, which a buffer the host
    fills anyway (a restore's, `GPU_ALLOCATION`) did not repay at 4k tokens on an H200.
    """
    global _UNWRITTEN_WORKS
    try:
        loaded = mx.load(_Unwritten(specs), format="safetensors", stream=mx.cpu)  # type: ignore[arg-type]  # a file object works too
    except (TypeError, ValueError, RuntimeError):  # an MLX without file-object loads
        _UNWRITTEN_WORKS = False
        return None
    out = cast(dict[str, mx.array], loaded)
    mx.eval(list(out.values()))
    cuda.to_gpu(list(out.values()))
    return out


def device_copy(x: mx.array) -> mx.array:
    """A lazy copy of `x` in a buffer of its own, made by the device (a copy kernel on a
    GPU: the host never reads `x`, which on CUDA would move its buffer). `mx.contiguous`
    of a contiguous array, or a slice assignment of a whole one, takes the source's
    buffer; a concatenation always writes a new one."""
    axis = max(range(x.ndim), key=lambda a: x.shape[a]) if x.ndim else None
    if axis is not None and x.shape[axis] > 1:
        return mx.concatenate(x.split((1,), axis=axis), axis=axis)
    if x.size == 0:
        return mx.zeros(x.shape, dtype=x.dtype)
    flat = x.reshape(-1)  # one element: twice over, then the first
    return mx.concatenate([flat, flat])[:1].reshape(x.shape)


def stacked_copy(arrays: list[mx.array]) -> mx.array:
    """Arrays of one shape and dtype copied by the device into one buffer of its own,
    stacked along their first axis (one copy kernel; `device_copy` for a single one)."""
    return mx.concatenate(arrays, axis=0) if len(arrays) > 1 else device_copy(arrays[0])


class WriterRoute:
    """How a store's writer takes the copies of new KV made on a CUDA GPU to the host
    without moving a page of device memory (the caller's next forward and the RAM tier's
    next restore want them where they are).

    The caller's thread evaluates each copy together with its device address
    (`addresses.device_addresses`: a kernel given the array, in the same evaluation); the
    writer's thread copies the bytes at that address by the copy engine through pinned
    pieces (`cuda.from_device`). So a copy is a plain device buffer from MLX's cache,
    which the RAM tier can keep as well: no managed buffer made for the writer (1.1 ms on
    a handle's first store, 256 tokens of an 8B llama on an H100), no second copy for the
    RAM tier. Where MLX cannot run the address kernel or the driver refuses, the writer
    takes a host view instead (which moves the buffer into managed memory: slower, the
    same bits) and the caller is told to keep a separate copy for the RAM tier.

    Args:
        pause: Called before each pinned piece is copied (the writer's
            `ReadsFirst.wait`: a restore goes first).
    """

    def __init__(self, pause: Callable[[], None] | None = None):
        self._pause = pause

    def evaluate(self, arrays: list[mx.array]) -> list[int | None]:
        """Evaluate `arrays` (on the caller's thread) and say where each sits on the device
        where the writer can copy it from there (else None: it takes a host view)."""
        where = addresses.device_addresses(arrays) if cuda.stager_possible() else None
        if where is None:
            mx.eval(arrays)
            return [None] * len(arrays)
        return list(where)

    def bits(self, array: mx.array, address: int | None) -> np.ndarray:
        """The bits of evaluated `array` (unsigned ints) in host memory, on the writer's
        thread: copied from `address` where given and the copy works, else read through a
        host view (`cuda.to_host`)."""
        if address is not None:
            got = cuda.from_device(address, array.nbytes, pause=self._pause)
            if got is not None:
                return got.view(f"<u{array.itemsize}").reshape(array.shape)
        return cuda.to_host(np.asarray(memoryview(array)), pause=self._pause)  # type: ignore[arg-type]  # MLX stubs: no buffer protocol


class HostBits:
    """A block tensor held as numpy bits of an MLX dtype, not yet in MLX memory (a
    block read from the remote tier, or by a background fill): the read path copies it
    into the joined buffers like an MLX array of the RAM tier, one copy less than making
    an MLX array first.

    Args:
        bits: The tensor's bits as unsigned ints of its item size.
        dtype: Its safetensors dtype name.
        arena: The `Arena` `bits` lie in, if they do (a fill on a GPU): the tensor is
            then a view of it in MLX, made when a restore asks (`to_mx`), no copy.
    """

    __slots__ = ("bits", "dtype", "shape", "itemsize", "nbytes", "ndim", "arena")

    def __init__(self, bits: np.ndarray, dtype: str, arena: "Arena | None" = None):
        self.bits = bits
        self.dtype = mx_dtype(dtype)
        self.shape = tuple(bits.shape)
        self.itemsize = bits.itemsize
        self.nbytes = bits.nbytes
        self.ndim = bits.ndim
        self.arena = arena

    def __getitem__(self, key) -> "HostBits":
        """A view of part of it (numpy indexing of the bits), as host bits."""
        return HostBits(self.bits[key], dtype_info(self.dtype)[0], self.arena)

    def to_mx(self) -> mx.array:
        """The tensor as an MLX array: a view of its arena, or else an evaluated copy
        (on a CUDA GPU: see `to_device`)."""
        if self.arena is not None:
            view = self.arena.view(self.bits, self.dtype)
            if view is not None:
                return view
        if on_gpu():
            return to_device([self])[0]
        x = mx.array(self.bits).view(self.dtype)
        mx.eval(x)
        return x


def as_mx(x):
    """`x` as an MLX array: host bits made one (`HostBits.to_mx`), an array as it is."""
    return x.to_mx() if isinstance(x, HostBits) else x


# -- RAM-tier blocks joined on the device ----------------------------------------------


def join_on_device(
    pieces: Iterable[tuple[str, int, int, object]],
    last: dict[str, Tensors],
    last_tokens: int,
    lid_kind: dict[str, str],
    capacity: int,
) -> tuple[dict[str, dict[str, list]], dict[str, Tensors]]:
    """Runs and snapshots from RAM-tier blocks only, joined by `mx.concatenate` (with
    zeros appended as room to grow in place); blocks a fill read into an arena join as
    views of it.

    Args:
        pieces: The path's sliced tensors as ``(name, start, end, array)`` in path
            order (``name`` is ``"<leaf>.<field>"``; an array may be `HostBits`).
        last: The last block's tensors by leaf (its snapshots are taken from them).
        last_tokens: The last block's number of tokens.
        lid_kind: Leaf id -> adapter kind (sequence leaves get room to grow).
        capacity: Rows a sequence leaf's run from position 0 is given at least.

    Returns:
        (runs by leaf then field as ``(start, end, array)``, the last block's snapshot
        tensors by leaf), as the read path returns them.
    """
    parts: dict[str, list[list]] = {}  # name -> runs of [start, end, [arrays]]
    for name, start, end, x in pieces:
        x = as_mx(x)
        runs = parts.setdefault(name, [])
        if runs and runs[-1][1] == start and runs[-1][2][-1].shape[:2] == x.shape[:2]:
            runs[-1][1] = end
            runs[-1][2].append(x)
        else:
            runs.append([start, end, [x]])
    by_leaf: dict[str, dict[str, list]] = {}
    joined = []
    for name, runs in parts.items():
        lid, _, fld = name.rpartition(".")
        for start, end, arrays in runs:
            if start == 0 and lid_kind.get(lid) == "seq":
                pad = capacity - (end - start)
                if pad > 0:
                    b, h, _, w = arrays[0].shape
                    arrays = arrays + [mx.zeros((b, h, pad, w), dtype=arrays[0].dtype)]
            array = mx.concatenate(arrays, axis=2) if len(arrays) > 1 else mx.array(arrays[0])
            joined.append(array)
            by_leaf.setdefault(lid, {}).setdefault(fld, []).append((start, end, array))
    mx.eval(joined)
    snaps = {
        lid: {f: as_mx(x) for f, x in part.items() if not is_sliced(f"{lid}.{f}", x.shape, last_tokens)}
        for lid, part in last.items()
    }
    return by_leaf, snaps


_COPIERS: list[ThreadPoolExecutor] = []  # made on first use
_COPY_PIECE = 8 << 20  # bytes one copier thread takes at a time


def to_device(items: list[HostBits]) -> list[mx.array]:
    """Host bits as evaluated MLX arrays made on a CUDA GPU, the way the disk read path
    fills its buffers: arrays made on the device, written from the host by several
    threads in pieces (numpy's copies release the GIL).

    An array made from host memory holds pages the GPU then faults over one by one: a
    background fill's 256 MiB took 0.28 s that way on the H200 (5 x the prefill it was to
    save), and 0.19 s written by one thread into device-made arrays.

    Args:
        items: Host bits (each may be a strided view).

    Returns:
        One array per item, in order.
    """
    made = allocate([(str(i), x.shape, dtype_info(x.dtype)[0]) for i, x in enumerate(items)])
    arrays = [made[str(i)] for i in range(len(items))]
    jobs = []
    for x, a in zip(items, arrays):
        if x.nbytes == 0:
            continue
        dst = np.frombuffer(memoryview(a).cast("B"), dtype=x.bits.dtype).reshape(x.shape)  # type: ignore[arg-type]  # MLX stubs
        pieces = max(1, min(x.shape[int(np.argmax(x.shape))], x.nbytes // _COPY_PIECE))
        if pieces == 1:
            jobs.append((dst, x.bits))
        else:
            axis = int(np.argmax(x.shape))
            jobs.extend(zip(np.array_split(dst, pieces, axis=axis), np.array_split(x.bits, pieces, axis=axis)))
    if len(jobs) == 1:
        np.copyto(*jobs[0])
    elif jobs:
        if not _COPIERS:
            _COPIERS.append(ThreadPoolExecutor(8, thread_name_prefix="ppc-to-device"))
        for _ in _COPIERS[0].map(lambda job: np.copyto(*job), jobs):
            pass
    cuda.to_gpu(arrays)  # the host wrote them: on the GPU in bulk
    return arrays

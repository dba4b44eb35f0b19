"""Buffers the read path fills: MLX arrays allocated without a zero-fill, blocks held
as host bits, and host reads (`host_reads`: a background fill of the RAM tier reads into
numpy buffers on its own thread, with no MLX work there).
"""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import numpy as np

from ..blocks import dtype_info, mx_dtype

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()


class host_reads:
    """Within this context, `read_path` on this thread reads into numpy buffers (no
    MLX work: a GPU's stream belongs to the caller's thread), on this thread alone (the
    reader pool is the callers'), and hands back `HostBits`: what a background fill of
    the RAM tier needs."""

    def __enter__(self) -> "host_reads":
        _local.host = True
        return self

    def __exit__(self, *exc) -> None:
        _local.host = False


def _host() -> bool:
    return getattr(_local, "host", False)


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


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def allocate(specs: list[tuple[str, tuple[int, ...], str]]) -> dict[str, mx.array]:
    """Evaluated MLX arrays of the given shapes and safetensors dtypes, contents undefined.

    On the CPU (and Apple's unified memory) `mx.load` of an unwritten file allocates
    them without touching their bytes. Where the default device is a GPU with its own
    memory (CUDA), zeros made on the device stream are cheaper: memory written from the
    CPU first migrates page by page (see docs/h200-measurements.md).
    """
    global _UNWRITTEN_WORKS
    if not specs:
        return {}
    if _host():  # numpy bits (`host_reads`): np.empty leaves the pages untouched too
        return {name: np.empty(shape, dtype=_BITS[dtype_info(dtype)[1]]) for name, shape, dtype in specs}
    if _on_gpu() or not _UNWRITTEN_WORKS or ALLOCATE_ZEROS:
        uint = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
        out = {
            name: mx.zeros(shape, dtype=uint[dtype_info(dtype)[1]]).view(mx_dtype(dtype))
            for name, shape, dtype in specs
        }
    else:
        try:
            out = mx.load(_Unwritten(specs), format="safetensors")
        except (TypeError, ValueError, RuntimeError):  # an MLX without file-object loads
            _UNWRITTEN_WORKS = False
            return allocate(specs)
    mx.eval(list(out.values()))
    return out


class HostBits:
    """A block tensor held as numpy bits of an MLX dtype, not yet in MLX memory (a
    block read from the remote tier, or by a background fill): the read path copies it into the joined buffers
    like an MLX array of the RAM tier, one copy less than making an MLX array first.

    Args:
        bits: The tensor's bits as unsigned ints of its item size.
        dtype: Its safetensors dtype name.
    """

    __slots__ = ("bits", "dtype", "shape", "itemsize", "nbytes", "ndim")

    def __init__(self, bits: np.ndarray, dtype: str):
        self.bits = bits
        self.dtype = mx_dtype(dtype)
        self.shape = tuple(bits.shape)
        self.itemsize = bits.itemsize
        self.nbytes = bits.nbytes
        self.ndim = bits.ndim

    def __getitem__(self, key) -> "HostBits":
        """A view of part of it (numpy indexing of the bits), as host bits."""
        return HostBits(self.bits[key], dtype_info(self.dtype)[0])

    def to_mx(self) -> mx.array:
        """The tensor as an (evaluated) MLX array."""
        x = mx.array(self.bits).view(self.dtype)
        mx.eval(x)
        return x

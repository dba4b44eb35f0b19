"""The disk read path: block files read straight into joined, ready-to-use buffers.

Restoring a prefix joins each layer's per-block slices along the sequence axis. Reading
each file into memory, decoding its tensors and then concatenating them copies every
byte three times; here each file's header is parsed, buffers for the joined tensors are
allocated once, and the file body is read with one ``preadv`` whose vectors point at
the places the bytes belong (a tensor ``[batch, heads, tokens, dim]`` of one block is
one contiguous run per (batch, head) in the joined tensor). The checksum is computed
over those same vectors in file order, so damage is still caught before anything is
used. Files are read on a few threads (``preadv`` releases the GIL).

Blocks already in the RAM tier are copied into the same buffers. The joined key and
value buffers of ``KVCache``-like layers get room for the tokens that follow, so that
mlx-lm's next ``update_and_fetch`` writes in place instead of copying the whole cache.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from .blockfile import BlockFiles, OpenBlock
from .node import Node

Tensors = dict[str, mx.array]
_READERS = 4
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reader_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_READERS, thread_name_prefix="ppc-reader")
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool
    _pool = None  # its threads do not exist in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens


def _capacity(position: int) -> int:
    """Rows to allocate for a cache restored at `position`: room for a few decode steps."""
    return (position // KV_STEP + 1) * KV_STEP


def _allocate(specs: list[tuple[str, tuple[int, ...], Any]]) -> dict[str, mx.array]:
    """Fresh, evaluated MLX arrays of the given shapes and dtypes (allocated on the
    caller's thread, as MLX wants; every byte is overwritten by the reads)."""
    # Zero-filling some dtypes (bfloat16) is slow on the CPU: allocate unsigned ints of
    # the same width and reinterpret them.
    arrays = {
        name: mx.zeros(shape, dtype=_UINT[dtype.size]).view(dtype)
        for name, shape, dtype in specs
    }
    mx.eval(list(arrays.values()))
    return arrays


_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


@dataclass
class _Run:
    """Consecutive blocks holding slices of one field: one joined buffer."""

    field: str  # "<leaf>.<field>"
    start: int
    end: int
    shape: tuple[int, ...] = ()
    dtype: Any = None
    array: mx.array | None = None
    bytes_view: memoryview | None = None
    row_bytes: int = 0  # bytes of one (batch, head) row of the whole joined tensor


def _is_slice(lid_kind: dict[str, str], name: str) -> bool:
    lid, _, fld = name.rpartition(".")
    return lid_kind.get(lid) in ("seq", "window") and not fld.startswith("snap_")


def read_path(
    nodes: Sequence[Node],
    cached: Sequence[dict[str, Tensors] | None],
    files: BlockFiles,
    lid_kind: dict[str, str],
    position: int,
) -> tuple[int, dict[str, dict[str, list]], dict[str, Tensors]]:
    """Read a path of blocks into joined buffers, for a restore at `position`.

    Args:
        nodes: The blocks, in order.
        cached: For each block, its tensors from the RAM tier, or None to read its file.
        files: The store's block files.
        lid_kind: Leaf id -> adapter kind (which fields are sequence slices).
        position: Where the cache will be rebuilt (sizes the room to grow).

    Returns:
        (number of blocks intact, runs by leaf then field as ``(start, end, array)``,
        the last block's snapshot tensors by leaf). Reading stops before the first
        missing or damaged block: then the runs are empty and only the count matters.
    """
    opened: list[OpenBlock | None] = []
    for node, have in zip(nodes, cached):
        f = None if have is not None else files.open_block(node)
        if have is None and f is None:
            break
        opened.append(f)
    files = opened
    try:
        if len(files) < len(nodes):
            return _verify_only(files), {}, {}
        runs, snaps, targets = _plan(nodes, cached, files, lid_kind, position)
        if runs is None:
            return 0, {}, {}
        bad = _read_all(files)
        if bad is not None:
            return bad, {}, {}
        _copy_cached(nodes, cached, runs)
        del targets  # release every view of the buffers before MLX owns them again
        by_leaf: dict[str, dict[str, list]] = {}
        for name, chain in runs.items():
            lid, _, fld = name.rpartition(".")
            by_leaf.setdefault(lid, {})[fld] = [(r.start, r.end, r.array) for r in chain]
        return len(nodes), by_leaf, snaps
    finally:
        for f in files:
            if f is not None:
                f.close()


def _verify_only(files: list) -> int:
    """How many of the blocks before a missing one are intact (their checksums hold)."""
    for i, f in enumerate(files):
        if f is None:
            continue
        f.targets = [[memoryview(bytearray(e.end - e.start))] for e in f.entries]
        if not f.read_into():
            return i
    return len(files)


def _plan(nodes, cached, files, lid_kind, position):
    """Allocate the joined buffers and point every file entry's bytes at their place.

    Returns:
        (runs by field, last block's snapshots by leaf, the targets), or (None, ...) if
        the blocks disagree on shapes or dtypes (a damaged store: a miss).
    """
    # Group each slice field's blocks into runs of consecutive positions; every block of
    # a run must agree on dtype and on all dims but the sequence axis.
    runs: dict[str, list[_Run]] = {}
    for i, node in enumerate(nodes):
        if cached[i] is not None:
            fields = [(f"{lid}.{fld}", tuple(x.shape), x.dtype) for lid, part in cached[i].items() for fld, x in part.items()]
        else:
            fields = [(e.name, e.shape, e.mx_dtype) for e in files[i].entries]
        for name, shape, dtype in fields:
            if not _is_slice(lid_kind, name):
                continue
            if len(shape) != 4 or shape[2] != node.n_tokens:
                return None, None, None
            chain = runs.setdefault(name, [])
            dims = (shape[0], shape[1], shape[3])
            if chain and chain[-1].end == node.position and (chain[-1].shape, chain[-1].dtype) == (dims, dtype):
                chain[-1].end = node.end
            else:
                chain.append(_Run(name, node.position, node.end, dims, dtype))
    all_runs = [r for chain in runs.values() for r in chain]
    specs = []
    for k, r in enumerate(all_runs):
        b, h, d = r.shape
        rows = r.end - r.start
        if r.start == 0 and lid_kind.get(r.field.rpartition(".")[0]) == "seq":
            rows = max(rows, _capacity(position))  # room for mlx-lm to grow in place
        specs.append((f"r{k}", (b, h, rows, d), r.dtype))
    last = len(nodes) - 1
    snap_entries = []
    if files and files[last] is not None:
        snap_entries = [e for e in files[last].entries if not _is_slice(lid_kind, e.name)]
        specs += [(f"s.{e.name}", e.shape, e.mx_dtype) for e in snap_entries]
    arrays = _allocate(specs)
    for k, r in enumerate(all_runs):
        r.array = arrays[f"r{k}"]
        r.bytes_view = memoryview(r.array).cast("B")
        r.row_bytes = r.array.shape[2] * r.shape[2] * r.array.itemsize
    snaps: dict[str, Tensors] = {}
    if files and files[last] is None:
        for lid, part in cached[last].items():
            snaps[lid] = {f: x for f, x in part.items() if not _is_slice(lid_kind, f"{lid}.{f}")}
    for e in snap_entries:
        lid, _, fld = e.name.rpartition(".")
        snaps.setdefault(lid, {})[fld] = arrays[f"s.{e.name}"]

    targets = []
    for i, f in enumerate(files):
        if f is None:
            continue
        f.targets = []
        for e in f.entries:
            r = _run_of(runs, e.name, f.node) if _is_slice(lid_kind, e.name) else None
            if r is not None:
                b, h, d = r.shape
                block = f.node.n_tokens * d * r.array.itemsize
                skip = (f.node.position - r.start) * d * r.array.itemsize
                rows = [r.bytes_view[k * r.row_bytes + skip : k * r.row_bytes + skip + block] for k in range(b * h)]
                f.targets.append(rows)
            elif i == last:
                f.targets.append([memoryview(arrays[f"s.{e.name}"]).cast("B")])
            else:  # a snapshot of an earlier block: not needed, but checksummed
                f.targets.append([memoryview(bytearray(e.end - e.start))])
        targets.append(f.targets)
    return runs, snaps, targets


def _run_of(runs: dict[str, list[_Run]], name: str, node: Node) -> _Run | None:
    for r in runs.get(name, ()):
        if r.start <= node.position and node.end <= r.end:
            return r
    return None


def _read_all(files: list) -> int | None:
    """Read every file on the reader threads; the index of the first bad one, or None."""
    jobs = [(i, f) for i, f in enumerate(files) if f is not None]
    if len(jobs) > 1:
        ok = list(_reader_pool().map(lambda job: job[1].read_into(), jobs))
    else:
        ok = [f.read_into() for _, f in jobs]
    for (i, _), good in zip(jobs, ok):
        if not good:
            return _verify_only(files[:i]) if i else 0
    return None


def _copy_cached(nodes, cached, runs) -> None:
    """Copy the slices of blocks that came from the RAM tier into their runs."""
    targets: dict[int, np.ndarray] = {}
    for node, have in zip(nodes, cached):
        if have is None:
            continue
        for lid, part in have.items():
            for fld, x in part.items():
                r = _run_of(runs, f"{lid}.{fld}", node)
                if r is None:
                    continue
                if id(r) not in targets:
                    targets[id(r)] = _bits(r.bytes_view, r.array)
                dst = targets[id(r)]
                dst[:, :, node.position - r.start : node.end - r.start, :] = _bits(memoryview(x), x)


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(view: memoryview, x: mx.array) -> np.ndarray:
    """A numpy view of an evaluated array's bits (numpy has no bfloat16; the bits are
    what we copy), without any MLX operation."""
    if not view.c_contiguous:
        x = mx.contiguous(x)
        mx.eval(x)
        view = memoryview(x)
    return np.frombuffer(view.cast("B"), dtype=_BITS[x.itemsize]).reshape(x.shape)

"""Segment files (format v3): the one owner of the bytes of stored blocks.

One segment holds the new blocks of one `store()` (consecutive positions of one
prompt), laid out so that a run of blocks reads in few, large I/Os straight into the
joined cache buffers::

    [u64 LE header length n][header: JSON, space-padded to a multiple of 8][data]

The header names the format (`SEGMENT_FORMAT`), the segment id, its blocks
(``[key hex, position, tokens]``, consecutive), its *sliced fields* and its
*snapshots*. A sliced field (a KV tensor ``[batch, heads, tokens, width]`` of a layer
sliced along the sequence) covers the blocks from ``first`` on and is stored head-major:
for each of its ``rows`` (batch x heads), the tokens of all those blocks, contiguous.
A snapshot (a recurrent state, a window) belongs to one block and is stored whole,
with the xxh3-64 digest of its bytes in the header.

A block's checksum (kept in its index record, verified on every read) is xxh3-64 over
its piece of every sliced field (header order, row by row), then the digests of its
snapshots: a damaged byte, a damaged header or a file of another block is a miss.

Write order: write under ``tmp/``, fsync, rename into ``segments/``, fsync the folder;
only then does the caller commit the index records. Segment ids are random, so no two
writers ever share a file; a file is unlinked only after the commit that removed its
last block (see `index_tables.Writer.freed`). A crash leaves at most a temporary file
or an unreferenced segment, both swept later.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from .codec import dtype_info
from .faults import pause_point
from .node import Node
from .portable import IOV_MAX, durable_fsync, start_writeback, writev
from .segment_reader import SEGMENT_FORMAT, OpenSegment
from .store_dir import create_file, make_dirs

# Fields stored sliced along the sequence (what `layers.adapters` names them).
SLICE_FIELDS = frozenset({"k", "v", "k0", "k1", "k2", "v0", "v1", "v2"})


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        durable_fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dtype(x: Any) -> str:
    # A tensor is an mlx or numpy array, or (numpy array of its bits, dtype name).
    return x[1] if isinstance(x, tuple) else dtype_info(x.dtype)[0]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple((x[0] if isinstance(x, tuple) else x).shape)


def is_sliced(name: str, shape: Sequence[int], n_tokens: int) -> bool:
    """Whether tensor ``<leaf>.<field>`` of a block is stored sliced (else a snapshot)."""
    return name.rpartition(".")[2] in SLICE_FIELDS and len(shape) == 4 and shape[2] == n_tokens


def _bytes(x: Any) -> memoryview:
    view = memoryview(x[0] if isinstance(x, tuple) else x)
    if not view.c_contiguous:
        raise ValueError("snapshot tensors must be row-contiguous")
    return view.cast("B")


def _rows(x: Any, rows: int) -> np.ndarray:
    """The bytes of a sliced tensor ``[batch, heads, n, width]`` as a ``[rows, bytes]``
    uint8 array, one (batch, head) row each: rows are contiguous, the array need not
    be (a strided view of unsigned ints: numpy reads it without MLX)."""
    view = memoryview(x[0] if isinstance(x, tuple) else x)
    if view.c_contiguous:
        return np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(rows, -1)
    a = np.asarray(view)
    return a.reshape(rows, a.shape[-2] * a.shape[-1]).view(np.uint8)


def _joined_rows(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The rows of consecutive blocks' `_rows`, joined where they follow each other
    in memory (the blocks of one `store()` are views of one copy per field): a row of
    a segment is then one I/O vector and one hash update, not one per block."""
    runs: list[list] = []  # [first array, address of its row 0, of the run's end, bytes per row]
    for a in arrays:
        at = a.__array_interface__["data"][0]
        if runs and at == runs[-1][2] and a.strides[0] == runs[-1][0].strides[0]:
            runs[-1][2] += a.shape[1]
            runs[-1][3] += a.shape[1]
        else:
            runs.append([a, at, at + a.shape[1], a.shape[1]])
    out = []
    for a, _, _, width in runs:
        if width != a.shape[1]:
            a = np.lib.stride_tricks.as_strided(a, shape=(a.shape[0], width), strides=(a.strides[0], 1))
        out.append(a)
    return out


class SegmentFiles:
    """The ``segments/`` and ``tmp/`` folders of one store.

    Args:
        root: The store directory.
        readonly: Create nothing.
    """

    def __init__(self, root: str, *, readonly: bool = False):
        self.root = root
        self.segments = os.path.join(root, "segments")
        self.tmp = os.path.join(root, "tmp")
        self.legacy = os.path.join(root, "blocks")  # schema v1-v2: one file per block
        if not readonly:
            for folder in (self.segments, self.tmp):
                make_dirs(folder, root)  # the store's modes, not the umask's

    def path_of(self, segment: bytes) -> str:
        """Absolute path of a segment's file."""
        h = segment.hex()
        return os.path.join(self.segments, h[:2], f"{h}.seg")

    # -- writing --------------------------------------------------------------------

    def write(self, blocks: Sequence[tuple[Node, dict[str, dict[str, Any]]]]) -> tuple[bytes, int, int]:
        """Write consecutive blocks into a new segment, durably.

        Sets each node's ``segment``, ``size`` and ``checksum``. The caller commits
        the index records only after this returns.

        Args:
            blocks: ``(node, tensors by leaf, then field)`` per block, in position
                order; tensors are evaluated, row-contiguous mlx or numpy arrays, or
                ``(numpy array of the bits, dtype name)`` (as `block_tensors` gives).

        Returns:
            (segment id, file size, digest of the whole segment: xxh3-64 over the
            xxh3-64 of each sliced field's data, then its snapshots' digests).

        Raises:
            OSError: On any failure (disk full, permissions); the temporary file is
                removed and nothing is referenced.
            ValueError: If the blocks are not consecutive or their tensors disagree.
        """
        segment = os.urandom(16)
        header, chunks, digest = _layout(segment, blocks)
        tmp = os.path.join(self.tmp, f"{segment.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = create_file(tmp, self.root)  # the store's file mode (0600 unless shared), not the umask's
        try:
            size = _writev_all(fd, [memoryview(header)] + chunks)
            start_writeback(fd)  # Linux only, for speed: the fsync is what counts
            durable_fsync(fd)
        except BaseException:
            os.close(fd)
            self._remove(tmp)
            raise
        os.close(fd)
        pause_point("before_rename")
        final = self.path_of(segment)
        try:
            folder = os.path.dirname(final)
            if not os.path.isdir(folder):
                make_dirs(folder, self.root)
                _fsync_dir(self.segments)
            os.replace(tmp, final)
            _fsync_dir(folder)
        except BaseException:
            self._remove(tmp)
            raise
        return segment, size, digest

    # -- reading --------------------------------------------------------------------

    def open(self, segment: bytes) -> OpenSegment | None:
        """Open a segment and check its header; None if missing or damaged.

        The caller closes the handle (`OpenSegment.close`).
        """
        try:
            fd = os.open(self.path_of(segment), os.O_RDONLY)
        except OSError:
            return None
        try:
            return OpenSegment(fd, segment)
        except (ValueError, OSError):
            os.close(fd)
            return None

    def verify(self, node: Node) -> str | None:
        """What is wrong with a node's bytes (None if nothing): every piece is read
        and checksummed, every snapshot checked against its digest."""
        if not os.path.exists(self.path_of(node.segment)):
            return "missing file"
        seg = self.open(node.segment)
        if seg is None:
            return "file does not decode"
        try:
            if seg.block_index(node) is None:
                return "file belongs to another block"
            return None if seg.block_tensors(node) is not None else "file size or checksum mismatch"
        finally:
            seg.close()

    def digest_of(self, segment: bytes) -> int | None:
        """The whole-segment digest of a segment file as it is (None if it does not
        open); every field is read."""
        seg = self.open(segment)
        if seg is None:
            return None
        try:
            rows = {}
            for f in seg.fields.values():
                buf = memoryview(bytearray(f.nbytes))
                step = f.tokens * f.row_bytes
                if not seg.read_rows(f, f.first, len(seg.blocks), [buf], [0], step):
                    return None
                rows[f.name] = (buf, step)
            return seg.whole_digest(
                {
                    f.name: seg.field_digest(f, lambda f, r: rows[f.name][0][r * rows[f.name][1] : (r + 1) * rows[f.name][1]])
                    for f in seg.fields.values()
                }
            )
        finally:
            seg.close()

    # -- removing -------------------------------------------------------------------

    def unlink(self, segments: Sequence[bytes]) -> None:
        """Remove the files of segments the index no longer references (commit first)."""
        for segment in segments:
            self._remove(self.path_of(segment))

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def stale_tmp(self) -> list[str]:
        """Temporary files whose writing process is gone (ours in flight are not)."""
        try:
            names = sorted(os.listdir(self.tmp))
        except FileNotFoundError:
            return []
        stale = []
        for name in names:
            parts = name.split(".")
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            if pid == os.getpid() or (pid is not None and _pid_alive(pid)):
                continue  # a live writer (this process or another) is still at work
            stale.append(name)
        return stale

    def sweep_tmp(self) -> int:
        """Remove temporary files whose writing process is gone.

        Returns:
            How many were removed.
        """
        stale = self.stale_tmp()
        for name in stale:
            self._remove(os.path.join(self.tmp, name))
        return len(stale)

    def orphans(self, is_referenced: Callable[[bytes], bool], *, grace: float) -> list[str]:
        """Segment files (paths relative to the store) no index entry references, and
        files left by schema v1-v2 (``blocks/``, which nothing references any more).

        Args:
            is_referenced: Whether the index references a segment id.
            grace: Leave out segments younger than this many seconds (a writer in
                another process may be about to commit them).
        """
        out = []
        cutoff = time.time() - grace
        for top, legacy in ((self.segments, False), (self.legacy, True)):
            subs = sorted(os.scandir(top), key=lambda e: e.name) if os.path.isdir(top) else ()
            for sub in subs:
                if not sub.is_dir():
                    continue
                for entry in sorted(os.scandir(sub.path), key=lambda e: e.name):
                    rel = os.path.relpath(entry.path, self.root)
                    if legacy:
                        out.append(rel)
                        continue
                    try:
                        if is_referenced(bytes.fromhex(entry.name.removesuffix(".seg"))):
                            continue
                        if entry.stat().st_mtime > cutoff:
                            continue
                    except (ValueError, FileNotFoundError):
                        pass
                    out.append(rel)
        return out

    def sweep_orphans(self, is_referenced: Callable[[bytes], bool], *, grace: float) -> int:
        """Remove the files `orphans` lists.

        Returns:
            How many were removed.
        """
        found = self.orphans(is_referenced, grace=grace)
        for rel in found:
            self._remove(os.path.join(self.root, rel))
        return len(found)


def _writev_all(fd: int, chunks: list) -> int:
    size = 0
    for j in range(0, len(chunks), IOV_MAX):
        group = chunks[j : j + IOV_MAX]
        want = sum(c.nbytes for c in group)
        done = writev(fd, group)
        while done < want:  # a short write: finish it piece by piece
            rest = b"".join(bytes(c) for c in group)[done:]
            done += os.write(fd, rest)
        size += want
    return size


def _layout(segment: bytes, blocks: Sequence[tuple[Node, dict]]) -> tuple[bytes, list[memoryview], int]:
    """The header, the data chunks and the digest of a segment; sets each node's size
    and checksum."""
    if not blocks:
        raise ValueError("a segment needs at least one block")
    for (a, _), (b, _) in zip(blocks, blocks[1:]):
        if b.position != a.end:
            raise ValueError("a segment's blocks must be consecutive")
    flat = [
        {f"{lid}.{f}": x for lid, part in tensors.items() for f, x in part.items()}
        for _, tensors in blocks
    ]
    sliced: dict[str, list] = {}  # name -> [dtype, batch, heads, width, first block]
    for i, ((node, _), tensors) in enumerate(zip(blocks, flat)):
        for name in sorted(tensors):
            shape = _shape(tensors[name])
            if not is_sliced(name, shape, node.n_tokens):
                continue
            spec = [_dtype(tensors[name]), shape[0], shape[1], shape[3]]
            if name not in sliced:
                sliced[name] = spec + [i]
            elif sliced[name][:4] != spec:
                raise ValueError(f"{name}: blocks of one segment disagree on dtype or shape")
    for name, (*_, first) in sliced.items():
        if any(name not in t for t in flat[first:]):
            raise ValueError(f"{name}: a block after the first holding it lacks it")
    chunks: list[memoryview] = []
    whole = xxhash.xxh3_64()
    row_pieces: dict[str, list[np.ndarray]] = {}  # name -> per block (from first), its rows
    fields, at = [], 0
    for name in sorted(sliced):
        dtype, batch, heads, width, first = sliced[name]
        rows = batch * heads
        fields.append([name, dtype, batch, heads, width, first, at])
        pieces = [_rows(flat[i][name], rows) for i in range(first, len(blocks))]
        row_pieces[name] = pieces
        joined = _joined_rows(pieces)
        h = xxhash.xxh3_64()
        for r in range(rows):
            for run in joined:
                chunks.append(run[r])
                h.update(run[r])
                at += run.shape[1]
        whole.update(h.intdigest().to_bytes(8, "little"))
    snaps = []
    for i, tensors in enumerate(flat):
        for name in sorted(tensors):
            if name in sliced and i >= sliced[name][4]:
                continue
            view = _bytes(tensors[name])
            digest = xxhash.xxh3_64_intdigest(view)
            snaps.append([i, name, _dtype(tensors[name]), list(_shape(tensors[name])), at, f"{digest:016x}"])
            whole.update(digest.to_bytes(8, "little"))
            chunks.append(view)
            at += len(view)
    for i, ((node, _), tensors) in enumerate(zip(blocks, flat)):
        h = xxhash.xxh3_64()
        size = 0
        for name, *_, first, _ in fields:
            if i >= first:
                for row in row_pieces[name][i - first]:  # rows in order, as a read sees them
                    h.update(row)
                    size += row.nbytes
        for j, name, _, _, _, digest in snaps:
            if j == i:
                h.update(int(digest, 16).to_bytes(8, "little"))
                size += _bytes(tensors[name]).nbytes
        node.segment, node.size, node.checksum = segment, size, h.intdigest()
    header = {
        "format": SEGMENT_FORMAT,
        "segment": segment.hex(),
        "blocks": [[node.key.hex(), node.position, node.n_tokens] for node, _ in blocks],
        "fields": fields,
        "snaps": snaps,
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, chunks, whole.intdigest()

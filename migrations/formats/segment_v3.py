"""Segment format v3 (``ppc-segment/3``), frozen: what migrations 0003 (writes it) and
0004 (reads it) and `ppc import` of a ``ppc-export/2`` pack need.

A copy of the v3 writer and reader as they were at the last v3 commit (1fd2b40), so
that a later format never changes what an old migration does. Nothing but those
callers uses it; the live format is in `segment` and `segment_reader`.

v3 layout: ``[u64 LE n][JSON header, space-padded to 8][data]``; the header holds
``format``, ``segment``, ``blocks`` (``[key hex, position, tokens]``), ``fields``
(``[name, dtype, batch, heads, width, first block, offset]``, head-major) and ``snaps``
(``[block, name, dtype, shape, offset, xxh3-64 hex]``). Not a safetensors file.
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from persistent_prefix_cache.disk.portable import IOV_MAX, durable_fsync, preadv, writev

from .dtypes import MAX_HEADER, dtype_info

Node = Any  # the block records it is given and reads (duck-typed: key, position, tokens, ...)

SEGMENT_FORMAT = "ppc-segment/3"
SLICE_FIELDS = frozenset({"k", "v", "k0", "k1", "k2", "v0", "v1", "v2"})


def path_of(store: str, segment: bytes) -> str:
    """Absolute path of a segment's file in a store directory."""
    h = segment.hex()
    return os.path.join(store, "segments", h[:2], f"{h}.seg")


def write(store: str, blocks: Sequence[tuple[Node, dict[str, dict[str, Any]]]]) -> tuple[bytes, int, int]:
    """Write consecutive blocks into a new v3 segment of a store directory, durably
    (tmp/, fsync, rename, fsync the folder); sets each node's segment, size and checksum.

    Returns:
        (segment id, file size, whole-segment digest).
    """
    segment = os.urandom(16)
    header, chunks, digest = _layout(segment, blocks)
    os.makedirs(os.path.join(store, "tmp"), exist_ok=True)
    tmp = os.path.join(store, "tmp", f"{segment.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = _writev_all(fd, [memoryview(header)] + chunks)
        durable_fsync(fd)
    finally:
        os.close(fd)
    final = path_of(store, segment)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    os.replace(tmp, final)
    _fsync_dir(os.path.dirname(final))
    return segment, size, digest


def open_segment(store: str, segment: bytes) -> "OpenSegment | None":
    """Open a v3 segment of a store directory; None if missing, damaged or not v3."""
    try:
        fd = os.open(path_of(store, segment), os.O_RDONLY)
    except OSError:
        return None
    try:
        return OpenSegment(fd, segment)
    except (ValueError, OSError):
        os.close(fd)
        return None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        durable_fsync(fd)
    finally:
        os.close(fd)


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


class Field:
    """A sliced field of a segment: where each row (batch x head) of its tokens lies."""

    __slots__ = ("name", "dtype", "itemsize", "batch", "heads", "rows", "width", "first", "at", "start", "tokens", "row_bytes")

    def __init__(self, name, dtype, itemsize, batch, heads, width, first, at, start, tokens):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize
        self.batch, self.heads, self.rows = batch, heads, batch * heads
        self.width, self.first, self.at = width, first, at
        self.start, self.tokens = start, tokens  # first position held, tokens per row
        self.row_bytes = width * itemsize  # bytes of one token in one row

    @property
    def nbytes(self) -> int:
        return self.rows * self.tokens * self.row_bytes


class Snap:
    """A snapshot of one block: a whole tensor and the digest of its bytes."""

    __slots__ = ("block", "name", "dtype", "shape", "at", "digest", "nbytes")

    def __init__(self, block, name, dtype, shape, at, digest, nbytes):
        self.block, self.name, self.dtype, self.shape = block, name, dtype, tuple(shape)
        self.at, self.digest, self.nbytes = at, digest, nbytes


class OpenSegment:
    """An open segment file whose header was parsed and checked against its size.

    Raises:
        ValueError: If the header is damaged or does not describe the file.
    """

    def __init__(self, fd: int, segment: bytes):
        self.fd = fd
        self.segment = segment
        size = os.fstat(fd).st_size
        head = os.pread(fd, min(size, 65536), 0)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
        if n < 0 or n > MAX_HEADER or 8 + n > size:
            raise ValueError("bad header length")
        if 8 + n > len(head):
            head = os.pread(fd, 8 + n, 0)
        try:
            h = json.loads(head[8 : 8 + n])
            if h["format"] != SEGMENT_FORMAT or h["segment"] != segment.hex():
                raise ValueError("another format or segment")
            self.blocks = [(bytes.fromhex(k), int(p), int(t)) for k, p, t in h["blocks"]]
            self.body = 8 + n
            self.fields: dict[str, Field] = {}
            for name, dtype, batch, heads, width, first, at in h["fields"]:
                first = int(first)
                start = self.blocks[first][1]
                tokens = sum(t for _, _, t in self.blocks[first:])
                self.fields[name] = Field(
                    name, dtype, dtype_info(dtype)[1], int(batch), int(heads), int(width), first, int(at), start, tokens
                )
            self.snaps = [
                Snap(int(i), name, dtype, shape, int(at), int(d, 16), math.prod(shape) * dtype_info(dtype)[1])
                for i, name, dtype, shape, at, d in h["snaps"]
            ]
        except (KeyError, TypeError, IndexError, AttributeError, ValueError, RecursionError) as exc:
            raise ValueError(f"damaged header: {type(exc).__name__}") from None
        ends = sorted([(f.at, f.at + f.nbytes) for f in self.fields.values()] + [(s.at, s.at + s.nbytes) for s in self.snaps])
        cursor = 0
        for a, b in ends:
            if a != cursor or b < a:
                raise ValueError("gap or overlap in the data")
            cursor = b
        if self.body + cursor != size:
            raise ValueError("data does not end where the file does")
        for (_, p, t), (_, q, _) in zip(self.blocks, self.blocks[1:]):
            if q != p + t:
                raise ValueError("blocks are not consecutive")
        self._by_key = {k: i for i, (k, _, _) in enumerate(self.blocks)}

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)

    def block_index(self, node: Node) -> int | None:
        """Where `node` is among the segment's blocks (None if it is not there)."""
        i = self._by_key.get(node.key)
        if i is None or self.blocks[i][1:] != (node.position, node.n_tokens):
            return None
        return i

    def tokens_of(self, i: int) -> int:
        """Tokens of block `i`."""
        return self.blocks[i][2]

    def fields_of(self, i: int) -> list[Field]:
        """The sliced fields block `i` has a piece of, in header order."""
        return [f for f in self.fields.values() if f.first <= i]

    def snaps_of(self, i: int) -> list[Snap]:
        """The snapshots of block `i`, in header order."""
        return [s for s in self.snaps if s.block == i]

    def read_rows(self, f: Field, lo: int, hi: int, dests: list[memoryview], offsets: list[int], stride: int) -> bool:
        """Read blocks ``[lo, hi)`` of field `f` into row buffers.

        Row ``r`` goes to ``dests[r % len(dests)]`` at ``offsets[...] + r * stride``
        if one destination is given for all rows (``len(dests) == 1``), else to its own.

        Returns:
            False on a short read (the file shrank under us).
        """
        p0 = self.blocks[lo][1] - f.start
        p1 = self.blocks[hi - 1][1] + self.blocks[hi - 1][2] - f.start
        n = (p1 - p0) * f.row_bytes
        whole = p0 == 0 and p1 == f.tokens  # the rows lie back to back in the file
        vectors = []
        for r in range(f.rows):
            dest, base = (dests[0], offsets[0] + r * stride) if len(dests) == 1 else (dests[r], offsets[r])
            vectors.append(dest[base : base + n])
        try:
            if whole:
                for j in range(0, len(vectors), IOV_MAX):
                    group = vectors[j : j + IOV_MAX]
                    at = self.body + f.at + j * f.tokens * f.row_bytes
                    if preadv(self.fd, group, at) != n * len(group):
                        return False
            else:
                for r, v in enumerate(vectors):
                    at = self.body + f.at + (r * f.tokens + p0) * f.row_bytes
                    if preadv(self.fd, [v], at) != n:
                        return False
        except OSError:
            return False
        return True

    @staticmethod
    def field_digest(f: Field, row: Callable[[Field, int], memoryview]) -> int:
        """The digest of one field's data, given its rows (already read)."""
        h = xxhash.xxh3_64()
        for r in range(f.rows):
            h.update(row(f, r))
        return h.intdigest()

    def whole_digest(self, field_digests: dict[str, int]) -> int:
        """The digest of the whole segment, given each field's (`field_digest`)."""
        h = xxhash.xxh3_64()
        for f in self.fields.values():
            h.update(field_digests[f.name].to_bytes(8, "little"))
        for s in self.snaps:
            h.update(s.digest.to_bytes(8, "little"))
        return h.intdigest()

    def block_digest(self, i: int, piece: Callable[[Field, int], memoryview]) -> int:
        """The checksum of block `i`, given its piece of each field's row (already read)."""
        h = xxhash.xxh3_64()
        for f in self.fields_of(i):
            for r in range(f.rows):
                h.update(piece(f, r))
        for s in self.snaps_of(i):
            h.update(s.digest.to_bytes(8, "little"))
        return h.intdigest()

    def read_snap(self, s: Snap, dest: memoryview) -> memoryview | None:
        """Read a snapshot into `dest` and check its digest; None if damaged."""
        try:
            if preadv(self.fd, [dest], self.body + s.at) != s.nbytes:
                return None
        except OSError:
            return None
        return dest if xxhash.xxh3_64_intdigest(dest) == s.digest else None

    def block_tensors(self, node: Node) -> dict[str, dict[str, tuple[np.ndarray, str]]] | None:
        """A block's tensors (by leaf, then field) as ``(numpy array of the bits, dtype
        name)``, verified against the node's checksum; None if missing or damaged."""
        i = self.block_index(node)
        if i is None:
            return None
        n = self.tokens_of(i)
        out: dict[str, dict[str, tuple[np.ndarray, str]]] = {}
        pieces = {}
        for f in self.fields_of(i):
            buf = np.empty(f.rows * n * f.row_bytes, dtype=np.uint8)
            if not self.read_rows(f, i, i + 1, [memoryview(buf)], [0], n * f.row_bytes):
                return None
            pieces[f.name] = buf
            lid, _, fld = f.name.rpartition(".")
            bits = buf.view(np.dtype(f"<u{f.itemsize}")).reshape(f.batch, f.heads, n, f.width)
            out.setdefault(lid, {})[fld] = (bits, f.dtype)
        step = {name: len(b) // self.fields[name].rows for name, b in pieces.items()}
        digest = self.block_digest(i, lambda f, r: memoryview(pieces[f.name])[r * step[f.name] : (r + 1) * step[f.name]])
        if digest != node.checksum:
            return None
        for s in self.snaps_of(i):
            buf = np.empty(s.nbytes, dtype=np.uint8)
            if self.read_snap(s, memoryview(buf)) is None:
                return None
            lid, _, fld = s.name.rpartition(".")
            itemsize = dtype_info(s.dtype)[1]
            out.setdefault(lid, {})[fld] = (buf.view(np.dtype(f"<u{itemsize}")).reshape(s.shape), s.dtype)
        return out

"""Reading a segment file (see `segment`): its header, checked against the file, and
its blocks' pieces, checksums and snapshots."""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import numpy as np
import xxhash

from .codec import MAX_HEADER, dtype_info
from .node import Node
from .portable import IOV_MAX, preadv

SEGMENT_FORMAT = "ppc-segment/3"


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

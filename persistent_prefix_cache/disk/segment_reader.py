"""Reading a segment file (see `segment`) whose header `segment_header` parsed and
checked: its blocks' pieces, checksums and snapshots.

Every digest computed here starts with the tag of what its bytes are (`digest_tags`): a
tensor relabelled in the header fails its block's checksum.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import xxhash

from ..blocks import Node, dtype_info
from .digest_tags import block_tag, segment_tag, tagged_digest
from .portable import IOV_MAX, preadv
from .segment_header import SegmentField, Snap, parse_header, read_head

# Bytes read and hashed at a time by `read_field_hashed`: small enough to stay in a
# core's L2 cache between the read's copy and the hash.
HASH_CHUNK = 512 * 1024


class OpenSegment:
    """An open segment file whose header was parsed and checked against its size.

    Raises:
        ValueError: If the header is damaged, not v5, or does not describe the file.
    """

    def __init__(self, fd: int, segment: bytes):
        self.fd = fd
        self.segment = segment
        head, size = read_head(fd)
        self.header = h = parse_header(head, size, segment)
        self.root, self.model, self.body, self.blocks = h.root, h.model, h.body, h.blocks
        self.block_size = h.block_size
        self.fields: dict[str, SegmentField] = {f.name: f for f in h.fields}
        self.snaps: list[Snap] = h.snaps
        self._by_key = {k: i for i, (k, _, _) in enumerate(self.blocks)}
        self._segment_tag = segment_tag(h.segment, h.root, [int(r[6], 16) for r in h.records])

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)

    def block_index(self, node: Node) -> int | None:
        """Where `node` is among the segment's blocks (None if it is not there)."""
        i = self._by_key.get(node.key)
        if i is None or self.blocks[i][1:] != (node.position, node.n_tokens):
            return None
        record = self.header.records[i]
        if int(record[6], 16) != node.checksum or record[5] != node.size or record[1] != node.parent.hex():
            return None  # a record of another block with this key: not ours to read
        return i

    def tokens_of(self, i: int) -> int:
        """Tokens of block `i`."""
        return self.blocks[i][2]

    def fields_of(self, i: int) -> list[SegmentField]:
        """The sliced fields block `i` has a piece of, in header order."""
        return [f for f in self.fields.values() if f.first <= i]

    def snaps_of(self, i: int) -> list[Snap]:
        """The snapshots of block `i`, in header order."""
        return [s for s in self.snaps if s.block == i]

    def read_rows(
        self, f: SegmentField, lo: int, hi: int, dests: list[memoryview], offsets: list[int], stride: int, stage=None
    ) -> bool:
        """Read blocks ``[lo, hi)`` of field `f` into row buffers.

        Row ``r`` goes to ``dests[r % len(dests)]`` at ``offsets[...] + r * stride``
        if one destination is given for all rows (``len(dests) == 1``), else to its own.

        Args:
            stage: A stager (`device.cuda.Stager`) for ``dests[0]`` (one destination only), if
                any: each row is read into its pinned pieces and copied to the device.

        Returns:
            False on a short read (the file shrank under us).
        """
        p0 = self.blocks[lo][1] - f.start
        p1 = self.blocks[hi - 1][1] + self.blocks[hi - 1][2] - f.start
        n = (p1 - p0) * f.row_bytes
        if stage is not None and len(dests) == 1:
            try:
                for r in range(f.rows):
                    at, base = self.body + f.at + (r * f.tokens + p0) * f.row_bytes, offsets[0] + r * stride
                    for lo_byte in range(0, n, stage.size):
                        m = min(stage.size, n - lo_byte)
                        piece = stage.take(m)
                        if preadv(self.fd, [piece], at + lo_byte) != m:
                            return False
                        stage.send([base + lo_byte], m)
            except OSError:
                return False
            return True
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

    def read_field_hashed(
        self,
        f: SegmentField,
        dest: memoryview,
        offset: int,
        stride: int,
        stage=None,
        keep: tuple[int, int] | None = None,
    ) -> int | None:
        """Read every block of field `f`, hashing each piece right after it arrives, while
        it is still in the CPU's cache (a second pass over the whole field would read it
        from memory again), into rows of `dest` (row ``r`` at ``offset + r * stride``).

        Args:
            stage: A stager (`device.cuda.Stager`) for `dest`, if any: each piece is read into its
                pinned memory, hashed there and copied to `dest` on the device.
            keep: With a stager, the bytes ``[a, b)`` of each row that go to `dest` (row
                ``r``'s byte ``a`` at ``offset + r * stride``); the rest is read and
                hashed only. None: whole rows.

        Returns:
            The field's digest (as `field_digest` computes it), None on a short read.
        """
        n = f.tokens * f.row_bytes
        a, b = keep if keep is not None else (0, n)
        if stage is None and (a, b) != (0, n):
            raise ValueError("only a staged read keeps part of each row")
        h = xxhash.xxh3_64()
        h.update(f.run_tag)
        try:
            if stage is not None and 0 < n <= stage.size:
                # Rows shorter than a stage: as many whole rows per piece as fit (they follow
                # each other in the file), one read and one hash each.
                per = stage.size // n
                for r in range(0, f.rows, per):
                    k = min(per, f.rows - r)
                    piece = stage.take(k * n)
                    if preadv(self.fd, [piece], self.body + f.at + r * n) != k * n:
                        return None
                    h.update(piece)
                    if b > a:
                        stage.send([offset + (r + i) * stride for i in range(k)], b - a, [i * n + a for i in range(k)])
                return h.intdigest()
            if stage is None and 0 < n < HASH_CHUNK // 2:
                # Short rows (a segment of a few blocks): as many as fit a chunk in one
                # read, each row to its place; the hash then takes them in order while
                # they are in cache. One call per row cost ~1 ms per segment of a 128 MiB
                # prompt stored a block at a time.
                per = HASH_CHUNK // n
                for r in range(0, f.rows, per):
                    k = min(per, f.rows - r)
                    rows = [dest[offset + (r + i) * stride : offset + (r + i) * stride + n] for i in range(k)]
                    if preadv(self.fd, rows, self.body + f.at + r * n) != k * n:
                        return None
                    for row in rows:
                        h.update(row)
                return h.intdigest()
            step = HASH_CHUNK if stage is None else stage.size
            for r in range(f.rows):
                at, start = self.body + f.at + r * n, offset + r * stride
                for lo in range(0, n, step):
                    size = min(step, n - lo)
                    piece = dest[start + lo : start + lo + size] if stage is None else stage.take(size)
                    if preadv(self.fd, [piece], at + lo) != size:
                        return None
                    h.update(piece)
                    x, y = max(lo, a), min(lo + size, b)  # the part of this piece kept
                    if stage is not None and y > x:
                        stage.send([start + x - a], y - x, [x - lo])
        except OSError:
            return None
        return h.intdigest()

    def read_fields_staged(self, parts: list[tuple[SegmentField, tuple, int, int]], stage) -> list[int] | None:
        """Read whole fields that follow each other in the file, together no longer than
        a stage's piece, with one read into one pinned piece; hash each there (its digest
        as `read_field_hashed` gives it) and copy its rows to its destination on the device.
        A small segment's fields were a read, a wait for a piece and a copy each, and on a
        GPU each such call cost ~0.5 ms of the reader threads (docs/performance.md).

        Args:
            parts: Per field, in file order: ``(field, its destination (`Stager.target`),
                where its row 0 goes, the destination's row stride)``.
            stage: The stager (`device.cuda.Stager`) whose piece the read fills.

        Returns:
            Each field's digest, None on a short read.
        """
        start = parts[0][0].at
        nbytes = parts[-1][0].at + parts[-1][0].nbytes - start
        try:
            piece = stage.take(nbytes)
            if preadv(self.fd, [piece], self.body + start) != nbytes:
                return None
            digests, sends = [], []
            for f, (dest, base), offset, stride in parts:
                at, n = f.at - start, f.tokens * f.row_bytes
                h = xxhash.xxh3_64()
                h.update(f.run_tag)
                h.update(piece[at : at + f.nbytes])  # its rows follow each other: as they are hashed one by one
                digests.append(h.intdigest())
                sends.append(
                    (dest, base, [offset + r * stride for r in range(f.rows)], n, [at + r * n for r in range(f.rows)])
                )
            stage.send_to(sends)
        except OSError:
            return None
        return digests

    @staticmethod
    def field_digest(f: SegmentField, row: Callable[[SegmentField, int], memoryview]) -> int:
        """The digest of one field's data, given its rows (already read)."""
        h = xxhash.xxh3_64()
        h.update(f.run_tag)
        for r in range(f.rows):
            h.update(row(f, r))
        return h.intdigest()

    def whole_digest(self, field_digests: dict[str, int]) -> int:
        """The digest of the whole segment, given each field's (`field_digest`); it binds
        the blocks' checksums as the header lists them."""
        h = xxhash.xxh3_64()
        h.update(self._segment_tag)
        for f in self.fields.values():
            h.update(field_digests[f.name].to_bytes(8, "little"))
        for s in self.snaps:
            h.update(s.digest.to_bytes(8, "little"))
        return h.intdigest()

    def block_digest(self, i: int, piece: Callable[[SegmentField, int], memoryview], node: Node) -> int:
        """The checksum of block `i`, given its piece of each field's row (already read)
        and the record it must belong to (`node`: its key, position, tokens, ... are hashed
        first, then each field's tag before its pieces)."""
        h = xxhash.xxh3_64()
        h.update(block_tag(node))
        for f in self.fields_of(i):
            h.update(f.tag)
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
        return dest if tagged_digest(s.tag, dest) == s.digest else None

    def run_tensors(self, nodes: list[Node]) -> list[tuple[Node, dict[str, dict[str, tuple[np.ndarray, str]]]]] | None:
        """The tensors of consecutive blocks of this segment, as `block_tensors` gives them
        (views of one buffer per field: its rows for the whole run, read at once), each
        block verified against its node's checksum; None if one is missing or damaged."""
        found = [self.block_index(n) for n in nodes]
        at = [i for i in found if i is not None]
        if not at or len(at) != len(found) or at != list(range(at[0], at[0] + len(at))):
            return None
        lo, hi = at[0], at[-1] + 1
        end = self.blocks[hi - 1][1] + self.blocks[hi - 1][2]
        runs: dict[str, tuple[int, np.ndarray]] = {}
        for f in self.fields.values():
            first = max(lo, f.first)
            if first >= hi:
                continue
            start = self.blocks[first][1]
            buf = np.empty((f.rows, (end - start) * f.row_bytes), dtype=np.uint8)
            if not self.read_rows(f, first, hi, [buf.data.cast("B")], [0], buf.shape[1]):
                return None
            runs[f.name] = (start, buf)
        out = []
        for node, i in zip(nodes, at):
            position, n = self.blocks[i][1], self.blocks[i][2]
            tensors: dict[str, dict[str, tuple[np.ndarray, str]]] = {}
            rows = {}
            for f in self.fields_of(i):
                start, buf = runs[f.name]
                a = (position - start) * f.row_bytes
                rows[f.name] = buf[:, a : a + n * f.row_bytes]
                lid, _, fld = f.name.rpartition(".")
                bits = rows[f.name].view(np.dtype(f"<u{f.itemsize}")).reshape(f.batch, f.heads, n, f.width)
                tensors.setdefault(lid, {})[fld] = (bits, f.dtype)
            if self.block_digest(i, lambda f, r: rows[f.name][r].data, node) != node.checksum:
                return None
            for s in self.snaps_of(i):
                buf = np.empty(s.nbytes, dtype=np.uint8)
                if self.read_snap(s, buf.data) is None:
                    return None
                lid, _, fld = s.name.rpartition(".")
                bits = buf.view(np.dtype(f"<u{dtype_info(s.dtype)[1]}")).reshape(s.shape)
                tensors.setdefault(lid, {})[fld] = (bits, s.dtype)
            out.append((node, tensors))
        return out

    def block_tensors(self, node: Node) -> dict[str, dict[str, tuple[np.ndarray, str]]] | None:
        """A block's tensors (by leaf, then field) as ``(numpy array of the bits, dtype
        name)``, verified against the node's checksum; None if missing or damaged."""
        got = self.run_tensors([node])
        return got[0][1] if got else None

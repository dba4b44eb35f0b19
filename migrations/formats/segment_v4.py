"""Segment format v4 (``ppc-segment/4``), frozen: what migrations 0004 (writes it) and
0005 (reads it), ``ppc import`` of a ``ppc-export/3`` pack and an index rebuild that
meets a v4 file need.

A copy of the v4 reader and writer as they were at the last v4 commit (ed6cf38:
``disk/segment_reader.py``, ``disk/segment_writer.py`` and ``SegmentFiles.write``), less
what only made them fast (the writer's second thread, the read path's hashed whole-field
reads and device staging): the bytes written and the checks made are v4's, plus one
v4's reader lacked. v4's checksums cannot tell tensors whose offsets a header swapped,
but v4's writer always put the data in one order (sliced fields by name, then the
snapshots by block and name): a header whose tensors lie in another order was not
written by it and is refused. Nothing but those callers uses it; the live format is in
`segment` and `segment_reader`.

v4 layout: a safetensors file, ``[u64 LE n][JSON header, space-padded to 8][data]``;
each sliced field one tensor ``<leaf>.<field>`` ``[batch, heads, T, width]`` (head-major),
snapshots ``b<i>.<leaf>.<field>``; ``__metadata__`` holds ``format``, ``segment``,
``root``, ``model``, ``block_size``, ``blocks`` (``[key, parent, position, tokens, flags,
size, checksum, extra]``), ``tokens`` (base64 int32 LE), ``fields``, ``snaps``,
``digest`` and ``header_digest``. A v4 block checksum is xxh3-64 over the block's piece
of every sliced field (data order, row by row), then its snapshots' xxh3-64 digests:
bytes only, bound to no name (why v5 replaced it).
"""

from __future__ import annotations

import base64
import json
import math
import os
import stat
import threading
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from persistent_prefix_cache.disk.portable import durable_fsync, fsync_dir, preadv, pwritev

from .dtypes import dtype_info

Node = Any  # the block records it is given and reads (duck-typed: key, parent, position, tokens, ...)

SEGMENT_FORMAT = "ppc-segment/4"
MAX_HEADER = 16 * 1024 * 1024
META_KEYS = frozenset(
    {"format", "segment", "root", "model", "block_size", "blocks", "tokens", "fields", "snaps", "digest", "header_digest"}
)
DIGEST_MARK = b'"header_digest":"'
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})
# v4's sliced fields: KV tensors [batch, heads, tokens, width] (plain and quantized).
SLICE_FIELDS = frozenset({"k", "v", "k0", "k1", "k2", "v0", "v1", "v2"})


def path_of(store: str, segment: bytes) -> str:
    """Absolute path of a segment's file in a store directory."""
    h = segment.hex()
    return os.path.join(store, "segments", h[:2], f"{h}.seg")


# -- reading ---------------------------------------------------------------------------


class SegmentField:
    """A sliced field of a segment: where each row (batch x head) of its tokens lies."""

    __slots__ = ("name", "dtype", "itemsize", "batch", "heads", "rows", "width", "first", "at", "start", "tokens", "row_bytes")

    def __init__(self, name, dtype, itemsize, batch, heads, width, first, at, start, tokens):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize
        self.batch, self.heads, self.rows = batch, heads, batch * heads
        self.width, self.first, self.at = width, first, at
        self.start, self.tokens = start, tokens
        self.row_bytes = width * itemsize


class Snap:
    """A snapshot of one block: a whole tensor and the digest of its bytes."""

    __slots__ = ("block", "name", "dtype", "shape", "at", "digest", "nbytes")

    def __init__(self, block, name, dtype, shape, at, digest, nbytes):
        self.block, self.name, self.dtype, self.shape = block, name, dtype, tuple(shape)
        self.at, self.digest, self.nbytes = at, digest, nbytes


class Header:
    """A v4 segment header, parsed and checked (attributes as v4's `Header`)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key is repeated")
    return out


def header_digest(head: bytes) -> int:
    """xxh3-64 of a header (length prefix included) with its digest's 16 hex digits as zeros."""
    at = head.find(DIGEST_MARK)
    if at < 0 or head.find(DIGEST_MARK, at + 1) >= 0:
        raise ValueError("no single header digest")
    at += len(DIGEST_MARK)
    return xxhash.xxh3_64_intdigest(head[:at] + b"0" * 16 + head[at + 16 :])


def parse_header(head: bytes, size: int, segment: bytes | None = None) -> Header:
    """Parse a v4 segment's header strictly and check that it describes the file.

    Raises:
        ValueError: If anything is damaged, inconsistent, or not v4.
    """
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if n < 2 or n > MAX_HEADER or 8 + n > size or len(head) < 8 + n:
        raise ValueError("bad header length")
    head = bytes(head[: 8 + n])
    try:
        h = json.loads(head[8:], object_pairs_hook=_unique)
        meta = h.pop("__metadata__")
        if set(meta) != META_KEYS or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("metadata keys")
        if meta["format"] != SEGMENT_FORMAT:
            raise ValueError("another format")
        if meta["header_digest"] != f"{header_digest(head):016x}":
            raise ValueError("header digest mismatch")
        if segment is not None and meta["segment"] != segment.hex():
            raise ValueError("another segment")
        block_size = int(meta["block_size"])
        records = json.loads(meta["blocks"])
        blocks = []
        for i, (key, parent, pos, t, flags, nbytes, csum, extra) in enumerate(records):
            key, pos, t = bytes.fromhex(key), int(pos), int(t)
            if len(key) != 16 or len(bytes.fromhex(parent)) != 16 or not 0 < t <= block_size or pos < 0 or len(csum) != 16:
                raise ValueError("block record")
            if i and (pos != blocks[-1][1] + blocks[-1][2] or parent != records[i - 1][0]):
                raise ValueError("blocks are not one chain")
            if not (isinstance(flags, int) and 0 <= flags < 256 and isinstance(nbytes, int) and nbytes >= 0):
                raise ValueError("block record")
            if not isinstance(extra, dict):
                raise ValueError("block record")
            int(csum, 16)
            blocks.append((key, pos, t))
        if not blocks or (blocks[0][1] == 0 and records[0][1] != meta["root"]):
            raise ValueError("no blocks, or a first block not under the root")
        total = sum(t for _, _, t in blocks)
        if len(meta["tokens"]) != 4 * -(-4 * total // 3):
            raise ValueError("token ids")
        firsts, digests = json.loads(meta["fields"]), json.loads(meta["snaps"])
        if set(firsts) & set(digests) or set(firsts) | set(digests) != set(h):
            raise ValueError("tensors and metadata disagree")
        ends = [0] * (len(blocks) + 1)
        for i, (_, _, t) in enumerate(blocks):
            ends[i + 1] = ends[i] + t
        fields, snaps, spans = [], [], []
        for name, info in h.items():
            if set(info) != _TENSOR_KEYS:
                raise ValueError("tensor entry")
            dtype, itemsize = dtype_info(info["dtype"])
            shape = [int(d) for d in info["shape"]]
            a, b = (int(o) for o in info["data_offsets"])
            if any(d < 0 for d in shape) or b - a != math.prod(shape) * itemsize:
                raise ValueError("shape does not match its bytes")
            spans.append((a, b))
            if name in firsts:
                first = int(firsts[name])
                if len(shape) != 4 or not 0 <= first < len(blocks) or shape[2] != total - ends[first]:
                    raise ValueError("field shape")
                batch, heads, tokens, width = shape
                fields.append(SegmentField(name, dtype, itemsize, batch, heads, width, first, a, blocks[first][1], tokens))
            else:
                tag, _, rest = name.partition(".")
                i = int(tag[1:]) if tag[:1] == "b" and tag[1:].isdigit() else -1
                if not 0 <= i < len(blocks) or not rest or len(digests[name]) != 16:
                    raise ValueError("snapshot name")
                snaps.append(Snap(i, rest, dtype, shape, a, int(digests[name], 16), b - a))
        cursor = 0
        for a, b in sorted(spans):
            if a != cursor:
                raise ValueError("gap or overlap in the data")
            cursor = b
        if 8 + n + cursor != size:
            raise ValueError("data does not end where the file does")
        out = Header(
            segment=bytes.fromhex(meta["segment"]),
            root=bytes.fromhex(meta["root"]),
            model=meta["model"].encode(),
            block_size=block_size,
            blocks=blocks,
            records=records,
            tokens=meta["tokens"],
            fields=sorted(fields, key=lambda f: f.at),
            snaps=sorted(snaps, key=lambda s: s.at),
            digest=int(meta["digest"], 16),
            body=8 + n,
        )
        if len(out.segment) != 16 or len(out.root) != 16 or len(meta["digest"]) != 16:
            raise ValueError("ids")
        if not _in_writer_order(out):
            raise ValueError("tensors are not where v4's writer put them")
        return out
    except (KeyError, TypeError, IndexError, AttributeError, ValueError, RecursionError) as exc:
        raise ValueError(f"damaged header: {exc}") from None


def _in_writer_order(h: Header) -> bool:
    """Whether the data lies as v4's writer laid it out: sliced fields by name, then
    snapshots by block and name."""
    names = [f.name for f in h.fields]
    snaps = [(s.block, s.name) for s in h.snaps]
    before = not h.fields or not h.snaps or h.fields[-1].at < h.snaps[0].at
    return names == sorted(names) and snaps == sorted(snaps) and before


def read_head(fd: int) -> tuple[bytes, int]:
    """(the length prefix and header of an open segment file, the file's size)."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, min(size, 65536), 0)
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if n < 0 or n > MAX_HEADER or 8 + n > size:
        raise ValueError("bad header length")
    if 8 + n > len(head):
        head = os.pread(fd, 8 + n, 0)
    return head, size


def decode_tokens(header: Header) -> list[bytes]:
    """Each block's token ids (int32 LE bytes), from a parsed header."""
    try:
        data = base64.b64decode(header.tokens, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"damaged header: token ids: {exc}") from None
    out, at = [], 0
    for _, _, t in header.blocks:
        out.append(data[at : at + 4 * t])
        at += 4 * t
    if at != len(data):
        raise ValueError("damaged header: token ids do not fit the blocks")
    return out


class OpenSegment:
    """An open v4 segment file whose header was parsed and checked against its size.

    Raises:
        ValueError: If the header is damaged, not v4, or does not describe the file.
    """

    def __init__(self, fd: int, segment: bytes | None):
        self.fd = fd
        head, size = read_head(fd)
        self.header = h = parse_header(head, size, segment)
        self.segment = h.segment
        self.root, self.model, self.body, self.blocks = h.root, h.model, h.body, h.blocks
        self.block_size = h.block_size
        self.fields: dict[str, SegmentField] = {f.name: f for f in h.fields}
        self.snaps: list[Snap] = h.snaps
        self._by_key = {k: i for i, (k, _, _) in enumerate(self.blocks)}

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
            return None
        return i

    def fields_of(self, i: int) -> list[SegmentField]:
        """The sliced fields block `i` has a piece of, in header order."""
        return [f for f in self.fields.values() if f.first <= i]

    def snaps_of(self, i: int) -> list[Snap]:
        """The snapshots of block `i`, in header order."""
        return [s for s in self.snaps if s.block == i]

    def read_rows(self, f: SegmentField, lo: int, hi: int, dests: list[memoryview], offsets: list[int], stride: int) -> bool:
        """Read blocks ``[lo, hi)`` of field `f` into row buffers; False on a short read."""
        p0 = self.blocks[lo][1] - f.start
        p1 = self.blocks[hi - 1][1] + self.blocks[hi - 1][2] - f.start
        n = (p1 - p0) * f.row_bytes
        try:
            for r in range(f.rows):
                dest, base = (dests[0], offsets[0] + r * stride) if len(dests) == 1 else (dests[r], offsets[r])
                at = self.body + f.at + (r * f.tokens + p0) * f.row_bytes
                if preadv(self.fd, [dest[base : base + n]], at) != n:
                    return False
        except OSError:
            return False
        return True

    def block_digest(self, i: int, piece: Callable[[SegmentField, int], memoryview]) -> int:
        """The v4 checksum of block `i`, given its piece of each field's row (already read)."""
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
        name)``, verified against the node's checksum by the v4 rule; None if missing or
        damaged."""
        i = self.block_index(node)
        if i is None:
            return None
        n = self.blocks[i][2]
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


def open_segment(store: str, segment: bytes) -> OpenSegment | None:
    """Open a v4 segment of a store directory; None if missing, damaged or not v4."""
    return open_path(path_of(store, segment), segment)


def open_path(path: str, segment: bytes | None = None) -> OpenSegment | None:
    """Open a v4 segment file by its path (`segment`: the id it must have, None: any);
    None if missing, damaged or not v4. Links and special files are not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return OpenSegment(fd, segment)
    except (ValueError, OSError):
        os.close(fd)
        return None


def records_of(seg: OpenSegment) -> list[dict]:
    """The blocks a v4 header lists, as keyword arguments of a record (key, parent,
    position, tokens, flags, size, checksum, extra, segment), in position order.

    Raises:
        ValueError: If the token ids do not decode.
    """
    tokens = decode_tokens(seg.header)
    return [
        dict(
            key=bytes.fromhex(key), parent=bytes.fromhex(parent), position=int(position), tokens=tokens[i],
            flags=flags, size=nbytes, checksum=int(checksum, 16), extra=extra, segment=seg.segment,
        )
        for i, (key, parent, position, _, flags, nbytes, checksum, extra) in enumerate(seg.header.records)
    ]  # fmt: skip


# -- writing ---------------------------------------------------------------------------


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
    """The bytes of a sliced tensor ``[batch, heads, n, width]`` as ``[rows, bytes]`` uint8."""
    view = memoryview(x[0] if isinstance(x, tuple) else x)
    if view.c_contiguous:
        return np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(rows, -1)
    a = np.asarray(view)
    return a.reshape(rows, a.shape[-2] * a.shape[-1]).view(np.uint8)


def _pwrite_all(fd: int, data: Any, offset: int) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        n = pwritev(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError("a write made no progress")
        done += n
    return done


def _plan(segment, blocks, root, model, block_size):
    """(safetensors entries, per field (rows, first block, per block its [rows, bytes]
    piece), snapshots (block, name, bytes), each block's size, data bytes)."""
    if not blocks:
        raise ValueError("a segment needs at least one block")
    for (a, _), (b, _) in zip(blocks, blocks[1:]):
        if b.position != a.end or b.parent != a.key:
            raise ValueError("a segment's blocks must be consecutive blocks of one chain")
    if blocks[0][0].position == 0 and blocks[0][0].parent != root:
        raise ValueError("a segment's first block is not under its model's root")
    if len(root) != 16:
        raise ValueError("a model root key has 16 bytes")
    flat = [{f"{lid}.{f}": x for lid, part in tensors.items() for f, x in part.items()} for _, tensors in blocks]
    sliced: dict[str, list] = {}
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
    sizes = [0] * len(blocks)
    fields, tensors_of, firsts, at = [], {}, {}, 0
    for name in sorted(sliced):
        dtype, batch, heads, width, first = sliced[name]
        rows = batch * heads
        pieces = [_rows(flat[i][name], rows) for i in range(first, len(blocks))]
        for i, piece in enumerate(pieces, first):
            sizes[i] += piece.nbytes
        fields.append((rows, first, pieces))
        tokens = sum(node.n_tokens for node, _ in blocks[first:])
        nbytes = sum(p.nbytes for p in pieces)
        tensors_of[name] = {"dtype": dtype, "shape": [batch, heads, tokens, width], "data_offsets": [at, at + nbytes]}
        firsts[name] = first
        at += nbytes
    snaps = []
    for i, tensors in enumerate(flat):
        for name in sorted(tensors):
            if name in sliced and i >= sliced[name][4]:
                continue
            view = _bytes(tensors[name])
            snaps.append((i, name, view))
            sizes[i] += view.nbytes
            tensors_of[f"b{i}.{name}"] = {
                "dtype": _dtype(tensors[name]),
                "shape": list(_shape(tensors[name])),
                "data_offsets": [at, at + len(view)],
            }
            at += len(view)
    if len(tensors_of) != len(sliced) + len(snaps):
        raise ValueError("a snapshot's tensor name clashes with a field's")
    return tensors_of, firsts, fields, snaps, sizes, at


def _header(segment, blocks, root, model, block_size, tensors_of, firsts, snaps, sizes, checksums, digests, whole) -> bytes:
    records = []
    for i, (node, _) in enumerate(blocks):
        records.append(
            [node.key.hex(), node.parent.hex(), node.position, node.n_tokens, node.flags, sizes[i],
             f"{checksums[i]:016x}", node.extra or {}]
        )  # fmt: skip
    metadata = {
        "format": SEGMENT_FORMAT,
        "segment": segment.hex(),
        "root": root.hex(),
        "model": model.decode("utf-8"),
        "block_size": str(int(block_size)),
        "blocks": json.dumps(records, separators=(",", ":")),
        "tokens": base64.b64encode(b"".join(node.tokens for node, _ in blocks)).decode(),
        "fields": json.dumps(firsts, separators=(",", ":")),
        "snaps": json.dumps({f"b{i}.{name}": f"{digests[j]:016x}" for j, (i, name, _) in enumerate(snaps)}, separators=(",", ":")),
        "digest": f"{whole:016x}",
        "header_digest": "0" * 16,
    }
    text = json.dumps({"__metadata__": metadata, **tensors_of}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise ValueError(f"a segment header of {len(text):,} bytes is over the limit of {MAX_HEADER:,}")
    head = len(text).to_bytes(8, "little") + text
    at = head.index(DIGEST_MARK) + len(DIGEST_MARK)
    return head[:at] + f"{header_digest(head):016x}".encode() + head[at + 16 :]


def _store_modes(store: str) -> tuple[int, int]:
    # The store's modes as v4's writer took them (its folder's group bits, private else).
    mode = os.stat(store).st_mode
    group = mode & 0o070 if not mode & 0o007 else 0
    return 0o700 | group | (mode & stat.S_ISGID), 0o600 | (group & 0o060)


def _make_dir(path: str, store: str, folder_mode: int) -> None:
    if os.path.isdir(path):
        return
    _make_dir(os.path.dirname(path), store, folder_mode)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, folder_mode)


def write(
    store: str, blocks: Sequence[tuple[Node, dict[str, dict[str, Any]]]], *, root: bytes, model: bytes, block_size: int
) -> tuple[bytes, int, int]:
    """Write consecutive blocks of one chain into a new v4 segment of a store directory,
    durably (under ``tmp/``, fsync, rename, fsync the folder); sets each node's
    segment, size and checksum (the v4 rule).

    Returns:
        (segment id, file size, whole-segment digest).

    Raises:
        ValueError: If the blocks are not one chain of one model, or disagree.
        OSError: On any failure to write (the temporary file is removed).
    """
    segment = os.urandom(16)
    tensors_of, firsts, fields, snaps, sizes, nbytes = _plan(segment, blocks, root, model, block_size)
    per_block = [xxhash.xxh3_64() for _ in blocks]
    whole = xxhash.xxh3_64()
    chunks = []
    for rows, first, pieces in fields:
        h = xxhash.xxh3_64()
        for r in range(rows):
            for i, piece in enumerate(pieces, first):
                row = piece[r]
                chunks.append(row)
                h.update(row)
                per_block[i].update(row)
        whole.update(h.intdigest().to_bytes(8, "little"))
    digests = []
    for i, _, view in snaps:
        chunks.append(view)
        d = xxhash.xxh3_64_intdigest(view)
        digests.append(d)
        whole.update(d.to_bytes(8, "little"))
        per_block[i].update(d.to_bytes(8, "little"))
    checksums = [h.intdigest() for h in per_block]
    head = _header(segment, blocks, root, model, block_size, tensors_of, firsts, snaps, sizes, checksums, digests, whole.intdigest())
    folder_mode, file_mode = _store_modes(store)
    _make_dir(os.path.join(store, "tmp"), store, folder_mode)
    tmp = os.path.join(store, "tmp", f"{segment.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, file_mode)
        size = _pwrite_all(fd, head, 0)
        for chunk in chunks:
            size += _pwrite_all(fd, chunk, size)
        durable_fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    final = path_of(store, segment)
    if not os.path.isdir(os.path.dirname(final)):
        _make_dir(os.path.dirname(final), store, folder_mode)
        fsync_dir(os.path.join(store, "segments"))
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    for i, (node, _) in enumerate(blocks):
        node.segment, node.size, node.checksum = segment, sizes[i], checksums[i]
    return segment, size, whole.intdigest()

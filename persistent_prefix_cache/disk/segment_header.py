"""A segment file's header (see `segment`): its format, parsed strictly and checked
against the file it heads.

A v5 segment is a safetensors file (``safe_open`` and ``mx.load`` read every tensor),
but we never trust a parser that accepts overlapping offsets, trailing bytes or a
damaged header: `parse_header` checks the safetensors schema itself, then our own
metadata (covered byte for byte by the header digest), and that the header describes
the file exactly. `segment_reader` reads the blocks a parsed header describes.
"""

from __future__ import annotations

import base64
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import xxhash

from ..blocks import dtype_info
from .digest_tags import field_tag, run_tag, snapshot_tag

SEGMENT_FORMAT = "ppc-segment/5"
MAX_HEADER = 16 * 1024 * 1024  # ~1M tokens in one segment: a header no reader should take
# The metadata keys of a segment (all values are strings, as safetensors requires).
META_KEYS = frozenset(
    {
        "format",
        "segment",
        "root",
        "model",
        "block_size",
        "blocks",
        "tokens",
        "fields",
        "snaps",
        "digest",
        "header_digest",
    }
)
# The header digest's value is found by this marker (unique: a quote inside a JSON
# string is escaped) and hashed as zeros: xxh3-64 of every other byte of the header.
DIGEST_MARK = b'"header_digest":"'
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})


class SegmentField:
    """A sliced field of a segment: where each row (batch x head) of its tokens lies."""

    __slots__ = (
        "name", "dtype", "itemsize", "batch", "heads", "rows", "width", "first", "at", "start", "tokens", "row_bytes",
        "tag", "run_tag",
    )  # fmt: skip

    def __init__(self, name, dtype, itemsize, batch, heads, width, first, at, start, tokens):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize
        self.batch, self.heads, self.rows = batch, heads, batch * heads
        self.width, self.first, self.at = width, first, at
        self.start, self.tokens = start, tokens  # first position held, tokens per row
        self.row_bytes = width * itemsize  # bytes of one token in one row
        # What a block's piece and the whole field are (see `digest_tags`).
        self.tag = field_tag(name, dtype, batch, heads, width)
        self.run_tag = run_tag(name, dtype, batch, heads, width, start, tokens)

    @property
    def nbytes(self) -> int:
        return self.rows * self.tokens * self.row_bytes


class Snap:
    """A snapshot of one block: a whole tensor and the digest of its bytes (bound to its
    block's key and position and its own name, dtype and shape by `tag`)."""

    __slots__ = ("block", "name", "dtype", "shape", "at", "digest", "nbytes", "tag")

    def __init__(self, block, name, dtype, shape, at, digest, nbytes, tag):
        self.block, self.name, self.dtype, self.shape = block, name, dtype, tuple(shape)
        self.at, self.digest, self.nbytes, self.tag = at, digest, nbytes, tag


@dataclass(eq=False)
class Header:
    """A segment header, parsed and checked (see `parse_header`).

    Attributes:
        segment: The segment id.
        root: The root key of the model every block belongs to.
        model: That model's record (the bytes the index stores for the root).
        block_size: The store's block size when the segment was written (no block is longer).
        blocks: Per block ``(key, position, tokens)``, consecutive, one chain.
        records: Per block ``[key hex, parent hex, position, tokens, flags, size,
            checksum hex, extra]`` as stored.
        tokens: The blocks' token ids, base64 of int32 LE, all blocks joined.
        fields: Sliced fields by name, in data order.
        snaps: Snapshots, in data order.
        digest: The whole-segment digest.
        body: File offset of the data.
    """

    segment: bytes
    root: bytes
    model: bytes
    block_size: int
    blocks: list[tuple[bytes, int, int]]
    records: list[list[Any]]
    tokens: str
    fields: list[SegmentField]
    snaps: list[Snap]
    digest: int
    body: int


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key is repeated")
    return out


def header_digest(head: bytes) -> int:
    """xxh3-64 of a header (length prefix included) with its digest's 16 hex digits as zeros.

    Raises:
        ValueError: If the header does not hold exactly one digest.
    """
    at = head.find(DIGEST_MARK)
    if at < 0 or head.find(DIGEST_MARK, at + 1) >= 0:
        raise ValueError("no single header digest")
    at += len(DIGEST_MARK)
    return xxhash.xxh3_64_intdigest(head[:at] + b"0" * 16 + head[at + 16 :])


def parse_header(head: bytes, size: int, segment: bytes | None = None) -> Header:
    """Parse a segment's header strictly (format v5) and check that it describes the file.

    Args:
        head: The file's first ``8 + n`` bytes (length prefix and header).
        size: The file's size.
        segment: The id the file must have (None: any).

    Raises:
        ValueError: If anything is damaged, inconsistent, or not v5.
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
        blocks: list[tuple[bytes, int, int]] = []
        for i, (key, parent, pos, t, flags, nbytes, csum, extra) in enumerate(records):
            key, pos, t = bytes.fromhex(key), int(pos), int(t)
            if (
                len(key) != 16
                or len(bytes.fromhex(parent)) != 16
                or not 0 < t <= block_size
                or pos < 0
                or len(csum) != 16
            ):
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
        ends = [0] * (len(blocks) + 1)  # tokens before block i
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
                fields.append(
                    SegmentField(name, dtype, itemsize, batch, heads, width, first, a, blocks[first][1], tokens)
                )
            else:
                tag, _, rest = name.partition(".")
                i = int(tag[1:]) if tag[:1] == "b" and tag[1:].isdigit() else -1
                if not 0 <= i < len(blocks) or not rest or len(digests[name]) != 16:
                    raise ValueError("snapshot name")
                tag = snapshot_tag(blocks[i][0], blocks[i][1], rest, dtype, shape)
                snaps.append(Snap(i, rest, dtype, shape, a, int(digests[name], 16), b - a, tag))
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
        return out
    except (KeyError, TypeError, IndexError, AttributeError, ValueError, RecursionError) as exc:
        raise ValueError(f"damaged header: {exc}") from None


def read_head(fd: int) -> tuple[bytes, int]:
    """(the length prefix and header of an open segment file, the file's size).

    Raises:
        ValueError: If the length prefix does not fit the file.
        OSError: If the file cannot be read.
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, min(size, 65536), 0)
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if n < 0 or n > MAX_HEADER or 8 + n > size:
        raise ValueError("bad header length")
    if 8 + n > len(head):
        head = os.pread(fd, 8 + n, 0)
    return head, size


def decode_tokens(header: Header) -> list[bytes]:
    """Each block's token ids (int32 LE bytes), from a parsed header.

    Raises:
        ValueError: If the token ids do not decode or do not fit the blocks.
    """
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

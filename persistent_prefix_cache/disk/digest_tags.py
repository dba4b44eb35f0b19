"""What each digest of a segment binds its bytes to (format v5): the tag hashed first.

A digest over bytes alone says they are intact, not what they are. Format v4 hashed a
block's pieces of its fields in data order, so a header that swapped the offsets of two
tensors of one shape (``0.k`` and ``0.v``, layer 0 and layer 1) or relabelled a block's
record still matched every digest, and a restore served the wrong KV. From v5 on, every
digest begins with a small canonical tag naming what the bytes after it are:

- a block's checksum (index record and header): `block_tag` (its key, parent,
  position, token ids, flags and ``extra``: the record less where its bytes lie), then
  per sliced field `field_tag` (name, dtype, batch, heads, width) before the block's
  piece of each row, then its snapshots' digests;
- a snapshot's digest: `snapshot_tag` (its block's key and position, the tensor's name,
  dtype and shape) before its bytes;
- a field's digest (a field read whole): `run_tag` (`field_tag`, and the first position
  and token count it spans) before its rows;
- the whole-segment digest, which verifies a segment read whole instead of its blocks'
  checksums: `segment_tag` (segment id, model root, every block's checksum: they bind
  the blocks' records) before the fields' and snapshots' digests.

No tag names the segment in a block's checksum: compaction copies a block into another
segment and compares the copy's checksum with the record's. A tag is a few dozen bytes
hashed with the bytes it precedes in the same pass, so binding costs no second pass.
Each tag starts with its own label, and its variable parts carry their lengths, so no
two different labellings hash the same stream of bytes.
"""

from __future__ import annotations

import json
import struct
from typing import Sequence

import xxhash

from ..blocks import Node

_BLOCK = struct.Struct("<QIBI")  # position, token count, flags, length of extra
_DIMS = struct.Struct("<III")  # batch, heads, width
_SPAN = struct.Struct("<QQ")  # first position, tokens


def _text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return len(raw).to_bytes(2, "little") + raw


def block_tag(node: Node) -> bytes:
    """The tag a block's checksum starts with: the record it belongs to (key, parent,
    position, token ids, flags, ``extra``)."""
    extra = json.dumps(node.extra or {}, sort_keys=True, separators=(",", ":")).encode()
    return (
        b"ppc5:block" + node.key + node.parent
        + _BLOCK.pack(node.position, node.n_tokens, node.flags, len(extra)) + node.tokens + extra
    )  # fmt: skip


def field_tag(name: str, dtype: str, batch: int, heads: int, width: int) -> bytes:
    """The tag hashed before a block's piece of sliced field `name` (``<leaf>.<field>``)."""
    return b"ppc5:field" + _text(name) + _text(dtype) + _DIMS.pack(batch, heads, width)


def run_tag(name: str, dtype: str, batch: int, heads: int, width: int, start: int, tokens: int) -> bytes:
    """The tag a field's digest starts with: the field and the positions it spans."""
    return b"ppc5:run" + field_tag(name, dtype, batch, heads, width) + _SPAN.pack(start, tokens)


def snapshot_tag(key: bytes, position: int, name: str, dtype: str, shape: Sequence[int]) -> bytes:
    """The tag a snapshot's digest starts with: its block (key, position) and tensor."""
    dims = struct.pack(f"<B{len(shape)}Q", len(shape), *shape)
    return b"ppc5:snap" + key + position.to_bytes(8, "little") + _text(name) + _text(dtype) + dims


def segment_tag(segment: bytes, root: bytes, checksums: Sequence[int]) -> bytes:
    """The tag the whole-segment digest starts with: the segment, its model's root and
    its blocks' checksums, in order."""
    return (
        b"ppc5:segment" + segment + root + len(checksums).to_bytes(4, "little")
        + b"".join(c.to_bytes(8, "little") for c in checksums)
    )  # fmt: skip


def tagged_digest(tag: bytes, data) -> int:
    """xxh3-64 of `tag`, then `data` (a snapshot's digest), in one pass over the data."""
    h = xxhash.xxh3_64()
    h.update(tag)
    h.update(data)
    return h.intdigest()

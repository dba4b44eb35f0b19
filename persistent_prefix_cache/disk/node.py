"""The index record of one block (a trie node) and its binary encoding."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

# version, parent key, position, token count, flags, bytes of the block, checksum,
# child count, last access (ns), length of the JSON tail; then (version 2) the segment.
_HEAD = struct.Struct("<B16sQIBQQIQH")
_SEGMENT = 16
RECORD_VERSION = 2
# A lookup matches packed records without decoding them: the slice of the record
# holding its parent key, position and token count, compared with `raw_head`, then its
# tokens from TOKENS_AT.
HEAD_AT = slice(1, 29)
_POSITION = struct.Struct("<QI")
TOKENS_AT = _HEAD.size  # 1: schema v1-v2 (one file per block, named by key and checksum)

# Flags (computed by `layers.Layout.flags`): where this block's layers can be rebuilt.
RESUMABLE = 1  # every layer can be rebuilt at the end of this block
TRIMMABLE = 2  # every layer can be trimmed back to any position inside the block


def raw_head(parent: bytes, position: int, n_tokens: int) -> bytes:
    """What a packed record of a block with this parent, position and token count
    holds at `HEAD_AT`."""
    return parent + _POSITION.pack(position, n_tokens)


@dataclass(slots=True)
class Node:
    """One stored block: where it sits in the trie and where its bytes are.

    A block's tensors live in a segment file (see `segment`) written by one writer
    for the blocks of one store; segment ids are random, so two processes that race
    to store one block never share, overwrite or unlink each other's file.
    """

    key: bytes
    parent: bytes
    position: int
    tokens: bytes  # int32 little-endian: compared byte-wise on every hit
    flags: int
    size: int
    checksum: int
    child_count: int = 0
    last_access: int = 0
    extra: dict = field(default_factory=dict)
    segment: bytes = bytes(_SEGMENT)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def end(self) -> int:
        return self.position + self.n_tokens

    @property
    def resumable(self) -> bool:
        return bool(self.flags & RESUMABLE)

    @property
    def trimmable(self) -> bool:
        return bool(self.flags & TRIMMABLE)

    @property
    def legacy_file_name(self) -> str:
        """Path (relative to ``blocks/``) of the block's own file in schema v1-v2."""
        hex_key = self.key.hex()
        return f"{hex_key[:2]}/{hex_key}-{self.checksum:016x}.safetensors"

    def pack(self) -> bytes:
        """The record as stored (version 2)."""
        tail = json.dumps(self.extra, separators=(",", ":")).encode() if self.extra else b""
        head = _HEAD.pack(
            RECORD_VERSION,
            self.parent,
            self.position,
            self.n_tokens,
            self.flags,
            self.size,
            self.checksum,
            self.child_count,
            self.last_access,
            len(tail),
        )
        return head + self.tokens + tail + self.segment

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> "Node":
        """Decode a record (version 2, or version 1 for the migration from schema v2).

        Raises:
            ValueError: If the record is malformed.
        """
        if len(raw) < _HEAD.size:
            raise ValueError("index record too short")
        (ver, parent, pos, n, flags, size, csum, children, access, n_tail) = _HEAD.unpack_from(raw)
        body = _HEAD.size + 4 * n + n_tail
        if ver not in (1, RECORD_VERSION) or len(raw) != body + (_SEGMENT if ver == 2 else 0):
            raise ValueError("index record has a bad version or length")
        tokens = bytes(raw[_HEAD.size : _HEAD.size + 4 * n])
        tail = raw[_HEAD.size + 4 * n : body]
        extra = json.loads(bytes(tail)) if n_tail else {}
        segment = bytes(raw[body:]) if ver == 2 else bytes(_SEGMENT)
        return cls(key, parent, pos, tokens, flags, size, csum, children, access, extra, segment)

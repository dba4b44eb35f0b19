"""The index record of one block (a trie node) and its binary encoding."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

# version, parent key, position, token count, flags, file size, checksum,
# child count, last access (ns), length of the JSON tail.
_HEAD = struct.Struct("<B16sQIBQQIQH")
RECORD_VERSION = 1

# Flags (computed by `layers.Layout.flags`): where this block's layers can be rebuilt.
RESUMABLE = 1  # every layer can be rebuilt at the end of this block
TRIMMABLE = 2  # every layer can be trimmed back to any position inside the block


@dataclass(slots=True)
class Node:
    """One stored block: where it sits in the trie and how to check its file.

    The file name is derived from the key and checksum (see `file_name`), so two
    processes that race to write one block never overwrite each other's file.
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
    def file_name(self) -> str:
        """Path of the block file relative to ``blocks/``."""
        hex_key = self.key.hex()
        return f"{hex_key[:2]}/{hex_key}-{self.checksum:016x}.safetensors"

    def pack(self) -> bytes:
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
        return head + self.tokens + tail

    @staticmethod
    def raw_matches(raw: bytes, parent: bytes, position: int, tokens: bytes) -> bool:
        """Whether a packed record has this parent, position and tokens, without
        decoding it (the lookup checks every block of a prompt this way)."""
        t = _HEAD.size
        return (
            raw[1:17] == parent
            and raw[t : t + len(tokens)] == tokens
            and int.from_bytes(raw[17:25], "little") == position
            and int.from_bytes(raw[25:29], "little") * 4 == len(tokens)
        )

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> "Node":
        """Decode a record.

        Raises:
            ValueError: If the record is malformed.
        """
        if len(raw) < _HEAD.size:
            raise ValueError("index record too short")
        (ver, parent, pos, n, flags, size, csum, children, access, n_tail) = _HEAD.unpack_from(raw)
        if ver != RECORD_VERSION or len(raw) != _HEAD.size + 4 * n + n_tail:
            raise ValueError("index record has a bad version or length")
        tokens = bytes(raw[_HEAD.size : _HEAD.size + 4 * n])
        tail = raw[_HEAD.size + 4 * n :]
        extra = json.loads(bytes(tail)) if n_tail else {}
        return cls(key, parent, pos, tokens, flags, size, csum, children, access, extra)

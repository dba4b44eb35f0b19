"""The remote tier's key scheme and the wire form of one block (a self-contained value).

One server key per block: ``ppc:b1:<root hex>:k<key id>:<block key hex>`` for a fleet
with a secret, ``ppc:b1:<root hex>:<block key hex>`` for one without (``remote_insecure``).
``b1`` is the wire format's version and the root key binds the model fingerprint,
namespace and cache layout, so two models, tenants or formats never meet. The key id
(16 hex digits of a hash of the MAC key, which reveals nothing of it) keeps the blocks of
each secret apart: writes are first-writer-wins (``SET NX``), so a host with a mistyped
secret, sharing keys with the others, would hold every block it wrote first against them
(values no one else accepts, never replaced); under its own key id it fills only its own
space, and the fleet's values are never its to block. There are no curly braces in a key
(Redis Cluster would read them as a hash tag and put every block on one node).

A value is, in order::

    b"PPCB" | u8 version | u8 flags (1: a MAC follows) | u16 0 | u32 header length h
    header: JSON, space-padded to a multiple of 8 (key, parent, position, token
            count, node flags and extra, tensors as [leaf, field, dtype, shape, offset])
    the block's tokens (int32 LE), padded to 8
    the tensors' bytes, each at its offset (multiples of 8) from here
    xxh3-128 of everything before (16 bytes)
    with a secret: keyed BLAKE2b-256 over the server key and everything before (32 bytes)

`decode` checks all of it against what the reader expects (key, parent, position,
tokens, checksum, MAC), and the caller checks the tensors against the model's layout;
a value that fails any check is a counted miss, never KV.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..blocks import Node, dtype_info, np_uint
from ..keys import block_key

MAGIC = b"PPCB"
WIRE_VERSION = 1
KEY_PREFIX = b"ppc:b1:"
_HEAD = struct.Struct("<4sBBHI")
_DIGEST = 16
_MAC = 32
HAS_MAC = 1


def server_key(root: bytes, key: bytes, kid: str | None = None) -> bytes:
    """The server key of block `key` of the chain rooted at `root`, in the space of key
    id `kid` (`key_id`; None: the space of values without a MAC)."""
    space = b"" if kid is None else b"k" + kid.encode() + b":"
    return KEY_PREFIX + root.hex().encode() + b":" + space + key.hex().encode()


def key_pattern(root: bytes) -> bytes:
    """A SCAN pattern matching every block of one root, of every key id (see `split_key`)."""
    return KEY_PREFIX + root.hex().encode() + b":*"


def split_key(skey: bytes) -> tuple[str | None, bytes]:
    """(key id or None, block key) of a server key `key_pattern` matched.

    Raises:
        ValueError: If it is not a key of this scheme.
    """
    parts = skey[len(KEY_PREFIX) :].split(b":")
    if not skey.startswith(KEY_PREFIX) or len(parts) not in (2, 3) or (len(parts) == 3 and parts[1][:1] != b"k"):
        raise ValueError("not a block key of this scheme")
    return (parts[1][1:].decode() if len(parts) == 3 else None), bytes.fromhex(parts[-1].decode())


def mac_key(secret: str | bytes) -> bytes:
    """The 64-byte BLAKE2b key derived from a secret of any length."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    return hashlib.blake2b(raw, digest_size=64, person=b"ppc-remote-mac").digest()


def key_id(mac: bytes) -> str:
    """The key id of a MAC key: 16 hex digits that reveal nothing of it."""
    return hashlib.blake2b(mac, digest_size=8, person=b"ppc-remote-kid").hexdigest()


def carries_mac(value: Any) -> bool:
    """Whether a value says it carries a MAC (unchecked: for a reader without a secret)."""
    if len(value) < _HEAD.size or bytes(memoryview(value)[:4]) != MAGIC:
        return False
    return bool(_HEAD.unpack_from(value)[2] & HAS_MAC)


def _mac(key: bytes, skey: bytes, data: memoryview | bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_MAC, key=key)
    h.update(len(skey).to_bytes(2, "little") + skey)
    h.update(data)
    return h.digest()


def _contiguous(x: Any) -> tuple[memoryview, str, tuple[int, ...]]:
    """Bytes, dtype name and shape of a block tensor: an mlx or numpy array, or
    ``(array of its bits, dtype name)`` (what the store's write path holds)."""
    arr, dtype = (x[0], x[1]) if isinstance(x, tuple) else (x, None)
    view = memoryview(arr)
    if dtype is None:
        dtype = dtype_info(arr.dtype)[0]
    shape = tuple(view.shape or ())  # (a tuple in CPython; the stubs allow None)
    if not view.c_contiguous:  # a strided view of one copy per field: numpy copies it
        view = np.ascontiguousarray(np.asarray(view)).data
    return view.cast("B"), dtype, shape


def encode(skey: bytes, node: Node, tensors: dict[str, dict[str, Any]], mac: bytes | None = None) -> bytes:
    """The value of one block.

    Args:
        skey: Its server key (`server_key`), covered by the MAC.
        node: Its record (key, parent, position, tokens, flags, extra are sent).
        tensors: By leaf, then field: evaluated arrays, or ``(bits, dtype name)``.
        mac: The MAC key (`mac_key`), or None to send no MAC.
    """
    specs: list[list[Any]] = []
    chunks: list[memoryview | bytes] = []
    at = 0
    for lid in sorted(tensors):
        for fld in sorted(tensors[lid]):
            data, dtype, shape = _contiguous(tensors[lid][fld])
            specs.append([lid, fld, dtype, list(shape), at])
            chunks.append(data)
            pad = -len(data) % 8
            if pad:
                chunks.append(bytes(pad))
            at += len(data) + pad
    header = {
        "key": node.key.hex(),
        "parent": node.parent.hex(),
        "pos": node.position,
        "n": node.n_tokens,
        "flags": node.flags,
        "extra": node.extra,
        "tensors": specs,
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    toks = node.tokens + bytes(-len(node.tokens) % 8)
    head = _HEAD.pack(MAGIC, WIRE_VERSION, HAS_MAC if mac is not None else 0, 0, len(text))
    parts: list[memoryview | bytes] = [head, text, toks, *chunks]
    body = b"".join(parts)
    digest = xxhash.xxh3_128_digest(body)
    if mac is None:
        return body + digest
    return body + digest + _mac(mac, skey, memoryview(body + digest))


class BadValue(ValueError):
    """A value that fails a check; `reason` is "corrupt" or "unauthenticated"."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class RemoteBlock:
    """A verified block from the server.

    Attributes:
        node: Its record (size set to its tensors' bytes; segment and checksum are
            the local store's to set).
        bits: By leaf, then field: ``(numpy array of the bits, dtype name)``, views
            of the value.
        nbytes: Length of the value.
    """

    node: Node
    bits: dict[str, dict[str, tuple[np.ndarray, str]]]
    nbytes: int


def decode(
    value: bytes, skey: bytes, *, key: bytes, parent: bytes, position: int, tokens: bytes, mac: bytes | None
) -> RemoteBlock:
    """Check a value against what the reader expects and decode it.

    Args:
        value: The value as read.
        skey: The server key it was read from.
        key, parent, position, tokens: What the block must be (from the query).
        mac: The MAC key: the value must carry a valid MAC; None accepts any
            value that is otherwise intact (the server is trusted like a disk).

    Raises:
        BadValue: On any mismatch.
    """
    view = memoryview(value)
    if len(view) < _HEAD.size + _DIGEST:
        raise BadValue("corrupt", "value too short")
    magic, version, vflags, _, n_head = _HEAD.unpack_from(view)
    if magic != MAGIC or version != WIRE_VERSION:
        raise BadValue("corrupt", "not a block value of this format")
    end = len(view) - (_MAC if vflags & HAS_MAC else 0)
    if end - _DIGEST < _HEAD.size + n_head:
        raise BadValue("corrupt", "value truncated")
    if mac is not None:
        if not vflags & HAS_MAC:
            raise BadValue("unauthenticated", "value carries no MAC")
        if not hmac.compare_digest(_mac(mac, skey, view[:end]), bytes(view[end:])):
            raise BadValue("unauthenticated", "MAC does not match")
    body = end - _DIGEST
    if xxhash.xxh3_128_digest(view[:body]) != bytes(view[body:end]):
        raise BadValue("corrupt", "checksum does not match")
    try:
        header = json.loads(bytes(view[_HEAD.size : _HEAD.size + n_head]))
        got = (bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]), int(header["pos"]), int(header["n"]))
        flags, extra, specs = int(header["flags"]), dict(header["extra"]), list(header["tensors"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadValue("corrupt", f"header does not decode: {exc}") from None
    if got != (key, parent, position, len(tokens) // 4):
        raise BadValue("corrupt", "value belongs to another block")
    at = _HEAD.size + n_head
    if bytes(view[at : at + len(tokens)]) != tokens or block_key(parent, tokens) != key:
        raise BadValue("corrupt", "value holds other tokens")
    data = at + len(tokens) + (-len(tokens) % 8)
    bits: dict[str, dict[str, tuple[np.ndarray, str]]] = {}
    size = 0
    try:
        for lid, fld, dtype, shape, offset in specs:
            itemsize = dtype_info(dtype)[1]
            count = math.prod(int(d) for d in shape)
            start = data + int(offset)
            if offset < 0 or count < 0 or start + count * itemsize > body:
                raise ValueError("tensor outside the value")
            arr = np.frombuffer(value, dtype=np_uint(itemsize), count=count, offset=start).reshape(shape)
            bits.setdefault(str(lid), {})[str(fld)] = (arr, dtype)
            size += count * itemsize
    except (ValueError, TypeError, KeyError) as exc:
        raise BadValue("corrupt", f"tensor table does not decode: {exc}") from None
    node = Node(key, parent, position, tokens, flags, size, 0, extra=extra)
    return RemoteBlock(node, bits, len(value))


def header_of(value: Any) -> dict:
    """The JSON header of a value, unchecked (to learn what block it claims to be;
    `decode` then checks everything against that).

    Raises:
        BadValue: If it does not parse.
    """
    if len(value) < _HEAD.size or bytes(memoryview(value)[:4]) != MAGIC:
        raise BadValue("corrupt", "not a block value of this format")
    n_head = _HEAD.unpack_from(value)[4]
    try:
        head = json.loads(bytes(value[_HEAD.size : _HEAD.size + n_head]))
        head["n"] = int(head["n"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadValue("corrupt", f"header does not decode: {exc}") from None
    if not isinstance(head, dict) or not 0 < head["n"] <= len(value) // 4:
        raise BadValue("corrupt", "header does not decode")
    return head


def tokens_of(value: Any) -> bytes:
    """The tokens a value claims to hold (unchecked, see `header_of`)."""
    head = header_of(value)
    at = _HEAD.size + _HEAD.unpack_from(value)[4]
    return bytes(value[at : at + 4 * head["n"]])

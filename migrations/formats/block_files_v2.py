"""Schema v1-v2 block files (one safetensors file per block under ``blocks/``), frozen:
read by migration 0003 and by `ppc import` of an export made by those versions.

The writer (`encode`) and the strict reader (`parse_header`, `decode`) as the last v2
code had them: we wrote the safetensors layout ourselves (8-byte header length, JSON
header, tensor bytes) and parse it strictly: `mx.load` and `safetensors` accept trailing
bytes, overlapping offsets and flipped tensor bytes, so only the checksum and the checks
here catch them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from .dtypes import DTYPES, MAX_HEADER, dtype_info


def file_name(node: Any) -> str:
    """Path (relative to ``blocks/``) of a block's own file: named by its key and checksum."""
    hex_key = node.key.hex()
    return f"{hex_key[:2]}/{hex_key}-{node.checksum:016x}.safetensors"


class BlockDecodeError(Exception):
    """A block file is damaged; the read path turns this into a miss."""


def encode(tensors: dict[str, mx.array], metadata: dict[str, str]) -> tuple[bytes, list]:
    """Lay out tensors as a safetensors file.

    Args:
        tensors: Evaluated, row-contiguous mlx arrays by name.
        metadata: String metadata for the header.

    Returns:
        The header bytes (length prefix included) and the list of buffers to write
        after it, in order.
    """
    header: dict = {"__metadata__": metadata}
    buffers = []
    offset = 0
    for name in sorted(tensors):
        arr = tensors[name]
        view = memoryview(arr)
        header[name] = {
            "dtype": dtype_info(arr.dtype)[0],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + view.nbytes],
        }
        buffers.append(view.cast("B") if view.nbytes else b"")
        offset += view.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format allows space padding; align the data
    return len(text).to_bytes(8, "little") + text, buffers


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of a whole file's bytes."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Entry:
    """One tensor of a block file: name, where its bytes lie in the body, and its type."""

    name: str
    start: int
    end: int
    shape: tuple[int, ...]
    mx_dtype: Any
    np_dtype: np.dtype


def parse_header(head: bytes | memoryview, file_size: int) -> tuple[int, list[Entry], dict]:
    """Parse and check a block file's header against the file's size.

    Args:
        head: The file's first bytes: at least the 8-byte length and the header.
        file_size: The whole file's size.

    Returns:
        (offset of the body, entries sorted by position, header metadata).

    Raises:
        BlockDecodeError: On any inconsistency: bad header length or JSON, unknown
            dtype, a shape that does not match its bytes, gaps, overlaps, or a body
            that is longer or shorter than its tensors.
    """
    view = memoryview(head)
    if len(view) < 8 or file_size < 8:
        raise BlockDecodeError("file shorter than its header length field")
    n = int.from_bytes(view[:8], "little")
    if n > MAX_HEADER or 8 + n > file_size:
        raise BlockDecodeError(f"header length {n} does not fit the file")
    if 8 + n > len(view):
        raise ValueError("parse_header needs the whole header")  # a caller bug, not damage
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BlockDecodeError(f"header is not JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise BlockDecodeError("header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise BlockDecodeError("header metadata is not an object")
    entries = []
    for name, info in header.items():
        try:
            mx_dtype, np_dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BlockDecodeError(f"tensor {name!r}: bad header entry") from None
        if any(d < 0 for d in shape) or end - start != math.prod(shape) * np_dtype.itemsize:
            raise BlockDecodeError(f"tensor {name!r}: shape does not match its bytes")
        entries.append(Entry(name, start, end, shape, mx_dtype, np_dtype))
    entries.sort(key=lambda e: (e.start, e.end))
    cursor = 0
    for e in entries:
        if e.start != cursor:
            raise BlockDecodeError(f"tensor {e.name!r}: gap or overlap at byte {e.start}")
        cursor = e.end
    body = file_size - 8 - n
    if cursor != body:
        raise BlockDecodeError(f"tensors end at byte {cursor} but the body holds {body}")
    return 8 + n, entries, metadata


def decode(data: bytes | memoryview) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Parse a whole block file strictly (see `parse_header`) into mlx arrays.

    Args:
        data: The whole file.

    Returns:
        (tensors by name, header metadata).

    Raises:
        BlockDecodeError: If the file is inconsistent.
    """
    view = memoryview(data)
    body_at, entries, metadata = parse_header(view, len(view))
    tensors = {}
    for e in entries:
        arr = np.frombuffer(view, dtype=e.np_dtype, count=(e.end - e.start) // e.np_dtype.itemsize, offset=body_at + e.start)
        out = mx.array(arr.reshape(e.shape))
        tensors[e.name] = out.view(e.mx_dtype) if out.dtype != e.mx_dtype else out
    return tensors, metadata


BLOCK_FORMAT = "ppc-block/1"


def decode_block(data: bytes, node: Any) -> dict[str, dict[str, Any]]:
    """The tensors (by leaf, then field) of a v1-v2 block file, verified.

    Raises:
        ValueError: If the file does not have the node's size and checksum, does not
            parse, or belongs to another block.
    """
    if len(data) != node.size or checksum(data) != node.checksum:
        raise ValueError("size or checksum mismatch")
    try:
        flat, metadata = decode(data)
    except BlockDecodeError as exc:
        raise ValueError(str(exc)) from None
    if metadata.get("format") != BLOCK_FORMAT or metadata.get("key") != node.key.hex():
        raise ValueError("file of another format or block")
    out: dict[str, dict[str, Any]] = {}
    for name, x in flat.items():
        lid, _, fld = name.rpartition(".")
        out.setdefault(lid, {})[fld] = x
    return out


def read_block(store: str, node: Any) -> dict[str, dict[str, Any]] | None:
    """`decode_block` of a node's file in a v1-v2 store directory; None if missing or damaged."""
    try:
        with open(os.path.join(store, "blocks", file_name(node)), "rb") as f:
            data = f.read(node.size + 1)
        return decode_block(data, node)
    except (OSError, ValueError):
        return None

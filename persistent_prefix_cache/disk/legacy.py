"""Schema v1-v2 block files (one safetensors file per block under ``blocks/``), read by
migration 0003 and by `ppc import` of an export made by those versions."""

from __future__ import annotations

import os
from typing import Any

from . import codec
from .node import Node

BLOCK_FORMAT = "ppc-block/1"


def decode_block(data: bytes, node: Node) -> dict[str, dict[str, Any]]:
    """The tensors (by leaf, then field) of a v1-v2 block file, verified.

    Raises:
        ValueError: If the file does not have the node's size and checksum, does not
            parse, or belongs to another block.
    """
    if len(data) != node.size or codec.checksum(data) != node.checksum:
        raise ValueError("size or checksum mismatch")
    try:
        flat, metadata = codec.decode(data)
    except codec.BlockDecodeError as exc:
        raise ValueError(str(exc)) from None
    if metadata.get("format") != BLOCK_FORMAT or metadata.get("key") != node.key.hex():
        raise ValueError("file of another format or block")
    out: dict[str, dict[str, Any]] = {}
    for name, x in flat.items():
        lid, _, fld = name.rpartition(".")
        out.setdefault(lid, {})[fld] = x
    return out


def read_block(store: str, node: Node) -> dict[str, dict[str, Any]] | None:
    """`decode_block` of a node's file in a v1-v2 store directory; None if missing or damaged."""
    try:
        with open(os.path.join(store, "blocks", node.legacy_file_name), "rb") as f:
            data = f.read(node.size + 1)
        return decode_block(data, node)
    except (OSError, ValueError):
        return None

"""What a segment says about itself: the index records it can rebuild.

A v4 segment (see `segment`) names the model its blocks belong to (root key and the
model's record) and holds every block's index record less its bookkeeping (child
count, last access, hit count), so a damaged index can be rebuilt from the intact
segments. `read_manifest` reads only the header (one small read), checked as strictly
as a read of the blocks checks it; the blocks' bytes are verified when they are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..blocks import Node
from ..files import open_regular
from .segment_header import decode_tokens, parse_header, read_head


@dataclass
class Manifest:
    """The index records a segment file holds.

    Attributes:
        segment: The segment's 16-byte id.
        root: The root key of the model the blocks belong to.
        model: That model's record, exactly as the index stores it (the writer's
            record: a later store may have registered one that knows more fields).
        block_size: The store's block size when the segment was written.
        nodes: Complete index records (key, parent, position, tokens, flags, size,
            checksum, extra, segment), in position order; child count and last
            access are 0.
        digest: The whole-segment digest, as `index_tables.Writer.add_segment` stores it.
        file_bytes: The file's size, as `index_tables.Writer.add_segment` stores it.
    """

    segment: bytes
    root: bytes
    model: bytes
    block_size: int
    nodes: list[Node]
    digest: int
    file_bytes: int


def read_manifest(path: str) -> Manifest:
    """Read the manifest of one segment file.

    Args:
        path: The segment file (``segments/ab/<id>.seg``); a name of that form must
            match the id in the header.

    Returns:
        The segment's manifest.

    Raises:
        ValueError: If the header is damaged, not format v4, or does not describe the
            file (sizes, offsets, header digest).
        OSError: If the file cannot be opened or read.
    """
    name = os.path.basename(path)
    expect = None
    if name.endswith(".seg") and len(name) == 36:
        try:
            expect = bytes.fromhex(name[:32])
        except ValueError:
            expect = None
    fd = open_regular(path)  # a link or a FIFO is refused, never followed or waited on
    try:
        head, size = read_head(fd)
    finally:
        os.close(fd)
    header = parse_header(head, size, expect)
    tokens = decode_tokens(header)
    nodes = [
        Node(
            key=bytes.fromhex(key),
            parent=bytes.fromhex(parent),
            position=int(position),
            tokens=tokens[i],
            flags=flags,
            size=nbytes,
            checksum=int(checksum, 16),
            extra=extra,
            segment=header.segment,
        )
        for i, (key, parent, position, _, flags, nbytes, checksum, extra) in enumerate(header.records)
    ]
    return Manifest(header.segment, header.root, header.model, header.block_size, nodes, header.digest, size)

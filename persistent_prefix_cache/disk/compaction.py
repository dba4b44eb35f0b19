"""Reclaiming the space of partly dead segments.

A segment dies whole when its last block goes (its file is unlinked after that
commit); a segment that lost only some blocks (evicted leaves, a superseded partial
leaf, a block another writer had stored first) keeps their bytes. Once the live part
is at most `SPARSE` of the file, its live blocks are copied into a new segment and
the records moved there in one commit; the old file goes when its last reference
does. Crash-safe like any write: the new segment is durable before the commit, and a
crash before it leaves an unreferenced file for the sweep.
"""

from __future__ import annotations

import logging
from typing import Iterable

from .index import WRITE_ERRORS, Index, Writer
from ..blocks import Node
from .segment import SegmentFiles

log = logging.getLogger("persistent_prefix_cache")

SPARSE = 0.5  # compact a segment once live blocks hold at most this share of its bytes


def compact_sparse(index: Index, files: SegmentFiles, segments: Iterable[bytes]) -> int:
    """Compact those of `segments` that are still referenced and sparse.

    Returns:
        How many segments were compacted.
    """
    done = 0
    for segment in dict.fromkeys(segments):
        with index.reader() as reader:
            held = reader.segment(segment)
        if held is not None and held[0] > 0 and held[1] <= SPARSE * held[2]:
            done += compact(index, files, segment)
    return done


def compact(index: Index, files: SegmentFiles, segment: bytes) -> bool:
    """Copy a segment's live blocks into new segments and move their records there.

    Returns:
        Whether any record moved (False if the segment is gone or damaged; a damaged
        block stays for the read path to find and drop).
    """
    seg = files.open(segment)
    if seg is None:
        return False
    try:
        with index.reader() as reader:
            live = [reader.get(key) for key, _, _ in seg.blocks]
        live = [n for n in live if n is not None and n.segment == segment]
        runs: list[list[tuple[Node, dict]]] = [[]]
        for node in live:
            tensors = seg.block_tensors(node)
            if tensors is None:
                runs.append([])
                continue
            if runs[-1] and runs[-1][-1][0].end != node.position:
                runs.append([])
            copy = Node(**{k: getattr(node, k) for k in Node.__slots__})
            runs[-1].append((copy, tensors))
        root, model, block_size = seg.root, seg.model, seg.block_size  # the copy names the same model
    finally:
        seg.close()
    moved = False
    for run in filter(None, runs):
        try:
            new, size, digest = files.write(run, root=root, model=model, block_size=block_size)
        except (OSError, ValueError) as exc:
            log.warning("could not compact segment %s: %s", segment.hex(), exc)
            return moved
        by_key = {n.key: n for n in live}

        def commit(w: Writer):
            w.add_segment(new, size, digest)
            # The copy's checksum is computed anew from the same bytes: equal, or the
            # block is left where it is.
            count = sum(
                w.move(by_key[copy.key], new) for copy, _ in run if copy.checksum == by_key[copy.key].checksum
            )
            held = w.segment(new)
            if held is not None and held[0] == 0:
                w.free_segment(new)
            return count, w.freed

        try:
            count, freed = index.write(commit)
        except WRITE_ERRORS as exc:
            log.warning("could not compact segment %s: %s", segment.hex(), exc)
            files.unlink([new])
            return moved
        files.unlink(freed)
        moved = moved or count > 0
    return moved

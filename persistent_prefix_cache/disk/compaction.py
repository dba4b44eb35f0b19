"""Rewriting segments: reclaiming partly dead ones, and merging a chain's small ones.

Both copy live blocks into a new segment and move their records there in one commit
(`commit`: crash-safe like any write); an old file goes when its last reference does,
and a record that changed meanwhile (another writer, an eviction) is left where it is.

- **Sparse segments** (`compact_sparse`): a segment that lost some blocks (evicted
  leaves, a superseded partial leaf, a block another writer had stored first) keeps
  their bytes; once the live part is at most `SPARSE` of the file, its live blocks move.
- **A chain stored piece by piece** (`merge_chain`): a prompt stored a block or a turn
  at a time (a server storing after every request, a chat growing turn by turn, a
  caller's own chunked prefill) lands in one segment per `store()`, and a restore pays
  per segment and field (a read, a hash, a header: 64 one-block segments of a 128 MiB
  prompt restored 5 x slower than one segment on a 2-core VM; 256 of them at ~1 GB/s
  instead of 9-13 GB/s on an H200). After each write, the segments at the end of the
  chain it extends are merged while the one before is no larger than what follows it
  (`MERGE_RATIO`): a binary counter, so a chain of n blocks stored one at a time ends in
  at most log2(n) segments (usually one or two), each block rewritten at most log2(n)
  times; a segment holding anything besides this chain, or a block that another prompt
  continues too, ends the merge, so prefixes shared by many prompts are never rewritten.
"""

from __future__ import annotations

import logging
from typing import AbstractSet, Iterable

from ..blocks import Node
from .commit import commit
from .index import WRITE_ERRORS, Index, Writer
from .segment import SegmentFiles

log = logging.getLogger("persistent_prefix_cache")

SPARSE = 0.5  # compact a segment once live blocks hold at most this share of its bytes
# Merge the segment before a chain's tail while it holds at most this many times the
# tail's bytes: 1 is a binary counter (log2(n) segments per chain, log2(n) rewrites per
# block at most); more merges sooner (fewer segments, more rewrites).
MERGE_RATIO = 1.0
# The same for segments of a burst of writes, once the writer is quiet (`merging.Merges.tidy`).
TIDY_RATIO = 4.0


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
            found = [reader.get(key) for key, _, _ in seg.blocks]
        live = [n for n in found if n is not None and n.segment == segment]
        runs: list[list[tuple[Node, dict]]] = [[]]
        for node in live:
            tensors = seg.block_tensors(node)
            if tensors is None:
                runs.append([])
                continue
            if runs[-1] and runs[-1][-1][0].end != node.position:
                runs.append([])
            runs[-1].append((node, tensors))
        root, model, block_size = seg.root, seg.model, seg.block_size  # the copy names the same model
    finally:
        seg.close()
    moved = False
    for run in filter(None, runs):
        done = rewrite(index, files, run, root=root, model=model, block_size=block_size, why="compact")
        if done is None:
            return moved
        moved = moved or bool(done[1])
    return moved


def merge_chain(
    index: Index, files: SegmentFiles, last: bytes, *, burst: AbstractSet[bytes] = frozenset()
) -> tuple[int, bytes | None, list[bytes], int]:
    """Merge the segments at the end of the chain that ends with block `last` (see the
    module's docstring for which).

    Args:
        burst: Segments that may merge up to `TIDY_RATIO` times the tail after them
            (instead of `MERGE_RATIO`).

    Returns:
        (how many segments were merged into one (0: none), the new segment, the keys of
        the blocks whose records moved there, the bytes written).
    """
    with index.reader() as reader:
        groups = _tail_groups(reader, last, burst)
    if len(groups) < 2:
        return 0, None, [], 0
    run: list[tuple[Node, dict]] = []
    root, model, block_size = b"", b"", 0  # what the new header records: set below (two or more segments)
    for segment, nodes in groups:
        seg = files.open(segment)
        if seg is None:
            return 0, None, [], 0
        try:
            got = seg.run_tensors(nodes)
            root, model, block_size = seg.root, seg.model, seg.block_size
        finally:
            seg.close()
        if got is None:  # damaged: left for the read path to find and drop
            return 0, None, [], 0
        run.extend(got)
    done = rewrite(index, files, run, root=root, model=model, block_size=block_size, why="merge segments of")
    if not done or not done[1]:
        return 0, None, [], 0
    return len(groups), done[0], done[1], done[2]


def _tail_groups(reader, last: bytes, burst: AbstractSet[bytes]) -> list[tuple[bytes, list[Node]]]:
    """The segments to merge at the end of the chain ending with block `last`, root-most
    first, each with the chain's blocks it holds (all of its live ones)."""
    groups: list[tuple[bytes, list[Node]]] = []
    tail_bytes = 0
    node = reader.get(last)
    while node is not None:
        segment, nodes = node.segment, []
        while node is not None and node.segment == segment:
            nodes.append(node)
            node = reader.get(node.parent) if node.position > 0 else None
        held = reader.segment(segment)
        size = sum(n.size for n in nodes)
        # Only segments that hold nothing but this stretch of the chain, and, before the
        # newest, a stretch no other prompt continues (one child each): a prefix shared
        # with other continuations stays where it is, read whole by each of them.
        if held is None or held[0] != len(nodes) or (groups and any(n.child_count != 1 for n in nodes)):
            break
        if groups and size > (TIDY_RATIO if segment in burst else MERGE_RATIO) * tail_bytes:
            break
        groups.append((segment, nodes[::-1]))
        tail_bytes += size
        if any(n.link is not None for n in nodes):
            break  # a tenant's blocks after a shared prefix never merge with the shared ones
    return groups[::-1]


def rewrite(
    index: Index,
    files: SegmentFiles,
    run: list[tuple[Node, dict]],
    *,
    root: bytes,
    model: bytes,
    block_size: int,
    why: str,
) -> tuple[bytes, list[bytes], int] | None:
    """Write one chain of stored blocks, read from their segments, into a new segment and
    move their records there in one commit (a record that changed meanwhile stays).

    Args:
        run: ``(node as the index holds it, its tensors)`` per block, in chain order.
        root, model, block_size: What the new segment's header records.
        why: What the warning of a failure says was attempted.

    Returns:
        (the new segment, the keys of the records moved there (none: the segment is
        gone again), its size); None if it could not be written or committed.
    """
    copies = [(Node(**{k: getattr(node, k) for k in Node.__slots__}), tensors) for node, tensors in run]
    try:
        new, size, digest = files.write(copies, root=root, model=model, block_size=block_size)
    except (OSError, ValueError) as exc:
        log.warning("could not %s segment(s) %s: %s", why, run[0][0].segment.hex(), exc)
        return None

    def records(w: Writer) -> list[bytes]:
        # The copy's checksum is computed anew from the same bytes: equal, or the block
        # is left where it is.
        return [
            node.key
            for (node, _), (copy, _) in zip(run, copies)
            if copy.checksum == node.checksum and w.move(node, new)
        ]

    try:
        moved = commit(index, files, records, new=[(new, size, digest)], before="before_move")
    except WRITE_ERRORS as exc:
        log.warning("could not %s segment(s) %s: %s", why, run[0][0].segment.hex(), exc)
        return None
    return new, moved, size

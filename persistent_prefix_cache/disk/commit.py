"""The commit protocol: how blocks written into new segment files become part of the store,
and how segment files leave it. Every write of the store follows it (the writer's group
commit, compaction and merges, ``ppc import``), and every removal (eviction, ``ppc gc``,
a damaged block dropped, a repair).

The steps, and why a crash at any point between them leaves the store consistent (the
index names only durable files, and a file goes only once nothing names it):

1. **Durable files.** Each new segment is written under ``tmp/``, fsynced and renamed
   into ``segments/`` (`SegmentFiles.write`, `SegmentFiles.publish`), and its folder is
   fsynced (by that call, or once per folder for a group with
   `SegmentFiles.sync_folders`): the caller's part, done before `commit`. A crash here
   leaves a temporary file or a segment nothing names, which the sweeps remove.
2. **One index transaction** (`commit`): the models registered, the new segments
   referenced (`register`), the blocks' records inserted or moved there by the caller's
   `change` (with whatever else it commits in the same transaction: recency, evictions),
   and every new segment none of whose blocks was taken (all stored by another writer
   first, or moved elsewhere meanwhile) freed again. LMDB commits it whole or not at
   all, so a crash leaves either the index before it (the files of step 1 are
   unreferenced) or after it (every file it names is durable).
3. **A failed transaction** (a full disk, a damaged page: the index is as it was)
   unlinks the new segments at once: nothing references them (a segment written here
   has a random id, this writer's alone; an imported one a pack's id the index did not
   hold). A crash before the unlink leaves unreferenced files again.
4. **After the commit**, the segments the transaction freed (none of their blocks is
   left) are unlinked: the removal is committed first, so no reader is ever sent to a
   file that is gone; a crash before the unlink leaves unreferenced files.

An index rebuild (``ppc check --fix``, `rebuild`) takes another road: it builds a new
index beside the damaged one from segment files that are already the store's (the
truth, never to be unlinked if the transaction fails) and swaps it in; it shares step
2's `register` only.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from .faults import hold_point, pause_point
from .index import WRITE_ERRORS, Index, Writer
from .segment import SegmentFiles

T = TypeVar("T")

# A new segment as `SegmentFiles.write` returns it: (id, file bytes, whole-segment digest).
NewSegment = tuple[bytes, int, int]


def register(w: Writer, segments: Iterable[NewSegment], models: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Step 2's start, inside the caller's transaction: record each model (root key,
    JSON record) and reference each segment (its blocks are inserted or moved after).

    Args:
        w: The transaction.
        segments: ``(id, file bytes, digest)`` per segment.
        models: ``(root key, record)`` per model the segments' blocks belong to.
    """
    for root, record in models:
        w.register_model(root, record)
    for segment, size, digest in segments:
        w.add_segment(segment, size, digest)


def commit(
    index: Index,
    files: SegmentFiles,
    change: Callable[[Writer], T],
    *,
    new: Iterable[NewSegment] = (),
    models: Iterable[tuple[bytes, bytes]] = (),
    before: str | None = None,
    after: str | None = None,
) -> T:
    """Steps 2 to 4 of the protocol (see the module): one index transaction that
    references the `new` segments and runs `change`, then the unlinks.

    Args:
        index: The store's index.
        files: The store's segment files.
        change: Inserts or moves the blocks' records (or removes some), with whatever
            else the caller commits with them; run inside the transaction, perhaps more
            than once (a full map is grown and the transaction run again).
        new: The new segments, durable already (step 1); empty for a removal.
        models: ``(root key, record)`` to register with them.
        before: The test hooks' point just before the transaction (a pause point and a
            hold point of that name: `faults`).
        after: The test hooks' pause point just after the commit, before any unlink.

    Returns:
        What `change` returned.

    Raises:
        lmdb.Error, OSError, StoreCorruptError: The transaction failed (`WRITE_ERRORS`):
            the index is as it was, and the new segments are unlinked.
    """
    new = list(new)
    models = list(models)

    def transaction(w: Writer) -> tuple[T, list[bytes]]:
        register(w, new, models)
        if new:  # SSD wear, store-wide: every segment byte written (`ppc stats`)
            w.add_counters({"written_bytes": sum(size for _, size, _ in new)})
        result = change(w)
        for segment, _, _ in new:
            held = w.segment(segment)
            if held is not None and held[0] == 0:
                w.free_segment(segment)  # none of its blocks was taken
        return result, w.freed

    if before is not None:
        pause_point(before)
        hold_point(before)
    try:
        result, freed = index.write(transaction)
    except WRITE_ERRORS:
        files.unlink([segment for segment, _, _ in new])
        raise
    if after is not None:
        pause_point(after)
    files.unlink(freed)
    return result

"""Rebuild a store's index from its segment files (``ppc check --fix`` on a damaged index).

The segments are the truth and the index is a cache of them: every segment names
its model (root key and record) and holds its blocks' complete index records (see
`manifest`). `rebuild_index` reads every segment (`read_manifest`, the whole-segment
digest and every block's checksum verified; a segment of format v4, whose checksums
were bound to nothing, is verified by the v4 rule and rewritten as v5 first, the v4
file unlinked once the new index is in), keeps each block whose parent chain is
complete back to its model's root, and writes a fresh index beside the damaged one,
then swaps it in. Only bookkeeping is lost: recency (a block's last access becomes its
segment file's modification time, so eviction still goes oldest first), hit counts,
the store-wide counters and remembered fingerprints (recomputed on the next load).

Crash-safe, in steps that a rerun recognises (see `store_guard`)::

    damaged-<time>/  segment files that are not intact moved here first
    index.rebuild/index/  written and committed (LMDB fsyncs the commit)
    index.new/       renamed from index.rebuild/index/ once complete; store folder fsynced
    damaged-<time>/  the damaged index renamed into it, with unusable segment files
    index/           index.new/ renamed in; store folder fsynced

A rerun finds ``index.new/`` and finishes the swap, or finds ``index.rebuild/`` and
starts over. The store lock is held exclusively throughout: no other process has the
store open while its index moves.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

from ..errors import ReadOnlyStoreError
from ..keys import block_key
from ..migrations.formats import segment_v4
from . import store_guard
from .faults import pause_point
from .index import Index
from .manifest import Manifest, read_manifest
from ..blocks import DEFAULT_BLOCK_SIZE, Node
from .segment import SegmentFiles
from .portable import fsync_dir


@dataclass
class RebuildReport:
    """What `rebuild_index` did.

    Attributes:
        segments: Segment files found.
        unusable: Segment files set aside (``(file, why)``: damaged, or of format v3).
        converted: Intact segment files of format v4 rewritten as v5.
        blocks: Blocks in the new index.
        dropped: Intact blocks left out because a block before them is missing.
        models: Models in the new index.
        block_size: The block size stamped in the new index.
        aside: Where the damaged index (and unusable segments) went.
        resumed: True if an interrupted rebuild's complete index was swapped in.
    """

    segments: int = 0
    unusable: list[tuple[str, str]] = field(default_factory=list)
    converted: int = 0
    blocks: int = 0
    dropped: int = 0
    models: int = 0
    block_size: int = 0
    aside: str | None = None
    resumed: bool = False

    def to_dict(self) -> dict:
        """The report as JSON-ready data (``ppc check --json``'s ``rebuild``)."""
        return {
            "segments": self.segments,
            "unusable": [{"file": f, "why": w} for f, w in self.unusable],
            "converted": self.converted,
            "blocks": self.blocks,
            "dropped": self.dropped,
            "models": self.models,
            "block_size": self.block_size,
            "aside": self.aside,
            "resumed": self.resumed,
        }


def _segment_paths(store: str) -> list[str]:
    top = os.path.join(store, "segments")
    out = []
    if os.path.isdir(top):
        for sub in sorted(os.scandir(top), key=lambda e: e.name):
            if sub.is_dir():
                out += [e.path for e in sorted(os.scandir(sub.path), key=lambda e: e.name) if e.name.endswith(".seg")]
    return out


def _read_intact(files: SegmentFiles, path: str) -> tuple[Manifest | None, str]:
    """A segment's manifest if the whole file is intact, else (None, why)."""
    try:
        m = read_manifest(path)
    except (ValueError, OSError) as exc:
        return None, f"header: {exc}"
    if files.digest_of(m.segment) != m.digest:
        return None, "whole-segment digest mismatch"
    for node in m.nodes:
        problem = files.verify(node)
        if problem is not None:
            return None, f"block {node.key.hex()}: {problem}"
    return m, ""


def _convert_v4(files: SegmentFiles, path: str) -> Manifest | None:
    """A segment file of format v4, every block verified by the v4 rule (its bytes
    alone), rewritten as one v5 segment: the new segment's manifest; None if the file
    is not an intact v4 segment."""
    seg = segment_v4.open_path(path)
    if seg is None:
        return None
    try:
        nodes = [Node(**kw) for kw in segment_v4.records_of(seg)]
        blocks = [(node, seg.block_tensors(node)) for node in nodes]
        root, model, block_size = seg.root, seg.model, seg.block_size
    except ValueError:
        return None
    finally:
        seg.close()
    if any(tensors is None for _, tensors in blocks):
        return None
    try:
        new, _, _ = files.write(blocks, root=root, model=model, block_size=block_size)
    except ValueError:
        return None
    return read_manifest(files.path_of(new))


def _chained(manifests: list[tuple[Manifest, int]]) -> tuple[dict[bytes, Node], int]:
    """The blocks whose parent chain is complete back to a root, by key; and how many
    intact blocks were left out (their chain is broken by a missing block)."""
    roots = {m.root for m, _ in manifests}
    candidates: dict[bytes, Node] = {}
    for m, mtime in manifests:
        for node in m.nodes:
            if node.key in candidates:
                continue  # the same block in two segments (a race, a compaction): one copy
            node.child_count, node.last_access = 0, mtime
            candidates[node.key] = node
    kept: dict[bytes, Node] = {}
    for node in sorted(candidates.values(), key=lambda n: n.position):
        if block_key(node.parent, node.tokens) != node.key:
            continue
        parent = kept.get(node.parent)
        if parent is None:
            if node.parent not in roots or node.position != 0:
                continue
        elif parent.end != node.position:
            continue
        kept[node.key] = node
    return kept, len(candidates) - len(kept)


def _superseded(kept: dict[bytes, Node], block_size: int) -> set[bytes]:
    """Partial leaves whose tokens begin a sibling's (the index had dropped them when
    the longer block was stored: bookkeeping, not data)."""
    by_parent: dict[bytes, list[Node]] = {}
    for n in kept.values():
        by_parent.setdefault(n.parent, []).append(n)
    parents = {n.parent for n in kept.values()}
    out = set()
    for siblings in by_parent.values():
        for n in siblings:
            if n.n_tokens < block_size and n.key not in parents:
                if any(o is not n and o.n_tokens > n.n_tokens and o.tokens.startswith(n.tokens) for o in siblings):
                    out.add(n.key)
    return out


def _finish_swap(store: str, stamp: str) -> str | None:
    """Swap a complete ``index.new/`` in; returns where the old index went."""
    new = os.path.join(store, store_guard.COMPLETE)
    index = os.path.join(store, "index")
    aside = None
    if os.path.isdir(index):
        aside = os.path.join(store, store_guard.ASIDE_PREFIX + stamp)
        os.makedirs(aside, exist_ok=True)
        os.rename(index, os.path.join(aside, "index"))
        fsync_dir(store)
        pause_point("rebuild_swap")
    os.rename(new, index)
    fsync_dir(store)
    return aside


def rebuild_index(store: str, *, block_size: int | None = None) -> RebuildReport:
    """Rebuild the index of `store` from its segment files and swap it in.

    Args:
        store: The store directory.
        block_size: The store's block size if known (read from the damaged index);
            the segments' own record of it wins (every segment names the block size
            it was cut with), and the default is taken when there is neither.

    Returns:
        A `RebuildReport`.

    Raises:
        StoreBusyError: If another process has the store open.
        ReadOnlyStoreError: If the store cannot be written.
    """
    store = os.path.realpath(store)
    if not os.access(store, os.W_OK):
        raise ReadOnlyStoreError(
            f"store {store} is not writable: its index cannot be rebuilt here",
            hint="run `ppc check --fix` with write access to the store, or on a writable copy of it",
        )
    report = RebuildReport()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    building = os.path.join(store, store_guard.BUILDING)
    with store_guard.exclusive(store):
        if os.path.isdir(os.path.join(store, store_guard.COMPLETE)):
            shutil.rmtree(building, ignore_errors=True)
            report.aside = _finish_swap(store, stamp)  # an interrupted run got this far
            report.resumed = True
            return report
        shutil.rmtree(building, ignore_errors=True)
        files = SegmentFiles(store)
        manifests, unusable, converted = [], [], []
        for path in _segment_paths(store):
            report.segments += 1
            m, why = _read_intact(files, path)
            if m is None and why.startswith("header:"):
                m = _convert_v4(files, path)
                if m is not None:
                    converted.append(path)
            if m is None:
                unusable.append(path)
                report.unusable.append((os.path.relpath(path, store), why))
            else:
                manifests.append((m, os.stat(path).st_mtime_ns))
        aside = os.path.join(store, store_guard.ASIDE_PREFIX + stamp)
        for path in unusable:  # kept for a closer look, out of the sweeps' way (before the swap)
            target = os.path.join(aside, os.path.relpath(path, store))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(path, target)
        kept, report.dropped = _chained(manifests)
        recorded = {m.block_size for m, _ in manifests}
        if recorded:
            block_size = max(recorded)  # one store, one block size: its segments say which
        elif block_size is None:
            block_size = DEFAULT_BLOCK_SIZE
        for key in _superseded(kept, block_size):
            kept.pop(key)
        report.blocks, report.block_size = len(kept), block_size
        roots = {m.root for m, _ in manifests}
        report.models = len({n.parent for n in kept.values() if n.parent in roots})
        segments = {m.segment: m for m, _ in manifests}

        def fill(w):
            for m, _ in manifests:  # the record that knows the most fields wins
                w.register_model(m.root, m.model)
            for seg in {n.segment for n in kept.values()}:
                w.add_segment(seg, segments[seg].file_bytes, segments[seg].digest)
            for node in sorted(kept.values(), key=lambda n: n.position):
                w.insert(node)

        # The new index sits one folder down: migrations clean the folder above the
        # index they stamp (0003 empties its segments/), which must not be the store.
        index = Index(os.path.join(building, "index"), block_size=block_size)
        try:
            index.write(fill)
        finally:
            index.close()
        pause_point("rebuild_built")
        os.rename(os.path.join(building, "index"), os.path.join(store, store_guard.COMPLETE))
        fsync_dir(store)
        shutil.rmtree(building, ignore_errors=True)
        report.aside = _finish_swap(store, stamp) or (aside if unusable else None)
        for path in converted:  # their blocks live in the v5 copies the new index names
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        report.converted = len(converted)
    return report

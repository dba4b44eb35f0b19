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

import json

import os
import secrets
import shutil
import time
from dataclasses import dataclass, field

from ..blocks import DEFAULT_BLOCK_SIZE, Node
from ..disk import store_guard
from ..disk.commit import register
from ..disk.faults import pause_point
from ..disk.index import Index
from ..disk.manifest import Manifest, read_manifest
from ..disk.portable import fsync_dir
from ..disk.segment import SegmentFiles
from ..disk.store_dir import folder, make_dirs, remove_entry
from ..errors import ReadOnlyStoreError
from ..keys import key_follows
from ..migrations.formats import segment_v4


@dataclass
class RebuildReport:
    """What `rebuild_index` did.

    Attributes:
        segments: Segment files found.
        unusable: Segment files set aside (``(file, why)``: damaged, or of format v3).
        converted: Intact segment files of format v4 rewritten as v5.
        blocks: Blocks in the new index.
        dropped: Intact blocks left out because a block before them is missing.
        emptied: Intact segment files removed because the new index keeps none of their
            blocks (every one of them was dropped or superseded): orphans otherwise, which
            a later ``ppc check`` would report once they are older than its grace.
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
    emptied: int = 0
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
            "emptied": self.emptied,
            "models": self.models,
            "block_size": self.block_size,
            "aside": self.aside,
            "resumed": self.resumed,
        }


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
    roots = {m.root for m, _ in manifests} | {r for m, _ in manifests if (r := _shared_root(m.model)) is not None}
    candidates: dict[bytes, Node] = {}
    for m, mtime in manifests:
        for node in m.nodes:
            if node.key in candidates:
                continue  # the same block in two segments (a race, a compaction): one copy
            node.child_count, node.last_access = 0, mtime
            candidates[node.key] = node
    kept: dict[bytes, Node] = {}
    for node in sorted(candidates.values(), key=lambda n: n.position):
        if not key_follows(node):
            continue
        parent = kept.get(node.parent)
        if parent is None:
            if node.parent not in roots or node.position != 0:
                continue
        elif parent.end != node.position:
            continue
        kept[node.key] = node
    return kept, len(candidates) - len(kept)


def _shared_root(model: bytes) -> bytes | None:
    """The shared prefixes' root a tenant's model record names (`keys.TenantRoot`): a
    tenant's segment may hold shared blocks, which hang under that root."""
    try:
        shared = json.loads(model).get("shared_root")
        return bytes.fromhex(shared) if isinstance(shared, str) and len(shared) == 32 else None
    except (ValueError, AttributeError):
        return None


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


def _remove_tree(store: str, name: str) -> None:
    """Remove a folder of the store's top level and what it holds; a link there is
    removed itself (``shutil.rmtree`` never follows one, nor walks through one)."""
    path = os.path.join(store, name)
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


class _Aside:
    """The folder a repair sets things aside in, ``damaged-<time>-<pid>-<random>``: made
    when first needed, exclusively (nobody can have put a link at that name), and filled
    by descriptor."""

    def __init__(self, store: str):
        self.store = store
        self.name = store_guard.ASIDE_PREFIX + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.name += f"-{os.getpid()}-{secrets.token_hex(3)}"
        self.made = False

    def move(self, rel: str) -> None:
        """Move the entry `rel` of the store (``index``, ``segments/ab/<id>.seg``) into
        the folder, at the same relative path."""
        if not self.made:
            with folder(self.store) as root:
                os.mkdir(self.name, 0o700, dir_fd=root)
            make_dirs(os.path.join(self.store, self.name), self.store)  # the store's folder mode
            self.made = True
        parent, name = os.path.split(rel)
        make_dirs(os.path.join(self.store, self.name, parent), self.store)
        with folder(self.store, parent) as src, folder(self.store, os.path.join(self.name, parent)) as dst:
            os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)

    @property
    def path(self) -> str | None:
        """Where it is (None if nothing was set aside)."""
        return os.path.join(self.store, self.name) if self.made else None


def _finish_swap(store: str, aside: _Aside) -> str | None:
    """Swap a complete ``index.new/`` in; returns where the old index went."""
    if os.path.lexists(os.path.join(store, "index")):
        aside.move("index")
        fsync_dir(store)
        pause_point("rebuild_swap")
    with folder(store) as root:
        os.rename(store_guard.COMPLETE, "index", src_dir_fd=root, dst_dir_fd=root)
    fsync_dir(store)
    return aside.path


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
    aside = _Aside(store)
    with store_guard.exclusive(store):
        if os.path.isdir(os.path.join(store, store_guard.COMPLETE)) and not os.path.islink(
            os.path.join(store, store_guard.COMPLETE)
        ):
            _remove_tree(store, store_guard.BUILDING)
            report.aside = _finish_swap(store, aside)  # an interrupted run got this far
            report.resumed = True
            return report
        for name in (store_guard.BUILDING, store_guard.COMPLETE):
            _remove_tree(store, name)  # what an earlier run (or somebody) left there
        files = SegmentFiles(store)
        manifests, unusable, converted = [], [], []
        listed: dict[bytes, str] = {}  # segment id -> its file
        for rel in files.listed():  # regular files only, in folders that are not links
            path = os.path.join(store, rel)
            report.segments += 1
            m, why = _read_intact(files, path)
            if m is None and why.startswith("header:"):
                m = _convert_v4(files, path)
                if m is not None:
                    converted.append(rel)
            if m is None:
                unusable.append(rel)
                report.unusable.append((rel, why))
            else:
                manifests.append((m, os.lstat(path).st_mtime_ns))
                listed[m.segment] = rel
        for rel in unusable:  # kept for a closer look, out of the sweeps' way (before the swap)
            aside.move(rel)
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
            # Files that are the store's already, into a new index: `register` alone, not
            # `commit` (which unlinks the segments of a transaction that fails). Each
            # model's records in turn: the one that knows the most fields wins.
            used = [segments[seg] for seg in {n.segment for n in kept.values()}]
            models = [(m.root, m.model) for m, _ in manifests]
            register(w, [(m.segment, m.file_bytes, m.digest) for m in used], models)
            for node in sorted(kept.values(), key=lambda n: n.position):
                w.insert(node)

        # The new index sits one folder down: migrations clean the folder above the
        # index they stamp (0003 empties its segments/), which must not be the store.
        index = Index(os.path.join(store, store_guard.BUILDING, "index"), block_size=block_size)
        try:
            index.write(fill)
        finally:
            index.close()
        pause_point("rebuild_built")
        with folder(store, store_guard.BUILDING) as src, folder(store) as root:
            os.rename("index", store_guard.COMPLETE, src_dir_fd=src, dst_dir_fd=root)
        fsync_dir(store)
        _remove_tree(store, store_guard.BUILDING)
        report.aside = _finish_swap(store, aside)
        for rel in converted:  # their blocks live in the v5 copies the new index names
            remove_entry(store, rel, regular_only=True)
        report.converted = len(converted)
        # Files the new index names no block of: their blocks are unreachable (a block
        # before them is lost) or superseded. The lock is still held, so none of them can
        # be a write in flight: removed now, not left to a later sweep's grace.
        used = {n.segment for n in kept.values()}
        emptied = [rel for seg, rel in listed.items() if seg not in used and rel not in converted]
        for rel in emptied:
            remove_entry(store, rel, regular_only=True)
        report.emptied = len(emptied)
    return report

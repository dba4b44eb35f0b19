"""The index's tables (schema v3) and the operations on them inside one transaction.

Every table is a key prefix in LMDB's main database (schema v1-v2 used named
databases; opening one takes LMDB's write lock in a writable environment, so every
open had to wait behind another process's commit). `Reader` and `Writer` are handed
out by `index.Index`; nothing else touches a transaction.

Tables (prefix byte, key -> value):

- meta ``\\x01``: name -> value (schema version, block size, totals, counters; u64 LE)
- models ``\\x02``: root key -> JSON (fingerprint, namespace, layout, leaves)
- nodes ``\\x03``: block key -> packed `Node`
- children ``\\x04``: parent key + child key -> empty (the trie's edges)
- lru ``\\x05``: last access (u64 BE, ns) + block key -> empty (eviction order)
- fingerprints ``\\x06``: weight files' signature -> JSON (fingerprint, sample digest of
  the model it was computed from, folder; a bare hex fingerprint before)
- hits ``\\x07``: block key -> u64 LE count of fetches that restored the block
- segments ``\\x08``: segment id -> live blocks, live bytes, file bytes (3 x u64 LE)
- digests ``\\x09``: segment id -> u64 LE xxh3 of its sliced fields' bytes and its
  snapshots' digests (verifies a read of the whole segment at once)
- owners, owned, owned lru ``\\x0a``-``\\x0c``: what each accounted root (a namespace
  with a quota) owns, kept by `index_owners.Owners` in the same transactions
"""

from __future__ import annotations

import heapq
import json
import struct
from typing import Any, Iterable, Iterator

from ..blocks import Node
from .index_owners import Owners

META, MODELS, NODES, CHILDREN, LRU, FINGERPRINTS, HITS, SEGMENTS, DIGESTS = (bytes([i]) for i in range(1, 10))
# The tables' layout (prefixes, keys, value encodings): schema v3's. Raise it with the
# migration that changes them, after freezing what older migrations write (tests/test_layout.py).
TABLES_VERSION = 3
# Over every process: fetches that restored or not, tokens restored, damage met, and
# for SSD wear the segment bytes written (every commit of new segments: stores, merges,
# imports) and the block bytes restores took (both counted from 2026-12-05 on: 0 before).
STORE_WIDE_COUNTERS = ("hits", "misses", "tokens_saved", "corrupt", "written_bytes", "restored_bytes")
_SEG = struct.Struct("<QQQ")


def u64(n: int) -> bytes:
    """8 bytes, little-endian."""
    return int(n).to_bytes(8, "little")


def _lru_key(access: int, key: bytes) -> bytes:
    return LRU + access.to_bytes(8, "big") + key  # big-endian sorts by time


def _fingerprint_entry(raw: bytes) -> dict:
    # Entries written before verification were the bare hex fingerprint: no sample,
    # so never trusted (`fingerprint.cached_fingerprint` hashes and replaces them).
    try:
        entry = json.loads(raw)
    except ValueError:
        entry = None
    if not isinstance(entry, dict):
        return {"fingerprint": raw.decode("utf-8", "replace")}
    return entry


class Reader:
    """Read operations inside one transaction.

    Args:
        txn: An LMDB transaction (from `index.Index.reader` or `index.Index.write`).
    """

    def __init__(self, txn: Any):
        self.txn = txn

    def _scan(self, prefix: bytes, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(key without the prefix, value) of every key under `prefix`, from `start`."""
        with self.txn.cursor() as cur:
            if not cur.set_range(prefix + start):
                return
            for key, value in cur:
                if not key.startswith(prefix):
                    return
                yield bytes(key[len(prefix) :]), bytes(value)

    def meta(self, name: bytes) -> bytes | None:
        """A raw value of the meta table."""
        return self.txn.get(META + name)

    def _meta_int(self, name: bytes) -> int:
        raw = self.meta(name)
        return int.from_bytes(raw, "little") if raw else 0

    def get(self, key: bytes) -> Node | None:
        """The node stored under `key`, or None (also None for a malformed record)."""
        raw = self.txn.get(NODES + key)
        if raw is None:
            return None
        try:
            return Node.unpack(key, raw)
        except ValueError:
            return None

    def get_raw(self, key: bytes) -> bytes | None:
        """The packed record stored under `key` (matched undecoded by the lookup)."""
        return self.txn.get(NODES + key)

    def children(self, parent: bytes) -> list[Node]:
        """Child nodes of `parent`, in key order."""
        out = []
        for edge, _ in self._scan(CHILDREN + parent):
            node = self.get(edge)
            if node is not None:
                out.append(node)
        return out

    def totals(self) -> tuple[int, int]:
        """(bytes of the stored blocks, number of blocks)."""
        return self._meta_int(b"bytes"), self._meta_int(b"blocks")

    def file_bytes(self) -> int:
        """Bytes of the segment files the index references (dead space included)."""
        return self._meta_int(b"file_bytes")

    def counters(self) -> dict[str, int]:
        """Store-wide hit counters (all processes, since the store was made)."""
        return {name: self._meta_int(name.encode()) for name in STORE_WIDE_COUNTERS}

    def hits(self, key: bytes) -> int:
        """How many fetches restored the block `key`."""
        raw = self.txn.get(HITS + key)
        return int.from_bytes(raw, "little") if raw else 0

    def iter_nodes(self) -> Iterator[Node]:
        """Every node, in key order (malformed records are skipped)."""
        for key, raw in self._scan(NODES):
            try:
                yield Node.unpack(key, raw)
            except ValueError:
                continue

    def model(self, root: bytes) -> bytes | None:
        """The JSON description of one model, if it was recorded."""
        raw = self.txn.get(MODELS + root)
        return bytes(raw) if raw is not None else None

    def models(self) -> dict[bytes, bytes]:
        """Root key -> JSON description of every model stored."""
        return dict(self._scan(MODELS))

    def filled_models(self) -> list[dict]:
        """The description (``root`` in hex, ``fingerprint``, ``namespace``, ``layout``)
        of every model with at least one stored block; unreadable records are left out."""
        out = []
        for root, raw in self.models().items():
            if not self.children(root):
                continue
            try:
                out.append({"name": None, **json.loads(raw), "root": root.hex()})  # no name before issue 17
            except (ValueError, TypeError):
                continue  # an unreadable record names no model one could compare with
        return out

    def edges(self) -> set[tuple[bytes, bytes]]:
        """Every trie edge as (parent key, child key)."""
        return {(k[:16], k[16:]) for k, _ in self._scan(CHILDREN)}

    def lru_entries(self) -> set[tuple[int, bytes]]:
        """Every entry of the LRU order as (last access, key)."""
        return {(int.from_bytes(k[:8], "big"), k[8:]) for k, _ in self._scan(LRU)}

    def fingerprint(self, signature: bytes) -> dict | None:
        """The entry remembered for a weight files' signature, if any: ``fingerprint``;
        entries written since they are verified also ``sample``, ``folder``, ``compared``."""
        raw = self.txn.get(FINGERPRINTS + signature)
        return _fingerprint_entry(bytes(raw)) if raw else None

    def fingerprints(self) -> dict[bytes, dict]:
        """Every remembered fingerprint entry, by weight files' signature."""
        return {sig: _fingerprint_entry(raw) for sig, raw in self._scan(FINGERPRINTS)}

    def owned(self, root: bytes) -> tuple[int, int] | None:
        """``(blocks, bytes)`` an accounted root owns (`index_owners`), None if not accounted."""
        return Owners(self.txn).use(root)

    def accounted(self) -> dict[bytes, tuple[int, int]]:
        """Every accounted root (a namespace with a quota) with ``(blocks, bytes)``."""
        return Owners(self.txn).accounted()

    def segment(self, segment: bytes) -> tuple[int, int, int] | None:
        """(live blocks, live bytes, file bytes) of a segment, or None if not referenced."""
        raw = self.txn.get(SEGMENTS + segment)
        return _SEG.unpack(raw) if raw else None

    def segment_digest(self, segment: bytes) -> int | None:
        """The digest of a whole segment (see `segment.SegmentFiles.write`)."""
        raw = self.txn.get(DIGESTS + segment)
        return int.from_bytes(raw, "little") if raw else None

    def segments(self) -> dict[bytes, tuple[int, int, int]]:
        """Every referenced segment: id -> (live blocks, live bytes, file bytes)."""
        return {k: _SEG.unpack(v) for k, v in self._scan(SEGMENTS)}


class Writer(Reader):
    """Write operations inside one write transaction.

    Segments whose last block was removed are collected in `freed`: the caller
    unlinks their files after the transaction committed; the keys of blocks evicted
    in `evicted` (`Index.write` remembers them once committed, for `disk.removed`).
    """

    def __init__(self, txn: Any):
        super().__init__(txn)
        self.freed: list[bytes] = []
        self.evicted: list[bytes] = []
        self.owners = Owners(txn)

    def _add_meta(self, name: bytes, delta: int) -> None:
        if delta:
            self.txn.put(META + name, u64(self._meta_int(name) + delta))

    def _put(self, node: Node) -> None:
        self.txn.put(NODES + node.key, node.pack())

    def put_meta(self, name: bytes, value: bytes) -> None:
        """Set a raw value of the meta table."""
        self.txn.put(META + name, value)

    def register_model(self, root: bytes, description: bytes) -> None:
        """Record a model's root key and description (again only if it learned fields,
        or names a model the record did not name; the first name recorded stays)."""
        current = self.txn.get(MODELS + root)
        if current is not None:
            try:
                known, new = json.loads(current), json.loads(description)
                if set(new.get("fields") or {}) <= set(known.get("fields") or {}) and (
                    known.get("name") or not new.get("name")
                ):
                    return
                if known.get("name"):
                    description = json.dumps({**new, "name": known["name"]}).encode()
            except (ValueError, AttributeError):
                pass  # an unreadable record: replace it
        self.txn.put(MODELS + root, description)

    def forget_model(self, root: bytes) -> list[Node]:
        """Remove every block of a model and its record (a handle still open on it
        records it again with its next block).

        Returns:
            The removed nodes.
        """
        removed = [n for child in self.children(root) for n in self.remove_subtree(child.key)]
        self.txn.delete(MODELS + root)
        return removed

    def remember_fingerprint(self, signature: bytes, entry: dict) -> None:
        """Remember a fingerprint entry (JSON) under its weight files' signature."""
        self.txn.put(FINGERPRINTS + signature, json.dumps(entry, sort_keys=True).encode())

    def forget_fingerprint(self, signature: bytes) -> bool:
        """Forget the entry of a weight files' signature; whether there was one."""
        return self.txn.delete(FINGERPRINTS + signature)

    def add_segment(self, segment: bytes, file_bytes: int, digest: int) -> None:
        """Reference a newly written segment file (its blocks are inserted after)."""
        if self.segment(segment) is None:
            self.txn.put(SEGMENTS + segment, _SEG.pack(0, 0, file_bytes))
            self.txn.put(DIGESTS + segment, u64(digest))
            self._add_meta(b"file_bytes", file_bytes)

    def _segment_add(self, segment: bytes, blocks: int, nbytes: int) -> None:
        current = self.segment(segment)
        if current is None:
            return
        live, live_bytes, size = current[0] + blocks, current[1] + nbytes, current[2]
        if live > 0:
            self.txn.put(SEGMENTS + segment, _SEG.pack(live, live_bytes, size))
        else:
            self.free_segment(segment)

    def free_segment(self, segment: bytes) -> None:
        """Drop a segment's entry (its file goes once the transaction committed)."""
        current = self.segment(segment)
        if current is not None:
            self.txn.delete(SEGMENTS + segment)
            self.txn.delete(DIGESTS + segment)
            self._add_meta(b"file_bytes", -current[2])
            self.freed.append(segment)

    def insert(self, node: Node) -> bool:
        """Add a node under its parent (its segment must be referenced).

        Returns:
            False (and nothing changed) if the key exists already, or the parent is
            neither a root nor a stored node (it was evicted meanwhile).
        """
        if self.txn.get(NODES + node.key) is not None:
            return False
        parent = self.get(node.parent)
        if parent is None and node.position != 0:
            return False
        owner = self.owners.owner_of_new(node, parent)
        if parent is not None:
            parent.child_count += 1
            self._put(parent)
        self._put(node)
        if owner is not None:
            self.owners.added(node, owner)
        self.txn.put(CHILDREN + node.parent + node.key, b"")
        self.txn.put(_lru_key(node.last_access, node.key), b"")
        self._add_meta(b"bytes", node.size)
        self._add_meta(b"blocks", 1)
        self._segment_add(node.segment, 1, node.size)
        return True

    def add_counters(self, deltas: dict[str, int]) -> None:
        """Add to the store-wide counters."""
        for name, delta in deltas.items():
            self._add_meta(name.encode(), delta)

    def count_hits(self, counts: dict[bytes, int]) -> None:
        """Add fetch counts to stored blocks (keys no longer stored are skipped)."""
        for key, n in counts.items():
            if self.txn.get(NODES + key) is not None:
                self.txn.put(HITS + key, u64(self.hits(key) + n))

    def touch(self, key: bytes, now: int) -> None:
        """Move a node to the recent end of the LRU order."""
        node = self.get(key)
        if node is None or node.last_access >= now:
            return
        self.owners.touched(node, now)
        self.txn.delete(_lru_key(node.last_access, key))
        node.last_access = now
        self._put(node)
        self.txn.put(_lru_key(now, key), b"")

    def move(self, node: Node, segment: bytes, *, checksum: int | None = None) -> bool:
        """Point a stored node at a copy of its bytes in another (referenced) segment.

        Args:
            checksum: The copy's checksum where the new segment computes it by another
                rule (a format migration); None: the same checksum.

        Returns:
            False (nothing changed) if the node is gone or no longer the one given.
        """
        current = self.get(node.key)
        if current is None or current.segment != node.segment or current.checksum != node.checksum:
            return False
        self._segment_add(current.segment, -1, -current.size)
        current.segment = segment
        if checksum is not None:
            current.checksum = checksum
        self._put(current)
        self._segment_add(segment, 1, current.size)
        return True

    def remove_leaf(self, node: Node) -> None:
        """Remove a node that has no children."""
        assert node.child_count == 0, "only leaves are removed"
        self.owners.removed(node)
        self.txn.delete(NODES + node.key)
        self.txn.delete(_lru_key(node.last_access, node.key))
        self.txn.delete(CHILDREN + node.parent + node.key)
        self.txn.delete(HITS + node.key)
        parent = self.get(node.parent)
        if parent is not None:
            parent.child_count = max(0, parent.child_count - 1)
            self._put(parent)
        self._add_meta(b"bytes", -node.size)
        self._add_meta(b"blocks", -1)
        self._segment_add(node.segment, -1, -node.size)

    def remove_subtree(self, key: bytes) -> list[Node]:
        """Remove a node and everything below it, deepest first.

        Returns:
            The removed nodes.
        """
        root = self.get(key)
        if root is None:
            return []
        order = [root]
        i = 0
        while i < len(order):
            order.extend(self.children(order[i].key))
            i += 1
        for node in reversed(order):
            node.child_count = 0  # its children are gone already
            self.remove_leaf(node)
        return order

    def evict(self, max_bytes: int) -> list[Node]:
        """Remove least-recently-used leaves until the blocks total at most `max_bytes`.

        A node with children is never removed before them. Removing a leaf can turn
        its parent into a leaf whose last access is older than leaves not yet taken,
        so such parents join a heap that is merged with the LRU order as it is walked.

        Returns:
            The removed nodes.
        """
        return self._evict(self.totals()[0] - max_bytes)

    def evict_owned(self, root: bytes, max_bytes: int) -> list[Node]:
        """Remove the least-recently-used leaves `root` owns until it owns at most
        `max_bytes` (a namespace's quota): no other root's block is ever taken, and a
        block that continues a shared prefix leaves the shared blocks in place.

        Returns:
            The removed nodes (none if `root` is not accounted: `adopt_root`).
        """
        use = self.owners.use(root)
        return self._evict(use[1] - max_bytes if use is not None else 0, owner=root)

    def _evict(self, excess: int, *, owner: bytes | None = None) -> list[Node]:
        """Remove least-recently-used leaves (of `owner`, if given) worth `excess` bytes."""
        removed: list[Node] = []
        for node in self._leaves_oldest_first(owner=owner) if excess > 0 else ():
            self.remove_leaf(node)
            removed.append(node)
            self.evicted.append(node.key)
            excess -= node.size
            if excess <= 0:
                break
        return removed

    def adopt_root(self, root: bytes) -> tuple[int, int]:
        """Account `root` (a namespace with a quota) from the blocks it has now: its
        subtree, and the blocks charged to it before with theirs (those that continue a
        shared prefix are not under its root). Idempotent; a handle with a quota runs it
        at open, which also repairs the count after an older library wrote the store.

        Returns:
            ``(blocks, bytes)`` it owns.
        """
        linked = [n for n in map(self.get, self.owners.owned_keys(root)) if n is not None and n.parent != root]
        seen: dict[bytes, Node] = {}
        stack = [root, *(n.key for n in linked)]
        seen.update((n.key, n) for n in linked)
        while stack:
            for child in self.children(stack.pop()):
                if child.key not in seen:
                    seen[child.key] = child
                    stack.append(child.key)
        return self.owners.adopt(root, iter(seen.values()), iter(()))

    def evict_unused(self, before: int) -> list[Node]:
        """Remove every block not used since `before` (ns since the epoch), leaves first:
        a block used later keeps the blocks before it in its chain.

        Returns:
            The removed nodes.
        """
        removed: list[Node] = []
        for node in self._leaves_oldest_first():
            if node.last_access >= before:
                break  # oldest first: every leaf after this one is newer too
            self.remove_leaf(node)
            removed.append(node)
            self.evicted.append(node.key)
        return removed

    def _leaves_oldest_first(self, *, owner: bytes | None = None) -> Iterator[Node]:
        """Leaves in least-recently-used order (of the blocks `owner` owns, if given), for
        a caller that removes each one it is given (or stops). Removing a leaf can turn
        its parent into a leaf older than leaves not yet given, so such parents join a
        heap merged with the LRU order."""
        orphaned: list[tuple[int, bytes]] = []  # (last access, key): parents turned leaves
        lru = self._lru_from(b"") if owner is None else self.owners.lru(owner)
        pending = next(lru, None)
        while pending is not None or orphaned:
            if pending is not None and not (orphaned and orphaned[0] < pending):
                _, key = pending
                pending = next(lru, None)
            else:
                _, key = heapq.heappop(orphaned)
            node = self.get(key)
            if node is None or node.child_count != 0:
                continue  # gone already, or an inner node: its leaves go first
            yield node  # removed by the caller before the walk goes on
            parent = self.get(node.parent)
            if parent is not None and parent.child_count == 0:
                if owner is None or self.owners.owner(parent.key) == owner:  # never another's block
                    heapq.heappush(orphaned, (parent.last_access, parent.key))

    def _lru_from(self, start: bytes) -> Iterator[tuple[int, bytes]]:
        """(last access, key) in LRU order from `start`, re-seeking after every step so
        that removals made meanwhile in this transaction never disturb the walk."""
        while True:
            entry = next(self._scan(LRU, start), None)
            if entry is None:
                return
            key = entry[0]
            yield int.from_bytes(key[:8], "big"), key[8:]
            start = key + b"\x00"

    def rebuild(
        self, alive: dict[bytes, Node], doomed: Iterable[bytes], *, sizes: dict[bytes, int] | None = None
    ) -> None:
        """Rewrite nodes, edges, LRU order, segments and totals from the nodes in `alive`.

        Child counts and segment counts are recomputed from `alive`; hit counts of
        `doomed` keys go; segments no node of `alive` uses are freed; `sizes` replaces
        the recorded file size of segments (their files' own). Used by repairs
        (``ppc check --fix``).
        """
        sizes = sizes or {}
        self.owners.forget()  # counted again by the next handle with a quota (`adopt_root`)
        child_counts: dict[bytes, int] = {}
        for n in alive.values():
            child_counts[n.parent] = child_counts.get(n.parent, 0) + 1
        segments = self.segments()
        for prefix in (NODES, CHILDREN, LRU, SEGMENTS):
            for key in [k for k, _ in self._scan(prefix)]:
                self.txn.delete(prefix + key)
        for key in doomed:
            self.txn.delete(HITS + key)
        live: dict[bytes, list[int]] = {}
        for key, n in alive.items():
            n.child_count = child_counts.get(key, 0)
            self._put(n)
            self.txn.put(CHILDREN + n.parent + key, b"")
            self.txn.put(_lru_key(n.last_access, key), b"")
            counts = live.setdefault(n.segment, [0, 0])
            counts[0] += 1
            counts[1] += n.size
        file_bytes = 0
        for seg, (_, _, size) in segments.items():
            size = sizes.get(seg, size)
            if seg in live:
                self.txn.put(SEGMENTS + seg, _SEG.pack(live[seg][0], live[seg][1], size))
                file_bytes += size
            else:
                self.txn.delete(DIGESTS + seg)
                self.freed.append(seg)
        self.put_meta(b"bytes", u64(sum(n.size for n in alive.values())))
        self.put_meta(b"blocks", u64(len(alive)))
        self.put_meta(b"file_bytes", u64(file_bytes))

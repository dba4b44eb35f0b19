"""The LMDB index: trie nodes, edges, LRU order, models and store-wide counters.

With `index_env`, the only code that imports ``lmdb`` or holds a transaction: every
other module reads through a `Reader` and writes through a `Writer` handed out by
`Index.reader` and `Index.write`. Writes retry after growing a full map and pick up
a map another process grew.
"""

from __future__ import annotations

import heapq
import json
import os
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

import lmdb

from ..errors import StoreCorruptError, StoreVersionError
from .faults import pause_point
from .index_env import acquire_env, release_env
from .migrations import MIGRATIONS, SCHEMA_VERSION
from .node import Node

T = TypeVar("T")
_U64 = 8
# Every named database of the current schema (created by the migrations).
LAYOUT_DBS = (b"meta", b"models", b"nodes", b"children", b"lru", b"fingerprints", b"hits")
COUNTERS = ("hits", "misses", "tokens_saved", "corrupt")
# What a failed write transaction raises (a full disk, say): the index is then as it was.
WRITE_ERRORS = (lmdb.Error, OSError)


def _u64(n: int) -> bytes:
    return int(n).to_bytes(_U64, "little")


def _lru_key(access: int, key: bytes) -> bytes:
    return access.to_bytes(8, "big") + key  # big-endian sorts by time


class Index:
    """The LMDB index of one store directory.

    Args:
        path: The ``index/`` folder.
        readonly: Open without writing (no migrations are applied then).
        block_size: Block size stamped into a new store.

    Raises:
        StoreVersionError: If a newer library wrote the store, or (read-only) if it
            needs a migration.
        StoreCorruptError: If the index cannot be read safely.
    """

    def __init__(
        self,
        path: str,
        *,
        readonly: bool = False,
        block_size: int = 64,
        migrate: bool = True,
    ):
        self.path = path
        self.readonly = readonly
        if not readonly:
            os.makedirs(path, exist_ok=True)
        self.env, self._gate = acquire_env(path, readonly)
        self._closed = False
        self._commits = 0
        try:
            self._retrying(lambda: (self._migrate(block_size) if migrate else None, self._open_dbs()))
        except lmdb.Error as exc:
            self.close()
            raise StoreCorruptError(f"store index {path} cannot be read: {type(exc).__name__}: {exc}")
        except BaseException:
            self.close()
            raise

    def _retrying(self, fn: Callable[[], T]) -> T:
        # Another process may grow the map at any time: adopt its size and retry.
        while True:
            try:
                return fn()
            except lmdb.MapResizedError:
                self._gate.resize(self.env, 0)

    def _open_dbs(self) -> None:
        self.dbs = {}
        for name in LAYOUT_DBS:
            try:
                self.dbs[name.decode()] = self.env.open_db(name, create=False)
            except lmdb.NotFoundError:
                pass  # an older schema (opened with migrate=False)
        self.block_size = int(self._meta(b"block_size") or 0) if "meta" in self.dbs else 0

    # -- setup ------------------------------------------------------------------------

    def version(self) -> int:
        """The schema version stamped in the store (0 for an empty environment)."""
        try:
            meta = self.env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            return 0
        with self.reader() as r:
            raw = r.txn.get(b"version", db=meta)
        return int(raw) if raw else 0

    def pending_migrations(self) -> list:
        """Migrations that would bring this store to the library's schema."""
        return [m for m in MIGRATIONS if m.VERSION > self.version()]

    def _migrate(self, block_size: int) -> None:
        version = self.version()
        if version > SCHEMA_VERSION:
            raise StoreVersionError(
                f"store index {self.path} has schema v{version}; this library reads up to "
                f"v{SCHEMA_VERSION}"
            )
        if version == SCHEMA_VERSION:
            return
        if self.readonly:
            raise StoreVersionError(
                f"store index {self.path} has schema v{version}, needs v{SCHEMA_VERSION}",
                hint="run `ppc migrate --store STORE` once with write access",
            )
        self.apply_migrations({"block_size": block_size})

    def apply_migrations(self, params: dict, *, upto: int | None = None) -> list[int]:
        """Apply pending migrations in one write transaction, stamping the version last.

        Args:
            params: ``block_size`` for a new store.
            upto: Stop at this schema version (tests build old stores with it).

        Returns:
            The versions applied.
        """

        def run(txn):
            try:
                version = int(txn.get(b"version", db=self.env.open_db(b"meta", txn=txn, create=False)) or 0)
            except lmdb.NotFoundError:
                version = 0
            done = []
            for m in MIGRATIONS:
                if m.VERSION > version and (upto is None or m.VERSION <= upto):
                    m.upgrade(self.env, txn, params)
                    done.append(m.VERSION)
            if done:
                txn.put(b"version", str(done[-1]).encode(), db=self.env.open_db(b"meta", txn=txn))
            return done

        done = self._write_txn(run)
        if hasattr(self, "dbs"):
            self._open_dbs()
        return done

    # -- transactions ------------------------------------------------------------------

    def _write_txn(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        # Retry after growing a full map, or after another process grew it.
        while True:
            try:
                with self._gate.transaction(), self.env.begin(write=True) as txn:
                    result = fn(txn)
                    pause_point("in_write_txn")
                self._commits += 1
                if self._commits % 256 == 0:
                    self.env.reader_check()  # free slots of readers that died
                return result
            except lmdb.MapFullError:
                self._gate.resize(self.env, self.env.info()["map_size"] * 2)
            except lmdb.MapResizedError:
                self._gate.resize(self.env, 0)

    def write(self, fn: Callable[["Writer"], T]) -> T:
        """Run `fn` with a `Writer` inside one write transaction (committed on return)."""
        return self._write_txn(lambda txn: fn(Writer(self, txn)))

    @contextmanager
    def reader(self) -> Iterator["Reader"]:
        """A read transaction, as a `Reader`."""
        while True:
            with self._gate.transaction():
                try:
                    txn = self.env.begin()
                except lmdb.MapResizedError:
                    pass
                else:
                    try:
                        yield Reader(self, txn)
                    finally:
                        txn.abort()
                    return
            self._gate.resize(self.env, 0)

    def _meta(self, name: bytes) -> bytes:
        with self.reader() as r:
            return r.txn.get(name, db=self.dbs["meta"])

    def remembered_fingerprint(self, signature: bytes) -> str | None:
        """The model fingerprint remembered for a weight files' signature, if any."""
        with self.reader() as r:
            return r.fingerprint(signature)

    def remember_fingerprint(self, signature: bytes, fingerprint: str) -> None:
        """Remember a model fingerprint under its weight files' signature (a read-only
        handle remembers nothing)."""
        if not self.readonly:
            self.write(lambda w: w.remember_fingerprint(signature, fingerprint))

    def totals(self) -> tuple[int, int]:
        """(bytes of block files, number of blocks) as recorded in the index."""
        with self.reader() as r:
            return r.totals()

    def close(self) -> None:
        """Release this handle's share of the environment."""
        if not self._closed:
            self._closed = True
            release_env(self.path)


class Reader:
    """Read operations inside one transaction."""

    def __init__(self, index: Index, txn: lmdb.Transaction):
        self.index = index
        self.txn = txn
        self.dbs = getattr(index, "dbs", {})  # not yet set while the index opens

    def get(self, key: bytes) -> Node | None:
        """The node stored under `key`, or None (also None for a malformed record)."""
        raw = self.txn.get(key, db=self.dbs["nodes"])
        if raw is None:
            return None
        try:
            return Node.unpack(key, raw)
        except ValueError:
            return None

    def get_raw(self, key: bytes) -> bytes | None:
        """The packed record stored under `key` (see `Node.raw_matches`)."""
        return self.txn.get(key, db=self.dbs["nodes"])

    def children(self, parent: bytes) -> list[Node]:
        """Child nodes of `parent`, in key order."""
        out = []
        with self.txn.cursor(db=self.dbs["children"]) as cur:
            if cur.set_range(parent):
                for edge in cur.iternext(values=False):
                    if edge[:16] != parent:
                        break
                    node = self.get(edge[16:])
                    if node is not None:
                        out.append(node)
        return out

    def totals(self) -> tuple[int, int]:
        meta = self.dbs["meta"]
        return (
            int.from_bytes(self.txn.get(b"bytes", db=meta), "little"),
            int.from_bytes(self.txn.get(b"blocks", db=meta), "little"),
        )

    def counters(self) -> dict[str, int]:
        """Store-wide hit counters (all processes, since the store was made)."""
        meta = self.dbs["meta"]
        return {
            name: int.from_bytes(self.txn.get(name.encode(), db=meta) or bytes(8), "little")
            for name in COUNTERS
        }

    def hits(self, key: bytes) -> int:
        """How many fetches restored the block `key`."""
        raw = self.txn.get(key, db=self.dbs["hits"])
        return int.from_bytes(raw, "little") if raw else 0

    def iter_nodes(self) -> Iterator[Node]:
        """Every node, in key order."""
        with self.txn.cursor(db=self.dbs["nodes"]) as cur:
            for key, raw in cur:
                try:
                    yield Node.unpack(bytes(key), bytes(raw))
                except ValueError:
                    continue

    def models(self) -> dict[bytes, bytes]:
        """Root key -> JSON description of every model stored."""
        with self.txn.cursor(db=self.dbs["models"]) as cur:
            return {bytes(k): bytes(v) for k, v in cur}

    def filled_models(self) -> list[dict]:
        """The description (``root`` in hex, ``fingerprint``, ``namespace``, ``layout``)
        of every model with at least one stored block; unreadable records are left out."""
        out = []
        for root, raw in self.models().items():
            if not self.children(root):
                continue
            try:
                out.append({**json.loads(raw), "root": root.hex()})
            except (ValueError, TypeError):
                continue  # an unreadable record names no model one could compare with
        return out

    def edges(self) -> set[tuple[bytes, bytes]]:
        """Every trie edge as (parent key, child key)."""
        with self.txn.cursor(db=self.dbs["children"]) as cur:
            return {(bytes(k[:16]), bytes(k[16:])) for k in cur.iternext(values=False)}

    def lru_entries(self) -> set[tuple[int, bytes]]:
        """Every entry of the LRU order as (last access, key)."""
        with self.txn.cursor(db=self.dbs["lru"]) as cur:
            return {(int.from_bytes(k[:8], "big"), bytes(k[8:])) for k in cur.iternext(values=False)}

    def fingerprint(self, signature: bytes) -> str | None:
        """The model fingerprint remembered for a weight files' signature, if any."""
        raw = self.txn.get(signature, db=self.dbs["fingerprints"])
        return raw.decode() if raw else None


class Writer(Reader):
    """Write operations inside one write transaction."""

    def _add_totals(self, d_bytes: int, d_blocks: int) -> None:
        size, count = self.totals()
        meta = self.dbs["meta"]
        self.txn.put(b"bytes", _u64(size + d_bytes), db=meta)
        self.txn.put(b"blocks", _u64(count + d_blocks), db=meta)

    def _put(self, node: Node) -> None:
        self.txn.put(node.key, node.pack(), db=self.dbs["nodes"])

    def register_model(self, root: bytes, description: bytes) -> None:
        """Record a model's root key (once)."""
        self.txn.put(root, description, db=self.dbs["models"], overwrite=False)

    def remember_fingerprint(self, signature: bytes, fingerprint: str) -> None:
        """Remember a model fingerprint under its weight files' signature."""
        self.txn.put(signature, fingerprint.encode(), db=self.dbs["fingerprints"])

    def rebuild(self, alive: dict[bytes, Node], doomed: Iterable[bytes]) -> None:
        """Rewrite nodes, edges, LRU order and totals from the nodes in `alive`.

        Child counts are recomputed from `alive`; hit counts of `doomed` keys go.
        Used by repairs (``ppc check --fix``): the caller unlinks the files of the
        doomed nodes after this commits.
        """
        child_counts: dict[bytes, int] = {}
        for n in alive.values():
            child_counts[n.parent] = child_counts.get(n.parent, 0) + 1
        for name in ("nodes", "children", "lru"):
            self.txn.drop(self.dbs[name], delete=False)
        for key in doomed:
            self.txn.delete(key, db=self.dbs["hits"])
        for key, n in alive.items():
            n.child_count = child_counts.get(key, 0)
            self._put(n)
            self.txn.put(n.parent + key, b"", db=self.dbs["children"])
            self.txn.put(_lru_key(n.last_access, key), b"", db=self.dbs["lru"])
        meta = self.dbs["meta"]
        self.txn.put(b"bytes", _u64(sum(n.size for n in alive.values())), db=meta)
        self.txn.put(b"blocks", _u64(len(alive)), db=meta)

    def insert(self, node: Node) -> bool:
        """Add a node under its parent.

        Returns:
            False (and nothing changed) if the key exists already, or the parent is
            neither a root nor a stored node (it was evicted meanwhile).
        """
        if self.txn.get(node.key, db=self.dbs["nodes"]) is not None:
            return False
        parent = self.get(node.parent)
        if parent is None and node.position != 0:
            return False
        if parent is not None:
            parent.child_count += 1
            self._put(parent)
        self._put(node)
        self.txn.put(node.parent + node.key, b"", db=self.dbs["children"])
        self.txn.put(_lru_key(node.last_access, node.key), b"", db=self.dbs["lru"])
        self._add_totals(node.size, 1)
        return True

    def add_counters(self, deltas: dict[str, int]) -> None:
        """Add to the store-wide counters."""
        current = self.counters()
        for name, delta in deltas.items():
            if delta:
                self.txn.put(name.encode(), _u64(current[name] + delta), db=self.dbs["meta"])

    def count_hits(self, counts: dict[bytes, int]) -> None:
        """Add fetch counts to stored blocks (keys no longer stored are skipped)."""
        for key, n in counts.items():
            if self.txn.get(key, db=self.dbs["nodes"]) is not None:
                self.txn.put(key, _u64(self.hits(key) + n), db=self.dbs["hits"])

    def touch(self, key: bytes, now: int) -> None:
        """Move a node to the recent end of the LRU order."""
        node = self.get(key)
        if node is None or node.last_access >= now:
            return
        self.txn.delete(_lru_key(node.last_access, key), db=self.dbs["lru"])
        node.last_access = now
        self._put(node)
        self.txn.put(_lru_key(now, key), b"", db=self.dbs["lru"])

    def remove_leaf(self, node: Node) -> None:
        """Remove a node that has no children."""
        assert node.child_count == 0, "only leaves are removed"
        self.txn.delete(node.key, db=self.dbs["nodes"])
        self.txn.delete(_lru_key(node.last_access, node.key), db=self.dbs["lru"])
        self.txn.delete(node.parent + node.key, db=self.dbs["children"])
        self.txn.delete(node.key, db=self.dbs["hits"])
        parent = self.get(node.parent)
        if parent is not None:
            parent.child_count = max(0, parent.child_count - 1)
            self._put(parent)
        self._add_totals(-node.size, -1)

    def remove_subtree(self, key: bytes) -> list[Node]:
        """Remove a node and everything below it, deepest first.

        Returns:
            The removed nodes (their files are the caller's to unlink after commit).
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
        """Remove least-recently-used leaves until the files total at most `max_bytes`.

        A node with children is never removed before them. Removing a leaf can turn
        its parent into a leaf whose last access is older than leaves not yet taken,
        so such parents join a heap that is merged with the LRU order as it is walked.

        Returns:
            The removed nodes.
        """
        removed: list[Node] = []
        excess = self.totals()[0] - max_bytes
        if excess <= 0:
            return removed
        orphaned: list[tuple[int, bytes]] = []  # (last access, key): parents turned leaves
        lru = self._lru_from(b"")
        pending = next(lru, None)
        while excess > 0 and (pending is not None or orphaned):
            if orphaned and (pending is None or orphaned[0] < pending):
                _, key = heapq.heappop(orphaned)
            else:
                _, key = pending
                pending = next(lru, None)
            node = self.get(key)
            if node is None or node.child_count != 0:
                continue  # gone already, or an inner node: its leaves go first
            self.remove_leaf(node)
            removed.append(node)
            excess -= node.size
            parent = self.get(node.parent)
            if parent is not None and parent.child_count == 0:
                heapq.heappush(orphaned, (parent.last_access, parent.key))
        return removed

    def _lru_from(self, start: bytes) -> Iterator[tuple[int, bytes]]:
        """(last access, key) in LRU order from `start`, re-seeking after every step so
        that removals made meanwhile in this transaction never disturb the walk."""
        while True:
            with self.txn.cursor(db=self.dbs["lru"]) as cur:
                if not cur.set_range(start):
                    return
                entry = bytes(cur.key())
            yield int.from_bytes(entry[:8], "big"), entry[8:]
            start = entry + b"\x00"

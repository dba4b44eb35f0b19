"""The LMDB index: the store's trie, LRU order, models, segments and counters.

With `index_env` (environments) and `index_tables` (the tables, read and written
through `Reader` and `Writer`), the only code that imports ``lmdb`` or holds a
transaction. Writes retry after growing a full map and pick up a map another
process grew. Opening never takes LMDB's write lock unless a migration is due, so an
open never waits behind another process's commit.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, TypeVar

import lmdb

from ..errors import ReadOnlyStoreError, StoreCorruptError
from .faults import pause_point
from .index_env import acquire_env, release_env
from .index_owners import OWNED, OWNED_LRU, OWNERS
from .removed import removed_for
from .store_guard import corrupt_index, store_of
from .index_tables import (  # noqa: F401 (the tables re-exported)
    CHILDREN,
    DIGESTS,
    FINGERPRINTS,
    HITS,
    LRU,
    META,
    MODELS,
    NODES,
    SEGMENTS,
    Reader,
    Writer,
)
from ..blocks import Node
from .schema import MIGRATIONS, check_schema

T = TypeVar("T")
log = logging.getLogger("persistent_prefix_cache")
# What LMDB raises for a damaged page (a read or a write that meets one becomes
# StoreCorruptError; after one, LMDB refuses every later write with PanicError).
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.PanicError)
# What a failed write transaction raises (a full disk, a damaged page): the index is
# then as it was.
WRITE_ERRORS = (lmdb.Error, OSError, StoreCorruptError)
# Schemas up to this one kept their tables in named databases (migrations 0001, 0002).
_LAST_NAMED_SCHEMA = 2


def _stamped_version(env: lmdb.Environment, txn: lmdb.Transaction) -> int:
    raw = txn.get(META + b"version")
    if raw is not None:
        return int(raw)
    try:  # schema v1-v2: a named "meta" database (opened inside this transaction)
        meta = env.open_db(b"meta", txn=txn, create=False)
    except lmdb.NotFoundError:
        return 0
    raw = txn.get(b"version", db=meta)
    return int(raw) if raw else 0


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
        self.env, self._gate = acquire_env(path, readonly)
        # Blocks removed from this store by this process lately: why a fetch missed.
        self.removed = removed_for(os.path.realpath(path))
        self.evicted_blocks = 0  # blocks this object's writes evicted under a budget
        self._closed = False
        self.said_write_damage = False  # `write_damaged` says it once per handle
        self._commits = 0

        def setup() -> None:
            if migrate:
                self._migrate(block_size)
            self._read_block_size()

        try:
            self._retrying(setup)
        except lmdb.Error as exc:
            self.close()
            raise corrupt_index(store_of(path), f"{type(exc).__name__}: {exc}") from None
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

    def _read_block_size(self) -> None:
        with self.reader() as r:
            raw = r.meta(b"block_size")
        self.block_size = int(raw) if raw else 0

    # -- setup ------------------------------------------------------------------------

    def version(self) -> int:
        """The schema version stamped in the store (0 for an empty environment)."""
        while True:
            with self._gate.transaction():
                try:
                    with self.env.begin() as txn:
                        return _stamped_version(self.env, txn)
                except lmdb.MapResizedError:
                    pass
            self._gate.resize(self.env, 0)

    def pending_migrations(self) -> list:
        """Migrations that would bring this store to the library's schema."""
        return [m for m in MIGRATIONS if m.VERSION > self.version()]

    def _migrate(self, block_size: int) -> None:
        if check_schema(store_of(self.path), self.version(), migrate=not self.readonly):
            self.apply_migrations({"block_size": block_size})

    def apply_migrations(self, params: dict, *, upto: int | None = None) -> list[int]:
        """Apply pending migrations in one write transaction, stamping the version last.

        Args:
            params: ``block_size`` for a new store (the store's folder is added as
                ``store``: migrations that rewrite files need it).
            upto: Stop at this schema version (tests build old stores with it).

        Returns:
            The versions applied.
        """
        params = {**params, "store": os.path.dirname(os.path.abspath(self.path))}
        pending: list[ModuleType] = []

        def run(txn):
            version = _stamped_version(self.env, txn)
            done = []
            for m in MIGRATIONS:
                if m.VERSION > version and (upto is None or m.VERSION <= upto):
                    m.upgrade(self.env, txn, params)
                    done.append(m)
            if done:
                stamp = str(done[-1].VERSION).encode()
                if done[-1].VERSION > _LAST_NAMED_SCHEMA:
                    txn.put(META + b"version", stamp)
                else:
                    txn.put(b"version", stamp, db=self.env.open_db(b"meta", txn=txn))
            pending[:] = done
            return [m.VERSION for m in done]

        applied = self._write_txn(run)
        for m in pending:  # files the committed migrations no longer reference
            if hasattr(m, "after_commit"):
                m.after_commit(params)
        if hasattr(self, "block_size"):
            self._read_block_size()
        return applied

    # -- transactions ------------------------------------------------------------------

    def _write_txn(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        # Retry after growing a full map, or after another process grew it; a damaged
        # page met on the way is StoreCorruptError, with what `ppc check --fix` will do.
        try:
            return self._write_retrying(fn)
        except _DAMAGE as exc:
            raise corrupt_index(store_of(self.path), f"a write failed: {type(exc).__name__}: {exc}") from None

    def _write_retrying(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        while True:
            try:
                with self._gate.transaction(), self.env.begin(write=True) as txn:
                    result = fn(txn)
                    pause_point("in_write_txn")
            except lmdb.MapFullError:
                self._gate.resize(self.env, self.env.info()["map_size"] * 2)
                continue
            except lmdb.MapResizedError:
                self._gate.resize(self.env, 0)
                continue
            # Committed: nothing below may fail the write (its caller would unlink the
            # segments the index now holds) or retry it (`fn` would run twice).
            self._commits += 1
            if self._commits % 256 == 0:
                self._free_dead_readers()
            return result

    def _free_dead_readers(self) -> None:
        """Free the reader slots of processes that died (LMDB's ``reader_check``):
        housekeeping after a commit, whose failure is only logged."""
        try:
            self.env.reader_check()
        except lmdb.Error as exc:
            log.debug("could not free the reader slots of dead processes in %s: %s", self.path, exc)

    def write(self, fn: Callable[[Writer], T]) -> T:
        """Run `fn` with a `Writer` inside one write transaction (committed on return);
        the blocks it evicted are remembered in `removed` once it committed."""
        last: list[Writer] = []  # the transaction that committed (a retry makes another)

        def run(txn: Any) -> T:
            last[:] = [Writer(txn)]
            return fn(last[0])

        result = self._write_txn(run)
        if last and last[0].evicted:
            self.removed.evicted(last[0].evicted)
            self.evicted_blocks += len(last[0].evicted)
        return result

    @contextmanager
    def reader(self) -> Iterator[Reader]:
        """A read transaction, as a `Reader`.

        Raises:
            StoreCorruptError: If a read inside meets a damaged page (LMDB may also
                abort the process there: only `index_probe` is safe from that).
        """
        while True:
            with self._gate.transaction():
                try:
                    txn = self.env.begin()
                except lmdb.MapResizedError:
                    pass
                else:
                    try:
                        yield Reader(txn)
                    except _DAMAGE as exc:  # a damaged page met by a read: typed, with the remedy
                        raise corrupt_index(store_of(self.path), f"{type(exc).__name__}: {exc}") from None
                    finally:
                        txn.abort()
                    return
            self._gate.resize(self.env, 0)

    def remembered_fingerprint(self, signature: bytes) -> dict | None:
        """The fingerprint entry remembered for a weight files' signature, if any."""
        with self.reader() as r:
            return r.fingerprint(signature)

    def remember_fingerprint(self, signature: bytes, entry: dict) -> None:
        """Remember a fingerprint entry under its weight files' signature (a read-only
        handle remembers nothing)."""
        if not self.readonly:
            try:
                self.write(lambda w: w.remember_fingerprint(signature, entry))
            except StoreCorruptError as exc:  # a nicety: the next open hashes the model again
                self.write_damaged(exc)

    def write_damaged(self, exc: StoreCorruptError) -> None:
        """Say once per handle that a write met a damaged index (the error names
        ``ppc check --fix``); the caller counts it and goes on without the write."""
        if not self.said_write_damage:
            self.said_write_damage = True
            log.warning("%s; writes that meet the damage are skipped (counted in write_errors)", exc)

    def remembered_fingerprints(self) -> list[dict]:
        """Every remembered fingerprint entry, with its ``signature`` in hex."""
        with self.reader() as r:
            return [{**entry, "signature": sig.hex()} for sig, entry in sorted(r.fingerprints().items())]

    def forget_fingerprints(self, *, folder: str | None = None, signature: bytes | None = None) -> int:
        """Forget remembered fingerprints: those of `folder` (by the folder recorded with
        them) and of `signature` (the folder's files as they are now: entries from
        before the folder was recorded); every one if neither is given.

        Returns:
            How many entries were forgotten.

        Raises:
            ReadOnlyStoreError: If the index was opened read-only.
        """
        if self.readonly:
            raise ReadOnlyStoreError(f"store index {self.path} is open read-only: cannot forget fingerprints")

        def run(w: Writer) -> int:
            doomed = [
                sig
                for sig, entry in w.fingerprints().items()
                if (folder is None and signature is None) or sig == signature or entry.get("folder") == folder
            ]
            return sum(w.forget_fingerprint(sig) for sig in doomed)

        return self.write(run)

    def totals(self) -> tuple[int, int]:
        """(bytes of the stored blocks, number of blocks) as recorded in the index."""
        with self.reader() as r:
            return r.totals()

    def stored_fingerprints(self) -> list:
        """The fingerprints of the models with blocks here (`fingerprint.current_fingerprint` asks)."""
        with self.reader() as r:
            return [m.get("fingerprint") for m in r.filled_models()]

    def segment_digests(self, nodes: Iterable[Any]) -> dict[bytes, int]:
        """The whole-segment digests of the segments that hold `nodes` (records with a
        ``segment``), by segment id; a segment without one is left out."""
        with self.reader() as r:
            found = {seg: r.segment_digest(seg) for seg in {n.segment for n in nodes}}
        return {seg: d for seg, d in found.items() if d is not None}

    def close(self) -> None:
        """Release this handle's share of the environment."""
        if not self._closed:
            self._closed = True
            release_env(self.path)


# -- the whole-index walk (run in a child process: see index_probe) ----------------------

_META_TEXT = (b"version", b"block_size")  # stamped as ASCII digits; every other meta value is a u64
_KEY_LENGTHS = {MODELS: 17, NODES: 17, CHILDREN: 33, LRU: 25, HITS: 17, SEGMENTS: 17, DIGESTS: 17}
_VALUE_LENGTHS = {CHILDREN: 0, LRU: 0, HITS: 8, SEGMENTS: 24, DIGESTS: 8}
# A namespace's quota (`index_owners`): owners, owned, owned lru.
_KEY_LENGTHS.update({OWNERS: 17, OWNED: 17, OWNED_LRU: 41})
_VALUE_LENGTHS.update({OWNERS: 16, OWNED: 16, OWNED_LRU: 0})


def _record_problem(key: bytes, value: bytes) -> str | None:
    """What is wrong with one record of the main database (None if it decodes)."""
    table = key[:1]
    want = _KEY_LENGTHS.get(table)
    if table == META:
        name = key[1:]
        if name in _META_TEXT:
            return None if value.isdigit() else f"meta {name.decode(errors='replace')} is not a number"
        return None if len(value) == 8 else f"meta {name!r} has {len(value)} bytes"
    if table == FINGERPRINTS:
        try:
            value.decode()
        except UnicodeDecodeError:
            return "fingerprint is not text"
        return None
    if want is None:
        return f"unknown key {key[:24].hex()}"
    if len(key) != want:
        return f"key {key[:24].hex()} has {len(key)} bytes"
    if table in _VALUE_LENGTHS and len(value) != _VALUE_LENGTHS[table]:
        return f"value of {key[:24].hex()} has {len(value)} bytes"
    if table == NODES:
        try:
            Node.unpack(key[1:], value)
        except (ValueError, UnicodeDecodeError) as exc:
            return f"node {key[1:].hex()}: {exc}"
    elif table == MODELS:
        try:
            if not isinstance(json.loads(value), dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            return f"model {key[1:].hex()}: {exc}"
    return None


def walk_index(path: str, *, trial_write: bool, say: Callable[[dict], None]) -> None:
    """Read every page of an index and try a write: in a child process only, because
    LMDB may abort the process (or it may die of SIGBUS) on a damaged page.

    The walk reads every record of the main database in key order (every branch, leaf
    and overflow page of the tree), checks the order, and decodes each record as its
    table says. The trial write (aborted, never committed) asks for more pages than
    the free list can hold, so that LMDB reads the whole free list as a commit would.

    Args:
        path: The ``index/`` folder.
        trial_write: Also try the write (needs write access).
        say: Called with each finding: ``{"stage": ...}`` before each step,
            ``{"problem": ...}`` for each record that does not decode, then
            ``{"done": True, "records": n, "block_size": n or None, "version": n}``.

    Raises:
        lmdb.Error: What LMDB says of a damaged page (the caller reports it).
    """
    from .index_env import close_env, open_env

    say({"stage": "open"})
    env = open_env(path, readonly=not trial_write)
    try:
        say({"stage": "walk"})
        records, problems, previous, block_size = 0, 0, None, None
        with env.begin(buffers=False) as txn:
            # Schemas v1-v2 (before `ppc migrate`) keep their tables in named databases:
            # walk each (every page read, keys in order), their records undecoded.
            version = _stamped_version(env, txn)
            named = 0 < version <= _LAST_NAMED_SCHEMA
            databases: list[lmdb._Database | None] = [None]  # None: the main database
            while databases:
                db = databases.pop()
                for key, value in txn.cursor(db=db) if db is not None else txn.cursor():
                    records += 1
                    problem = None if previous is None or key > previous else "keys out of order"
                    if db is None and named and key[:1] > SEGMENTS:
                        databases.append(env.open_db(key, txn=txn, create=False))
                    elif db is None:
                        problem = problem or _record_problem(key, value)
                    if key == META + b"block_size" and value.isdigit():
                        block_size = int(value)
                    if problem and problems < 20:
                        say({"problem": problem})
                    problems += bool(problem)
                    previous = key
                previous = None
        if trial_write:
            info, stat = env.info(), env.stat()
            used = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"] + 2
            pages = max(1, info["last_pgno"] + 1 - used) + 1
            say({"stage": "write_wait"})
            txn = env.begin(write=True)
            try:
                say({"stage": "write"})
                try:
                    txn.put(META + b"trial_write", bytes(pages * stat["psize"]))
                except lmdb.MapFullError:
                    pass  # the free list was read before the map was found too small
                txn.put(META + b"trial_write", b"")
            finally:
                txn.abort()
        say({"done": True, "records": records, "problems": problems, "block_size": block_size, "version": version})
    finally:
        close_env(env)

"""The LMDB index: the store's trie, LRU order, models, segments and counters.

With `index_env` (environments) and `index_tables` (the tables, read and written
through `Reader` and `Writer`), the only code that imports ``lmdb`` or holds a
transaction. Writes retry after growing a full map and pick up a map another
process grew. Opening never takes LMDB's write lock unless a migration is due, so an
open never waits behind another process's commit.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import lmdb

from ..errors import ReadOnlyStoreError, StoreCorruptError, StoreVersionError
from .faults import pause_point
from .index_env import acquire_env, release_env
from .index_tables import COUNTERS, META, Reader, Writer  # noqa: F401 (re-exported)
from .migrations import MIGRATIONS, SCHEMA_VERSION
from .store_dir import make_dirs

T = TypeVar("T")
# What a failed write transaction raises (a full disk, say): the index is then as it was.
WRITE_ERRORS = (lmdb.Error, OSError)
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
        if not readonly:
            make_dirs(path, os.path.dirname(os.path.abspath(path)))  # the store's folder mode
        self.env, self._gate = acquire_env(path, readonly)
        self._closed = False
        self._commits = 0
        try:
            self._retrying(lambda: (self._migrate(block_size) if migrate else None, self._read_block_size()))
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
            params: ``block_size`` for a new store (the store's folder is added as
                ``store``: migrations that rewrite files need it).
            upto: Stop at this schema version (tests build old stores with it).

        Returns:
            The versions applied.
        """
        params = {**params, "store": os.path.dirname(os.path.abspath(self.path))}
        pending = []

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

    def write(self, fn: Callable[[Writer], T]) -> T:
        """Run `fn` with a `Writer` inside one write transaction (committed on return)."""
        return self._write_txn(lambda txn: fn(Writer(txn)))

    @contextmanager
    def reader(self) -> Iterator[Reader]:
        """A read transaction, as a `Reader`."""
        while True:
            with self._gate.transaction():
                try:
                    txn = self.env.begin()
                except lmdb.MapResizedError:
                    pass
                else:
                    try:
                        yield Reader(txn)
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
            self.write(lambda w: w.remember_fingerprint(signature, entry))

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

    def close(self) -> None:
        """Release this handle's share of the environment."""
        if not self._closed:
            self._closed = True
            release_env(self.path)

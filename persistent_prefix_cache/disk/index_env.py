"""The LMDB environments of this process: one per store, shared by its handles.

LMDB forbids opening one environment twice in a process and using one across
``fork()``; a map resize must wait until no transaction of this process is active.
This module (with `index`, the only code that imports ``lmdb``) owns those rules.
"""

from __future__ import annotations

import errno
import os
import threading
from contextlib import contextmanager
from typing import Iterator

import lmdb

try:  # py-lmdb >= 3.0 imports this on the first open: load it now, with the package,
    # so that a process that drops privileges after its imports (a server started as
    # root, say) can still open a store where that user cannot read site-packages.
    import lmdb._envid  # noqa: F401
except ImportError:  # older py-lmdb: nothing imported lazily
    pass

from ..errors import ReadOnlyStoreError, StoreNotWritableError
from ..files import NotRegularFileError
from . import index_files, store_guard
from .store_dir import LEGACY_FILE, make_dirs, modes_of, require_writable

# The map grows on demand (doubling); the start is small so tiny stores stay tiny.
INITIAL_MAP_SIZE = 64 * 1024 * 1024  # tests set it smaller (module setting) to reach the growth path
# Named databases opened per environment: the current schema's, and a few spare.
MAX_DBS = 12


class Gate:
    """Any number of transactions at once, or one map resize alone: LMDB requires that
    no transaction of this process be active while the map size changes."""

    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    def resize(self, env: lmdb.Environment, size: int) -> None:
        """Set the map size (0: adopt the size another process grew it to)."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            env.reader_check()  # readers of dead processes pin pages; free them first
            if size == 0 or size > env.info()["map_size"]:
                env.set_mapsize(size)
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


_ENVS: dict[tuple[int, str], list] = {}  # (pid, path) -> [env, refcount, gate]
_PINS: dict[int, tuple[str, str | None]] = {}  # id(env) -> (index path, its private folder)
_ENVS_LOCK = threading.Lock()


def open_env(path: str, readonly: bool) -> lmdb.Environment:
    """Open an index's LMDB environment, its files checked first (`index_files`: no
    link, no special or foreign file, no page in use missing), without sharing or the
    store lock (`acquire_env` adds those; the index walk in a child uses this alone).

    Raises:
        StoreCorruptError: If the files are not a valid, complete environment, or one
            of them is a link, a special file or another user's.
    """
    writable = os.access(path, os.W_OK)
    store = store_guard.store_of(path)
    # A read-only handle opens the environment read-only: then even a writer
    # paused inside its transaction in another process never blocks it.
    with index_files.checked(path, readonly=readonly, writable=writable) as files:
        try:
            env = lmdb.open(
                files.path,
                subdir=files.subdir,
                map_size=INITIAL_MAP_SIZE,
                max_dbs=MAX_DBS,
                readonly=readonly,
                create=not readonly,
                max_readers=512,
                # A reader of a directory it cannot write cannot take LMDB's reader
                # lock either; no writer can be at work there (same permissions).
                lock=writable or not readonly,
                # The files exist already, made by `index_files` with the store's mode.
                mode=modes_of(store).file or (LEGACY_FILE | 0o111),
            )
        except (lmdb.InvalidError, lmdb.CorruptedError) as exc:
            raise store_guard.corrupt_index(store, f"not a valid LMDB environment: {exc}")
        except lmdb.VersionMismatchError as exc:
            raise store_guard.corrupt_index(store, f"written by another LMDB: {exc}")
        except lmdb.Error as exc:
            if not _is_permission_error(exc):
                raise
            raise StoreNotWritableError(f"store index {path} cannot be opened for writing: {exc}") from None
    _PINS[id(env)] = (path, files.pin)
    if not readonly:
        env.reader_check()
    return env


def close_env(env: lmdb.Environment) -> None:
    """Close an environment `open_env` opened, and remove its private folder."""
    path, pin = _PINS.pop(id(env), (None, None))
    env.close()
    if path is not None:
        index_files.remove_pin(path, pin)


def _is_permission_error(exc: Exception) -> bool:
    # py-lmdb raises its base Error (errno text only) for EROFS and EPERM.
    text = str(exc)
    return isinstance(exc, lmdb.ReadonlyError) or any(
        os.strerror(code) in text for code in (errno.EROFS, errno.EACCES, errno.EPERM)
    )


def acquire_env(path: str, readonly: bool) -> tuple[lmdb.Environment, Gate]:
    ident = (os.getpid(), os.path.realpath(path))
    with _ENVS_LOCK:
        held = _ENVS.get(ident)
        if held is not None:
            if not readonly and held[0].flags()["readonly"]:
                raise ReadOnlyStoreError(
                    f"store index {path} is already open read-only in this process",
                    hint="open the writable handle first, or close the read-only one",
                )
            held[1] += 1
            return held[0], held[2]
        store = store_guard.store_of(path)
        if not readonly:
            require_writable(store)  # one clear error, not LMDB's "Read-only file system"
            os.makedirs(store, exist_ok=True)
        # Every open shares the store lock: a repair (which takes it alone) waits for
        # no one and is never surprised by a handle opened meanwhile.
        # A read-only handle changes nothing, not even by creating the lock file: it
        # shares the lock once any writable open (or a repair) made it.
        store_guard.share(store, create=not readonly)
        try:
            store_guard.check_no_pending_repair(store)
            if not readonly:
                root, rel = index_files.anchor(path)
                try:
                    make_dirs(path, root)  # the store's folder mode; no link followed
                except NotRegularFileError:  # refused as `index_files.checked` refuses one, naming the repair
                    raise store_guard.unsafe_entry(store, f"{rel} is a symbolic link or a file, not a folder") from None
            env = open_env(path, readonly)
        except BaseException:
            store_guard.unshare(store)
            raise
        gate = Gate()
        _ENVS[ident] = [env, 1, gate]
        return env, gate


def _forget_inherited_envs() -> None:
    # LMDB environments must not be used across fork(): a child closes the copies it
    # inherited (which clears lmdb's "already open" guard) so that it can open anew.
    for (pid, _), (env, *_) in list(_ENVS.items()):
        if pid != os.getpid():
            try:
                env.close()
            except lmdb.Error:
                pass
    _ENVS.clear()
    _PINS.clear()  # the parent's private folders are the parent's to remove
    store_guard.forget_inherited()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_envs)


def release_env(path: str) -> None:
    ident = (os.getpid(), os.path.realpath(path))
    with _ENVS_LOCK:
        held = _ENVS.get(ident)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _ENVS[ident]
            close_env(held[0])
            store_guard.unshare(store_guard.store_of(path))

"""LMDB's files checked before LMDB opens them: what ``index_env.open_env`` hands LMDB.

LMDB opens ``data.mdb`` and ``lock.mdb`` by path, creating them if missing, following
links, and (the first process to open an environment) truncates the lock file and
writes its lock table into it. In a group store any member can put a link at those
names, and make the next process that opens the store (root, or the store's owner)
truncate and write the file it points to. So, before LMDB opens anything:

- the index folder is opened by descriptor without following a link
  (`store_dir.folder_fd`), and the files are created here, exclusively, when missing;
- each file is linked (a hard link, not following a link) into a folder of this
  process's own (mode 0700, made inside the index folder: the same file system), where
  nobody else can change an entry; there each must be a regular file owned by the
  store's owner, this user, or (a group store) the store's group;
- LMDB opens that private folder through ``/proc/self/fd/<descriptor>`` (so not even a
  folder renamed meanwhile can redirect it), that is the very files just checked; the
  private folder is removed as soon as LMDB has them open.

Where a private folder cannot be made (a store this user cannot write, a system
without ``/proc``, a file system without hard links), the checks run on the index
folder itself just before LMDB opens it (a narrow window, see docs/guarantees.md).

Then ``data.mdb``'s size is checked against the pages its trees use (`index_pages`):
a file shorter than its newest meta page's ``last_pgno`` is normal after an eviction;
only one that lacks a page in use is refused (it would kill the interpreter with SIGBUS
on read).
"""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from typing import Iterator

from ..files import (
    NotRegularFileError, create_exclusive, kind_of, open_folder, open_regular, pid_alive, pid_of_temp, temp_name,
)  # fmt: skip
from . import store_guard
from .index_pages import DamagedPages, pages_in_use, read_meta
from .store_dir import file_mode, folder_fd, segment_file_count

LMDB_FILES = ("data.mdb", "lock.mdb")
PIN_STEM = "lmdb-open"  # the private folders: ``lmdb-open.<pid>.<random>.tmp``
_PROC_FD = "/proc/self/fd"
# A writer in another process may reuse a page while the walk reads it: read the
# meta page again and walk again this many times before calling the file damaged.
WALK_TRIES = 5


def anchor(index_path: str) -> tuple[str, str]:
    """(store folder, the index folder relative to it) for an index path:
    ``<store>/index``, or a rebuild's ``<store>/index.rebuild/index``."""
    parent = os.path.dirname(os.path.abspath(index_path))
    if os.path.basename(parent) == store_guard.BUILDING:
        return os.path.dirname(parent), f"{store_guard.BUILDING}/{os.path.basename(index_path)}"
    return parent, os.path.basename(index_path)


def _acceptable_owner(st: os.stat_result, store: os.stat_result) -> bool:
    if st.st_uid in (store.st_uid, os.geteuid()):
        return True
    return bool(store.st_mode & 0o070) and st.st_gid == store.st_gid  # a group store's member


def _check(dir_fd: int, name: str, store_st: os.stat_result, where: str, store: str) -> bool:
    """Whether `name` exists in `dir_fd`; raise unless it is a regular file of an
    acceptable owner."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise store_guard.unsafe_entry(store, f"{where}/{name} is {kind_of(st.st_mode)}, not a file")
    if not _acceptable_owner(st, store_st):
        raise store_guard.unsafe_entry(
            store, f"{where}/{name} belongs to uid {st.st_uid} (group {st.st_gid}), not to the store's owner or group"
        )
    return True


def _pin(idx: int, present: list[str]) -> tuple[int, str] | None:
    """A private folder in the index folder holding a hard link to each present file;
    None where that cannot be done here."""
    if not os.path.isdir(_PROC_FD):
        return None
    name = temp_name(PIN_STEM)
    try:
        os.mkdir(name, 0o700, dir_fd=idx)
    except OSError:
        return None  # a store this user cannot write: the checks run in place
    fd = open_folder(name, dir_fd=idx)
    try:
        for f in present:
            os.link(f, f, src_dir_fd=idx, dst_dir_fd=fd, follow_symlinks=False)
    except OSError:
        _unpin(idx, (fd, name))
        return None  # no hard links here (a file system without them, or not ours to link)
    return fd, name


def _unpin(idx: int, pin: tuple[int, str] | None) -> None:
    if pin is None:
        return
    fd, name = pin
    for f in LMDB_FILES:
        try:
            os.unlink(f, dir_fd=fd)
        except OSError:
            pass
    os.close(fd)
    try:
        os.rmdir(name, dir_fd=idx)
    except OSError:
        pass


def sweep_pins(idx: int) -> None:
    """Remove the private folders of processes that died while opening (best effort:
    another user's is theirs, or root's, to remove)."""
    try:
        names = [n for n in os.listdir(idx) if n.startswith(PIN_STEM + ".")]
    except OSError:
        return
    for name in names:
        pid = pid_of_temp(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        try:
            fd = open_folder(name, dir_fd=idx)
        except OSError:
            continue
        _unpin(idx, (fd, name))


def _check_size(fd: int, store: str, where: str) -> None:
    size = os.fstat(fd).st_size
    if size == 0:
        return  # made just now: LMDB writes the first meta pages
    if size < 2 * 4096:
        raise store_guard.corrupt_index(store, f"{where}/data.mdb is truncated ({size} bytes)")
    for _ in range(WALK_TRIES):
        meta = read_meta(fd)
        if meta is None:
            return  # not an LMDB file at all: LMDB says so (InvalidError)
        if (meta.last_pgno + 1) * meta.psize <= size:
            return  # holds every page there is
        try:
            need = pages_in_use(fd, meta, size)
        except DamagedPages as exc:
            damage = str(exc)
        else:
            if need * meta.psize <= size:
                return  # shorter than last_pgno, but every page in use is there
            damage = f"data.mdb holds {size // meta.psize} pages, its trees use {need}"
        again = read_meta(fd)
        size = os.fstat(fd).st_size
        if again is None or again.txnid == meta.txnid:
            raise store_guard.corrupt_index(store, f"{where}/{damage}")
    raise store_guard.corrupt_index(store, f"{where}/data.mdb keeps changing under a walk of its pages")


@contextmanager
def checked(index_path: str, *, readonly: bool, writable: bool) -> Iterator[str]:
    """The path LMDB opens for an index folder, its files checked (see the module).

    Args:
        index_path: The index folder.
        readonly: The environment is opened read-only (``data.mdb`` is not created).
        writable: This process may write the index folder (``lock.mdb`` is created).

    Yields:
        The path to hand ``lmdb.open``, valid until the context exits (open LMDB inside).

    Raises:
        StoreCorruptError: If a file is a link, a special file or a foreign one (the
            hint names ``ppc check --fix``), or ``data.mdb`` lacks a page in use.
        OSError: If the index folder cannot be opened.
    """
    store, rel = anchor(index_path)
    try:
        idx = folder_fd(store, rel)
    except NotRegularFileError:
        raise store_guard.unsafe_entry(store, f"{rel} is a symbolic link or a file, not a folder") from None
    pin = None
    try:
        store_st = os.stat(store)
        mode, exact = file_mode(store)
        if rel == "index" and not readonly and not _check(idx, "data.mdb", store_st, rel, store):
            held = segment_file_count(store)
            if held:  # a new index here would take them for orphans and sweep them
                raise store_guard.corrupt_index(store, f"index/data.mdb is missing, but {held} segment file(s) hold blocks")
        for name in LMDB_FILES if writable else ():
            if (name == "lock.mdb" or not readonly) and not _check(idx, name, store_st, rel, store):
                try:
                    os.close(create_exclusive(name, mode, dir_fd=idx, exact=exact))
                except FileExistsError:
                    pass  # another process made it meanwhile: checked below like any other
        if writable:
            sweep_pins(idx)
        present = [name for name in LMDB_FILES if _check(idx, name, store_st, rel, store)]
        pin = _pin(idx, present) if writable else None
        where = idx if pin is None else pin[0]
        for name in present:  # the files LMDB will open, as they are now
            _check(where, name, store_st, rel, store)
        if "data.mdb" in present:
            try:
                data = open_regular("data.mdb", dir_fd=where)
            except NotRegularFileError as exc:
                raise store_guard.unsafe_entry(store, f"{rel}/data.mdb: {exc.strerror}") from None
            try:
                _check_size(data, store, rel)
            finally:
                os.close(data)
        if pin is not None:
            yield f"{_PROC_FD}/{pin[0]}"
        elif os.path.isdir(_PROC_FD):
            yield f"{_PROC_FD}/{idx}"  # the folder at least cannot be swapped
        else:
            yield index_path
    finally:
        _unpin(idx, pin)
        os.close(idx)

"""LMDB's files checked before LMDB opens them: what ``index_env.open_env`` hands LMDB.

LMDB opens ``data.mdb`` and ``lock.mdb`` by path, creating them if missing, following
links, and (the first process to open an environment) truncates the lock file and
writes its lock table into it. In a group store any member can put a link at those
names, and make the next process that opens the store (root, or the store's owner)
truncate and write the file it points to. So, before LMDB opens anything:

- the index folder is opened by descriptor without following a link
  (`store_dir.folder_fd`), and the files are created here, exclusively, when missing;
- each file is hard-linked (the entry itself, never a link's target) into a folder of
  this user's own in the index folder (``lmdb-open-<uid>``, mode 0700: the same file
  system, and nobody else can change an entry in it); there each must be a regular file
  owned by the store's owner, this user, or (a group store) the store's group;
- LMDB opens those links through ``/proc/self/fd/<folder>/<name>`` (``subdir=False``: so
  not even a folder renamed meanwhile can redirect it), that is the very files just
  checked; the links are removed as soon as LMDB has the files open. The folder stays
  for the next open (one made for a single open, where somebody else holds that name,
  goes once LMDB has closed the files: `remove_pin`; a process that died leaves it, and
  its links, to `sweep_pins`).

A file replaced while it is being linked (somebody swapping it) is linked again, never
opened in place; after `PIN_TRIES` such replacements the open is refused. Where a private
folder cannot be made (a store this user cannot write, a system without ``/proc``, a
file system without hard links), the checks run on the index folder itself just before
LMDB opens it (a narrow window, see docs/guarantees.md).

Then ``data.mdb``'s size is checked against the pages its trees use (`index_pages`):
a file shorter than its newest meta page's ``last_pgno`` is normal after an eviction;
only one that lacks a page in use is refused (it would kill the interpreter with SIGBUS
on read).
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from ..files import (
    NotRegularFileError, create_exclusive, kind_of, open_folder, open_regular, pid_alive, pid_of_temp, temp_name,
)  # fmt: skip
from . import store_guard
from .index_pages import DamagedPages, Meta, pages_in_use, read_meta
from .store_dir import file_mode, folder_fd, segment_file_count

LMDB_FILES = ("data.mdb", "lock.mdb")
# The private folders: ``lmdb-open-<uid>`` (this user's, kept), or for one open where
# that name is somebody else's, ``lmdb-open-<uid>.<pid>.<random>.tmp``.
PIN_STEM = "lmdb-open"
_PROC_FD = "/proc/self/fd"
# Times an LMDB file is linked into the private folder when it keeps being replaced
# while it is linked (a member swapping it): then the open is refused.
PIN_TRIES = 16


class _KeptChanging(Exception):
    """An LMDB file was replaced every time it was linked (`_pin`)."""


# A writer in another process may commit or reuse a page while the size is checked:
# read the meta page and size again (after RELOOK_S) and check again this many times
# before calling the file damaged.
WALK_TRIES = 5
RELOOK_S = 0.005


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


@dataclass
class Pin:
    """This process's hard links to LMDB's files in a private folder: the folder's
    descriptor and name, the links' name (``<name>`` for ``data.mdb``, ``<name>-lock``
    for ``lock.mdb``), and whether the folder is made for this open alone (removed once
    LMDB closes the files: `remove_pin`)."""

    fd: int
    folder: str
    name: str
    own_folder: bool


def _private_folder(idx: int) -> tuple[int, str, bool] | None:
    """This user's private folder in the index folder (kept for later opens), or one
    made for this open alone where that name holds somebody else's; None if none can
    be made here."""
    name = f"{PIN_STEM}-{os.geteuid()}"
    for attempt in (name, None):
        fresh = attempt is None
        folder = attempt if attempt is not None else temp_name(f"{PIN_STEM}-{os.geteuid()}")
        try:
            os.mkdir(folder, 0o700, dir_fd=idx)
        except FileExistsError:
            if fresh:
                return None
        except OSError:
            return None  # a store this user cannot write: the checks run in place
        try:
            fd = open_folder(folder, dir_fd=idx)
        except OSError:
            continue  # not a folder (a link, a file somebody put there): one of our own
        if os.fstat(fd).st_uid == os.geteuid():
            # Ours: private again if somebody (root, `chmod -R`) opened it up; from here on
            # nobody else can change an entry in it (our links get fresh random names).
            os.fchmod(fd, 0o700)
            return fd, folder, fresh
        os.close(fd)  # somebody else's under our name: it could change under us
    return None


def _pin(idx: int) -> Pin | None:
    """Hard links to ``data.mdb`` and ``lock.mdb`` in a folder nobody else can change
    (`_private_folder`); None where that cannot be done here."""
    if not os.path.isdir(_PROC_FD):
        return None
    found = _private_folder(idx)
    if found is None:
        return None
    fd, folder, fresh = found
    if not fresh:
        _sweep_links(fd)
    pin = Pin(fd, folder, f"{os.getpid()}.{secrets.token_hex(8)}", fresh)
    for _ in range(PIN_TRIES):
        try:
            os.link("data.mdb", pin.name, src_dir_fd=idx, dst_dir_fd=fd, follow_symlinks=False)
            os.link("lock.mdb", pin.name + "-lock", src_dir_fd=idx, dst_dir_fd=fd, follow_symlinks=False)
            return pin
        except FileNotFoundError:
            # The entry was replaced while it was being linked (its file lost its last
            # name): somebody is swapping it. Never fall back to opening in place for
            # that (LMDB would follow whatever stands there then): link again.
            _unlink_pinned(pin)
        except OSError:
            _unpin(idx, pin)
            return None  # no hard links here (a file system without them, or not ours to link)
    _unpin(idx, pin)
    raise _KeptChanging()


def _unlink_pinned(pin: Pin) -> None:
    for name in (pin.name, pin.name + "-lock"):
        try:
            os.unlink(name, dir_fd=pin.fd)
        except OSError:
            pass


def _unpin(idx: int, pin: Pin | None, *, remove: bool = True) -> None:
    """Remove the links (at once: LMDB has the files open), and the folder if it was made
    for this open and `remove` (else once LMDB has closed them: `remove_pin`)."""
    if pin is None:
        return
    _unlink_pinned(pin)
    os.close(pin.fd)
    if remove and pin.own_folder:
        try:
            os.rmdir(pin.folder, dir_fd=idx)
        except OSError:
            pass


def _sweep_links(fd: int) -> None:
    # Links a process of this user left when it died between linking and opening.
    try:
        names = os.listdir(fd)
    except OSError:
        return
    for name in names:
        pid = name.split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError:
                pass


def remove_pin(index_path: str, folder: str | None) -> None:
    """Remove the (empty) private folder `checked` made for one open, once LMDB has
    closed its files (removed before, LMDB's close of the lock file takes milliseconds
    on ext4)."""
    if folder is None:
        return
    store, rel = anchor(index_path)
    try:
        fd = folder_fd(store, rel)
    except OSError:
        return
    try:
        os.rmdir(folder, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sweep_pins(idx: int) -> None:
    """Remove the folders made for one open by processes that died while opening (best
    effort: another user's is theirs, or root's, to remove)."""
    try:
        names = [n for n in os.listdir(idx) if n.startswith(PIN_STEM + "-")]
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
        _sweep_links(fd)
        os.close(fd)
        try:
            os.rmdir(name, dir_fd=idx)
        except OSError:
            pass


def _observe(fd: int) -> tuple[Meta | None, int]:
    """The newest meta page, then the file's size. In this order: LMDB writes a
    commit's pages before its meta page, so a size read after a meta covers every page
    that meta names (read before, a commit landing between the two reads looks like a
    truncated file)."""
    meta = read_meta(fd)
    return meta, os.fstat(fd).st_size


def _size_damage(fd: int, store: str, meta: Meta | None, size: int, *, new: bool) -> str | None:
    """What is wrong with the file's size (None: every page in use is there)."""
    if size == 0 and (new or not segment_file_count(store)):
        return None  # a new index (made here, or by an open beside this one): LMDB writes its meta pages
    if size < 2 * 4096:
        return f"data.mdb is truncated ({size} bytes)"
    if meta is None:
        return None  # not an LMDB file at all: LMDB says so (InvalidError)
    if (meta.last_pgno + 1) * meta.psize <= size:
        return None  # holds every page there is
    try:
        need = pages_in_use(fd, meta, size)
    except DamagedPages as exc:
        return str(exc)
    if need * meta.psize <= size:
        return None  # shorter than last_pgno, but every page in use is there
    return f"data.mdb holds {size // meta.psize} pages, its trees use {need}"


def _check_size(fd: int, store: str, where: str, *, new: bool) -> None:
    meta, size = _observe(fd)
    for _ in range(WALK_TRIES):
        damage = _size_damage(fd, store, meta, size, new=new)
        if damage is None:
            return
        # Damage, or a writer in another process at work: a commit (or a new index's
        # first pages) landing, a page reused under the walk. Give a write in flight a
        # moment, then look again: the same meta page and size twice are the file as it is.
        time.sleep(RELOOK_S)
        again = _observe(fd)
        if again == (meta, size):
            raise store_guard.corrupt_index(store, f"{where}/{damage}")
        meta, size = again
    raise store_guard.corrupt_index(store, f"{where}/data.mdb keeps changing under a walk of its pages")


@dataclass
class Checked:
    """What `checked` hands LMDB: the path to open (valid inside the context), whether it
    is a folder (``subdir``: else the data file, its lock file beside it as
    ``<path>-lock``), and a private folder to remove with `remove_pin` once the
    environment is closed (None: nothing to remove)."""

    path: str
    subdir: bool = True
    pin: str | None = None


@contextmanager
def checked(index_path: str, *, readonly: bool, writable: bool) -> Iterator[Checked]:
    """The path LMDB opens for an index folder, its files checked (see the module).

    Args:
        index_path: The index folder.
        readonly: The environment is opened read-only (``data.mdb`` is not created).
        writable: This process may write the index folder (``lock.mdb`` is created).

    Yields:
        A `Checked`: open LMDB on its path inside the context; once the environment is
        closed, `remove_pin` its private folder.

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
    pin, opened = None, False
    try:
        store_st = os.stat(store)
        mode, exact = file_mode(store)
        if rel == "index" and not readonly and not _check(idx, "data.mdb", store_st, rel, store):
            held = segment_file_count(store)
            if held:  # a new index here would take them for orphans and sweep them
                raise store_guard.corrupt_index(
                    store, f"index/data.mdb is missing, but {held} segment file(s) hold blocks"
                )
        for name in LMDB_FILES if writable else ():
            if (name == "lock.mdb" or not readonly) and not _check(idx, name, store_st, rel, store):
                try:
                    os.close(create_exclusive(name, mode, dir_fd=idx, exact=exact))
                except FileExistsError:
                    pass  # another process made it meanwhile: checked below like any other
        if writable:
            sweep_pins(idx)
        present = [name for name in LMDB_FILES if _check(idx, name, store_st, rel, store)]
        try:
            pin = _pin(idx) if writable and len(present) == 2 else None
        except _KeptChanging:
            raise store_guard.unsafe_entry(
                store, f"{rel}/data.mdb or {rel}/lock.mdb was replaced while it was opened, {PIN_TRIES} times"
            ) from None
        if pin is not None:  # the files LMDB will open, as they are now: nobody can swap them
            where, names = pin.fd, {"data.mdb": pin.name, "lock.mdb": pin.name + "-lock"}
        else:
            where, names = idx, {name: name for name in present}
        for name in present:
            _check(where, names[name], store_st, rel, store)
        if "data.mdb" in present:
            try:
                data = open_regular(names["data.mdb"], dir_fd=where)
            except NotRegularFileError as exc:
                raise store_guard.unsafe_entry(store, f"{rel}/data.mdb: {exc.strerror}") from None
            try:
                _check_size(data, store, rel, new=rel != "index")
            finally:
                os.close(data)
        if pin is not None:
            yield Checked(f"{_PROC_FD}/{pin.fd}/{pin.name}", subdir=False, pin=pin.folder if pin.own_folder else None)
        elif os.path.isdir(_PROC_FD):
            yield Checked(f"{_PROC_FD}/{idx}")  # the folder at least cannot be swapped
        else:
            yield Checked(index_path)
        opened = True
    finally:
        # The hard links go at once; the empty folder stays until `remove_pin` (unless
        # LMDB did not open: then it goes now).
        _unpin(idx, pin, remove=not opened)
        os.close(idx)

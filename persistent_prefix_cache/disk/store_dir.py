"""The store folder: where a store may be made, and the modes of what it holds.

A store holds users' prompts (token ids in the index and segment headers) and their
KV, so it is **private by default**: a new store's folder is 0700 and everything in it
0700 (folders) or 0600 (files), whatever the umask. A store meant for a group (a
service account and its operators) is made with ``shared=True`` (``--store-shared``):
its folder is 2770 (setgid, so new files take the folder's group) and its files 0660.
Others never get a bit.

The store folder's own mode is the record every later writer follows (`modes_of`):
its group bits are given to everything created inside; a folder that grants others
any bit is a store made before this rule (or opened up by hand), whose new files keep
following the umask as they always did until the user asks (``ppc check --fix``, see
`make_private`). So changing a store is one ``chmod`` of its folder, and no two
writers can disagree.

Nothing the store does leaves it (a group store's members can put links anywhere in
it): its folders are opened by descriptor, the store folder where the user's path leads
and each folder inside without following a link (`folder_fd`); files are created
exclusively under names nobody can predict (`TempFile`, see `files`) and renamed or
unlinked relative to those descriptors (`TempFile.move_to`, `remove_entry`).

Where a store may be made (`check_location`, the one rule the library and ``ppc``
share): a new path whose nearest existing folder this process can write, an empty
folder (or what a creation killed midway left: ``segments/``, ``tmp/``), or a store.
Never a file, a folder of other files, or a place this process cannot write.
"""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import StoreNotWritableError, StorePathError
from ..files import NotRegularFileError, create_temp, open_folder
from .store_guard import corrupt_index

PRIVATE_FOLDER, PRIVATE_FILE = 0o700, 0o600
SHARED_FOLDER, SHARED_FILE = 0o2770, 0o660
# The modes of a store made before stores were private: the umask decides, as then.
LEGACY_FILE = 0o644


@dataclass(frozen=True)
class Modes:
    """The modes of what is created in one store (None: leave it to the umask)."""

    folder: int | None
    file: int | None


def modes_of(root: str) -> Modes:
    """The modes new folders and files of the store at `root` get, from its folder's mode.

    Args:
        root: The store directory.

    Returns:
        Private (0700/0600) plus the group bits of the store folder; `Modes(None,
        None)` if the folder grants others any bit (a store from before this rule) or
        does not exist.
    """
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return Modes(None, None)
    if mode & 0o007:
        return Modes(None, None)
    group = mode & 0o070
    return Modes(PRIVATE_FOLDER | group | (mode & stat.S_ISGID), PRIVATE_FILE | (group & 0o060))


def _subfolder(parent: int, name: str, modes: Modes | None) -> tuple[int, bool]:
    """Open the folder `name` in `parent` without following a link; with `modes`, make
    it first if it is missing. Returns (descriptor, whether it was made here)."""
    try:
        return open_folder(name, dir_fd=parent), False
    except FileNotFoundError:
        if modes is None:
            raise
    try:
        os.mkdir(name, 0o700 if modes.folder is not None else 0o777, dir_fd=parent)
        made = True
    except FileExistsError:
        made = False  # another writer made it: its mode is the same
    fd = open_folder(name, dir_fd=parent)
    if made and modes.folder is not None:
        try:
            os.fchmod(fd, modes.folder)  # by descriptor: never a link put there meanwhile
        except BaseException:
            os.close(fd)
            raise
    return fd, made


def folder_fd(root: str, rel: str = "", *, create: bool = False) -> int:
    """Open a folder of the store at `root` by descriptor: the store folder where the
    user's path leads, then each component of `rel` without following a link, so that
    what is done relative to the descriptor happens inside the store.

    Args:
        root: The store directory.
        rel: A folder inside it (``"segments/ab"``; ``""``: the store folder itself).
        create: Make missing folders with the store's folder mode (a missing store
            folder is made private, `create_root`).

    Returns:
        The descriptor (the caller closes it).

    Raises:
        NotRegularFileError: If a component is a link or a file (somebody put it
            there: ``ppc check --fix`` removes it).
        OSError: If a folder is missing (and not `create`) or cannot be opened.
    """
    if create and not os.path.isdir(root):
        create_root(root)
    modes = modes_of(root) if create else None
    fd = open_folder(root, follow=True)
    try:
        for part in rel.split("/"):
            if part and part != ".":
                sub, _ = _subfolder(fd, part, modes)
                os.close(fd)
                fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def folder(root: str, rel: str = "", *, create: bool = False) -> Iterator[int]:
    """`folder_fd` as a context manager (the descriptor is closed on exit)."""
    fd = folder_fd(root, rel, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def make_dirs(path: str, root: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` for a folder inside the store at `root`, each
    folder it creates given the store's folder mode (the umask does not narrow it); a
    missing store folder is made private (`create_root`). No link is followed.

    Raises:
        NotRegularFileError: If a component of `path` inside the store is a link or a file.
    """
    os.close(folder_fd(root, os.path.relpath(os.path.abspath(path), os.path.abspath(root)), create=True))


def subfolder(parent: int, name: str, root: str) -> tuple[int, bool]:
    """Open (or make, with the store's folder mode) the folder `name` in the store
    folder open as `parent`, without following a link.

    Returns:
        (descriptor, whether it was made here: the caller fsyncs `parent` then).
    """
    return _subfolder(parent, name, modes_of(root))


def file_mode(root: str) -> tuple[int, bool]:
    """The mode a new file of the store at `root` gets: (bits, exact). Exact: set as
    is; else the umask narrows it (a store from before stores were private)."""
    mode = modes_of(root).file
    return (mode, True) if mode is not None else (LEGACY_FILE, False)


class TempFile:
    """A temporary file of a store, created exclusively in one of its folders under a
    name nobody can predict (`files.temp_name`) with the store's file mode, and moved
    into place (`move_to`) or removed (`discard`) by descriptor: inside the store.

    Args:
        root: The store directory.
        folder: The folder it is made in (``"tmp"``; ``""``: the store folder).
        stem: What it will become (a segment id in hex, a file name), without dots.
        flags: ``os.O_WRONLY`` or ``os.O_RDWR``.

    Attributes:
        fd: The open file (None once closed).
        path: Its path (for messages).
    """

    def __init__(self, root: str, folder: str, stem: str, *, flags: int = os.O_WRONLY):
        self.root = root
        self.dir_fd: int | None = folder_fd(root, folder, create=True)
        mode, exact = file_mode(root)
        try:
            fd, name = create_temp("", stem, mode, dir_fd=self.dir_fd, flags=flags, exact=exact)
        except BaseException:
            os.close(self.dir_fd)
            raise
        self.fd: int | None = fd
        self.name: str | None = name
        self.path = os.path.join(root, folder, name)

    def fileno(self) -> int:
        """The open file's descriptor.

        Raises:
            ValueError: If the file was closed.
        """
        if self.fd is None:
            raise ValueError(f"{self.path} is closed")
        return self.fd

    def close_file(self) -> None:
        """Close the file (it stays where it is)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def move_to(self, dst_fd: int, name: str) -> None:
        """Close the file and rename it to `name` in the store folder open as `dst_fd`
        (replacing what is there, a link itself and never its target); then `discard`
        closes the rest.

        Raises:
            OSError: If the rename fails (then the caller's `discard` removes the file).
            ValueError: If the file was moved or removed already.
        """
        if self.name is None:
            raise ValueError(f"{self.path} was moved or removed already")
        self.close_file()
        os.replace(self.name, name, src_dir_fd=self.dir_fd, dst_dir_fd=dst_fd)
        self.name = None
        self.discard()

    def discard(self) -> None:
        """Close and remove the file (unless it was moved), and close its folder."""
        self.close_file()
        if self.name is not None:
            try:
                os.unlink(self.name, dir_fd=self.dir_fd)
            except OSError:
                pass
            self.name = None
        if self.dir_fd is not None:
            fd, self.dir_fd = self.dir_fd, None
            os.close(fd)


def remove_entry(root: str, rel: str, *, regular_only: bool = False) -> bool:
    """Unlink an entry of the store at `root` by descriptor: a link is removed itself,
    never followed, and a link among the folders on the way stops it.

    Args:
        root: The store directory.
        rel: The entry (``"segments/ab/<id>.seg"``).
        regular_only: Remove it only if it is a regular file.

    Returns:
        Whether it was removed (False: missing, not a regular file with
        `regular_only`, or a link on the way).

    Raises:
        OSError: If it cannot be removed (permissions).
    """
    parent, name = os.path.split(rel)
    try:
        fd = folder_fd(root, parent)
    except (FileNotFoundError, NotRegularFileError):
        return False
    try:
        if regular_only and not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            return False
        os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def store_exists(path: str) -> bool:
    """Whether `path` holds a store (its ``index/`` folder)."""
    return os.path.isdir(os.path.join(path, "index"))


def unwritable_part(path: str) -> str | None:
    """The first folder or index file of the store at `path` this process cannot write
    (None if it can write them all): permissions, another user's files, a read-only
    file system (`os.access` reports each)."""
    parts = [path] + [os.path.join(path, p) for p in ("index", "segments", "tmp", "blocks")]
    parts += [os.path.join(path, "index", f) for f in ("data.mdb", "lock.mdb")]
    for p in parts:
        if os.path.exists(p) and not os.access(p, os.W_OK | (os.X_OK if os.path.isdir(p) else 0)):
            return p
    return None


def _why_not_writable(path: str) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    except OSError:
        pass
    return "is not writable by this user"


def require_writable(path: str, *, hint: str | None = None) -> None:
    """Raise `StoreNotWritableError` if any part of the store at `path` cannot be written.

    Args:
        path: The store directory.
        hint: What to do (default: `StoreNotWritableError`'s).
    """
    part = unwritable_part(path)
    if part is not None:
        where = f"store {path}" if part == path else f"store {path}: {part}"
        raise StoreNotWritableError(f"{where} {_why_not_writable(part)}", hint=hint)


def check_readable(path: str, *, what: str = "store") -> None:
    """Raise `StoreNotWritableError` if `path` is a folder this process cannot open
    (another user's private store): "no store here" would be a wrong answer."""
    if os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):
        st = os.stat(path)
        raise StoreNotWritableError(
            f"{what} {path}: this user cannot open it (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid})",
            hint="run as the store's owner, or have its owner share it with your group "
            "(`ppc check --fix --store-shared`, then chgrp -R GROUP STORE)",
        )


def segment_file_count(path: str) -> int:
    """How many segment files ``segments/`` of `path` holds."""
    top = os.path.join(path, "segments")
    try:
        subs = [e.path for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
        return sum(1 for sub in subs for e in os.scandir(sub) if e.name.endswith(".seg"))
    except OSError:
        return 0


def _left_by_a_creation(path: str, name: str) -> bool:
    # A process killed while creating a store leaves ``lock``, ``segments/`` (two-hex-digit
    # folders, no segment file: those are written only once ``index/`` exists) and
    # ``tmp/`` (``*.tmp`` files) before ``index/``: that folder is still ours to finish;
    # anything else is the user's.
    p = os.path.join(path, name)
    if name == "lock":
        return os.path.isfile(p) and not os.path.islink(p)
    if name not in ("segments", "tmp") or os.path.islink(p) or not os.path.isdir(p):
        return False
    if name == "tmp":
        return all(f.endswith(".tmp") for f in os.listdir(p))
    return all(len(f) == 2 and all(c in "0123456789abcdef" for c in f) for f in os.listdir(p))


def check_location(path: str, *, readonly: bool = False, what: str = "store") -> bool:
    """Whether a store is at `path`; raise if none is and none may be made there.

    Creates nothing. Call it before creating anything (`create_root` next).

    Args:
        path: The store directory (absolute, expanded).
        readonly: Only an existing store will do.
        what: How to name the path in messages (``store``, ``--store``).

    Returns:
        True if a store is at `path` (whether this process can write it is the
        caller's question: `unwritable_part`), False if one may be created there.

    Raises:
        StorePathError: If `path` is a file, a folder of other files, under a file,
            or (with `readonly`) holds no store.
        StoreNotWritableError: If a store would have to be created where this process
            cannot write, or `path` is a folder it cannot open.
        StoreCorruptError: If `path` holds segment files but no index (a lost index:
            the hint names ``ppc check --fix``, which rebuilds it from them).
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StorePathError(f"{what} {path}: is a file, not a directory")
    check_readable(path, what=what)
    if store_exists(path):
        return True
    held = segment_file_count(path)
    if held:
        # A store that lost its index: a new one here would sweep these as orphans.
        raise corrupt_index(path, f"index/ is missing, but {held} segment file(s) hold blocks")
    if readonly:
        raise StorePathError(f"no store at {path} to open read-only", hint="give the folder of an existing store")
    if os.path.isdir(path):
        try:
            foreign = [name for name in sorted(os.listdir(path)) if not _left_by_a_creation(path, name)]
        except OSError as exc:
            raise StoreNotWritableError(f"{what} {path}: cannot list it: {exc.strerror}") from None
        if foreign:
            raise StorePathError(
                f"{what} {path}: folder has files but no store in it (no index/; found {foreign[0]!r})",
                hint="give a new or empty folder; a store is never made among other files",
            )
        place = path
    else:
        place = os.path.dirname(path) or os.curdir  # a bare name (`--store kv`) lives in the cwd
        while not os.path.lexists(place) and place != os.path.dirname(place):
            place = os.path.dirname(place)
        if not os.path.isdir(place):
            raise StorePathError(f"{what} {path}: {place} is a file, not a directory")
    if not os.access(place, os.W_OK | os.X_OK):
        raise StoreNotWritableError(
            f"cannot create {what} {path}: {place} {_why_not_writable(place)}",
            hint="give a directory you can write, or fix its permissions; nothing was created",
        )
    return False


def create_root(path: str, *, shared: bool = False) -> bool:
    """Make the folder of a new store (or claim an empty one) with its mode: 0700, or
    2770 if `shared`. The parents it needs are made as ``mkdir -p`` makes them.

    Returns:
        Whether the folder itself was made here (else it existed, empty).
    """
    made = not os.path.isdir(path)
    os.makedirs(path, exist_ok=True)
    os.chmod(path, SHARED_FOLDER if shared else PRIVATE_FOLDER)
    return made


def missing_folders(path: str) -> list[str]:
    """The folders that creating `path` (as ``mkdir -p``, `create_root`) would make: `path`
    and its missing parents, deepest first (none if `path` exists)."""
    out, p = [], os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        out.append(p)
        p = os.path.dirname(p)
    return out


def undo_creation(path: str, *, made_folder: bool, parents: Sequence[str] = ()) -> None:
    """Take back a store this process has just created and not written to (its open
    failed: a wrong model, a refused remote URL, a damaged pack): what a caller's mistake
    made is gone again. Only what a creation makes is removed, and nothing once a
    segment exists.

    Args:
        path: The store directory.
        made_folder: Remove the folder too (`create_root` made it).
        parents: Folders above it that the creation made (`missing_folders`, deepest
            first): removed too, each while it is empty.
    """
    if segment_file_count(path):
        return  # another process has begun to use the store meanwhile: leave it
    for name in ("index/data.mdb", "index/lock.mdb", "lock"):
        try:
            remove_entry(path, name)  # by descriptor: a link put in the way is not followed
        except OSError:
            pass
    for top in ("segments", "index", "tmp"):
        try:
            with folder(path, top) as fd:
                # segments/ab/ folders; the private folder LMDB's files were pinned in
                subs = os.listdir(fd) if top in ("segments", "index") else []
                for sub in subs:
                    try:
                        os.rmdir(sub, dir_fd=fd)  # only an empty folder: never somebody's files
                    except OSError:
                        pass
            os.rmdir(os.path.join(path, top))
        except OSError:
            pass
    if made_folder:
        for made in [path, *parents]:
            try:
                os.rmdir(made)  # only an empty folder: never somebody's files
            except OSError:
                break

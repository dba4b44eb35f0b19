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

Where a store may be made (`check_location`, the one rule the library and ``ppc``
share): a new path whose nearest existing folder this process can write, an empty
folder (or what a creation killed midway left: ``segments/``, ``tmp/``), or a store.
Never a file, a folder of other files, or a place this process cannot write.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..errors import StoreNotWritableError, StorePathError
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


def make_dirs(path: str, root: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` for a folder inside the store at `root`, each
    folder it creates given the store's folder mode (the umask does not narrow it); a
    missing store folder is made private (`create_root`)."""
    if not os.path.isdir(root):
        create_root(root)
    modes = modes_of(root)
    missing = []
    p = os.path.abspath(path)
    stop = os.path.abspath(root)
    while p != stop and not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700 if modes.folder is not None else 0o777)
        except FileExistsError:
            continue  # another writer made it: its mode is the same
        if modes.folder is not None:
            os.chmod(folder, modes.folder)


def create_file(path: str, root: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """Open (create) a file in the store at `root` with the store's file mode.

    Returns:
        The file descriptor (the caller closes it).
    """
    mode = modes_of(root).file
    fd = os.open(path, flags, PRIVATE_FILE if mode is not None else LEGACY_FILE)
    if mode is not None:
        try:
            os.fchmod(fd, mode)  # the umask may have taken group bits away
        except BaseException:
            os.close(fd)
            raise
    return fd


def set_file_mode(path: str, root: str) -> None:
    """Give a file the store's file mode (for files created by others: LMDB's). Best
    effort: a file another user of a shared store made first is theirs to set."""
    mode = modes_of(root).file
    try:
        if mode is not None and stat.S_IMODE(os.stat(path).st_mode) != mode:
            os.chmod(path, mode)
    except OSError:
        pass


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
        place = os.path.dirname(os.path.abspath(path))  # a bare name ("kv") lies in the working folder
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


def undo_creation(path: str, *, made_folder: bool) -> None:
    """Take back a store this process has just created and not written to (its open
    failed: a wrong model, a refused remote URL): what a caller's mistake made is gone
    again. Only what a creation makes is removed, and nothing once a segment exists.

    Args:
        path: The store directory.
        made_folder: Remove the folder too (`create_root` made it).
    """
    if segment_file_count(path):
        return  # another process has begun to use the store meanwhile: leave it
    for name in ("index/data.mdb", "index/lock.mdb", "lock"):
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass
    tops = ["index", "tmp", "segments"] + ([""] if made_folder else [])
    for top in tops:
        folder = os.path.join(path, top)
        subs = [os.path.join(folder, e) for e in os.listdir(folder)] if top == "segments" and os.path.isdir(folder) else []
        for sub in subs + [folder]:
            try:
                os.rmdir(sub)  # only an empty folder: never somebody's files
            except OSError:
                pass


# -- the permissions finding of ``ppc check`` -----------------------------------------------


def exposed(root: str) -> list[tuple[str, int]]:
    """What in the store at `root` other users can read, write or enter.

    Returns:
        (path relative to `root` ("." for the folder itself), mode) per entry.
    """
    out = []
    for folder, dirs, files in os.walk(root):
        for p in [folder] + [os.path.join(folder, f) for f in files]:
            try:
                mode = stat.S_IMODE(os.lstat(p).st_mode)
            except OSError:
                continue  # removed meanwhile (a writer at work)
            if mode & 0o007 and not os.path.islink(p):
                out.append((os.path.relpath(p, root), mode))
    return out


def make_private(root: str, *, shared: bool = False) -> tuple[int, list[str]]:
    """Give everything in the store at `root` the modes of a new store: 0700/0600, or
    2770/0660 if `shared` or the store folder already grants its group write (a group
    store stays one). Others lose every bit.

    Returns:
        (how many folders and files changed mode, paths relative to `root` that could
        not be changed: another user's files, whose owner must run it).
    """
    shared = shared or bool(os.stat(root).st_mode & stat.S_IWGRP)
    folder_mode, file_mode = (SHARED_FOLDER, SHARED_FILE) if shared else (PRIVATE_FOLDER, PRIVATE_FILE)
    changed, refused = 0, []
    for folder, dirs, files in os.walk(root):
        for p, want in [(folder, folder_mode)] + [(os.path.join(folder, f), file_mode) for f in files]:
            try:
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == want:
                    continue
                os.chmod(p, want)
            except FileNotFoundError:
                continue  # removed meanwhile (a writer at work)
            except PermissionError:
                refused.append(os.path.relpath(p, root))
                continue
            changed += 1
    return changed, refused


def permissions_finding(root: str, *, fix: bool = False, shared: bool = False) -> dict:
    """``ppc check``'s finding on who else can open the store (see `exposed`); with
    `fix`, the store made private (`make_private`; `shared`: kept for its group).

    Returns:
        ``exposed`` (how many entries others could read, write or enter), ``examples``
        (up to 3 ``"path 0644"``), ``made_private`` (entries changed) and ``refused``
        (entries this user could not change).
    """
    # Files first: they hold the prompts.
    found = sorted(exposed(root), key=lambda e: (os.path.isdir(os.path.join(root, e[0])), e[0]))
    out = {"exposed": len(found), "examples": [f"{p} {m:04o}" for p, m in found[:3]], "made_private": 0, "refused": []}
    if fix and (found or shared):
        out["made_private"], out["refused"] = make_private(root, shared=shared)
    return out


def describe_finding(finding: dict) -> list[str]:
    """`permissions_finding` as lines for ``ppc check``'s text output (none if nothing)."""
    lines = []
    if finding["exposed"] and not finding["made_private"] and not finding["refused"]:
        lines.append(
            f"warning: {finding['exposed']} file(s)/folder(s) of the store are open to other users "
            f"({', '.join(finding['examples'])}): they can read the stored prompts; run with --fix to make "
            "them private (0700/0600; with --store-shared the group keeps read/write), or `chmod -R go-rwx STORE`"
        )
    if finding["made_private"]:
        lines.append(f"made {finding['made_private']} file(s)/folder(s) private to their owner (or group)")
    if finding["refused"]:
        lines.append(
            f"warning: {len(finding['refused'])} entries could not be changed (another user's files, e.g. "
            f"{finding['refused'][0]}): their owner must run `ppc check --fix`"
        )
    return lines

"""What ``ppc check`` finds among a store's files themselves: entries that are not the
store's (links, special files, files of a foreign owner, pin folders of dead processes)
and who else can read it; with ``--fix``, those removed, handed back or made private.

Every walk here goes by descriptor (`walk`): a folder is opened without following a
link and checked to be the one listed, so nothing it does (an unlink, a chmod, a chown)
can reach a file outside the store, whatever a member of a group store puts inside it.

- A **link** or a **special file** (FIFO, socket, device) is never the store's: with
  ``fix`` it is unlinked (the entry itself; what a link points to is never touched).
- A file or folder of a **foreign owner**: in a private store, not owned by the store
  folder's owner; in a group store, neither that owner's nor of the store's group. With
  ``fix``, root hands it to the store's owner and group, its owner gives it the store's
  group; anyone else is told who must run the fix.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Iterator

from ..disk.index_files import PIN_STEM
from ..disk.store_dir import PRIVATE_FILE, PRIVATE_FOLDER, SHARED_FILE, SHARED_FOLDER
from ..files import NotRegularFileError, kind_of, open_folder, open_regular, pid_alive, pid_of_temp
from .pack_sign import KEY_FILE

MAX_DEPTH = 16  # a store is a few folders deep; deeper nests are not walked (and reported)
# Where an entry that is not the store's stops every open (LMDB's files, the store lock).
OPENS_THROUGH = ("index", "lock")
BLOCKING = ("link", "special file", "foreign owner")


@dataclass
class Entry:
    """One entry of a store met by `walk`: its path relative to the store (``"."`` for
    the store folder), its ``lstat``, the descriptor of its folder and its name there."""

    rel: str
    st: os.stat_result
    parent: int | None
    name: str


def walk(root: str, *, depth_note: list[str] | None = None) -> Iterator[Entry]:
    """Every entry of the store at `root`, parents first, without following a link.

    The folder descriptors stay open while their entries are handled (an `Entry`'s
    ``parent`` is valid until the next one of another folder).

    Args:
        root: The store directory.
        depth_note: Collects folders not walked because they nest deeper than `MAX_DEPTH`.
    """
    top = open_folder(root, follow=True)
    try:
        yield Entry(".", os.fstat(top), None, "")
        yield from _walk(top, "", 1, depth_note)
    finally:
        os.close(top)


def _walk(fd: int, rel: str, depth: int, depth_note: list[str] | None) -> Iterator[Entry]:
    try:
        names = sorted(os.listdir(fd))
    except OSError:
        return  # not ours to list (another member's private folder): nothing to see
    for name in names:
        path = f"{rel}{name}"
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile (a writer at work)
        yield Entry(path, st, fd, name)
        if not stat.S_ISDIR(st.st_mode):
            continue
        if depth >= MAX_DEPTH:
            if depth_note is not None:
                depth_note.append(path)
            continue
        try:
            sub = open_folder(name, dir_fd=fd)
        except OSError:
            continue
        try:
            if os.path.samestat(os.fstat(sub), st):  # still the folder listed, not a swap
                yield from _walk(sub, f"{path}/", depth + 1, depth_note)
        finally:
            os.close(sub)


def _foreign(st: os.stat_result, root: os.stat_result) -> bool:
    if st.st_uid == root.st_uid:
        return False
    return not (root.st_mode & 0o070 and st.st_gid == root.st_gid)


def _pin_entry(e: Entry) -> str | None:
    """``"folder"`` for a private folder of `index_files` (``index/lmdb-open-<uid>...``),
    ``"link"`` for an entry in one, None otherwise."""
    parts = e.rel.split("/")
    if len(parts) in (2, 3) and parts[0] == "index" and parts[1].startswith(PIN_STEM + "-"):
        return "folder" if len(parts) == 2 else "link"
    return None


def _stale_pin(e: Entry, kind: str) -> bool:
    """A private folder made for one open, or a link, of a process that is gone."""
    pid = pid_of_temp(e.name) if kind == "folder" else e.name.split(".")[0]
    pid = int(pid) if isinstance(pid, str) and pid.isdigit() else pid
    return isinstance(pid, int) and not pid_alive(pid)


def entry_findings(root: str, *, fix: bool = False) -> tuple[list[tuple[str, str]], list[str], int]:
    """Links, special files, foreign-owned entries and leftover pin folders in a store.

    Args:
        root: The store directory.
        fix: Remove links and special files (the entries themselves), hand foreign
            files to the store's owner and group where this user may.

    Returns:
        (problems as ``(kind, detail)``, problems left unfixed (details), how many
        entries were fixed).
    """
    problems: list[tuple[str, str]] = []
    left: list[str] = []
    fixed = 0
    deep: list[str] = []
    root_st = None
    for e in walk(root, depth_note=deep):
        if e.parent is None:
            root_st = e.st
            continue
        mode = e.st.st_mode
        if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            what = kind_of(mode)
            if stat.S_ISLNK(mode):
                try:
                    what += f" to {os.readlink(e.name, dir_fd=e.parent)}"
                except OSError:
                    pass
            kind = "link" if stat.S_ISLNK(mode) else "special file"
            problems.append((kind, f"{e.rel}: {what} (not the store's)"))
            if fix:
                fixed += _try(lambda: os.unlink(e.name, dir_fd=e.parent), e.rel, left)
            continue
        pin = _pin_entry(e)
        if pin is not None:  # this user's or another's: never the store's owner's to judge
            if _stale_pin(e, pin):
                problems.append((f"leftover temporary {'folder' if pin == 'folder' else 'file'}", e.rel))
                if fix:
                    fixed += _try(lambda: _remove_pin(e) if pin == "folder" else os.unlink(e.name, dir_fd=e.parent),
                                  e.rel, left)  # fmt: skip
            continue
        if root_st is not None and _foreign(e.st, root_st):
            problems.append(
                ("foreign owner", f"{e.rel}: owned by uid {e.st.st_uid} group {e.st.st_gid}, "
                 f"the store by uid {root_st.st_uid} group {root_st.st_gid}")
            )  # fmt: skip
            if fix:
                fixed += _try(lambda: _hand_back(e, root_st), e.rel, left)
    for rel in deep:
        problems.append(("nested too deep", f"{rel}: folders below it were not checked"))
        left.append(rel)
    return problems, left, fixed


def _try(action, rel: str, left: list[str]) -> int:
    try:
        action()
    except FileNotFoundError:
        return 1  # gone meanwhile
    except OSError as exc:
        left.append(f"{rel} ({exc.strerror})")
        return 0
    return 1


def _remove_pin(e: Entry) -> None:
    fd = open_folder(e.name, dir_fd=e.parent)
    try:
        for name in os.listdir(fd):
            os.unlink(name, dir_fd=fd)  # hard links of the index's files: the files stay
    finally:
        os.close(fd)
    os.rmdir(e.name, dir_fd=e.parent)


def _hand_back(e: Entry, root: os.stat_result) -> None:
    uid = root.st_uid if os.geteuid() == 0 else -1
    # lchown: the entry itself (a swap to a link meanwhile changes the link, not its target).
    os.chown(e.name, uid, root.st_gid, dir_fd=e.parent, follow_symlinks=False)
    if os.geteuid() != 0 and _foreign(os.stat(e.name, dir_fd=e.parent, follow_symlinks=False), root):
        raise PermissionError(1, "only its owner or root can hand it to the store's owner")


def blocks_opening(kind: str, detail: str) -> bool:
    """Whether a finding (`kind` ``""``: any) makes every open of the store refuse until
    it is fixed: a link, special or foreign file among LMDB's files or at the lock."""
    return (not kind or kind in BLOCKING) and detail.split("/")[0].split(":")[0].split(" ")[0] in OPENS_THROUGH


def describe_entries(left: list[str]) -> list[str]:
    """Lines for ``ppc check`` about entry findings `--fix` could not settle."""
    if not left:
        return []
    return [
        f"warning: {len(left)} entr{'y' if len(left) == 1 else 'ies'} could not be fixed by this user "
        f"(e.g. {left[0]}): run `ppc check --fix` as root or as their owner"
    ]


# -- who else can read the store ----------------------------------------------------------


def exposed(root: str) -> list[tuple[str, int]]:
    """What in the store at `root` other users can read, write or enter.

    Returns:
        (path relative to `root` ("." for the folder itself), mode) per entry; links
        and special files are left to `entry_findings`.
    """
    return [
        (e.rel, stat.S_IMODE(e.st.st_mode))
        for e in walk(root)
        if (stat.S_ISREG(e.st.st_mode) or stat.S_ISDIR(e.st.st_mode)) and e.st.st_mode & 0o007
    ]


def make_private(root: str, *, shared: bool = False) -> tuple[int, list[str]]:
    """Give everything in the store at `root` the modes of a new store: 0700/0600, or
    2770/0660 if `shared` or the store folder already grants its group write (a group
    store stays one). Others lose every bit. Each mode is set through a descriptor of
    the entry opened without following a link: never on what a link points to.

    Returns:
        (how many folders and files changed mode, paths relative to `root` that could
        not be changed: another user's files, whose owner must run it).
    """
    shared = shared or bool(os.stat(root).st_mode & stat.S_IWGRP)
    folder_mode, file_mode = (SHARED_FOLDER, SHARED_FILE) if shared else (PRIVATE_FOLDER, PRIVATE_FILE)
    changed, refused = 0, []
    for e in walk(root):
        is_dir = stat.S_ISDIR(e.st.st_mode)
        if not (is_dir or stat.S_ISREG(e.st.st_mode)) or _pin_entry(e):
            continue  # links and special files: never chmod-ed (entry_findings removes them);
            # the private folders of `index_files` stay private
        want = folder_mode if is_dir else PRIVATE_FILE if e.rel == KEY_FILE else file_mode  # `pack_sign`: the
        # pack key stays its owner's in a group store too (its members may not sign)
        if stat.S_IMODE(e.st.st_mode) == want:
            continue
        try:
            if e.parent is None:
                fd = open_folder(root, follow=True)
            elif is_dir:
                fd = open_folder(e.name, dir_fd=e.parent)
            else:
                fd = open_regular(e.name, dir_fd=e.parent)
        except FileNotFoundError:
            continue  # removed meanwhile (a writer at work)
        except NotRegularFileError:
            continue  # swapped for a link or a FIFO meanwhile: entry_findings' business
        except PermissionError:
            refused.append(e.rel)
            continue
        try:
            if os.path.samestat(os.fstat(fd), e.st):
                os.fchmod(fd, want)
                changed += 1
        except PermissionError:
            refused.append(e.rel)
        finally:
            os.close(fd)
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

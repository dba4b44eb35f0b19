"""Files created and opened so that no other user can redirect them: the one home of
every temporary name and of every open of a file someone else could have replaced.

A folder that other users may write (a group store, a shared export folder) lets them
plant a symbolic link, a FIFO or a hard link at any name they can predict. So:

- a file is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``): never through a
  link, never over an existing file; a temporary one under a name with a random part
  (`temp_name`), so nobody can plant anything at it beforehand;
- a file that may stand where a special one could (`open_regular`) is opened without
  following a link and without blocking (a FIFO would block an open for ever), then
  checked with ``fstat`` to be a regular file;
- a folder is opened by descriptor without following a link (`open_folder`), so what
  is done relative to it stays in it (``dir_fd=``: rename, unlink, create).

Every descriptor is close-on-exec: a program a process spawns inherits none of them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from typing import BinaryIO, Callable

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# How a new file is created: exclusively, never through a link.
CREATE = os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
TEMP_SUFFIX = ".tmp"


class NotRegularFileError(OSError):
    """A path names a link, a FIFO, a device, a socket or a folder where a regular file
    was expected (raised by `open_regular`; an `OSError`, so callers that treat a file
    they cannot open as missing or damaged do so here too)."""


def temp_name(stem: str) -> str:
    """A temporary file's name: ``<stem>.<pid>.<16 random hex digits>.tmp``.

    The process id lets a sweep tell a live writer's file from a dead one's; the random
    part makes the name unpredictable, so no other user can plant a link at it first.

    Args:
        stem: What the file will become (a segment id in hex, a file name); no dots.
    """
    return f"{stem}.{os.getpid()}.{secrets.token_hex(8)}{TEMP_SUFFIX}"


def pid_of_temp(name: str) -> int | None:
    """The writer's process id in a `temp_name` (None if `name` is not one)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[3] != TEMP_SUFFIX[1:] or not parts[1].isdigit():
        return None
    return int(parts[1])


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a writer whose temporary files stay)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def create_exclusive(
    path: str, mode: int, *, dir_fd: int | None = None, flags: int = os.O_WRONLY, exact: bool = True
) -> int:
    """Create a new file, exclusively and never through a link, with the mode `mode`.

    Args:
        path: The new file (relative to `dir_fd` if given).
        mode: Its permission bits.
        dir_fd: A folder descriptor (see `open_folder`).
        flags: ``os.O_WRONLY`` or ``os.O_RDWR``.
        exact: Set `mode` with ``fchmod`` (the umask does not narrow it); False: the
            umask narrows it, as for any new file.

    Returns:
        The file descriptor (the caller closes it).

    Raises:
        FileExistsError: If anything (a file, a link, a FIFO) already has that name.
        OSError: As ``open`` raises otherwise.
    """
    fd = os.open(path, flags | CREATE, mode & 0o600 if exact else mode, dir_fd=dir_fd)
    if exact:
        try:
            os.fchmod(fd, mode)  # by descriptor, after the exclusive create: this very file
        except BaseException:
            os.close(fd)
            raise
    return fd


def create_temp(
    folder: str, stem: str, mode: int, *, dir_fd: int | None = None, flags: int = os.O_WRONLY, exact: bool = True
) -> tuple[int, str]:
    """Create a temporary file in `folder` under a `temp_name`, exclusively.

    Args:
        folder: The folder (relative to `dir_fd` if given; ``""`` is `dir_fd` itself).
        stem: See `temp_name`.
        mode: The file's permission bits (see `create_exclusive` for `exact`).
        dir_fd: A folder descriptor the name is relative to.
        flags: ``os.O_WRONLY`` or ``os.O_RDWR``.
        exact: See `create_exclusive`.

    Returns:
        (file descriptor, the file's path: `folder` joined with its name).
    """
    for _ in range(8):
        path = os.path.join(folder, temp_name(stem))
        try:
            return create_exclusive(path, mode, dir_fd=dir_fd, flags=flags, exact=exact), path
        except FileExistsError:
            continue  # 64 random bits taken: somebody guessed or planted; draw again
    raise FileExistsError(errno.EEXIST, "no free temporary name", folder)


def open_regular(path: str, flags: int = os.O_RDONLY, *, dir_fd: int | None = None) -> int:
    """Open a file that must be a regular one: no link is followed, a FIFO does not
    block, and anything but a regular file is refused after the open.

    Args:
        path: The file (relative to `dir_fd` if given); a link in its last component
            is refused (the folders above it are followed as usual).
        flags: ``os.O_RDONLY`` or ``os.O_RDWR`` (no ``O_CREAT``).
        dir_fd: A folder descriptor.

    Returns:
        The descriptor, in blocking mode again.

    Raises:
        NotRegularFileError: If `path` is a link, a FIFO, a device, a socket or a folder.
        OSError: If it cannot be opened (missing, permissions).
    """
    try:
        fd = os.open(path, flags | NOFOLLOW | NONBLOCK | CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise NotRegularFileError(errno.ELOOP, "a symbolic link, not a file", path) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader (O_WRONLY), a folder
            raise NotRegularFileError(exc.errno, "not a regular file", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"not a regular file ({kind_of(mode)})", path)
        if NONBLOCK:  # blocking again; F_SETFL ignores the access mode in `flags`
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_folder(path: str, *, dir_fd: int | None = None, follow: bool = False) -> int:
    """Open a folder by descriptor, without following a link unless `follow`.

    Args:
        path: The folder (relative to `dir_fd` if given).
        dir_fd: A folder descriptor.
        follow: Follow a link in the last component (only for the user's own path to a
            store: the store is wherever the user's path leads).

    Raises:
        NotRegularFileError: If `path` is a link (and not `follow`) or not a folder.
        OSError: If it cannot be opened.
    """
    try:
        return os.open(path, os.O_RDONLY | DIRECTORY | CLOEXEC | (0 if follow else NOFOLLOW), dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotRegularFileError(exc.errno, "a symbolic link or a file, not a folder", path) from None
        raise


def kind_of(mode: int) -> str:
    """What a file mode says an entry is, in words (``a FIFO``, ``a symbolic link``)."""
    for test, name in (
        (stat.S_ISREG, "a file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "a special file"


def replace_beside(
    path: str, write: Callable[[BinaryIO], object], *, mode: int = 0o600, sync: Callable[[int], None] = os.fsync
) -> None:
    """Write a file the user named (an export, a prompt-cache file) crash-safely and
    never through a link: a temporary file created exclusively beside it, written by
    ``write(file object)``, fsynced, renamed over `path` (a link at `path` itself is
    replaced, not followed), and the folder fsynced.

    Args:
        path: The file to write.
        write: Called with the temporary file, open for binary writing.
        mode: The file's permission bits.
        sync: How a descriptor is made durable (``os.fsync``, or the store's
            `durable_fsync`, which is ``F_FULLFSYNC`` on macOS).

    Raises:
        OSError: If it cannot be written (the temporary file is removed).
    """
    folder = os.path.dirname(os.path.abspath(path))
    dir_fd = open_folder(folder, follow=True)  # the user's folder, wherever it leads
    try:
        fd, tmp = create_temp("", os.path.basename(path).replace(".", "_"), mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                sync(f.fileno())
            os.replace(tmp, os.path.basename(path), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        sync(dir_fd)
    finally:
        os.close(dir_fd)

"""The few OS calls the disk wing needs that are not everywhere, each with a fallback
that keeps the same guarantees (macOS is where most users run).

- `preadv`: positional scatter read (Linux, BSDs; Python on macOS may lack it).
  Fallback: one ``os.pread`` per buffer, copied in; positional too, so threads
  sharing a file descriptor never race on its offset.
- `writev`: gather write. Fallback: ``os.write`` of each buffer; the caller loops on
  short writes either way.
- `pwritev`: positional gather write (a segment's data is written before its header,
  from a second thread). Fallback: one ``os.pwrite`` per buffer; positional too.
- `durable_fsync`: what the write order (file, rename, folder, index) relies on:
  the bytes on stable storage before the next step. Linux's ``fsync`` does that; macOS's
  only hands them to the drive, whose cache may still lose them on power loss, so
  there ``fcntl(F_FULLFSYNC)`` is used, and ``fsync`` where a file system refuses it.
- `start_writeback`: Linux's ``sync_file_range`` starts the writeback early (of a
  whole file, or of the range just written), only for speed: elsewhere it is skipped (the ``durable_fsync`` that follows is what counts).

Each is chosen when this module is imported, by looking for the call itself, not at
the platform's name; the tests hide the Linux ones to run the store on the fallbacks.
"""

from __future__ import annotations

import ctypes
import os
import sys

try:
    import fcntl

    # F_FULLFSYNC: macOS (and iOS) only.
    _FULLFSYNC: int | None = getattr(fcntl, "F_FULLFSYNC", None)
except ImportError:  # not on POSIX: durable_fsync falls back to os.fsync
    _FULLFSYNC = None


def _iov_max() -> int:
    try:
        return max(1, min(1024, os.sysconf("SC_IOV_MAX")))
    except (AttributeError, ValueError, OSError):
        return 16  # POSIX's minimum for IOV_MAX


IOV_MAX = _iov_max()
HAS_PREADV = hasattr(os, "preadv")
HAS_WRITEV = hasattr(os, "writev")
HAS_PWRITEV = hasattr(os, "pwritev")


def preadv(fd: int, buffers: list, offset: int) -> int:
    """Read into `buffers` (writable buffers, in order) from `offset` of `fd`.

    Returns:
        Bytes read (fewer than the buffers hold at the end of the file).
    """
    if HAS_PREADV:
        return os.preadv(fd, buffers, offset)
    total = 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        data = os.pread(fd, len(view), offset + total)
        view[: len(data)] = data
        total += len(data)
        if len(data) < len(view):
            break  # end of file: as preadv, report what was read
    return total


def writev(fd: int, buffers: list) -> int:
    """Write `buffers` in order at `fd`'s offset; the bytes written (may be short)."""
    if HAS_WRITEV:
        return os.writev(fd, buffers)
    total = 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        n = os.write(fd, view)
        total += n
        if n < len(view):
            break  # a short write: the caller finishes it, as after a short writev
    return total


def pwritev(fd: int, buffers: list, offset: int) -> int:
    """Write `buffers` in order at `offset` of `fd` (its file offset is left alone);
    the bytes written (may be short)."""
    if HAS_PWRITEV:
        return os.pwritev(fd, buffers, offset)
    total = 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        n = os.pwrite(fd, view, offset + total)
        total += n
        if n < len(view):
            break  # a short write: the caller finishes it, as after a short pwritev
    return total


def durable_fsync(fd: int) -> None:
    """Flush `fd`'s data to stable storage (see the module docstring)."""
    if _FULLFSYNC is not None:
        try:
            fcntl.fcntl(fd, _FULLFSYNC)
            return
        except OSError:
            pass  # a file system without F_FULLFSYNC (some network mounts): fsync
    os.fsync(fd)


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
HAS_SYNC_FILE_RANGE = _SYNC_FILE_RANGE is not None


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Start writing `fd`'s dirty pages to disk without waiting (Linux); a no-op
    elsewhere. Only for speed: a failure is ignored.

    Args:
        fd: The file.
        offset: First byte of the range.
        nbytes: Bytes of the range; 0: to the end of the file.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


def fsync_dir(path: str) -> None:
    """Make a folder's entries durable (a rename or a new file in it): `durable_fsync`
    of the folder itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        durable_fsync(fd)
    finally:
        os.close(fd)

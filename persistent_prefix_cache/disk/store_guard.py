"""Who may use a store while its index is rebuilt: the store lock, the folders of a
repair in progress, and what to tell a user whose index is damaged.

Every process that opens a store's index holds a shared ``flock`` on ``<store>/lock``
for as long as its environment is open (`index_env.acquire_env` takes it once per store
and process). A repair (`rebuild.rebuild_index`) takes it exclusive and non-blocking: it
refuses to start while anyone has the store open, and while it runs every open waits a
moment and then raises `StoreBusyError`.

``flock`` belongs to the open file description: a ``fork()`` child shares its parent's
lock until it closes its copy, which `forget_inherited` does right after the fork (the
parent keeps its lock; the child takes its own when it opens the store). The lock file
is opened close-on-exec, so a spawned program never holds it.

A rebuild writes the new index into ``index.rebuild/``, renames it ``index.new/`` once
it is complete, then swaps it in (the damaged index goes into ``damaged-<time>/``). A
crash leaves one of those folders: opens then refuse with the command that finishes
the repair (`pending_repair`), and a rerun of the repair picks up where it stopped.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ..errors import StoreBusyError, StoreCorruptError
from ..files import NotRegularFileError, create_exclusive, open_folder, open_regular

LOCK_NAME = "lock"
BUILDING = "index.rebuild"  # a rebuild writing its new index (incomplete)
COMPLETE = "index.new"  # a complete new index, not yet swapped in
ASIDE_PREFIX = "damaged-"  # what a repair set aside: the damaged index, unusable segments
# How long an open waits for a repair in another process before it raises.
OPEN_WAIT = 2.0

_HELD: dict[tuple[int, str], list] = {}  # (pid, store) -> [fd or None, "sh" | "ex", count]
_LOCK = threading.Lock()


def store_of(index_path: str) -> str:
    """The store directory of an index folder: the folder above ``<store>/index``, two
    above a rebuild's ``<store>/index.rebuild/index``; where the user's path leads
    (the folders inside the store are never followed: a link there is not the store)."""
    parent = os.path.dirname(os.path.abspath(index_path))
    if os.path.basename(parent) == BUILDING:
        parent = os.path.dirname(parent)
    return os.path.realpath(parent)


def _open_lock_file(store: str, *, create: bool) -> int | None:
    # Read-only is enough for flock (either kind): a member of a shared store's group
    # who may not write the lock file still takes it. Never through a link, never a
    # FIFO (that open would block), and only a file this open made gets its mode.
    try:
        root = open_folder(store, follow=True)
    except OSError:
        return None
    try:
        try:
            return open_regular(LOCK_NAME, dir_fd=root)
        except FileNotFoundError:
            if not create:
                raise
        try:  # readable by whoever may list the store (the owner alone unless it is shared)
            return create_exclusive(LOCK_NAME, os.fstat(root).st_mode & 0o660 | 0o400, dir_fd=root, flags=os.O_RDONLY)
        except FileExistsError:
            return open_regular(LOCK_NAME, dir_fd=root)  # another process made it meanwhile
    except NotRegularFileError as exc:
        raise unsafe_entry(store, f"{LOCK_NAME} is not a file ({exc.strerror})") from None
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
            return None  # a store nobody can write: no repair can run there either
        raise
    finally:
        os.close(root)


def share(store: str, *, create: bool) -> None:
    """Take (or count once more) this process's shared lock on a store.

    Args:
        store: The store directory.
        create: Create the lock file if it is missing (a writable open).

    Raises:
        StoreBusyError: If a repair holds the store for longer than `OPEN_WAIT`.
    """
    ident = (os.getpid(), os.path.realpath(store))
    with _LOCK:
        held = _HELD.get(ident)
        if held is not None:  # shared already, or this process is the repair itself
            held[2] += 1
            return
        fd = _open_lock_file(store, create=create) if os.path.isdir(store) else None
        if fd is not None:
            deadline = time.monotonic() + OPEN_WAIT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        os.close(fd)
                        raise StoreBusyError(f"store {store} is being repaired (ppc check --fix)") from None
                    time.sleep(0.05)
        _HELD[ident] = [fd, "sh", 1]


def unshare(store: str) -> None:
    """Give back one count of this process's lock on a store (unlocked at zero; an
    exclusive lock stays until `exclusive` ends)."""
    ident = (os.getpid(), os.path.realpath(store))
    with _LOCK:
        held = _HELD.get(ident)
        if held is None:
            return
        held[2] -= 1
        if held[2] <= 0 and held[1] == "sh":
            del _HELD[ident]
            if held[0] is not None:
                os.close(held[0])  # closing the only descriptor releases the flock


@contextmanager
def exclusive(store: str) -> Iterator[None]:
    """Hold a store alone (a repair): no other process may have it open meanwhile.

    Opens of the store inside this process while it is held share it.

    Raises:
        StoreBusyError: If another process (or a handle of this one) has the store open.
        ReadOnlyStoreError: If the lock file cannot be created (an unwritable store).
    """
    store = os.path.realpath(store)
    ident = (os.getpid(), store)
    with _LOCK:
        if ident in _HELD:
            raise StoreBusyError(
                f"store {store} is open in this process",
                hint="close the store's other handles in this process first",
            )
        fd = _open_lock_file(store, create=True)
        if fd is None:
            from ..errors import ReadOnlyStoreError

            raise ReadOnlyStoreError(f"store {store} is not writable: it cannot be repaired here")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if any(os.path.isdir(os.path.join(store, n)) for n in (COMPLETE, BUILDING)):
                raise StoreBusyError(f"store {store} is being repaired by another process") from None
            raise StoreBusyError(
                f"store {store} is open in another process",
                hint="close ppc serve and the store's other users first, then run `ppc check --fix` again",
            ) from None
        _HELD[ident] = [fd, "ex", 0]
    try:
        yield
    finally:
        with _LOCK:
            _HELD.pop(ident, None)
            os.close(fd)


def holds_exclusive(store: str) -> bool:
    """Whether this process is repairing `store` (holds it exclusively)."""
    held = _HELD.get((os.getpid(), os.path.realpath(store)))
    return held is not None and held[1] == "ex"


def forget_inherited() -> None:
    """In a ``fork()`` child: close the lock descriptors inherited from the parent
    (closing, not unlocking: the parent's lock stays)."""
    for (pid, _), (fd, *_) in list(_HELD.items()):
        if pid != os.getpid() and fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


def segment_count(store: str) -> int:
    """How many segment files a store holds (what a rebuild would read); folders that
    are links are not followed."""
    n = 0
    try:
        with os.scandir(os.path.join(store, "segments")) as subs:
            for sub in subs:
                if sub.is_dir(follow_symlinks=False):
                    with os.scandir(sub.path) as entries:
                        n += sum(1 for e in entries if e.name.endswith(".seg") and e.is_file(follow_symlinks=False))
    except OSError:
        pass
    return n


def rebuild_hint(store: str) -> str:
    """What ``ppc check --fix`` will do for a store whose index is damaged."""
    n = segment_count(store)
    return (
        f"run `ppc check --fix --store {store}`: it rebuilds the index from the {n} segment "
        f"file{'s' if n != 1 else ''} (every intact block is kept; recency and hit counts are lost)"
    )


def unsafe_entry(store: str, detail: str) -> StoreCorruptError:
    """The error for a link, a special file or a foreign file where the store keeps one
    of its own (`detail` says which): nothing was opened through it."""
    return StoreCorruptError(
        f"store {store}: {detail}: refused to open it",
        hint=f"run `ppc check --fix --store {store}`: it removes links and special files from the store "
        "(never what they point to)",
    )


def corrupt_index(store: str, detail: str) -> StoreCorruptError:
    """The error for a store whose index cannot be read safely (`detail` says why)."""
    return StoreCorruptError(f"store {store}: index damaged: {detail}", hint=rebuild_hint(store))


def pending_repair(store: str) -> str | None:
    """Which folder an interrupted repair left in `store`, if any (None while this
    process is the repair)."""
    if holds_exclusive(store):
        return None
    for name in (COMPLETE, BUILDING):
        if os.path.isdir(os.path.join(store, name)):
            return name
    return None


def check_no_pending_repair(store: str) -> None:
    """Raise if a repair of `store` was interrupted.

    Raises:
        StoreBusyError: If the repair is still running (in another process).
        StoreCorruptError: Naming the command that finishes it.
    """
    left = pending_repair(store)
    if left is not None:
        share(store, create=False)  # raises StoreBusyError while the repair still runs
        unshare(store)
        raise StoreCorruptError(
            f"store {store}: a repair of its index was interrupted (found {left}/)",
            hint=f"run `ppc check --fix --store {store}` to finish it",
        )

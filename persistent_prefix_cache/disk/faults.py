"""Test hooks: pause points for crash tests, and the one variable that sets them.

The test suite's hooks all live in one environment variable, ``PPC_TEST_HOOKS``: a
comma-separated list of ``name=value`` (test-only, never needed in production; see
docs/environment.md). `hook` reads one. The library's own hooks:

- ``pause_at=<point>`` with ``pause_file=<path>``: when a process reaches that pause
  point it writes the point's name to the file and sleeps, so that the test can kill it
  with SIGKILL exactly there. Without the variable a pause point costs one lookup.

- ``hold_at=<point>`` with ``pause_file=<path>``: the same, but the process goes on once
  the test removes the file (``pull_batch``: ``ppc pull`` has read its first batch of
  blocks, the test stops the server there; ``before_commit``: the writer holds a write
  uncommitted, and the writes queued meanwhile share the next group commit; any point a
  `commit.commit` passes before its transaction is one).

Points: ``before_rename`` (segment file written and fsynced under ``tmp/``),
``before_commit`` (segment renamed into ``segments/``, index not yet committed),
``after_commit`` (index committed), ``in_write_txn`` (inside an open LMDB write
transaction, before it commits), ``remote_publish`` (the publisher has sent the
first block of a batch to the remote, not the rest), ``rebuild_built`` (an index rebuild
has committed its new index under ``index.rebuild/``), ``rebuild_swap`` (the damaged
index is set aside, the new one not yet in place), ``before_move`` (a merge or compaction
has written and renamed its new segment, the records not yet moved there).

In-process actions (`acting_at`): a test of one process runs a function of its own when
a thread passes a pause point (another handle's write in between, or a raise: a failure
at exactly that step), instead of replacing a private method of the store's parts.

The suite's own (read by ``tests/``): ``require=redis:valkey`` (CI: a remote-tier test
whose server is not installed fails instead of skipping) and ``linux_calls_hidden=...``
(set in a run whose Linux-only calls are hidden, ``tests/no_linux_calls``).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

VARIABLE = "PPC_TEST_HOOKS"
_parsed: tuple[str, dict[str, str]] = ("", {})  # the last value read, and its hooks
_actions: dict[str, Callable[[], None]] = {}  # in-process actions by pause point (`acting_at`)
_actions_lock = threading.Lock()


def hook(name: str) -> str | None:
    """The value of test hook `name` in ``PPC_TEST_HOOKS`` (None: not set).

    Args:
        name: The hook, e.g. ``pause_at``.

    Returns:
        Its value (after the first ``=``; empty if none was given), None if absent.
    """
    global _parsed
    raw = os.environ.get(VARIABLE, "")
    if raw != _parsed[0]:  # parsed once per value: pause points sit on the write path
        pairs = (item.partition("=") for item in raw.split(",") if item.strip())
        _parsed = (raw, {k.strip(): v for k, _, v in pairs})
    return _parsed[1].get(name)


def hooks_value(**hooks: object) -> str:
    """``PPC_TEST_HOOKS``'s value for these hooks.

    Args:
        hooks: Hook names and their values, e.g. ``pause_at="in_write_txn"``.

    Returns:
        ``name=value`` pairs joined by commas (``pause_at=in_write_txn``).
    """
    return ",".join(f"{name}={value}" for name, value in hooks.items())


@contextmanager
def acting_at(point: str, action: Callable[[], None]) -> Iterator[None]:
    """Run `action` whenever a thread of this process passes pause point `point`, while
    the block runs (tests only: the one seam for a fault or a race at a chosen step).

    The action runs on the thread that passes the point (often a store's writer thread),
    every time one does: it tells threads apart itself. What it raises is raised at the
    point, as a failure of that step (``in_write_txn``: the write transaction fails and
    nothing of it is committed).

    Args:
        point: A pause point (see the module), e.g. ``before_commit``.
        action: Called with no arguments.

    Raises:
        ValueError: If another action is already set at `point`.
    """
    with _actions_lock:
        if point in _actions:
            raise ValueError(f"an action is already set at pause point {point!r}")
        _actions[point] = action
    try:
        yield
    finally:
        with _actions_lock:
            del _actions[point]


def pause_point(name: str) -> None:
    """Run the action `acting_at` set here, then sleep forever if the ``pause_at`` test
    hook names this point."""
    if _actions:  # a dict's truth: the write path pays no more than that
        action = _actions.get(name)
        if action is not None:
            action()
    if hook("pause_at") != name:
        return
    marker = hook("pause_file")
    if marker:
        with open(marker, "w") as f:
            f.write(name)
    while True:
        time.sleep(3600)


def hold_point(name: str) -> None:
    """Wait here, while the ``pause_file`` exists, if the ``hold_at`` test hook names this point."""
    if hook("hold_at") != name:
        return
    marker = hook("pause_file")
    if not marker:
        return
    with open(marker, "w") as f:
        f.write(name)
    while os.path.exists(marker):
        time.sleep(0.05)

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

The suite's own (read by ``tests/``): ``require=redis:valkey`` (CI: a remote-tier test
whose server is not installed fails instead of skipping) and ``linux_calls_hidden=...``
(set in a run whose Linux-only calls are hidden, ``tests/no_linux_calls``).
"""

from __future__ import annotations

import os
import time

VARIABLE = "PPC_TEST_HOOKS"
_parsed: tuple[str, dict[str, str]] = ("", {})  # the last value read, and its hooks


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


def pause_point(name: str) -> None:
    """Sleep forever here if the ``pause_at`` test hook names this point."""
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

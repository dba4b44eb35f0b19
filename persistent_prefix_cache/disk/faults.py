"""Pause points for crash tests.

A test starts a writer process with ``PPC_PAUSE_AT=<point>`` and
``PPC_PAUSE_FILE=<path>``; when the process reaches that point it writes the point's
name to the file and sleeps, so that the test can kill it with SIGKILL exactly there.
Without the variable a pause point costs one dictionary lookup.

Points: ``before_rename`` (segment file written and fsynced under ``tmp/``),
``before_commit`` (segment renamed into ``segments/``, index not yet committed),
``after_commit`` (index committed), ``in_write_txn`` (inside an open LMDB write
transaction, before it commits), ``remote_publish`` (the publisher has sent the
first block of a batch to the remote, not the rest), ``rebuild_built`` (an index rebuild
has committed its new index under ``index.rebuild/``), ``rebuild_swap`` (the damaged
index is set aside, the new one not yet in place).
"""

from __future__ import annotations

import os
import time


def pause_point(name: str) -> None:
    """Sleep forever here if the environment asks for this point."""
    if os.environ.get("PPC_PAUSE_AT") != name:
        return
    marker = os.environ.get("PPC_PAUSE_FILE")
    if marker:
        with open(marker, "w") as f:
            f.write(name)
    while True:
        time.sleep(3600)

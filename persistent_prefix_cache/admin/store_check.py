"""``ppc check [--fix]`` as a whole: the index walked in a child process first, a damaged
index rebuilt from the segments, then `StoreAdmin.check` on an index known to read.

Nothing of the index is read in this process before a child walked all of it: a damaged
page there may abort LMDB (see `index_probe`). Each finding is one ``(kind, detail)``
of `CheckReport.problems`; a damaged index is ``("index damaged", what)``.
"""

from __future__ import annotations

import os

from ..disk import store_guard
from ..errors import InvalidArgumentError
from ..paths import expand_path
from .check_report import CheckReport
from .index_probe import probe_index
from .index_rebuild import rebuild_index
from .store_admin import StoreAdmin
from .store_audit import blocks_opening, entry_findings

INDEX_DAMAGED = "index damaged"


def check_store(path: str, *, fix: bool = False, grace: float = 60.0) -> CheckReport:
    """Verify a store; with `fix`, repair it (rebuilding a damaged index).

    Args:
        path: The store directory.
        fix: Repair: rebuild a damaged index from the segment files (the store must not
            be open elsewhere), drop broken blocks, sweep leftover files.
        grace: Leave unreferenced files younger than this (seconds).

    Returns:
        A `CheckReport`: a damaged index is one problem of kind ``"index damaged"``;
        with `fix`, ``rebuild`` says what the rebuild did.

    Raises:
        InvalidArgumentError: If there is no store at `path` (no index and no segment
            files: an ``index/`` that went while the segments stayed is rebuilt).
        StoreBusyError: If a repair is running in another process, or (with `fix`) the
            index needs a rebuild and another process has the store open.
        StoreVersionError: If the store needs ``ppc migrate`` (or a newer library).
    """
    path = os.path.abspath(expand_path(path, what="path"))
    index = os.path.join(path, "index")
    if not os.path.lexists(index) and not store_guard.pending_repair(path) and not store_guard.segment_count(path):
        raise InvalidArgumentError(f"no store at {path}")
    report = CheckReport()
    # Links, special and foreign files first, before anything opens through them (LMDB's
    # files, the lock): found, and with --fix removed (never followed) or handed back.
    found, report.unfixed, fixed = entry_findings(path, fix=fix)
    report.problems += found
    if fixed:
        report.fixed = True
    stuck = (
        [d for k, d in found if blocks_opening(k, d)]
        if not fix
        else [u for u in report.unfixed if blocks_opening("", u)]
    )
    if stuck:
        report.notes.append(
            f"the index was not opened: {stuck[0].split(':')[0]} is not the store's (`ppc check --fix` removes it)"
        )
        return report
    pending = store_guard.pending_repair(path)
    missing = pending is None and not os.path.isdir(index)
    block_size = None
    damage: str | None
    if missing:  # segment files without an index: it can be rebuilt from them
        damage = "index/ is missing"
        report.problems.append((INDEX_DAMAGED, damage))
    elif pending is not None:
        store_guard.share(path, create=False)  # raises StoreBusyError while it still runs
        store_guard.unshare(path)
        damage = f"a repair was interrupted (found {pending}/)"
    else:
        health = probe_index(index)
        if health.refused:  # an entry put there since the walk above: say so, open nothing
            report.problems.append(("not the store's", health.refused))
            return report
        report.notes += health.notes
        damage, block_size = health.damaged, health.block_size
        report.problems += [(INDEX_DAMAGED, p) for p in health.problems]
        if health.damaged and not health.problems:
            report.problems.append((INDEX_DAMAGED, health.damaged))
    if damage is not None:
        if pending is not None and not missing:
            report.problems.append((INDEX_DAMAGED, damage))
        if not fix:
            report.notes.append(store_guard.rebuild_hint(path))
            return report
        report.rebuild = rebuild_index(path, block_size=block_size).to_dict()
    with StoreAdmin(path, readonly=not fix) as admin:
        after = admin.check(fix=fix, grace=grace)
    report.nodes, report.files_verified = after.nodes, after.files_verified
    report.segments_verified = after.segments_verified
    report.problems += after.problems
    report.removed_nodes, report.removed_files = after.removed_nodes, after.removed_files
    report.fixed = report.fixed or after.fixed or report.rebuild is not None
    report.remaining, report.notes = after.remaining, report.notes + after.notes
    return report

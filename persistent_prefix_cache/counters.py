"""`Counters`: a handle's counters, shared by the caller's threads and the writer thread.

One instance per `PersistentPrefixCache` counts what its fetches, stores, writer thread
and remote tier do (the names: `HANDLE_COUNTERS`, `tiers.REMOTE_COUNTERS`);
`stats()` reads a snapshot of them beside the store-wide totals the index keeps
(`disk.index_tables.STORE_WIDE_COUNTERS`). ``ppc push`` and ``ppc pull`` count a
transfer with one too (`remote_sync`).
"""

from __future__ import annotations

import threading

# What a handle counts of its own work (`PersistentPrefixCache.stats` says what each is).
HANDLE_COUNTERS = (
    "queries", "hits", "misses", "not_longer", "tokens_saved", "skipped_slower", "tokens_skipped",
    "restored_all", "restored_ram_only", "restored_shorter",
    "corrupt", "evictions", "write_errors", "blocks_written", "bytes_written", "restored_blocks_disk",
    "segments_merged", "bytes_rewritten", "group_commits", "group_commit_writes",
)  # fmt: skip


class Counters:
    """A handle's counters, shared by the caller's threads and the writer thread."""

    def __init__(self, *names: str):
        self.lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        """Add to counters."""
        with self.lock:
            for name, n in deltas.items():
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self.lock:
            return dict(self._values)

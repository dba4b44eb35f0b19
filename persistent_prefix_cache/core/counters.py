"""`Counters`: a handle's counters, shared by the caller's threads and the writer thread.

One instance per `PersistentPrefixCache` counts what its fetches, stores, writer thread
and remote tier do (the names: `HANDLE_COUNTERS`, `tiers.REMOTE_COUNTERS`);
`stats()` reads a snapshot of them beside the store-wide totals the index keeps
(`disk.index_tables.STORE_WIDE_COUNTERS`). ``ppc push`` and ``ppc pull`` count a
transfer with one too (`admin/remote_sync.py`).
"""

from __future__ import annotations

import threading

# Why a fetch stopped short of the whole prompt (all but its last token): each reason,
# how it is told apart and what it costs to tell, is in `miss_reasons`.
MISS_REASONS = (
    "never_stored",  # the next block was never stored here (as far as this process knows)
    "evicted",  # the next block was evicted under the disk budget (by this process, lately)
    "not_admitted",  # the next block was seen by a store of this handle, which the admission rule left out
    "damaged",  # a block failed its checks (this fetch, or dropped for it lately)
    "other_model",  # nothing matched, but the first block is stored for another model or namespace
    "not_resumable",  # stored further, but a recurrent or windowed layer has no snapshot there
    "write_pending",  # the next block is this handle's, still queued for the writer
    "slower",  # the cost model: restoring (more) is slower than computing
    "remote_unreachable",  # the local store fell short and the remote tier did not answer
    "unsupported",  # the model has a layer the store cannot hold: every fetch misses
)

# What a handle counts of its own work (`PersistentPrefixCache.stats` shows them).
HANDLE_COUNTERS = (
    "queries", "hits", "misses",  # fetches: queries = hits + misses
    "not_longer",  # fetches stopped by ``longer_than``, loading nothing
    "tokens_saved",  # tokens the hits restored
    # Hits and their tokens by the deepest tier each read: the remote (blocks it brought in
    # this fetch), else disk (any block read from a segment file), else RAM.
    "hits_ram", "hits_disk", "hits_remote", "tokens_saved_ram", "tokens_saved_disk", "tokens_saved_remote",
    "tokens_recomputed",  # tokens of the queries' prompts left to compute (a miss: all of them)
    "bytes_restored_ram", "bytes_restored_disk",  # block bytes restores took from the RAM tier, from segment files
    # Queries that missed (miss_*) or restored part of what they asked (short_*), by why
    # they stopped (`MISS_REASONS`).
    *(f"miss_{reason}" for reason in MISS_REASONS),
    *(f"short_{reason}" for reason in MISS_REASONS),
    # The cost model's decision of each fetch that found blocks: all of them, only the
    # leading part held in RAM, another shorter prefix, nothing (computing was faster);
    # and the tokens the cuts left to compute.
    "restored_all", "restored_ram_only", "restored_shorter", "skipped_slower", "tokens_skipped",
    "corrupt", "evictions", "write_errors",  # damage met, blocks evicted, writes failed
    "quota_evictions",  # blocks of its namespace evicted under the namespace's quota (namespace_bytes)
    "restored_blocks_disk",  # blocks restores read from segment files (the RAM tier's: its memory_hits_*)
    # Blocks this handle committed and the bytes of the segment files it wrote for them
    # (another process's are not counted).
    "blocks_written", "bytes_written",
    # Segments this handle's writer merged away (a chain stored piece by piece: see
    # `merging`), and the bytes it wrote doing so.
    "segments_merged", "bytes_rewritten",
    "group_commits", "group_commit_writes",  # index transactions of its block writes, and the writes they held
    # New blocks (and their tokens) the admission rule left unwritten (``store(..., admit=)``:
    # a block deferred twice counts twice).
    "blocks_not_admitted", "tokens_not_admitted",
)  # fmt: skip


def write_amplification(stats: dict) -> float | None:
    """Disk bytes a handle wrote (new blocks' segments and merges) per block byte its
    restores took (from the RAM tier and segment files), from its `stats()`; None
    until a restore.

    Args:
        stats: A handle's counters (``bytes_written``, ``bytes_rewritten``,
            ``bytes_restored_ram``, ``bytes_restored_disk``).
    """
    restored = stats["bytes_restored_ram"] + stats["bytes_restored_disk"]
    return (stats["bytes_written"] + stats["bytes_rewritten"]) / restored if restored else None


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

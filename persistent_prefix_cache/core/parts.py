"""`Parts`: what a handle is made of, built once at its open (`opening.open_parts`), and
what the facade asks of them together: a flush of every part that holds pending work,
the handle's `stats()` assembled from the parts that keep each figure, and their
shutdown in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cost_model import CostModel
from .counters import Counters, write_amplification
from ..disk.index import Index
from ..disk.segment import SegmentFiles
from .fetching import Fetcher
from ..layers import Layout
from .model_record import ModelRecord
from .storing import Storer
from ..tiers.memory import MemoryTier
from .warm import Warmer
from .writeback import WriteBack

if TYPE_CHECKING:  # the remote's client is imported only where a remote is configured
    from .remote_fill import RemoteFill
    from ..tiers.remote import RemoteTier


@dataclass
class Parts:
    """What a handle is made of, built once at its open (`opening.open_parts`).

    Attributes:
        path: The store directory (absolute); `readonly`, `block_size`: as opened.
        layout: The model's cache layout; `model` its record (fingerprint, root key).
        index, files: The store's index and segment files.
        memory: The RAM tier.
        counters: The handle's counters.
        writeback: The writer thread (None: read-only).
        remote: The remote tier, `remote_fill` its part in a fetch (None: none configured).
        warmer: Background fills of the RAM tier.
        costs: The cost model; `fetcher` and `storer` the handle's fetches and stores.
    """

    path: str
    readonly: bool
    block_size: int
    layout: Layout
    model: ModelRecord
    index: Index
    files: SegmentFiles
    memory: MemoryTier
    counters: Counters
    writeback: WriteBack | None
    remote: RemoteTier | None
    remote_fill: RemoteFill | None
    warmer: Warmer
    costs: CostModel
    fetcher: Fetcher
    storer: Storer

    def flush(self) -> None:
        """Save the learned costs, wait for a background fill of the RAM tier, every
        pending write and access update (committed), and every block stored so far
        published to the remote (or failed, counted)."""
        self.costs.save()
        self.warmer.wait()
        if self.writeback is not None:
            self.writeback.flush()
        if self.remote is not None:
            self.remote.flush()

    def stop(self) -> bool:
        """The first half of a close: the learned costs saved, the fill and writer threads
        ended (the writer's block writes waited for), the remote closed.

        Returns:
            Whether the writer finished (False: bookkeeping was left behind, and its
            thread may still wait on the index's lock: `release` must then leave the
            index open).
        """
        self.costs.save()
        self.warmer.stop()
        finished = self.writeback.stop() if self.writeback is not None else True
        if self.remote is not None:
            self.remote.close()
        return finished

    def release(self, *, close_index: bool) -> None:
        """The second half of a close: the RAM tier emptied (its budget 0: an "auto" share
        goes back to the process, `opening.memory_tier`), the index closed if asked."""
        self.memory.clear()
        self.memory.resize(0)
        if close_index:
            self.index.close()

    def stats(self) -> dict[str, Any]:
        """What `PersistentPrefixCache.stats` returns (docs/library.md says what each is):
        this handle's counters (`counters.HANDLE_COUNTERS`), pending_writes, disk_budget
        (`disk_bytes` resolved, None if unbounded), budget_evictions and the namespace's
        quota and holdings; the store's over every process (blocks, block_bytes,
        bytes_on_disk, and ``store_`` + each of `index_tables.STORE_WIDE_COUNTERS`); the
        RAM tier's (`MemoryTier.stats`); the costs measured for this model on this device
        kind (`Costs.figures`); the remote's (its URL, password hidden, remote_pending,
        remote_key_id); write_amplification (docs/wear.md)."""
        out: dict[str, Any] = self.counters.snapshot()
        out["pending_writes"] = self.writeback.pending if self.writeback is not None else 0
        out["disk_budget"] = self.writeback.disk_bytes if self.writeback is not None else None
        # `evictions` less superseded partial leaves, and less those under the namespace's quota
        out["budget_evictions"] = max(0, self.index.evicted_blocks - out["quota_evictions"])
        out["namespace_quota"] = self.writeback.quota if self.writeback is not None else None
        with self.index.reader() as reader:
            owned = reader.owned(self.model.root)
            out["namespace_blocks"], out["namespace_bytes"] = owned if owned is not None else (None, None)
            out["block_bytes"], out["blocks"] = reader.totals()
            out["bytes_on_disk"] = reader.file_bytes()
            out.update({f"store_{k}": v for k, v in reader.counters().items()})
        out.update(self.memory.stats())
        out.update(self.costs.learned.figures())
        out["remote"] = self.remote.url if self.remote is not None else None  # its password hidden
        out["remote_pending"] = self.remote.pending if self.remote is not None else 0
        out["remote_key_id"] = self.remote.kid if self.remote is not None else None  # whose key space
        out["write_amplification"] = write_amplification(out)  # docs/wear.md
        return out

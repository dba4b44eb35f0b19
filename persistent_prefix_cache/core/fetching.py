"""A handle's fetch, top to bottom: `Fetcher` (`PersistentPrefixCache.fetch` and `peek`).

1. The lookup: the longest usable stored prefix (`lookup.Trie.longest`).
2. The remote fill, with a remote tier, where the local prefix falls short: the fleet's
   continuation into the RAM tier (`remote_fill.RemoteFill.fill`), looked up again.
3. The cost cut: the prefix faster to restore than to compute
   (`cost_model.CostModel.cut`).
4. The restore: fresh caches from the blocks any layer needs (`restore.restore`: the
   RAM tier, else verified segment reads).
5. Damage: a damaged block is counted, dropped with what follows it (on the writer
   thread), and the fetch backs off to what comes before it (`lookup.back_off`); a
   damaged index page is a miss, said once per handle.
6. Timing: the restore teaches the cost model its tier's rate
   (`cost_model.CostModel.timed`); hits, misses and recency go to the index with the
   next write (`writeback.WriteBack.note`).
7. The report: a fetch that stopped short of the whole prompt says why
   (`miss_reasons.MissReasons`), counted by reason; every fetch leaves a
   `miss_reasons.FetchReport` for its thread (`PersistentPrefixCache.last_fetch`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..blocks import Node
from .cost_model import CostModel
from .counters import Counters
from ..device.target import Target
from ..disk.index import Index
from ..disk.segment import SegmentFiles
from ..errors import StoreCorruptError
from ..keys import as_token_array
from ..layers import Layout
from .lookup import Trie, Walk, back_off
from .miss_reasons import FetchReport, MissReasons
from .restore import restore
from ..tiers.memory import MemoryTier
from .writeback import WriteBack

if TYPE_CHECKING:  # the remote's client is imported only where a remote is configured
    from .remote_fill import RemoteFill

log = logging.getLogger("persistent_prefix_cache")


class Fetcher:
    """The fetches of one handle (see the module's docstring).

    Args:
        layout, trie, memory, files, index, counters: The handle's.
        target: Where the handle's restores put what they read (`device.target.device_target`).
        costs: The handle's cost model.
        writeback: The writer thread (None: a read-only handle notes and drops nothing).
        remote_fill: The remote tier's part of a fetch (None: no remote).
        reasons: Tells why a fetch stopped short.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        trie: Trie,
        memory: MemoryTier,
        files: SegmentFiles,
        index: Index,
        target: Target,
        counters: Counters,
        costs: CostModel,
        writeback: WriteBack | None,
        remote_fill: RemoteFill | None,
        reasons: MissReasons,
    ):
        self._layout, self._trie, self._memory, self._files, self._index = layout, trie, memory, files, index
        self._target, self._counters, self._costs = target, counters, costs
        self._writeback, self._remote_fill, self._reasons = writeback, remote_fill, reasons
        self._warned_index = False
        self._last = threading.local()  # each thread's last report

    def fetch(self, tokens: Any, *, longer_than: int | None = None) -> tuple[list | None, Any]:
        """`PersistentPrefixCache.fetch` past the handle's check: a damaged index page
        is a miss, never an error."""
        toks = as_token_array(tokens)
        try:
            return self._fetch(tokens, toks, longer_than)
        except StoreCorruptError as exc:
            self.index_damaged(exc)
            self._counters.add(queries=1, misses=1, miss_damaged=1, tokens_recomputed=len(toks))
            self._last.report = FetchReport(len(toks), 0, 0, "damaged", None)
            return None, tokens

    def last(self) -> FetchReport | None:
        """The report of this thread's last fetch (None before the first)."""
        return getattr(self._last, "report", None)

    def peek(self, tokens: Any) -> int:
        """How many tokens `fetch` would restore, from the index alone (nothing is loaded)."""
        if self._layout.unsupported is not None:
            return 0
        return self._trie.longest(as_token_array(tokens), decode=False)[1]

    def index_damaged(self, exc: StoreCorruptError) -> None:
        """Count a read that met a damaged index page; say so once per handle (with
        what ``ppc check --fix`` will do)."""
        self._counters.add(corrupt=1)
        if not self._warned_index:
            self._warned_index = True
            log.warning("%s; serving what can be read, everything else misses", exc)

    def _fetch(self, tokens: Any, toks: np.ndarray, longer_than: int | None) -> tuple[list | None, Any]:
        """The lookup and the remote's part, then the restore."""
        if self._layout.unsupported is not None:
            return self._restore(tokens, toks, Walk([], 0, 0, None), longer_than, local=None, remote=None)
        walk = self._trie.walk(toks)
        local, pending, remote = walk.matched, None, None
        if self._remote_fill is not None and walk.matched < len(toks) - 1:
            pending = self._remote_fill.fill(toks, walk.matched)
            remote = self._remote_fill.remote.take_last_read()
            if pending is not None:  # the fleet held more: its blocks are in the RAM tier now
                walk = self._trie.walk(toks)
        result = self._restore(tokens, toks, walk, longer_than, local=None if pending is None else local, remote=remote)
        if pending and self._remote_fill is not None:
            self._remote_fill.write(pending)  # into the local store, once the caller's restore is done
        self._costs.save_soon()
        return result

    def _restore(
        self,
        tokens: Any,
        toks: np.ndarray,
        walk: Walk,
        longer_than: int | None,
        *,
        local: int | None,
        remote: str | None,
    ) -> tuple[list | None, Any]:
        """Restore the lookup's path (the cost cut, damage, timing), and report it.

        Args:
            local: Tokens the local store held before the remote's fill brought blocks
                (None: it brought none).
            remote: How the remote's read went (`RemoteTier.take_last_read`; None: not asked).
        """
        path, matched, n = walk.path, walk.matched, len(toks)
        if longer_than is not None and matched <= longer_than:
            reason: str | None = self._why(toks, walk, remote, matched)
            if longer_than == 0:
                # The caller holds nothing and the store has nothing: a plain miss
                # (a server's request that found nothing must show in `ppc stats`).
                self._counters.add(queries=1, misses=1, tokens_recomputed=n, **{f"miss_{reason}": 1})
                self._note(misses=1)
            else:
                self._counters.add(not_longer=1)
            self._last.report = FetchReport(n, 0, matched, reason, None)
            return None, tokens
        found = matched
        if path:
            path, matched = self._costs.cut(path, matched, len(tokens))
        slower, damaged = matched < found, False
        layers = None
        while path and layers is None:
            first = self._layout.first_needed(path, matched)
            from_disk = disk_bytes = ram_bytes = 0
            for node in path[first:]:  # where each block is, before admission
                if self._memory.node(node.key) is None:
                    from_disk, disk_bytes = from_disk + 1, disk_bytes + node.size
                else:
                    ram_bytes += node.size
            started = time.perf_counter()
            layers, intact = restore(
                self._layout, self._memory, self._files, path[first:], matched,
                self._index.segment_digests(path[first:]), target=self._target, room_for=n,
            )  # fmt: skip
            if layers is not None:
                self._costs.timed(path[first:], time.perf_counter() - started, in_ram=not from_disk)
            damaged = damaged or layers is None
            if intact < len(path) - first:
                self._damaged(path[first + intact])
            elif layers is None:
                break  # intact blocks that do not fit the layout: a miss
            # A damaged block cut the path short: fall back to what comes before it.
            if layers is None:
                path, matched = back_off(path[: first + intact], matched)
        if layers is None:
            reason = self._why(toks, walk, remote, 0, damaged=damaged, slower=slower)
            self._counters.add(queries=1, misses=1, tokens_recomputed=n, **{f"miss_{reason}": 1})
            self._note(misses=1)
            self._last.report = FetchReport(n, 0, found, reason, None)
            return None, tokens
        tier = "remote" if local is not None and matched > local else "disk" if from_disk else "ram"
        reason = None if matched >= n - 1 else self._why(toks, walk, remote, matched, damaged=damaged, slower=slower)
        self._counters.add(
            queries=1, hits=1, tokens_saved=matched, restored_blocks_disk=from_disk, tokens_recomputed=n - matched,
            bytes_restored_ram=ram_bytes, bytes_restored_disk=disk_bytes,
            **{f"hits_{tier}": 1, f"tokens_saved_{tier}": matched}, **({f"short_{reason}": 1} if reason else {}),
        )  # fmt: skip
        keys = [node.key for node in path]
        self._note(touch=keys, hit=keys, hits=1, tokens_saved=matched, restored_bytes=ram_bytes + disk_bytes)
        self._last.report = FetchReport(n, matched, found, reason, tier)
        return layers, tokens[matched:]

    def _why(
        self, toks: np.ndarray, walk: Walk, remote: str | None, matched: int, *, damaged=False, slower=False
    ) -> str:
        """Why a fetch stopped at `matched` tokens: from its last step back to the lookup
        (`miss_reasons`)."""
        if self._layout.unsupported is not None:
            return "unsupported"
        if damaged and matched < walk.matched:
            return "damaged"
        if slower:
            return "slower"
        return self._reasons.why(toks, walk, remote)

    def _damaged(self, node: Node) -> None:
        """Count a damaged block and drop it, with everything stored after it."""
        self._memory.discard(node.key)
        with self._index.reader() as reader:
            current = reader.get(node.key)
        if current is None or (current.checksum, current.segment) != (node.checksum, node.segment):
            return  # removed, replaced or moved (compacted) by this or another process meanwhile
        log.warning("block %s is missing or damaged; dropping it", node.key.hex())
        self._reasons.dropped(node.key)
        self._counters.add(corrupt=1)
        self._note(corrupt=1)
        if self._writeback is not None:
            self._writeback.submit(self._writeback.drop_subtree, node.key)

    def _note(self, **kwargs: Any) -> None:
        # Committed with the next write; a read-only handle keeps no account.
        if self._writeback is not None:
            self._writeback.note(**kwargs)

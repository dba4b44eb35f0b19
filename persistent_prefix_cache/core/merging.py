"""When the writer merges a chain's small segments (`disk.compaction.merge_chain` does it).

- After every write, as a job of its own behind it (`Merges.after_write`): the segments at
  the end of each chain written, while the one before is no larger than what follows it
  (a binary counter: at most log2(n) segments and log2(n) rewrites of a block for a
  chain stored in n pieces, a prompt a block at a time or a chat a turn at a time).
- Once the writer has had nothing to write for `QUIET_SECONDS`, and at close (up to
  `CLOSE_TIDY_BYTES`) (`Merges.tidy`): what is left of a burst of writes, the chain's tail segments written
  since the last quiet spell, merged into one where the largest holds at most
  `disk.compaction.TIDY_RATIO` times the rest (a prompt stored a block at a time ends
  in one segment; a long prompt is never rewritten to absorb the few blocks of an answer).
  Waiting for quiet keeps a caller that stores a block at a time, waiting for each
  (``sync_writes``), from having its whole prompt rewritten after every block.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .counters import Counters
from ..disk.compaction import merge_chain
from ..disk.index import Index
from ..disk.segment import SegmentFiles
from ..tiers.memory import MemoryTier

QUIET_SECONDS = 2.0  # a module setting; tests set 0 (`tidy` then runs at close only)
MAX_BURST = 100_000  # segments remembered per burst (a writer never quiet forgets the rest)
# What a tidy at close may rewrite: a server stopped after hours without a quiet spell must
# not spend its shutdown merging (what is left keeps the binary counter's few segments).
CLOSE_TIDY_BYTES = 512 << 20


class Merges:
    """The writer's merges of small segments (see the module's docstring).

    Args:
        index, files: The store's index and segment files.
        memory: The RAM tier (its records follow the blocks that move).
        counters: The handle's counters (``segments_merged``, ``bytes_rewritten``).
        submit: Runs a job on the writer thread (`writeback.WriteBack.submit`).
    """

    def __init__(
        self, index: Index, files: SegmentFiles, memory: MemoryTier, counters: Counters, submit: Callable[..., Any]
    ):
        self.index, self.files, self.memory, self.counters = index, files, memory, counters
        self._submit = submit
        self._lock = threading.Lock()
        self._burst: set[bytes] = set()  # segments written since the writer was last quiet
        self._ends: dict[bytes, None] = {}  # the last block of every write of the burst, in order
        self._last_write = 0.0
        self._timer: threading.Timer | None = None
        self._stopped = False

    def after_write(self, segments: list[bytes], ends: list[bytes]) -> None:
        """Queue the merges a commit of these segments (ending with these blocks) calls
        for: one job now, a tidy once the writer is quiet."""
        with self._lock:
            if len(self._burst) > MAX_BURST:
                self._burst.clear()
                self._ends.clear()
            self._burst.update(segments)
            self._ends.update(dict.fromkeys(ends))
            self._last_write = time.monotonic()
        self._submit(self.merge, ends)
        self._arm()

    def merge(self, ends: list[bytes], *, tidy: bool = False, budget: int | None = None) -> int:
        """Merge the small segments at the end of each chain ending with a block of `ends`
        (a writer-thread job).

        Args:
            tidy: Also merge segments of the burst up to `TIDY_RATIO` times the rest.
            budget: Stop once this many bytes were rewritten (None: no limit).

        Returns:
            How many segments were merged away.
        """
        with self._lock:
            burst = set(self._burst) if tidy else frozenset()
        merged = written = 0
        for key in ends:
            if budget is not None and written >= budget:
                break
            n, segment, moved, nbytes = merge_chain(self.index, self.files, key, burst=burst)
            if n and segment is not None:  # (merged: a new segment)
                merged += n - 1
                written += nbytes
                self.counters.add(segments_merged=n - 1, bytes_rewritten=nbytes)
                self.memory.moved(moved, segment)
                with self._lock:
                    self._burst.add(segment)
        return merged

    def tidy(self, budget: int | None = None) -> int:
        """Merge what is left of the burst (a writer-thread job; see the module's docstring).

        Args:
            budget: Bytes it may rewrite at most (at close: `CLOSE_TIDY_BYTES`).

        Returns:
            How many segments were merged away.
        """
        with self._lock:
            ends = list(self._ends)
        merged = self.merge(ends[::-1], tidy=True, budget=budget)  # the newest chains first: they hold the rest
        with self._lock:
            self._burst.clear()
            self._ends.clear()
        return merged

    def stop(self) -> None:
        """No more timers; the burst's tidy is queued (close waits for it)."""
        with self._lock:
            self._stopped = True
            timer, self._timer = self._timer, None
            pending = bool(self._ends)
        if timer is not None:
            timer.cancel()
        if pending:
            self._submit(self.tidy, CLOSE_TIDY_BYTES)

    def _arm(self) -> None:
        with self._lock:
            if self._timer is not None or self._stopped or QUIET_SECONDS <= 0:
                return
            self._timer = threading.Timer(QUIET_SECONDS, self._quiet)
            self._timer.daemon = True
            self._timer.start()

    def _quiet(self) -> None:
        with self._lock:
            self._timer = None
            if self._stopped:
                return
            wait = self._last_write + QUIET_SECONDS - time.monotonic()
        if wait > 0:  # written to since: wait for the rest of the quiet spell
            with self._lock:
                if self._timer is None and not self._stopped:
                    self._timer = threading.Timer(wait, self._quiet)
                    self._timer.daemon = True
                    self._timer.start()
            return
        self._submit(self.tidy)

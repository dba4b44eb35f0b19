"""Background fills of the RAM tier: what the cost model leaves on disk still joins it.

Where a prefill is fast (a datacenter GPU) the cost model finds reading a short prefix
from disk slower than computing it, and reads nothing; a prefix never read never joins
the RAM tier, and every later fetch computes it again, although a restore from the tier
would win by far (× 0.1–0.2 of the prefill at 2k–8k tokens on an H200). So when a fetch
leaves blocks on disk, `Warmer` reads them on a thread of its own, where the tier's
admission rule (`MemoryTier.admit`, with the copy counted as cheap: the caller does not
wait for it) says they pay: at once where they fit in free room, else on their second
skip. The next fetch of that prefix then finds them in the tier.

What it costs the caller, and what it keeps:

- The read runs on one thread at low priority (nice 19 where the OS allows), after
  the caller's prefill of what was skipped (as the cost model predicts it), one fill
  at a time (a fill asked for while one runs is dropped and counted), never more bytes
  than ``memory_bytes``, with the reader pool left to callers (`device.target.host_target`).
- No MLX work runs on that thread (a GPU stream belongs to the caller's thread): it reads
  into numpy buffers, and the tier holds those bits as they are (`HostBits`, as it holds
  the remote's blocks). On a GPU those buffers are carved from an `Arena` of MLX's
  managed memory the skipping fetch made on its own thread; the fill's thread moves the
  pages the host wrote to the GPU before the blocks join the tier, and a restore takes them as views of the
  arena (no copy, no MLX work until a fetch asks). Joining them with MLX copies on the
  next fetch cost it ~5 ms at 512 tokens on an H200 (a quarter of the prefill).
- Every block's checksum is verified before it joins the tier (`read_path`); a damaged
  or missing block stops the fill there (counted; the fetch that reads it drops it).
- The tier's buffers are its own: restores copy out of them (`read_path`), so nothing the
  caller's cache grows into is shared. Like the admission's copies, an arena is freed
  once the last of its blocks leaves the tier.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from ..disk.read_path import read_path
from ..device.buffers import Arena
from ..device.target import Target, host_target
from ..blocks import Node, is_sliced
from ..disk.segment import SegmentFiles
from ..layers import Layout
from .restore import read_snapshots
from ..tiers.memory import MemoryTier, SharedOrigins

NICE = 19  # the fill thread's priority: the caller's prefill comes first
MAX_DELAY = 1.0  # seconds a fill waits at most for the caller's prefill to end


class Warmer:
    """Reads blocks a fetch left on disk into the RAM tier, in the background.

    Args:
        layout: The store's layout.
        memory: The RAM tier.
        files: The segment files.
        digests: Segment ids -> their whole-segment digests from the index (a segment
            read whole is then verified with one pass per field, not one per block).
        target: The handle's restore target (on a GPU a fill reads into an `Arena`).
    """

    def __init__(
        self, layout: Layout, memory: MemoryTier, files: SegmentFiles, digests: Callable[[list], dict], target: Target
    ):
        self.layout, self.memory, self.files, self.digests = layout, memory, files, digests
        self.target = target
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._job: tuple[list[Node], float, Arena | None] | None = None  # the fill asked for, not started yet
        self._busy = False  # a fill is running
        self._stopped = False
        self._thread: threading.Thread | None = None
        if memory.max_bytes > 0:  # started with the handle: a fetch never waits for a thread to start
            self._thread = threading.Thread(target=self._loop, name="ppc-warm", daemon=True)
            self._thread.start()

    def skipped(self, path: list[Node], kept: int, matched: int, *, after: float | None = None) -> int:
        """A fetch restores only ``path[:kept]``: start a fill of the rest of what a
        restore of `path` at `matched` needs, where the admission rule says it pays.

        Args:
            after: Seconds the caller is expected to spend computing what was left
                (the cost model's prefill): the fill starts then (at most `MAX_DELAY`),
                not while that prefill runs (a thread running Python code can hold the
                caller off the GIL for the switch interval, 5 ms, at a time).

        Returns:
            How many blocks the fill will read (0: none started).
        """
        if self._thread is None or not path or kept >= len(path):
            return 0
        with self._lock:
            if self._stopped:
                return 0
            if self._busy or self._job is not None:
                self.memory.count_warm(memory_warm_dropped=1)
                return 0
            first = max(kept, self.layout.first_needed(path, matched))
            wanted = [n for n in path[first:] if self.memory.node(n.key) is None]
            flags = self.memory.admit(wanted, cheap_copy=True)
            nodes = [n for n, yes in zip(wanted, flags) if yes]
            if not nodes:
                return 0
            # On a GPU the fill reads straight into MLX memory made here, on the
            # caller's thread (zeroed asynchronously: `buffers.ARENA_ZEROS`), that its
            # thread then moves to the device: host memory copied over later cost
            # 1.1-3 x the prefill it was to save (H200). Host reads join no buffers
            # with room to grow: the blocks' bytes, and 64-byte alignment per buffer.
            arena = None
            if self.target.join_on_device:
                size = sum(n.size for n in nodes)
                tensors = len(self.layout.fields or ()) or 256  # per block, at most (snapshots: + 4)
                try:
                    arena = Arena(size + 64 * (tensors + 4) * len(nodes) + (64 << 10))
                except (RuntimeError, ValueError, OverflowError, MemoryError):  # a fill is a hint
                    return 0
            self._job = (nodes, min(MAX_DELAY, max(0.0, after or 0.0)), arena)
            self._changed.notify_all()
            return len(nodes)

    def wait(self) -> None:
        """Wait for the fill in progress, if any (it is then in the tier)."""
        with self._changed:
            while (self._busy or self._job is not None) and not self._stopped:
                self._changed.wait()

    def stop(self) -> None:
        """Start no more fills and wait for the one in progress (before the files close)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        self._stopping.set()  # a fill still waiting to start does not start
        if self._thread is not None:
            self._thread.join()

    # -- on the fill's thread ----------------------------------------------------------

    def _loop(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        while True:
            with self._changed:
                while self._job is None and not self._stopped:
                    self._changed.wait()
                job = self._job
                if self._stopped or job is None:  # (woken with no job: stopped)
                    return
                (nodes, delay, arena), self._job, self._busy = job, None, True
            try:
                if not (delay and self._stopping.wait(delay)):
                    self._fill(nodes, arena)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()

    def _fill(self, nodes: list[Node], arena: Arena | None) -> None:
        try:
            got = self._read(nodes, host_target(arena))
        except Exception:  # a fill is a hint: whatever goes wrong, the fetches read the disk
            got = None
        if got is None:
            return
        nodes, runs, snaps = got
        if arena is not None:
            # On this thread, before the blocks join the tier: the host wrote these
            # pages, and a restore's copies would fault them over one by one.
            arena.to_device()
        shared = SharedOrigins()  # blocks of one run share their origin
        for k, node in enumerate(nodes):
            tensors, origin = _block_bits(node, self.layout.kinds, runs, snaps.get(k, {}), shared)
            self.memory.put(node, tensors, origin, source="disk")
        self.memory.count_warm(memory_warmed=len(nodes), memory_warmed_bytes=sum(n.size for n in nodes))

    def _read(self, nodes: list[Node], target: Target) -> tuple[list[Node], dict, dict] | None:
        """The blocks' runs and snapshots as host bits (`target`: a host one), every
        checksum verified; the intact leading blocks only (None if none is)."""
        kinds, fields = self.layout.kinds, self.layout.fields
        digests = self.digests(nodes)
        read = lambda nodes: read_path(  # noqa: E731
            nodes, [None] * len(nodes), self.files, kinds, fields, digests, target=target
        )
        intact, runs, last = read(nodes)
        if intact < len(nodes):
            self.memory.count_warm(memory_warm_damaged=1)
            if intact == 0:
                return None
            nodes = nodes[:intact]
            intact, runs, last = read(nodes)
            if intact < len(nodes):
                return None
        snaps: dict[int, Any] = {len(nodes) - 1: last}
        for k, node in enumerate(nodes[:-1]):
            if node.extra.get("snap"):
                own = read_snapshots(self.files, node, target)
                if own is None:  # a damaged snapshot: keep the blocks before it
                    self.memory.count_warm(memory_warm_damaged=1)
                    return self._read(nodes[:k], target) if k else None
                snaps[k] = own
        return nodes, runs, snaps


def _block_bits(
    node: Node, leaves: dict, runs: dict, snaps: dict, shared: SharedOrigins
) -> tuple[dict[str, dict[str, Any]], dict]:
    """One block's tensors by leaf (every leaf of `leaves`): views of the fill's runs
    (sliced fields) and its snapshots, as host bits; and their origin (see
    `MemoryTier.put`: a restore copies the blocks of one run as one slice of it), the
    one `shared` gives every block of the same runs."""
    tensors: dict[str, dict] = {lid: {} for lid in leaves}
    origin: dict[str, tuple] = {}
    for lid, part in runs.items():
        fields, starts = {}, set()
        for fld, pieces in part.items():
            for a, z, run in pieces:
                if a <= node.position and node.end <= z:
                    bits = run[..., node.position - a : node.end - a, :]
                    if is_sliced(f"{lid}.{fld}", bits.shape, node.n_tokens):
                        tensors.setdefault(lid, {})[fld] = bits
                        fields[fld] = run
                        starts.add(a)
        if len(starts) == 1:
            origin[lid] = shared.leaf(lid, fields, starts.pop())
    for lid, part in snaps.items():
        tensors.setdefault(lid, {}).update(part)
    return tensors, shared.block(origin)

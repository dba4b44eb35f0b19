"""The RAM tier: recently used blocks, already decoded, under a byte budget.

It holds each block's index record beside its tensors, so a block stored a moment ago
is found (and its children listed) before the writer thread has put it on disk.

Blocks enter it three ways (each entry remembers which, for `stats()`): stored by this
process (``"store"``), read from the remote tier (``"remote"``, by `remote_fill.RemoteFill`),
or read from disk by a fetch (``"disk"``), admitted by `MemoryTier.admit`:

- on the **second** disk hit of a block within a window (the keys of the last blocks
  read from disk, as many bytes as twice the budget): admitting costs a copy of the
  block's bytes (the caller's cache must own the buffers the read filled: mlx-lm grows
  them in place), which a prefix read once never pays back; a prefix read twice is the
  hot one (a system prompt), and from its third fetch on it is served from RAM
  (measured on a 2-core VM, 128 MiB: the copy costs about one disk fetch, 110–126 ms
  for the 2nd fetch against 54–63 ms for the 1st, and the 3rd takes 36–38 ms: paid
  back by the 4th or 5th fetch, never by a prefix read once; README);
- on the **first** hit where the blocks fit in the tier's free room and the copy is a
  device-side one (GPU: ~3 ms per GiB, docs/h200-measurements.md), evicting nothing;
- never a path larger than the whole budget (it would flush the tier and itself).

**What an entry holds.** Blocks cut from one copy per field (a store's new blocks, a
restore's admitted ones, a fill's) are held as that copy and where the block starts in
it (its *origin*), not as views: an MLX array is an object Python's cyclic garbage
collector tracks, and a tier holding 64 views per block of an 8B model had every full
collection walk them all (tens of milliseconds inside the caller's `store()`; measured by
``tools/gc_in_store.py``, docs/performance.md). A restore reads such blocks as slices of
their copies (`disk.read_path`); `block_tensors` makes the views where a caller wants them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable, Mapping

from ..blocks import CutFrom, Node, Tensors

# How a block entered the tier: stored by this process, read from disk, from the remote.
SOURCES = ("store", "disk", "remote")


def tensors_nbytes(tensors: Mapping[str, Tensors]) -> int:
    """Bytes held by one block's tensors (by leaf, then by field)."""
    if isinstance(tensors, CutFrom):  # its share of each copy's bytes, with no view made
        n = tensors.hi - tensors.lo
        return sum(x.nbytes // x.shape[-2] * n for part in tensors.copies.values() for x in part.values())
    return sum(x.nbytes for part in tensors.values() for x in part.values())


def block_tensors(node: Node, rest: dict[str, Tensors], origin: dict) -> dict[str, Tensors]:
    """A held block's tensors by leaf, then field: views of its copies (see `MemoryTier.put`)
    beside the tensors held as they are (`rest`), in fresh dicts."""
    out = {lid: {f: base[..., node.position - at : node.end - at, :] for f, base in fields.items()}
           for lid, (fields, at) in origin.items()}  # fmt: skip
    for lid, part in rest.items():
        out.setdefault(lid, {}).update(part)
    return out


def _rest(tensors: Mapping[str, Tensors], origin: dict) -> dict[str, Tensors]:
    """What of a block's tensors its origin does not give (snapshots, fields cut elsewhere)."""
    if not origin:
        return tensors if isinstance(tensors, dict) else dict(tensors)
    if isinstance(tensors, CutFrom) and all(
        origin.get(lid, (None,))[0] is part for lid, part in tensors.copies.items()
    ):
        return {}  # cut from the copies its origin names: nothing more to hold
    out = {}
    for lid, part in tensors.items():
        held = origin.get(lid)
        if held is None:
            out[lid] = part
        elif not part.keys() <= held[0].keys():
            out[lid] = {f: x for f, x in part.items() if f not in held[0]}
    return out


class SharedOrigins:
    """Gives the blocks of one copy one origin object (see `MemoryTier.put`): a restore's
    admitted blocks or a background fill's, put one by one, would each bring a dict and
    a tuple per leaf of their own, which the tier then keeps; shared, the tier keeps next
    to nothing per block. Keyed by the copies' identities, so it lives only as long as
    one batch of blocks whose copies it holds alive."""

    def __init__(self) -> None:
        self._seen: dict[tuple, Any] = {}

    def leaf(self, lid: str, fields: dict, at: int) -> tuple[dict, int]:
        """The one ``(fields, at)`` of leaf `lid` for every block cut from these copies at `at`."""
        return self._seen.setdefault((lid, at, *map(id, fields.values())), (fields, at))

    def block(self, origin: dict) -> dict:
        """The one origin (leaf -> `leaf`'s pair) for every block whose leaves share these."""
        return self._seen.setdefault(("block", *map(id, origin.values())), origin)


class MemoryTier:
    """A thread-safe LRU map from block key to (node, tensors by leaf).

    Args:
        max_bytes: Budget for tensor bytes; 0 disables the tier.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self.admitted = 0  # blocks admitted from disk reads (`admit`) and the remote
        self.admitted_bytes = 0
        self.served = dict.fromkeys(SOURCES, 0)  # blocks a restore took from here, by source
        # Background fills (`warm.Warmer`): blocks and bytes put, fills not started
        # (one was running), blocks found missing or damaged.
        self.warm = {"memory_warmed": 0, "memory_warmed_bytes": 0, "memory_warm_dropped": 0, "memory_warm_damaged": 0}
        # key -> (node, the tensors its origin does not give, bytes, origin, source)
        self._entries: OrderedDict[bytes, tuple[Node, dict[str, Tensors], int, dict, str]] = OrderedDict()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # recent disk hits: key -> bytes
        self._seen_bytes = 0
        self._children: dict[bytes, set[bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[Node, dict[str, Tensors], dict] | None:
        """The entry for `key` as ``(node, rest, origin)``, refreshed as most recently
        used, or None: the block's tensors are the views its origin gives (see `put`)
        and those of `rest` (`block_tensors` joins them)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0], entry[1], entry[3]

    def node(self, key: bytes) -> Node | None:
        """The node for `key` without touching the LRU order."""
        entry = self._entries.get(key)
        return entry[0] if entry else None

    def moved(self, keys: list[bytes], segment: bytes) -> None:
        """Records of these blocks now point at `segment` (a merge moved their bytes):
        the nodes held here say so too, so that a restore that finds a block evicted
        between its lookup and its read reads the new file."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry[0].segment = segment

    def children(self, parent: bytes) -> list[Node]:
        """Nodes held here whose parent is `parent`."""
        with self._lock:
            return [self._entries[k][0] for k in self._children.get(parent, ())]

    def source(self, key: bytes) -> str | None:
        """How the block `key` entered the tier (see `SOURCES`), or None if it is not here."""
        entry = self._entries.get(key)
        return entry[4] if entry else None

    def fits(self, tensors: Mapping[str, Tensors] | int) -> bool:
        """Whether a block of these tensors (or of this many bytes) fits in the tier's
        budget at all (else `put` leaves it out)."""
        return (tensors if isinstance(tensors, int) else tensors_nbytes(tensors)) <= self.max_bytes

    def put(
        self,
        node: Node,
        tensors: Mapping[str, Tensors],
        origin: dict | None = None,
        source: str = "store",
        *,
        size: int | None = None,
    ) -> None:
        """Insert or refresh a block, evicting least recently used ones over budget.

        Args:
            node: The block's record.
            tensors: Its tensors by leaf, then field.
            origin: Leaf -> ``(fields, position)`` where the leaf's tensors of those
                fields are views of those arrays starting at that position (blocks cut
                from one copy): only the copy and the position are kept (see the
                module), and a restore joins consecutive such blocks as one slice of it.
            source: How it came: ``"store"``, ``"disk"`` or ``"remote"`` (counted).
            size: Its tensors' bytes, if the caller knows them (else they are summed).
        """
        size = tensors_nbytes(tensors) if size is None else size
        if size > self.max_bytes:
            return
        with self._lock:
            self._drop(node.key)
            self._entries[node.key] = (node, _rest(tensors, origin or {}), size, origin or {}, source)
            if source != "store":
                self.admitted += 1
                self.admitted_bytes += size
            self._children.setdefault(node.parent, set()).add(node.key)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self.evictions += 1

    def admit(self, nodes: list[Node], *, cheap_copy: bool) -> list[bool]:
        """Which of `nodes` (blocks a restore just read from disk) to admit (see the
        module's docstring); the others are remembered as hit once.

        Args:
            nodes: The blocks read from disk by one restore.
            cheap_copy: Whether copying them costs next to nothing (a device copy).

        Returns:
            One flag per node.
        """
        if self.max_bytes <= 0 or not nodes:
            return [False] * len(nodes)
        total = sum(n.size for n in nodes)
        with self._lock:
            if total > self.max_bytes:
                return [False] * len(nodes)  # a scan larger than the tier: keep what is hot
            room = cheap_copy and self.nbytes + total <= self.max_bytes
            out = [room or n.key in self._seen for n in nodes]
            for node, yes in zip(nodes, out):
                old = self._seen.pop(node.key, None)
                if old is not None:
                    self._seen_bytes -= old
                if not yes:
                    self._seen[node.key] = node.size
                    self._seen_bytes += node.size
            while self._seen and self._seen_bytes > 2 * self.max_bytes:
                self._seen_bytes -= self._seen.popitem(last=False)[1]
            return out

    def resize(self, max_bytes: int) -> None:
        """Change the budget, evicting least recently used blocks down to it at once.

        Args:
            max_bytes: The new budget for tensor bytes (0 empties and disables the tier).
        """
        with self._lock:
            self.max_bytes = max(0, max_bytes)
            while self.nbytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self.evictions += 1

    def count_served(self, keys: list[bytes]) -> None:
        """Count blocks a restore took from the tier, by how they entered it."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self.served[entry[4]] += 1

    def count_warm(self, **counts: int) -> None:
        """Count what a background fill did (keys of ``self.warm``)."""
        with self._lock:
            for name, n in counts.items():
                self.warm[name] += n

    def stats(self) -> dict[str, int]:
        """The tier's part of the store's `stats()`.

        Returns:
            bytes_in_memory, blocks_in_memory, memory_budget (its budget now),
            memory_evictions; memory_admitted and
            memory_admitted_bytes (blocks read from disk or the remote that joined the
            tier); memory_hits_store, memory_hits_disk, memory_hits_remote (blocks
            restores took from the tier, by how they entered it: stored by this handle,
            admitted from a disk read, read from the remote); memory_warmed[_bytes]
            (blocks a background fill read from disk into the tier: a prefix the cost
            model left on disk), memory_warm_dropped (fills not started: one was
            running), memory_warm_damaged (blocks such a fill found missing or damaged).
        """
        with self._lock:
            out = {
                "bytes_in_memory": self.nbytes,
                "blocks_in_memory": len(self._entries),
                "memory_budget": self.max_bytes,
            }
            out.update(memory_evictions=self.evictions, memory_admitted=self.admitted)
            out["memory_admitted_bytes"] = self.admitted_bytes
            out.update({f"memory_hits_{source}": n for source, n in self.served.items()})
            out.update(self.warm)
            return out

    def held(self) -> list[tuple[bytes, dict[str, Tensors]]]:
        """Every block held, least recently used first, as ``(key, tensors by leaf, then
        field)``: the tier's own arrays (or views of them) in fresh dicts; the order and
        counters unchanged."""
        with self._lock:
            entries = [(key, entry[0], entry[1], entry[3]) for key, entry in self._entries.items()]
        return [(key, block_tensors(node, rest, origin)) for key, node, rest, origin in entries]

    def discard(self, key: bytes) -> bool:
        """Forget a block (it was evicted from disk or found damaged).

        Returns:
            Whether it was held.
        """
        with self._lock:
            held = key in self._entries
            self._drop(key)
            return held

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._entries.clear()
            self._children.clear()
            self._seen.clear()
            self._seen_bytes = 0
            self.nbytes = 0

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        node, _, size, _, _ = entry
        self.nbytes -= size
        siblings = self._children.get(node.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[node.parent]


class MemoryView:
    """A handle's RAM tier seen from outside (`PersistentPrefixCache.ram_tier`): the blocks
    it holds with their tensors, read without changing it, and blocks dropped by key.

    Args:
        tier: The tier it shows.
    """

    def __init__(self, tier: MemoryTier):
        self._tier = tier

    def items(self) -> list[tuple[bytes, dict[str, Tensors]]]:
        """Every block the tier holds, least recently used first.

        Returns:
            ``(block key, tensors)`` per block, the tensors by leaf, then field: the
            tier's own arrays (MLX arrays, or `device.buffers.HostBits` where the tier
            keeps host bits), to read, never to write. Neither the tier's order nor its
            counters change.
        """
        return self._tier.held()

    def evict(self, keys: Iterable[bytes]) -> int:
        """Drop these blocks from the tier; they stay on disk, where a later fetch reads
        them (not counted in ``memory_evictions``, which counts the budget's).

        Args:
            keys: Block keys (as `items` gives them).

        Returns:
            How many of them the tier held.
        """
        return sum(self._tier.discard(key) for key in keys)

"""The RAM tier: recently used blocks, already decoded, under a byte budget.

It holds each block's index record beside its tensors, so a block stored a moment ago
is found (and its children listed) before the writer thread has put it on disk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..disk.node import Node

# One block's tensors for one leaf, by field (evaluated mlx arrays).
Tensors = dict[str, Any]


def tensors_nbytes(tensors: dict[str, Tensors]) -> int:
    """Bytes held by one block's tensors (by leaf, then by field)."""
    return sum(x.nbytes for part in tensors.values() for x in part.values())


class MemoryTier:
    """A thread-safe LRU map from block key to (node, tensors by leaf).

    Args:
        max_bytes: Budget for tensor bytes; 0 disables the tier.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, tuple[Node, dict[str, Tensors], int, dict]] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[Node, dict[str, Tensors], dict] | None:
        """The entry for `key` as ``(node, tensors, origin)`` (see `put`), refreshed as
        most recently used, or None."""
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

    def children(self, parent: bytes) -> list[Node]:
        """Nodes held here whose parent is `parent`."""
        with self._lock:
            return [self._entries[k][0] for k in self._children.get(parent, ())]

    def put(self, node: Node, tensors: dict[str, Tensors], origin: dict | None = None) -> None:
        """Insert or refresh a block, evicting least recently used ones over budget.

        Args:
            node: The block's record.
            tensors: Its tensors by leaf, then field.
            origin: Leaf -> ``(fields, position)`` where the leaf's tensors are views
                of those arrays starting at that position (blocks cut from one copy):
                a restore joins consecutive such blocks as one slice of it.
        """
        size = tensors_nbytes(tensors)
        if size > self.max_bytes:
            return
        with self._lock:
            self._drop(node.key)
            self._entries[node.key] = (node, tensors, size, origin or {})
            self._children.setdefault(node.parent, set()).add(node.key)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self.evictions += 1

    def discard(self, key: bytes) -> None:
        """Forget a block (it was evicted from disk or found damaged)."""
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._entries.clear()
            self._children.clear()
            self.nbytes = 0

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        node, _, size, _ = entry
        self.nbytes -= size
        siblings = self._children.get(node.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[node.parent]

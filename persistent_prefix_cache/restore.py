"""Rebuilding fresh caches from a path of stored blocks.

Blocks in the RAM tier are used as they are; the rest are read from their segments
into joined buffers (`disk.assemble`), checked against the dtypes and shapes the
model's layout holds, and every leaf is rebuilt from those (`layers.Layout`).
"""

from __future__ import annotations

from .disk.assemble import read_path
from .disk.segment import SegmentFiles
from .disk.node import Node
from .layers import JoinedSource, Layout
from .tiers.memory import MemoryTier


def restore(
    layout: Layout,
    memory: MemoryTier,
    files: SegmentFiles,
    nodes: list[Node],
    position: int,
    digests: dict[bytes, int] | None = None,
) -> tuple[list | None, int]:
    """Rebuild the cache at `position` from `nodes` (the blocks any leaf needs).

    Args:
        layout: The store's layout.
        memory: The RAM tier.
        files: The segment files.
        nodes: Consecutive blocks, from the first one a leaf needs to the last.
        position: Where the cache is rebuilt (inside or at the end of the last block).
        digests: The index's whole-segment digests of the segments involved.

    Returns:
        ``(cache or None, how many of nodes were intact)``. Fewer than ``len(nodes)``
        intact means the block after them is missing or damaged; all intact and None
        means the blocks do not fit the layout.
    """
    cached, origins = [], []
    for node in nodes:
        entry = memory.get(node.key)
        cached.append(entry[1] if entry is not None else None)
        origins.append(entry[2] if entry is not None else {})
    intact, runs, snaps = read_path(
        nodes, cached, files, layout.kinds, position, layout.fields, digests, origins
    )
    if intact < len(nodes):
        return None, intact
    # Blocks read from disk do not join the RAM tier: views of the returned buffers
    # would stop mlx-lm from growing them in place (it copies shared buffers).
    last = nodes[-1]
    sources = {
        lid: JoinedSource(layout.view(last, lid, snaps.get(lid, {})), runs.get(lid, {}))
        for lid, _, _ in layout.leaves
    }
    return layout.rebuild(sources, position), len(nodes)

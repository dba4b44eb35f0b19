"""Rebuilding fresh caches from a path of stored blocks.

Blocks in the RAM tier are used as they are; the rest are read from their segments
into joined buffers (`disk.read_path`), checked against the dtypes and shapes the
model's layout holds, and every leaf is rebuilt from those (`layers.Layout`).

Blocks read from disk may then join the RAM tier (`MemoryTier.admit` says which):
the tier gets its own copy of their rows, one per joined buffer, with the blocks as
views of it. Never views of the buffers handed to the caller: mlx-lm's ``KVCache``
writes its next tokens into that buffer in place, which MLX only does while nothing
else holds it (else the first decode step copies the whole cache).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np
import mlx.core as mx

from ..disk.read_path import array_bits, read_path
from ..blocks import Node, dtype_info, is_sliced, mx_uint
from ..device.buffers import allocate, device_copy
from ..device.readers import reader_pool
from ..device.target import Target
from ..disk.segment import SegmentFiles
from ..layers import JoinedSource, Layout, grown_rows
from ..tiers.memory import MemoryTier, SharedOrigins

_PARALLEL_BYTES = 4 << 20  # below this, handing copies to threads costs more than it saves


def restore(
    layout: Layout,
    memory: MemoryTier,
    files: SegmentFiles,
    nodes: list[Node],
    position: int,
    digests: dict[bytes, int] | None = None,
    *,
    target: Target,
    room_for: int = 0,
) -> tuple[list | None, int]:
    """Rebuild the cache at `position` from `nodes` (the blocks any leaf needs).

    Args:
        target: Where the handle's restores put what they read (`device.target.device_target`).
        layout: The store's layout.
        memory: The RAM tier.
        files: The segment files.
        nodes: Consecutive blocks, from the first one a leaf needs to the last.
        position: Where the cache is rebuilt (inside or at the end of the last block).
        digests: The index's whole-segment digests of the segments involved.
        room_for: The caller's prompt length: its cache gets the rows mlx-lm's own prefill
            of it would leave, room to compute the rest in place (`layers.grown_rows`).

    Returns:
        ``(cache or None, how many of nodes were intact)``. Fewer than ``len(nodes)``
        intact means the block after them is missing or damaged; all intact and None
        means the blocks do not fit the layout.
    """
    with files.reads_first.reading():  # the store's writer waits meanwhile (`reads_first`)
        cached, origins = [], []
        for node in nodes:
            entry = memory.get(node.key)
            cached.append(entry[1] if entry is not None else None)
            origins.append(entry[2] if entry is not None else {})
        intact, runs, snaps = read_path(
            nodes, cached, files, layout.kinds, layout.fields, digests, origins, target=target,
            seq_rows=grown_rows(max(position, room_for)),
        )  # fmt: skip
        if intact < len(nodes):
            return None, intact
        last = nodes[-1]
        sources = {
            lid: JoinedSource(layout.view(last, lid, snaps.get(lid, {})), runs.get(lid, {}))
            for lid, _, _ in layout.leaves
        }
        cache = layout.rebuild(sources, position)
        if cache is not None:
            memory.count_served([n.key for n, have in zip(nodes, cached) if have is not None])
            admit(memory, nodes, cached, runs, snaps, files, target)
        return cache, len(nodes)


def admit(
    memory: MemoryTier,
    nodes: list[Node],
    cached: list,
    runs: dict[str, dict[str, list]],
    snaps: dict[str, dict[str, mx.array]],
    files: SegmentFiles,
    target: Target,
) -> int:
    """Put the blocks of a restore that came from disk into the RAM tier, where
    `MemoryTier.admit` says they pay, as views of fresh copies of the joined buffers.

    The read path reads the snapshot tensors of the path's last block only: those of
    another admitted block are read here (small: a window or a recurrent state), and a
    block whose snapshot cannot be read intact is left out.

    Args:
        memory: The RAM tier.
        nodes: The restored path; `cached` its RAM-tier tensors (None: read from disk).
        runs: The joined buffers by leaf, then field, as ``(start, end, array)``.
        snaps: The last block's snapshot tensors by leaf.
        files: The segment files (for the other blocks' snapshots).
        target: The restore's target (on a GPU the copies are device-side ones).

    Returns:
        How many blocks were admitted.
    """
    end = len(nodes) - 1
    candidates = [k for k, have in enumerate(cached) if have is None]
    on_device = target.join_on_device
    flags = memory.admit([nodes[k] for k in candidates], cheap_copy=on_device)
    chosen = [k for k, yes in zip(candidates, flags) if yes]
    own_snaps: dict[int, dict] = {end: snaps}
    unread = set()  # blocks whose snapshots are not intact: they stay out
    for k in chosen:
        if k != end and nodes[k].extra.get("snap"):
            got = read_snapshots(files, nodes[k], target)
            if got is None:
                unread.add(k)
            else:
                own_snaps[k] = got
    chosen = [k for k in chosen if k not in unread]
    return join_admitted(memory, nodes, chosen, runs, own_snaps, on_device)


def join_admitted(
    memory: MemoryTier,
    nodes: list[Node],
    chosen: list[int],
    runs: dict[str, dict[str, list]],
    own_snaps: dict[int, dict],
    on_device: bool,
) -> int:
    """Put ``nodes[k]`` for each k in `chosen` into the RAM tier, held as where they start
    in fresh copies of the joined `runs` (one copy per buffer and stretch of admitted
    blocks; `MemoryTier.put`'s origins).

    Args:
        own_snaps: Block index -> its snapshot tensors by leaf (the last block's are
            copied: they went to the caller; the others' are the tier's own).
        on_device: Copy with MLX operations (a GPU) rather than into host buffers.

    Returns:
        How many blocks were admitted.
    """
    if not chosen:
        return 0
    end, snaps = len(nodes) - 1, own_snaps.get(len(nodes) - 1, {})
    # One copy per joined buffer and stretch of consecutive admitted blocks, of the rows
    # they cover (not of blocks between them that the tier holds already: uncounted).
    stretches: list[list[int]] = []  # [first row, one past the last, last block]
    for k in chosen:
        if stretches and stretches[-1][2] == k - 1:
            stretches[-1][1:] = [nodes[k].end, k]
        else:
            stretches.append([nodes[k].position, nodes[k].end, k])
    spans = []  # (leaf, field, first row copied, one past the last, the rows)
    for lid, part in runs.items():
        for fld, pieces in part.items():
            for start, stop, array in pieces:
                for lo, hi, _ in stretches:
                    a, z = max(lo, start), min(hi, stop)
                    if a < z:
                        spans.append((lid, fld, a, z, array[..., a - start : z - start, :]))
    copies = _copies([rows for *_, rows in spans], on_device)
    bases: dict[str, dict[str, list]] = {}
    for (lid, fld, a, z, _), copy in zip(spans, copies):
        bases.setdefault(lid, {}).setdefault(fld, []).append((a, z, copy))
    # The last block's snapshots went to the caller: copied. The others were read here.
    flat = [(lid, f, x) for lid, part in snaps.items() for f, x in part.items()] if end in chosen else []
    snap_copies = {end: [(lid, f, copy) for (lid, f, _), copy in zip(flat, _copies([x for *_, x in flat], on_device))]}
    for k, held in own_snaps.items():
        if k != end:
            snap_copies[k] = [(lid, f, x) for lid, fields in held.items() for f, x in fields.items()]
    # A block is held as the copies it was cut from and where it starts in them (its
    # origin, `MemoryTier.put`), never as views: making a view per block and field (16k
    # for a 16k-token prompt of an 8B llama) cost 70-110 ms of a restore on this VM, and the
    # tier dropped them again. Each leaf's stretch of copies gives its origin to the blocks
    # inside it at once (they are consecutive). A block one of whose leaves has fields in
    # copies starting at different rows (runs that disagree: not seen in any family) stays out.
    at = [nodes[k].position for k in chosen]  # ascending, as `chosen`
    ends = [nodes[k].end for k in chosen]
    origins: list[dict[str, tuple]] = [{} for _ in chosen]
    sizes = [0] * len(chosen)
    several: dict[tuple[int, str], list[tuple[dict, int]]] = {}  # (block, leaf) covered twice -> (copies, start)
    shared = SharedOrigins()
    for lid, part in bases.items():
        by_stretch: dict[tuple[int, int], dict] = {}
        for fld, pieces in part.items():
            for a, z, copy in pieces:
                by_stretch.setdefault((a, z), {})[fld] = copy
        for (a, z), copies_by_field in by_stretch.items():
            first, past = bisect_left(at, a), bisect_right(ends, z)  # the blocks inside [a, z)
            # Tokens of a block -> its sliced fields (`is_sliced`), their origin and bytes a
            # token: one of each for all the blocks of that length (all but a last one).
            kept: dict[int, tuple[dict, tuple, int]] = {}
            for i in range(first, past):
                n = ends[i] - at[i]
                got = kept.get(n)
                if got is None:
                    fields = {
                        f: c
                        for f, c in copies_by_field.items()
                        if is_sliced(f"{lid}.{f}", (*c.shape[:-2], n, c.shape[-1]), n)
                    }
                    got = kept[n] = (fields, shared.leaf(lid, fields, a), _row_bytes(fields))
                fields, pair, per_token = got
                if not fields:
                    continue
                if (i, lid) in several:
                    several[(i, lid)].append((fields, a))
                elif lid in origins[i]:
                    held, start = origins[i].pop(lid)
                    sizes[i] -= n * _row_bytes(held)
                    several[(i, lid)] = [(held, start), (fields, a)]
                else:
                    origins[i][lid] = pair
                    sizes[i] += n * per_token
    left_out = set()  # blocks a leaf's copies give from different rows: never held as views
    for (i, lid), pairs in several.items():
        if len({a for _, a in pairs}) > 1:
            left_out.add(i)
            continue
        merged = {f: c for fields, _ in pairs for f, c in fields.items()}
        sizes[i] += (ends[i] - at[i]) * _row_bytes(merged)
        origins[i][lid] = shared.leaf(lid, merged, pairs[0][1])  # every field's copy starts at one row
    admitted = 0
    for i, k in enumerate(chosen):
        if i in left_out:
            continue
        tensors: dict[str, dict] = {lid: {} for lid in (*runs, *own_snaps.get(k, {})) if lid not in origins[i]}
        for lid, f, copy in snap_copies.get(k, ()):
            tensors.setdefault(lid, {})[f] = copy
            sizes[i] += copy.nbytes
        memory.put(nodes[k], tensors, shared.block(origins[i]), source="disk", size=sizes[i])
        admitted += 1
    return admitted


def _row_bytes(fields: dict) -> int:
    """Bytes of one token's row of each copy in `fields`, together."""
    return sum(c.nbytes // c.shape[-2] for c in fields.values())


def read_snapshots(files: SegmentFiles, node: Node, target: Target) -> dict[str, dict[str, mx.array]] | None:
    """The snapshot tensors of one stored block by leaf, each checked against its digest
    (which the block's checksum covers; `HostBits` for a host target); None if the block
    or one of them is not intact."""
    seg = files.open(node.segment)
    if seg is None:
        return None
    try:
        i = seg.block_index(node)
        if i is None:
            return None
        wanted = seg.snaps_of(i)
        arrays = target.allocate([(f"s{j}", s.shape, s.dtype) for j, s in enumerate(wanted)])
        out: dict[str, dict[str, mx.array]] = {}
        for j, s in enumerate(wanted):
            if seg.read_snap(s, memoryview(arrays[f"s{j}"]).cast("B")) is None:
                return None
            lid, _, fld = s.name.rpartition(".")
            out.setdefault(lid, {})[fld] = target.wrap(arrays[f"s{j}"], s.dtype)
        return out
    finally:
        seg.close()


def _copies(arrays: list[mx.array], on_device: bool) -> list[mx.array]:
    """Evaluated copies of `arrays` in memory of their own (never a buffer they share).

    On a GPU a device-side copy (a copy kernel, no CPU touch); on the
    CPU (and unified memory) into buffers allocated without a zero-fill, with numpy
    copies on the reader threads (they drop the GIL).
    """
    if not arrays:
        return []
    if on_device:
        out = [device_copy(x) for x in arrays]
        mx.eval(out)
        return out
    fresh = allocate([(f"c{i}", x.shape, dtype_info(x.dtype)[0]) for i, x in enumerate(arrays)])
    out = [fresh[f"c{i}"] for i in range(len(arrays))]
    sources = [x.view(mx_uint(x.itemsize)) for x in arrays]
    mx.eval(sources)

    def copy(i: int) -> None:
        # (The ignores: mlx's stubs omit mx.array's buffer protocol.)
        target = array_bits(memoryview(out[i]), out[i])  # type: ignore[arg-type]
        np.copyto(target, np.asarray(memoryview(sources[i])), casting="no")  # type: ignore[arg-type]

    if len(arrays) > 1 and sum(x.nbytes for x in arrays) >= _PARALLEL_BYTES:
        list(reader_pool().map(copy, range(len(arrays))))
    else:
        for i in range(len(arrays)):
            copy(i)
    return out

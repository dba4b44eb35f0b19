"""RAM-tier blocks joined on the device: where CPU writes would migrate pages (a GPU),
a restore that needs no disk read joins the tier's blocks with MLX operations."""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx

from ..blocks import Tensors, is_sliced
from .buffers import as_mx


def join_on_device(
    pieces: Iterable[tuple[str, int, int, object]],
    last: dict[str, Tensors],
    last_tokens: int,
    lid_kind: dict[str, str],
    capacity: int,
) -> tuple[dict[str, dict[str, list]], dict[str, Tensors]]:
    """Runs and snapshots from RAM-tier blocks only, joined by `mx.concatenate` (with
    zeros appended as room to grow in place); blocks a fill read into an arena join as
    views of it.

    Args:
        pieces: The path's sliced tensors as ``(name, start, end, array)`` in path
            order (``name`` is ``"<leaf>.<field>"``; an array may be `HostBits`).
        last: The last block's tensors by leaf (its snapshots are taken from them).
        last_tokens: The last block's number of tokens.
        lid_kind: Leaf id -> adapter kind (sequence leaves get room to grow).
        capacity: Rows a sequence leaf's run from position 0 is given at least.

    Returns:
        (runs by leaf then field as ``(start, end, array)``, the last block's snapshot
        tensors by leaf), as the read path returns them.
    """
    parts: dict[str, list[list]] = {}  # name -> runs of [start, end, [arrays]]
    for name, start, end, x in pieces:
        x = as_mx(x)
        runs = parts.setdefault(name, [])
        if runs and runs[-1][1] == start and runs[-1][2][-1].shape[:2] == x.shape[:2]:
            runs[-1][1] = end
            runs[-1][2].append(x)
        else:
            runs.append([start, end, [x]])
    by_leaf: dict[str, dict[str, list]] = {}
    joined = []
    for name, runs in parts.items():
        lid, _, fld = name.rpartition(".")
        for start, end, arrays in runs:
            if start == 0 and lid_kind.get(lid) == "seq":
                pad = capacity - (end - start)
                if pad > 0:
                    b, h, _, w = arrays[0].shape
                    arrays = arrays + [mx.zeros((b, h, pad, w), dtype=arrays[0].dtype)]
            array = mx.concatenate(arrays, axis=2) if len(arrays) > 1 else mx.array(arrays[0])
            joined.append(array)
            by_leaf.setdefault(lid, {}).setdefault(fld, []).append((start, end, array))
    mx.eval(joined)
    snaps = {
        lid: {f: as_mx(x) for f, x in part.items() if not is_sliced(f"{lid}.{f}", x.shape, last_tokens)}
        for lid, part in last.items()
    }
    return by_leaf, snaps

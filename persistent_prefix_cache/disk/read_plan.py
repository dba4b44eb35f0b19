"""What a restore reads, planned before a byte is read: the runs of consecutive blocks
whose slices of one field become one joined buffer, grouped by the segment or the RAM
tier that holds them (`disk.read_path` reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..blocks import dtype_info, is_sliced
from .segment import OpenSegment


def ram_pieces(nodes, cached, origins) -> list[tuple[str, int, int, mx.array]]:
    """The sliced tensors of the RAM-tier blocks of a path as ``(name, start, end,
    array)``, in path order; consecutive blocks cut from one copy (their origin: see
    `MemoryTier.put`) come as one slice of it: joining thousands of block-sized pieces
    costs a copy kernel or a numpy call each."""
    out: list[list] = []
    last: dict[str, list] = {}  # name -> its latest piece
    names: dict[tuple, str | None] = {}  # (leaf, field, shape, tokens) -> name if sliced (asked once)

    def sliced(lid: str, fld: str, shape: tuple, tokens: int) -> str | None:
        key = (lid, fld, shape, tokens)
        name = names.get(key, "")
        if name == "":
            name = names[key] = f"{lid}.{fld}" if is_sliced(f"{lid}.{fld}", shape, tokens) else None
        return name

    for k, (node, have) in enumerate(zip(nodes, cached)):
        if have is None:
            continue
        position, end = node.position, node.end
        for lid, (fields, at) in (origins[k] if origins else {}).items():
            for fld, base in fields.items():
                name = sliced(lid, fld, (*base.shape[:-2], end - position, base.shape[-1]), end - position)
                if name is None:
                    continue
                prev = last.get(name)
                if prev is not None and prev[3] is base and prev[2] == position:
                    prev[2] = end  # the same copy goes on: widen the slice
                    continue
                last[name] = piece = [name, position, end, base, at]
                out.append(piece)
        for lid, part in have.items():  # held as they are (not cut from one copy)
            for fld, x in part.items():
                name = sliced(lid, fld, x.shape, end - position)
                if name is not None:
                    last[name] = piece = [name, position, end, x, None]
                    out.append(piece)
    return [
        (name, start, end, x if at is None else x[..., start - at : end - at, :]) for name, start, end, x, at in out
    ]


@dataclass
class Run:
    """Consecutive blocks holding slices of one field: one joined buffer."""

    name: str  # "<leaf>.<field>"
    start: int
    end: int
    dims: tuple[int, int, int]  # batch, heads, width
    dtype: str
    array: Any = None  # the joined buffer: an MLX array, or a host target's numpy bits
    view: memoryview = memoryview(b"")  # its bytes, while the read writes them (empty: see `address`)
    address: int = 0  # where its bytes sit in device memory, if the stages copy there (no host view)
    row_stride: int = 0  # bytes from one (batch, head) row of the buffer to the next
    moving: bool = False  # its pages are on their way to the device (`Target.start_moves`)
    checked_on_host: bool = False  # the host reads or writes it after its copies land: placed again

    def host_view(self) -> memoryview:
        """Its bytes as the host sees them (taken now where the stages had only its
        device address: MLX moves the buffer into managed memory, and `place` moves it
        back). Called on one thread, after the copies to it have landed."""
        if self.address and not self.view.nbytes:
            self.view = memoryview(self.array).cast("B")
            self.checked_on_host = True
        return self.view


def first_unfit(seg: OpenSegment, expect: dict[str, list] | None) -> int:
    """The first block of `seg` holding a field whose dtype or shape differs from what
    the model's layout holds (past the last block if none)."""
    first = len(seg.blocks)
    for f in seg.fields.values():
        want = (expect or {}).get(f.name)
        if want is not None and list(want) != [f.dtype, f.batch, f.heads, f.width]:
            first = min(first, f.first)
    return first


def plan_runs(nodes, cached, origins, where) -> tuple[list[Run], int | None]:
    """Group each sliced field's blocks into runs of consecutive positions.

    Returns:
        (the runs, the index of the first block whose dtype or dims differ from the
        block before it, or None).
    """
    chains: dict[str, list[Run]] = {}

    def extend(k: int, name: str, start: int, end: int, dims, dtype) -> bool:
        chain = chains.setdefault(name, [])
        if chain and chain[-1].end == start:
            if (chain[-1].dims, chain[-1].dtype) != (dims, dtype):
                return False
            chain[-1].end = end
        else:
            chain.append(Run(name, start, end, dims, dtype))
        return True

    known: dict[tuple, tuple] = {}  # (leaf, field, shape, dtype) -> (name, dims, dtype name)
    for k, span in segment_groups(where):
        if span is None:  # a RAM-tier block: the fields its origin gives, then those held as they are
            node = nodes[k]
            n = node.n_tokens
            held = [
                (lid, fld, (*x.shape[:-2], n, x.shape[-1]), x.dtype)
                for lid, (fields, _) in (origins[k] if origins else {}).items()
                for fld, x in fields.items()
            ]
            held += [(lid, fld, x.shape, x.dtype) for lid, part in cached[k].items() for fld, x in part.items()]
            for lid, fld, shape, dtype in held:
                spec = known.get((lid, fld, shape, dtype))
                if spec is None:
                    name = f"{lid}.{fld}"
                    spec = (
                        (name, (shape[0], shape[1], shape[3]), dtype_info(dtype)[0])
                        if len(shape) == 4
                        else (name, None, None)
                    )
                    known[(lid, fld, shape, dtype)] = spec
                if spec[1] is not None and is_sliced(spec[0], shape, n):
                    if not extend(k, spec[0], node.position, node.end, spec[1], spec[2]):
                        return [], k
            continue
        seg, (lo, hi) = where[k][0], span
        for f in seg.fields.values():
            first = max(lo, f.first)
            if first < hi:
                start, end = seg.blocks[first][1], seg.blocks[hi - 1][1] + seg.blocks[hi - 1][2]
                if not extend(k, f.name, start, end, (f.batch, f.heads, f.width), f.dtype):
                    return [], k + first - lo
    return [r for chain in chains.values() for r in chain], None


def segment_groups(where) -> list[tuple[int, tuple[int, int] | None]]:
    """The path as (index of its first node, (first block, one past the last block)) per
    run of nodes from one segment, and (index, None) per RAM-tier node."""
    out: list[tuple[int, tuple[int, int] | None]] = []
    k = 0
    while k < len(where):
        if where[k] is None:
            out.append((k, None))
            k += 1
            continue
        seg, lo = where[k]
        j = k
        while j + 1 < len(where) and where[j + 1] is not None and where[j + 1][0] is seg:
            j += 1
        out.append((k, (lo, where[j][1] + 1)))
        k = j + 1
    return out


def run_of(runs: list[Run], name: str, start: int, end: int) -> Run | None:
    """The run of field `name` that holds positions ``[start, end)``, if any."""
    for r in runs:
        if r.name == name and r.start <= start and end <= r.end:
            return r
    return None

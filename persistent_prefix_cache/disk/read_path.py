"""The disk read path: segments read straight into joined, ready-to-use buffers.

Restoring a prefix joins each layer's per-block slices along the sequence axis. A
segment stores each sliced field head-major (see `segment`), so the blocks of one
segment that a restore needs arrive, per field, with one ``preadv`` whose vectors are
the rows of the joined buffer: a few hundred vectors for a whole prompt, not one per
head per block. Buffers are allocated once, without a zero-fill (`allocate`), and get
room for the tokens that follow, so that mlx-lm's next ``update_and_fetch`` writes in
place instead of copying the cache. Every block's checksum is then computed over its
pieces in the buffers, before anything is used. Segments are read on a few threads
(``preadv`` and xxh3 release the GIL); where the reads are staged to a CUDA GPU, the
small fields of a segment read whole are read together (`_packed`). Blocks already in
the RAM tier are copied into the same buffers. Which buffers a path needs, and which
segment holds each block, is planned first (`read_plan`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence, cast

import mlx.core as mx
import numpy as np

from ..blocks import Node, Tensors, dtype_info, is_sliced, mx_uint, np_uint
from ..device.buffers import HostBits, as_mx, join_on_device
from ..device.readers import reader_pool
from ..device.target import Target
from .read_plan import Run, first_unfit, plan_runs, ram_pieces, run_of, segment_groups
from .segment import OpenSegment, SegmentFiles

_PARALLEL_COPY_BYTES = 4 << 20  # below this, handing copies to threads costs more than it saves


# -- the read path ---------------------------------------------------------------------


def read_path(
    nodes: Sequence[Node],
    cached: Sequence[dict[str, Tensors] | None],
    files: SegmentFiles,
    lid_kind: dict[str, str],
    expect: dict[str, list] | None = None,
    digests: dict[bytes, int] | None = None,
    origins: Sequence[dict] | None = None,
    *,
    target: Target,
    seq_rows: int = 0,
) -> tuple[int, dict[str, dict[str, list]], dict[str, Tensors]]:
    """Read a path of blocks into joined buffers, for a restore.

    Args:
        target: Where the buffers are made and what comes back (`device.target`:
            `device_target`, MLX arrays with room to grow; `host_target`, host bits, no MLX work).
        nodes: The blocks, in order.
        cached: For each block, its tensors from the RAM tier (those its origin does
            not give), or None to read it.
        files: The store's segment files.
        lid_kind: Leaf id -> adapter kind (sequence leaves get room to grow).
        expect: Field name -> ``[dtype, batch, heads, width]`` the model's layout
            holds; a block whose fields differ is treated as damaged.
        digests: Segment id -> its whole-segment digest from the index: a segment
            read whole is verified with one pass (else block by block).
        origins: For each block, the RAM tier's origin of its tensors (see
            `MemoryTier.put`), or None.
        seq_rows: Rows the buffers of a sequence leaf's run from position 0 get at
            least (its caller's choice, `layers.grown_rows`): room for mlx-lm's next
            forwards to write in place instead of growing the cache by a copy of all of it.

    Returns:
        (number of blocks intact, runs by leaf then field as ``(start, end, array)``,
        the last block's snapshot tensors by leaf). Reading stops before the first
        missing or damaged block: then the runs are empty and only the count matters.
    """
    if all(have is not None for have in cached) and target.join_on_device and not target.host:
        pieces = ram_pieces(nodes, cached, origins)
        last_cached = cast(dict[str, Tensors], cached[-1])  # every block is in the RAM tier
        return len(nodes), *join_on_device(pieces, last_cached, nodes[-1].n_tokens, lid_kind, seq_rows)
    segments: dict[bytes, OpenSegment | None] = {}
    runs: list[Run] = []
    unfit: dict[bytes, int] = {}  # segment -> first block whose fields do not fit
    again = (nodes, cached, files, lid_kind, expect, digests, origins, target)
    try:
        where: list[tuple[OpenSegment, int] | None] = []
        for node, have in zip(nodes, cached):
            if have is not None:
                where.append(None)
                continue
            if node.segment not in segments:
                segments[node.segment] = seg = files.open(node.segment)
                unfit[node.segment] = first_unfit(seg, expect) if seg is not None else 0
            seg = segments[node.segment]
            i = seg.block_index(node) if seg is not None else None
            if seg is None or i is None or i >= unfit[node.segment]:
                return _intact_before(len(where), *again), {}, {}
            where.append((seg, i))
        runs, disagree = plan_runs(nodes, cached, origins, where)
        if disagree is not None:  # a block's tensors do not continue the one before
            return _intact_before(disagree, *again), {}, {}
        last = len(nodes) - 1
        at_last = where[last]
        snaps_wanted = [] if at_last is None else at_last[0].snaps_of(at_last[1])
        specs: list[tuple[str, tuple[int, ...], str]] = []
        for k, r in enumerate(runs):
            b, h, w = r.dims
            rows = r.end - r.start
            if r.start == 0 and lid_kind.get(r.name.rpartition(".")[0]) == "seq" and not target.host:
                rows = max(rows, seq_rows)  # room for mlx-lm to grow in place
            specs.append((f"r{k}", (b, h, rows, w), r.dtype))
        specs += [(f"s{k}", s.shape, s.dtype) for k, s in enumerate(snaps_wanted)]
        arrays = target.allocate(specs)
        _bind(runs, arrays, target)
        field_digests = _read_segments(nodes, where, runs, target)
        if any(r.moving for r in runs):
            # Copies and moves of what was read land before the host looks at any of
            # it again (a block checked one by one, a RAM-tier block copied in).
            target.wait_moves()
        if field_digests is None and any(r.address for r in runs) and not target.stages():
            # A driver call failed and staging stopped for the process: reads into device
            # memory had no host view to fall back on. Read it all again through host
            # views (never a healthy block taken for damaged).
            return read_path(nodes, cached, files, lid_kind, expect, digests, origins, target=target, seq_rows=seq_rows)
        if field_digests is None:
            return _intact_before(len(nodes), *again, verify=True), {}, {}
        bad = _first_bad(nodes, where, runs, _read_whole(where, field_digests, digests or {}), target)
        if bad is not None:
            return _intact_before(bad, *again), {}, {}
        snaps: dict[str, Tensors] = {}
        if at_last is None:
            for lid, part in cast(dict[str, Tensors], cached[last]).items():  # a RAM-tier block
                snaps[lid] = {
                    f: as_mx(x) for f, x in part.items() if not is_sliced(f"{lid}.{f}", x.shape, nodes[last].n_tokens)
                }
        else:
            seg = at_last[0]
            for k, s in enumerate(snaps_wanted):
                if seg.read_snap(s, memoryview(arrays[f"s{k}"]).cast("B")) is None:
                    return last, {}, {}
                lid, _, fld = s.name.rpartition(".")
                snaps.setdefault(lid, {})[fld] = target.wrap(arrays[f"s{k}"], s.dtype)
        _copy_cached(nodes, cached, origins, runs)
        if not target.host:
            # Verified, then moved to the device in bulk (a CUDA GPU's), inside the timed
            # restore (the first forward would fault the pages over one by one, unseen by the costs).
            # (Buffers read in pieces or moved as read were waited for after the reads.)
            rest = [r.array for r in runs if not r.moving or r.checked_on_host]
            rest += [arrays[f"s{k}"] for k in range(len(snaps_wanted))]
            target.place(rest)
        by_leaf: dict[str, dict[str, list]] = {}
        for r in runs:
            r.view = memoryview(b"")  # release every view of the buffers before MLX owns them again
            lid, _, fld = r.name.rpartition(".")
            array = target.wrap(r.array, r.dtype)
            by_leaf.setdefault(lid, {}).setdefault(fld, []).append((r.start, r.end, array))
        return len(nodes), by_leaf, snaps
    finally:
        if any(r.moving for r in runs):
            target.wait_moves()  # copies still landing in buffers this read gives up: never reused early
        for seg in segments.values():
            if seg is not None:
                seg.close()


def _bind(runs: list[Run], arrays: dict, target: Target) -> None:
    """Give each run its buffer, and where the reads write: its device address where the
    stages copy to the device (`Target.addresses`: the host view of a buffer in device
    memory makes MLX move it into managed memory, a synchronous copy of all of it), else
    its host view."""
    for k, r in enumerate(runs):
        r.array = arrays[f"r{k}"]
        r.row_stride = r.array.shape[2] * r.dims[2] * dtype_info(r.dtype)[1]
    addresses = target.addresses([r.array for r in runs])
    for k, r in enumerate(runs):
        if addresses:
            r.address = addresses[k]
        else:
            r.view = memoryview(r.array).cast("B")


def _intact_before(j, nodes, cached, files, lid_kind, expect, digests, origins, target, *, verify: bool = False) -> int:
    """How many of the blocks before index `j` are intact (j itself is not, unless
    `verify`: then j is the whole path, which failed to read)."""
    if verify:
        j -= 1
    while j > 0:
        intact = read_path(nodes[:j], cached[:j], files, lid_kind, expect, digests, origins, target=target)[0]
        if intact == j:
            return j
        j = intact
    return 0


def _read_segments(nodes, where, runs, target: Target) -> dict[bytes, dict[str, int]] | None:
    """Read every (segment, field) the path needs into the runs, on the reader threads.

    Returns:
        For each segment read whole, the digests of its fields (computed by the thread
        that read the field, while its bytes are fresh); None on a short read.
    """
    staging = target.staged()
    jobs: list[list[Any]] = []
    for k, span in segment_groups(where):
        if span is None:
            continue
        seg, (lo, hi) = where[k][0], span
        whole = lo == 0 and hi == len(seg.blocks)
        # A segment read in part is checked block by block on the host, which on a GPU
        # moves the pages the stages put on the device back (a server's prompt stored
        # with the token it generated, fetched again: ~1.6 GB/s on an H100). Where
        # stages run and the path needs most of it, read it all, hashed in the pinned
        # pieces, and copy to the device only what the path needs: one check per segment.
        read_all = whole or (staging and _mostly_needed(seg, lo, hi))
        for f in seg.fields.values():
            first = max(lo, f.first)
            if first >= hi:
                continue
            start = seg.blocks[first][1]
            end = seg.blocks[hi - 1][1] + seg.blocks[hi - 1][2]
            r = run_of(runs, f.name, start, end)
            if r is None:
                return None
            keep = None if whole or not read_all else ((start - f.start) * f.row_bytes, (end - f.start) * f.row_bytes)
            jobs.append([seg, f, first, hi, r, (start - r.start) * f.row_bytes, read_all, False, keep])
    if target.moves_as_read():
        # Every job goes to the GPU as it is read where stages run (`Target.stager`:
        # pinned pieces, the copy engine), whatever segments fill its buffer: a chat stored
        # turn by turn, a prefix shared with another prompt (read through the host into
        # managed memory, such a restore ran at ~2 GB/s on an H200 against 5-8 by stages).
        # Stages copy into device pages: the buffers go there first, in order on the same
        # stream. Without stages, a buffer one job fills whole moves once read while the
        # other jobs read (H200, 1 GiB: 105 ms against 125 ms moved after the last read).
        fills = Counter(id(job[4]) for job in jobs)
        for job in jobs:
            job[7] = staging or (job[6] and fills[id(job[4])] == 1)
            # Blocks of a segment read in part are checked on the host (`_first_bad`),
            # which moves their pages back: the run goes to the GPU again after.
            job[4].checked_on_host = job[4].checked_on_host or (staging and not job[6])
        if staging:
            for r in {id(job[4]): job[4] for job in jobs}.values():
                r.moving = bool(r.address) or target.start_moves([r.view])  # an address is in device memory
    if staging:
        jobs = _packed(jobs, target.piece_bytes())
    done = target.share(lambda job: _read_job(job, target), jobs)
    if not all(ok for ok, _ in done):
        return None
    digests: dict[bytes, dict[str, int]] = {}
    for job, (_, digest) in zip(jobs, done):
        for one, d in zip(job.jobs, digest) if isinstance(job, _Pack) else [(job, digest)]:
            if d is not None:
                digests.setdefault(one[0].segment, {})[one[1].name] = d
    return digests


@dataclass
class _Pack:
    """Jobs of small whole fields of one segment that follow each other in the file, no
    more bytes than a stager's piece: one read (`OpenSegment.read_fields_staged`)."""

    jobs: list


def _packed(jobs: list, piece: int) -> list:
    """`jobs` with runs of small whole fields of one segment, staged, packed (`_Pack`): a
    prompt stored in pieces ends with small segments, and on a GPU each read, wait and
    copy of one of their fields cost ~0.5 ms of the reader threads (docs/performance.md)."""
    out: list = []
    pack: list = []
    size = 0
    for job in jobs:
        seg, f = job[0], job[1]
        small = job[6] and job[8] is None and job[7] and job[4].moving and f.nbytes <= piece // 2
        follows = bool(pack) and pack[-1][0] is seg and pack[-1][1].at + pack[-1][1].nbytes == f.at
        if pack and not (small and follows and size + f.nbytes <= piece):
            out.append(pack[0] if len(pack) == 1 else _Pack(pack))
            pack, size = [], 0
        if small:
            pack.append(job)
            size += f.nbytes
        else:
            out.append(job)
    if pack:
        out.append(pack[0] if len(pack) == 1 else _Pack(pack))
    return out


def _mostly_needed(seg: OpenSegment, lo: int, hi: int) -> bool:
    """Whether blocks ``[lo, hi)`` hold at least half of the segment's tokens and every
    field of it has data there (so that reading it all gives every field's digest)."""
    blocks = seg.blocks
    total = blocks[-1][1] + blocks[-1][2] - blocks[0][1]
    needed = blocks[hi - 1][1] + blocks[hi - 1][2] - blocks[lo][1]
    return 2 * needed >= total and all(f.first < hi for f in seg.fields.values())


def _read_job(job: list | _Pack, target: Target) -> tuple[bool, Any]:
    if isinstance(job, _Pack):
        return _read_pack(job.jobs, target)
    seg: OpenSegment
    r: Run
    seg, f, lo, hi, r, offset, read_all, move, keep = job  # see `_read_segments`
    stage = target.stager(r.view, r.address) if move and r.moving else None
    if r.address and stage is None:
        return False, None  # staging stopped meanwhile: no host view to read into (a short read)
    if read_all and (keep is None or stage is not None):
        # The whole field, hashed as it is read, while each piece is in cache.
        digest = seg.read_field_hashed(f, r.view, offset, r.row_stride, stage, keep)
        if move and digest is not None and stage is None:
            r.moving = target.start_moves([r.view])
        return digest is not None, digest
    # Without a stager, only the blocks needed: checked one by one after (`_first_bad`).
    r.checked_on_host = r.checked_on_host or keep is not None
    return seg.read_rows(f, lo, hi, [r.view], [offset], r.row_stride, stage), None


def _read_pack(jobs: list, target: Target) -> tuple[bool, list[int | None] | None]:
    """Read a `_Pack` (its fields' digests), or its jobs one by one where staging stopped."""
    r = jobs[0][4]
    stage = target.stager(r.view, r.address)
    if stage is None:
        done = [_read_job(job, target) for job in jobs]
        return all(ok for ok, _ in done), [d for _, d in done]
    parts = [(job[1], stage.target(job[4].view, job[4].address), job[5], job[4].row_stride) for job in jobs]
    digests = jobs[0][0].read_fields_staged(parts, stage)
    return digests is not None, digests


def _read_whole(where, field_digests: dict[bytes, dict[str, int]], digests: dict[bytes, int]) -> set[int]:
    """Indexes of the nodes whose whole segment was read and matches the index's digest
    (one check per segment instead of one per block)."""
    verified: set[int] = set()
    for k, span in segment_groups(where):
        seg = where[k][0] if span is not None else None
        if span is None or seg is None or seg.segment not in field_digests or seg.segment not in digests:
            continue
        got = field_digests[seg.segment]
        if len(got) == len(seg.fields) and seg.whole_digest(got) == digests[seg.segment]:
            verified.update(range(k, k + span[1] - span[0]))
    return verified


def _first_bad(nodes, where, runs, verified: set[int], target: Target) -> int | None:
    """Index of the first block read from disk whose checksum does not hold (blocks in
    `verified` are known to be intact)."""
    todo = [k for k, at in enumerate(where) if at is not None and k not in verified]
    if todo:
        for r in runs:
            r.host_view()  # here, once: the checks below run on several threads

    def check(k: int) -> bool:
        seg, i = where[k]
        node = nodes[k]
        views: dict[str, Run] = {}

        def piece(f, row: int) -> memoryview:
            r = views.get(f.name)
            if r is None:  # the plan put every block read in a run
                r = views[f.name] = cast(Run, run_of(runs, f.name, node.position, node.end))
            n = node.n_tokens * f.row_bytes
            at = row * r.row_stride + (node.position - r.start) * f.row_bytes
            return r.view[at : at + n]  # (`host_view` was taken above)

        return seg.block_digest(i, piece, node) == node.checksum

    ok = target.share(check, todo)
    for k, good in zip(todo, ok):
        if not good:
            return k
    return None


def array_bits(view: memoryview, x: mx.array) -> np.ndarray:
    """A numpy view of an evaluated array's bits (numpy has no bfloat16; the bits are
    what we copy); a strided view (a RAM-tier block cut from one copy per field) is
    seen through a view as unsigned ints, not copied."""
    if not view.c_contiguous:
        u = x.view(mx_uint(x.itemsize))
        mx.eval(u)
        return np.asarray(memoryview(u))  # type: ignore[arg-type]  # MLX stubs: no buffer protocol
    return np.frombuffer(view.cast("B"), dtype=np_uint(x.itemsize)).reshape(x.shape)


def _copy_cached(nodes, cached, origins, runs) -> None:
    """Copy the slices of blocks that came from the RAM tier into their runs."""
    by_name: dict[str, list[Run]] = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r)
    pieces = [
        (run_of(by_name[name], name, start, end), start, end, x)
        for name, start, end, x in ram_pieces(nodes, cached, origins)
        if name in by_name
    ]
    # Blocks cut from one copy per field are strided views: see them all as unsigned
    # ints with one evaluation, not one per piece (blocks from the remote tier come
    # as host bits already).
    views = [x.bits if isinstance(x, HostBits) else x.view(mx_uint(x.itemsize)) for *_, x in pieces]
    mx.eval([v for v in views if not isinstance(v, np.ndarray)])
    for run in {id(p[0]): p[0] for p in pieces if p[0] is not None}.values():
        run.host_view()  # here, once: the copies below run on several threads
    by_run: dict[int, list] = {}
    for (r, start, end, _), v in zip(pieces, views):
        by_run.setdefault(id(r), [r]).append((start, end, v))

    def copy(job: list) -> None:
        r, *parts = job
        target = array_bits(r.view, r.array)
        for start, end, v in parts:
            target[:, :, start - r.start : end - r.start, :] = (
                v if isinstance(v, np.ndarray) else np.asarray(memoryview(v))
            )

    # One job per buffer, on the reader threads (numpy's copies drop the GIL): a
    # restore from the RAM tier or the remote is a copy into fresh memory, and one
    # thread fills fresh pages at a fraction of what the machine's cores can.
    jobs = list(by_run.values())
    if len(jobs) > 1 and sum(v.nbytes for *_, v in pieces) >= _PARALLEL_COPY_BYTES:
        list(reader_pool().map(copy, jobs))
    else:
        for job in jobs:
            copy(job)

"""The segment writer (the write side of `disk.segment`): place every tensor, then write.

`plan_segment` checks the blocks of one ``store()`` and places every tensor (format v5, see
`disk.segment`) before a byte is hashed: the header's length is then known (each digest
in it is 16 hex digits), so the data can go to the disk first and the header last, at
offset 0. `SegmentPlan.stream` hands the data to a `Sink` in file order, hashing it into
its field's digest (a field's rows as one chunk where they follow each other in memory)
and each block's piece of it into the block's checksum (the block's short pieces of a
field's rows joined by one copy, hashed once: each hash call keeps the GIL, which a caller
launching kernels shares), each digest tagged with what it covers (`digest_tags`); the
sink writes batches with ``pwritev`` from a second thread and starts their
writeback at once (``sync_file_range``), so hashing, the kernel's copy and the disk
overlap and the final fsync finds little left to do.
"""

from __future__ import annotations

import base64
import errno
import json
import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from ..blocks import Node, dtype_info, is_sliced, sliced_spec
from .digest_tags import block_tag, field_tag, run_tag, segment_tag, snapshot_tag, tagged_digest
from .portable import IOV_MAX, pwritev, start_writeback
from .segment_header import DIGEST_MARK, MAX_HEADER, SEGMENT_FORMAT, header_digest


def _dtype(x: Any) -> str:
    # A tensor is an mlx or numpy array, or (numpy array of its bits, dtype name).
    return x[1] if isinstance(x, tuple) else dtype_info(x.dtype)[0]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple((x[0] if isinstance(x, tuple) else x).shape)


def _bytes(x: Any) -> memoryview:
    view = memoryview(x[0] if isinstance(x, tuple) else x)
    if not view.c_contiguous:
        raise ValueError("snapshot tensors must be row-contiguous")
    return view.cast("B")


def _rows(x: Any, rows: int) -> np.ndarray:
    """The bytes of a sliced tensor ``[batch, heads, n, width]`` as a ``[rows, bytes]``
    uint8 array, one (batch, head) row each: rows are contiguous, the array need not
    be (a strided view of unsigned ints: numpy reads it without MLX)."""
    view = memoryview(x[0] if isinstance(x, tuple) else x)
    if view.c_contiguous:
        return np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(rows, -1)
    a = np.asarray(view)
    return a.reshape(rows, a.shape[-2] * a.shape[-1]).view(np.uint8)


def _joined_rows(arrays: list[np.ndarray], first: int = 0) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
    """The rows of consecutive blocks' `_rows`, joined where they follow each other
    in memory (the blocks of one `store()` are views of one copy per field): a row of
    a segment is then one I/O vector and one hash update, not one per block.

    Returns:
        ``(rows of the run, [(block, bytes of its piece of a row)])`` per run, blocks
        numbered from `first`.
    """
    runs: list[list] = []  # [first array, address of its row 0, of the run's end, bytes per row, pieces]
    for i, a in enumerate(arrays, first):
        at = a.__array_interface__["data"][0]
        if runs and at == runs[-1][2] and a.strides[0] == runs[-1][0].strides[0]:
            runs[-1][2] += a.shape[1]
            runs[-1][3] += a.shape[1]
            runs[-1][4].append((i, a.shape[1]))
        else:
            runs.append([a, at, at + a.shape[1], a.shape[1], [(i, a.shape[1])]])
    out = []
    for a, _, _, width, pieces in runs:
        if width != a.shape[1]:
            a = np.lib.stride_tricks.as_strided(a, shape=(a.shape[0], width), strides=(a.strides[0], 1))
        out.append((a, pieces))
    return out


# A block's pieces of a field's rows shorter than this are joined by one copy and hashed
# as one (a hash call per row and block, each holding the GIL, was most of the writer's
# Python for short blocks, and took it from a caller's thread launching kernels).
JOIN_PIECES_BYTES = 64 << 10


def _hash_rows(h: Any, pieces: np.ndarray) -> None:
    """Hash the rows of `pieces` (``[rows, bytes]``, rows strided) into `h`, in order."""
    if pieces.flags.c_contiguous:
        h.update(pieces)
    elif pieces.shape[1] < JOIN_PIECES_BYTES:
        h.update(np.ascontiguousarray(pieces))
    else:
        for row in pieces:
            h.update(row)


# Data is handed to the disk in batches of about this many bytes: each is written, and
# its writeback started, while the next is hashed (see `Sink`).
BATCH_BYTES = 8 << 20
# Segments at least this large write their data from a second thread; smaller ones
# inline (a thread's start costs more than it saves there).
THREADED_BYTES = 4 << 20


def pwritev_all(fd: int, chunks: list, offset: int) -> int:
    """Write every chunk at `offset` on, finishing short writes; the bytes written."""
    views = [memoryview(c).cast("B") if not isinstance(c, memoryview) or c.format != "B" else c for c in chunks]
    total = sum(v.nbytes for v in views)
    done = 0
    while views:
        for j in range(0, len(views), IOV_MAX):
            group = views[j : j + IOV_MAX]
            want = sum(v.nbytes for v in group)
            n = pwritev(fd, group, offset + done)
            if n <= 0 < want:  # no progress: never loop for ever
                raise OSError(errno.EIO, "a write made no progress")
            done += n
            if n < want:  # a short write: go on from the first byte not written
                rest, skip = [], n
                for v in views[j:]:
                    if skip >= v.nbytes:
                        skip -= v.nbytes
                        continue
                    rest.append(v[skip:])
                    skip = 0
                views = rest
                break
        else:
            views = []
    return total


class Sink:
    """Where a segment's data goes while it is hashed: batches written at their offsets
    and their writeback started (`start_writeback`), from a second thread for large
    segments, so the disk, the kernel's copy and the hashing overlap.

    Args:
        fd: The temporary file.
        offset: Where the data starts (after the header, which is written last).
        nbytes: Bytes of data to come: from `THREADED_BYTES` on, written from a second
            thread.
        pause: Called before each batch is handed over and before it is written (a
            writer that gives way to restores: `reads_first.ReadsFirst.wait`).
    """

    def __init__(self, fd: int, offset: int, *, nbytes: int, pause: Callable[[], None] = lambda: None):
        self.fd, self.at, self.pause = fd, offset, pause
        self.batch: list = []
        self.pending = 0
        self.error: BaseException | None = None
        self.jobs: queue.SimpleQueue | None = None
        self.thread: threading.Thread | None = None
        if nbytes >= THREADED_BYTES:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(jobs,), name="ppc-segment-io", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new thread at interpreter exit: write inline
                pass
            else:
                self.jobs, self.thread = jobs, thread

    def put(self, chunk: Any) -> None:
        """Queue one chunk of data (in file order)."""
        self.batch.append(chunk)
        self.pending += chunk.nbytes
        if self.pending >= BATCH_BYTES or len(self.batch) >= IOV_MAX:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self.batch:
            return
        self.pause()  # the hashing of the next batch waits too
        job = (self.batch, self.at, self.pending)
        self.at += self.pending
        self.batch, self.pending = [], 0
        if self.jobs is not None:
            self.jobs.put(job)
        else:
            self._write(*job)

    def _write(self, chunks: list, offset: int, nbytes: int) -> None:
        pwritev_all(self.fd, chunks, offset)
        start_writeback(self.fd, offset, nbytes)  # Linux only, for speed: the fsync is what counts

    def _run(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            if self.error is None:
                try:
                    self.pause()
                    self._write(*job)
                except BaseException as exc:  # raised on the writer's thread by `close`
                    self.error = exc

    def close(self) -> int:
        """Write what is left and wait for every batch.

        Returns:
            The offset after the data.

        Raises:
            OSError: The first failure of a write.
        """
        try:
            self._hand_over()
        finally:
            if self.thread is not None and self.jobs is not None:
                self.jobs.put(None)
                self.thread.join()
        if self.error is not None:
            raise self.error
        return self.at


class SegmentPlan:
    """A segment's layout, computed before any byte is hashed: where every tensor lies
    (so the header's length is known, its digests being fixed-width), and the data in
    file order (see `stream`)."""

    def __init__(self, segment, blocks, root, model, block_size, tensors_of, firsts, fields, snaps, sizes, nbytes):
        self.segment, self.blocks, self.root, self.model, self.block_size = segment, blocks, root, model, block_size
        self.tensors_of, self.firsts, self.fields, self.snaps = tensors_of, firsts, fields, snaps
        self.sizes, self.nbytes = sizes, nbytes

    def stream(self, put: Callable[[Any], None]) -> tuple[list[int], list[int], int]:
        """Hand every chunk of data to `put` in file order, hashing it into its field's
        digest and each block's piece of it into the block's checksum (in the order a read
        sees: field by field, row by row); each digest starts with the tag of what it
        covers (`digest_tags`).

        Returns:
            (each block's checksum, each snapshot's digest, the whole-segment digest).
        """
        per_block = [xxhash.xxh3_64() for _ in self.blocks]
        for h, (node, _) in zip(per_block, self.blocks):
            h.update(block_tag(node))
        field_digests = []
        for rows, first, runs, tag, whole_tag in self.fields:
            for i in range(first, len(self.blocks)):
                per_block[i].update(tag)  # before block i's pieces of this field
            h = xxhash.xxh3_64()
            h.update(whole_tag)
            if len(runs) == 1 and runs[0][0].flags.c_contiguous:  # rows back to back: one chunk
                put(runs[0][0])
                h.update(runs[0][0])
            else:
                for r in range(rows):
                    for run, _ in runs:
                        put(run[r])
                        h.update(run[r])
            for run, widths in runs:
                at = 0
                for i, width in widths:  # block i's pieces of the rows, in row order: what a read sees
                    _hash_rows(per_block[i], run[:, at : at + width])
                    at += width
            field_digests.append(h.intdigest())
        digests = []
        for i, _, view, tag in self.snaps:
            put(view)
            d = tagged_digest(tag, view)
            digests.append(d)
            per_block[i].update(d.to_bytes(8, "little"))
        checksums = [h.intdigest() for h in per_block]
        # The whole-segment digest stands in for the blocks' checksums on a whole read:
        # it binds them (and so the blocks' records), then the fields' and snapshots' digests.
        whole = xxhash.xxh3_64()
        whole.update(segment_tag(self.segment, self.root, checksums))
        for d in field_digests + digests:
            whole.update(d.to_bytes(8, "little"))
        return checksums, digests, whole.intdigest()

    def header(self, checksums: list[int] | None, digests: list[int] | None, whole: int | None) -> bytes:
        """The header bytes; digests None: zeros (same length: every digest is 16 hex
        digits). With the digests, sets each node's segment, size and checksum."""
        records = []
        for i, (node, _) in enumerate(self.blocks):
            checksum = checksums[i] if checksums is not None else 0
            if checksums is not None:
                node.segment, node.size, node.checksum = self.segment, self.sizes[i], checksum
            records.append(
                [node.key.hex(), node.parent.hex(), node.position, node.n_tokens, node.flags, self.sizes[i],
                 f"{checksum:016x}", node.extra or {}]
            )  # fmt: skip
        snaps = {
            f"b{i}.{name}": f"{digests[j] if digests is not None else 0:016x}"
            for j, (i, name, *_) in enumerate(self.snaps)
        }
        metadata = {
            "format": SEGMENT_FORMAT,
            "segment": self.segment.hex(),
            "root": self.root.hex(),
            "model": self.model.decode("utf-8"),  # a JSON record: the index's bytes, exactly
            "block_size": str(int(self.block_size)),
            "blocks": json.dumps(records, separators=(",", ":")),
            "tokens": base64.b64encode(b"".join(node.tokens for node, _ in self.blocks)).decode(),
            "fields": json.dumps(self.firsts, separators=(",", ":")),
            "snaps": json.dumps(snaps, separators=(",", ":")),
            "digest": f"{whole or 0:016x}",
            "header_digest": "0" * 16,
        }
        text = json.dumps({"__metadata__": metadata, **self.tensors_of}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors allows space padding; aligns the data
        if len(text) > MAX_HEADER:  # ~1M tokens in one segment: a file no reader would open
            raise ValueError(f"a segment header of {len(text):,} bytes is over the limit of {MAX_HEADER:,}")
        head = len(text).to_bytes(8, "little") + text
        at = head.index(DIGEST_MARK) + len(DIGEST_MARK)
        return head[:at] + f"{header_digest(head):016x}".encode() + head[at + 16 :]


def plan_segment(
    segment: bytes, blocks: Sequence[tuple[Node, dict]], root: bytes, model: bytes, block_size: int
) -> "SegmentPlan":
    """Check the blocks and lay out their segment (nothing is hashed yet)."""
    if not blocks:
        raise ValueError("a segment needs at least one block")
    for (a, _), (b, _) in zip(blocks, blocks[1:]):
        if b.position != a.end or b.parent != a.key:
            raise ValueError("a segment's blocks must be consecutive blocks of one chain")
    # One segment, one model: a chain that starts at position 0 hangs from the root.
    if blocks[0][0].position == 0 and blocks[0][0].parent != root:
        raise ValueError("a segment's first block is not under its model's root")
    if len(root) != 16:
        raise ValueError("a model root key has 16 bytes")
    flat = [{f"{lid}.{f}": x for lid, part in tensors.items() for f, x in part.items()} for _, tensors in blocks]
    sliced: dict[str, list] = {}  # name -> [dtype, batch, heads, width, first block]
    # Blocks of one store are alike: each (name, shape, dtype, tokens) is asked once.
    specs: dict[tuple, list | None] = {}
    for i, ((node, _), tensors) in enumerate(zip(blocks, flat)):
        for name in sorted(tensors):
            x = tensors[name]
            asked = (name, _shape(x), _dtype(x), node.n_tokens)
            if asked not in specs:
                specs[asked] = sliced_spec(name, asked[2], asked[1]) if is_sliced(name, asked[1], asked[3]) else None
            spec = specs[asked]
            if spec is None:
                continue
            if name not in sliced:
                sliced[name] = spec + [i]
            elif sliced[name][:4] != spec:
                raise ValueError(f"{name}: blocks of one segment disagree on dtype or shape")
    for name, (*_, first) in sliced.items():
        if any(name not in t for t in flat[first:]):
            raise ValueError(f"{name}: a block after the first holding it lacks it")
    sizes = [0] * len(blocks)
    fields = []  # (rows, first block, [(run, [(block, bytes of its piece of a row)])], field tag, run tag)
    tensors_of: dict[str, dict] = {}  # safetensors entries, in data order
    firsts: dict[str, int] = {}
    at = 0
    for name in sorted(sliced):
        dtype, batch, heads, width, first = sliced[name]
        rows = batch * heads
        pieces = [_rows(flat[i][name], rows) for i in range(first, len(blocks))]
        for i, piece in enumerate(pieces, first):
            sizes[i] += piece.nbytes
        runs = _joined_rows(pieces, first)
        tokens = sum(node.n_tokens for node, _ in blocks[first:])
        start = blocks[first][0].position
        fields.append((rows, first, runs, field_tag(name, dtype, batch, heads, width),
                       run_tag(name, dtype, batch, heads, width, start, tokens)))  # fmt: skip
        nbytes = sum(p.nbytes for p in pieces)
        tensors_of[name] = {"dtype": dtype, "shape": [batch, heads, tokens, width], "data_offsets": [at, at + nbytes]}
        firsts[name] = first
        at += nbytes
    snaps: list[tuple[int, str, memoryview, bytes]] = []  # (block, "<leaf>.<field>", bytes, tag)
    for i, tensors in enumerate(flat):
        for name in sorted(tensors):
            if name in sliced and i >= sliced[name][4]:
                continue
            view = _bytes(tensors[name])
            node = blocks[i][0]
            snaps.append(
                (
                    i,
                    name,
                    view,
                    snapshot_tag(node.key, node.position, name, _dtype(tensors[name]), _shape(tensors[name])),
                )
            )
            sizes[i] += view.nbytes
            tensors_of[f"b{i}.{name}"] = {
                "dtype": _dtype(tensors[name]),
                "shape": list(_shape(tensors[name])),
                "data_offsets": [at, at + len(view)],
            }
            at += len(view)
    if len(tensors_of) != len(sliced) + len(snaps):
        raise ValueError("a snapshot's tensor name clashes with a field's")
    return SegmentPlan(segment, blocks, root, model, block_size, tensors_of, firsts, fields, snaps, sizes, at)

"""Segment files (format v4): the one owner of the bytes of stored blocks.

One segment holds the new blocks of one `store()` (consecutive blocks of one prompt,
so of one model), laid out so that a run of blocks reads in few, large I/Os straight
into the joined cache buffers. It is a safetensors file (``safetensors.safe_open`` and
``mx.load(path, format="safetensors")`` read every tensor)::

    [u64 LE header length n][header: JSON, space-padded to a multiple of 8][data]

A *sliced field* (a KV tensor ``[batch, heads, tokens, width]`` of a layer sliced along
the sequence) is one tensor ``<leaf>.<field>`` of shape ``[batch, heads, T, width]``
over the blocks from its first one on (T tokens): stored in C order, each of its rows
(batch x head) holds the tokens of all those blocks, contiguous (head-major). A
*snapshot* (a recurrent state, a window) belongs to one block and is the tensor
``b<i>.<leaf>.<field>``. The header's ``__metadata__`` (strings only) makes the
segment self-describing, so the index can be rebuilt from the segments alone:

- ``format`` (`SEGMENT_FORMAT`), ``segment`` (the id, hex), ``root`` (the model's root
  key, hex) and ``model`` (that model's record, the bytes the index stores);
- ``blocks``: JSON, per block ``[key, parent, position, tokens, flags, size, checksum,
  extra]`` (keys hex, checksum 16 hex digits): the index record less its bookkeeping;
  ``tokens``: every block's token ids, int32 LE, joined, base64;
- ``fields``: JSON, each sliced field's first block; ``snaps``: JSON, each snapshot's
  xxh3-64 digest; ``digest``: the whole-segment digest (xxh3-64 over each field's
  xxh3-64, then the snapshots' digests), as the index keeps it;
- ``header_digest``: xxh3-64 of the whole header with these 16 digits as zeros: a
  flipped byte anywhere in the header makes the segment fail to open (a miss).

A block's checksum (kept in its index record and the header, verified on every read)
is xxh3-64 over its piece of every sliced field (data order, row by row), then the
digests of its snapshots: a damaged byte, a damaged header or a file of another block
is a miss.

Write order: write under ``tmp/``, fsync, rename into ``segments/``, fsync the folder;
only then does the caller commit the index records. Segment ids are random, so no two
writers ever share a file; a file is unlinked only after the commit that removed its
last block (see `index_tables.Writer.freed`). A crash leaves at most a temporary file
or an unreferenced segment, both swept later.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from .codec import MAX_HEADER, dtype_info
from .faults import pause_point
from .node import Node
from .portable import IOV_MAX, durable_fsync, start_writeback, writev
from .segment_reader import DIGEST_MARK, SEGMENT_FORMAT, OpenSegment, header_digest
from .store_dir import create_file, make_dirs

# Fields stored sliced along the sequence (what `layers.adapters` names them).
SLICE_FIELDS = frozenset({"k", "v", "k0", "k1", "k2", "v0", "v1", "v2"})


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        durable_fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dtype(x: Any) -> str:
    # A tensor is an mlx or numpy array, or (numpy array of its bits, dtype name).
    return x[1] if isinstance(x, tuple) else dtype_info(x.dtype)[0]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple((x[0] if isinstance(x, tuple) else x).shape)


def is_sliced(name: str, shape: Sequence[int], n_tokens: int) -> bool:
    """Whether tensor ``<leaf>.<field>`` of a block is stored sliced (else a snapshot)."""
    return name.rpartition(".")[2] in SLICE_FIELDS and len(shape) == 4 and shape[2] == n_tokens


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


def _joined_rows(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The rows of consecutive blocks' `_rows`, joined where they follow each other
    in memory (the blocks of one `store()` are views of one copy per field): a row of
    a segment is then one I/O vector and one hash update, not one per block."""
    runs: list[list] = []  # [first array, address of its row 0, of the run's end, bytes per row]
    for a in arrays:
        at = a.__array_interface__["data"][0]
        if runs and at == runs[-1][2] and a.strides[0] == runs[-1][0].strides[0]:
            runs[-1][2] += a.shape[1]
            runs[-1][3] += a.shape[1]
        else:
            runs.append([a, at, at + a.shape[1], a.shape[1]])
    out = []
    for a, _, _, width in runs:
        if width != a.shape[1]:
            a = np.lib.stride_tricks.as_strided(a, shape=(a.shape[0], width), strides=(a.strides[0], 1))
        out.append(a)
    return out


class SegmentFiles:
    """The ``segments/`` and ``tmp/`` folders of one store.

    Args:
        root: The store directory.
        readonly: Create nothing.
    """

    def __init__(self, root: str, *, readonly: bool = False):
        self.root = root
        self.segments = os.path.join(root, "segments")
        self.tmp = os.path.join(root, "tmp")
        self.legacy = os.path.join(root, "blocks")  # schema v1-v2: one file per block
        if not readonly:
            for folder in (self.segments, self.tmp):
                make_dirs(folder, root)  # the store's modes, not the umask's

    def path_of(self, segment: bytes) -> str:
        """Absolute path of a segment's file."""
        h = segment.hex()
        return os.path.join(self.segments, h[:2], f"{h}.seg")

    # -- writing --------------------------------------------------------------------

    def write(
        self, blocks: Sequence[tuple[Node, dict[str, dict[str, Any]]]], *, root: bytes, model: bytes, block_size: int
    ) -> tuple[bytes, int, int]:
        """Write consecutive blocks of one chain into a new segment, durably.

        Sets each node's ``segment``, ``size`` and ``checksum``. The caller commits
        the index records only after this returns.

        Args:
            blocks: ``(node, tensors by leaf, then field)`` per block, in position
                order, each the parent of the next; tensors are evaluated,
                row-contiguous mlx or numpy arrays, or ``(numpy array of the bits,
                dtype name)`` (as `block_tensors` gives).
            root: The root key of the model the blocks belong to.
            model: That model's record (JSON, as `index_tables.Writer.register_model`
                stores it), kept in the header so the index can be rebuilt.
            block_size: The store's block size (kept in the header for the same reason:
                a rebuild must cut new prompts as the lost index did).

        Returns:
            (segment id, file size, digest of the whole segment: xxh3-64 over the
            xxh3-64 of each sliced field's data, then its snapshots' digests).

        Raises:
            OSError: On any failure (disk full, permissions); the temporary file is
                removed and nothing is referenced.
            ValueError: If the blocks are not one chain of one model, or their
                tensors disagree.
        """
        segment = os.urandom(16)
        header, chunks, digest = _layout(segment, blocks, root, model, block_size)
        tmp = os.path.join(self.tmp, f"{segment.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = create_file(tmp, self.root)  # the store's file mode (0600 unless shared), not the umask's
        try:
            size = _writev_all(fd, [memoryview(header)] + chunks)
            start_writeback(fd)  # Linux only, for speed: the fsync is what counts
            durable_fsync(fd)
        except BaseException:
            os.close(fd)
            self._remove(tmp)
            raise
        os.close(fd)
        pause_point("before_rename")
        final = self.path_of(segment)
        try:
            folder = os.path.dirname(final)
            if not os.path.isdir(folder):
                make_dirs(folder, self.root)
                _fsync_dir(self.segments)
            os.replace(tmp, final)
            _fsync_dir(folder)
        except BaseException:
            self._remove(tmp)
            raise
        return segment, size, digest

    # -- reading --------------------------------------------------------------------

    def open(self, segment: bytes) -> OpenSegment | None:
        """Open a segment and check its header; None if missing or damaged.

        The caller closes the handle (`OpenSegment.close`).
        """
        try:
            fd = os.open(self.path_of(segment), os.O_RDONLY)
        except OSError:
            return None
        try:
            return OpenSegment(fd, segment)
        except (ValueError, OSError):
            os.close(fd)
            return None

    def verify(self, node: Node) -> str | None:
        """What is wrong with a node's bytes (None if nothing): every piece is read
        and checksummed, every snapshot checked against its digest."""
        if not os.path.exists(self.path_of(node.segment)):
            return "missing file"
        seg = self.open(node.segment)
        if seg is None:
            return "file does not decode"
        try:
            if seg.block_index(node) is None:
                return "file belongs to another block"
            return None if seg.block_tensors(node) is not None else "file size or checksum mismatch"
        finally:
            seg.close()

    def digest_of(self, segment: bytes) -> int | None:
        """The whole-segment digest of a segment file as it is (None if it does not
        open, or its data does not match the digest its header records); every field
        is read."""
        seg = self.open(segment)
        if seg is None:
            return None
        try:
            rows = {}
            for f in seg.fields.values():
                buf = memoryview(bytearray(f.nbytes))
                step = f.tokens * f.row_bytes
                if not seg.read_rows(f, f.first, len(seg.blocks), [buf], [0], step):
                    return None
                rows[f.name] = (buf, step)
            digest = seg.whole_digest(
                {
                    f.name: seg.field_digest(f, lambda f, r: rows[f.name][0][r * rows[f.name][1] : (r + 1) * rows[f.name][1]])
                    for f in seg.fields.values()
                }
            )
            return digest if digest == seg.header.digest else None
        finally:
            seg.close()

    # -- removing -------------------------------------------------------------------

    def unlink(self, segments: Sequence[bytes]) -> None:
        """Remove the files of segments the index no longer references (commit first)."""
        for segment in segments:
            self._remove(self.path_of(segment))

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def stale_tmp(self) -> list[str]:
        """Temporary files whose writing process is gone (ours in flight are not)."""
        try:
            names = sorted(os.listdir(self.tmp))
        except FileNotFoundError:
            return []
        stale = []
        for name in names:
            parts = name.split(".")
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            if pid == os.getpid() or (pid is not None and _pid_alive(pid)):
                continue  # a live writer (this process or another) is still at work
            stale.append(name)
        return stale

    def sweep_tmp(self) -> int:
        """Remove temporary files whose writing process is gone.

        Returns:
            How many were removed.
        """
        stale = self.stale_tmp()
        for name in stale:
            self._remove(os.path.join(self.tmp, name))
        return len(stale)

    def orphans(self, is_referenced: Callable[[bytes], bool], *, grace: float) -> list[str]:
        """Segment files (paths relative to the store) no index entry references, and
        files left by schema v1-v2 (``blocks/``, which nothing references any more).

        Args:
            is_referenced: Whether the index references a segment id.
            grace: Leave out segments younger than this many seconds (a writer in
                another process may be about to commit them).
        """
        out = []
        cutoff = time.time() - grace
        for top, legacy in ((self.segments, False), (self.legacy, True)):
            subs = sorted(os.scandir(top), key=lambda e: e.name) if os.path.isdir(top) else ()
            for sub in subs:
                if not sub.is_dir():
                    continue
                for entry in sorted(os.scandir(sub.path), key=lambda e: e.name):
                    rel = os.path.relpath(entry.path, self.root)
                    if legacy:
                        out.append(rel)
                        continue
                    try:
                        if is_referenced(bytes.fromhex(entry.name.removesuffix(".seg"))):
                            continue
                        if entry.stat().st_mtime > cutoff:
                            continue
                    except (ValueError, FileNotFoundError):
                        pass
                    out.append(rel)
        return out

    def sweep_orphans(self, is_referenced: Callable[[bytes], bool], *, grace: float) -> int:
        """Remove the files `orphans` lists.

        Returns:
            How many were removed.
        """
        found = self.orphans(is_referenced, grace=grace)
        for rel in found:
            self._remove(os.path.join(self.root, rel))
        return len(found)


def _writev_all(fd: int, chunks: list) -> int:
    size = 0
    for j in range(0, len(chunks), IOV_MAX):
        group = chunks[j : j + IOV_MAX]
        want = sum(c.nbytes for c in group)
        done = writev(fd, group)
        while done < want:  # a short write: finish it piece by piece
            rest = b"".join(bytes(c) for c in group)[done:]
            done += os.write(fd, rest)
        size += want
    return size


def _layout(
    segment: bytes, blocks: Sequence[tuple[Node, dict]], root: bytes, model: bytes, block_size: int
) -> tuple[bytes, list[memoryview], int]:
    """The header, the data chunks and the digest of a segment; sets each node's size
    and checksum."""
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
    flat = [
        {f"{lid}.{f}": x for lid, part in tensors.items() for f, x in part.items()}
        for _, tensors in blocks
    ]
    sliced: dict[str, list] = {}  # name -> [dtype, batch, heads, width, first block]
    for i, ((node, _), tensors) in enumerate(zip(blocks, flat)):
        for name in sorted(tensors):
            shape = _shape(tensors[name])
            if not is_sliced(name, shape, node.n_tokens):
                continue
            spec = [_dtype(tensors[name]), shape[0], shape[1], shape[3]]
            if name not in sliced:
                sliced[name] = spec + [i]
            elif sliced[name][:4] != spec:
                raise ValueError(f"{name}: blocks of one segment disagree on dtype or shape")
    for name, (*_, first) in sliced.items():
        if any(name not in t for t in flat[first:]):
            raise ValueError(f"{name}: a block after the first holding it lacks it")
    chunks: list[memoryview] = []
    whole = xxhash.xxh3_64()
    row_pieces: dict[str, list[np.ndarray]] = {}  # name -> per block (from first), its rows
    tensors_of: dict[str, dict] = {}  # safetensors entries, in data order
    firsts: dict[str, int] = {}
    at = 0
    for name in sorted(sliced):
        dtype, batch, heads, width, first = sliced[name]
        rows = batch * heads
        pieces = [_rows(flat[i][name], rows) for i in range(first, len(blocks))]
        row_pieces[name] = pieces
        joined = _joined_rows(pieces)
        h = xxhash.xxh3_64()
        begin = at
        for r in range(rows):
            for run in joined:
                chunks.append(run[r])
                h.update(run[r])
                at += run.shape[1]
        whole.update(h.intdigest().to_bytes(8, "little"))
        tokens = sum(node.n_tokens for node, _ in blocks[first:])
        tensors_of[name] = {"dtype": dtype, "shape": [batch, heads, tokens, width], "data_offsets": [begin, at]}
        firsts[name] = first
    snaps: list[tuple[int, str, int]] = []  # (block, "<leaf>.<field>", digest)
    for i, tensors in enumerate(flat):
        for name in sorted(tensors):
            if name in sliced and i >= sliced[name][4]:
                continue
            view = _bytes(tensors[name])
            digest = xxhash.xxh3_64_intdigest(view)
            snaps.append((i, name, digest))
            whole.update(digest.to_bytes(8, "little"))
            chunks.append(view)
            tensors_of[f"b{i}.{name}"] = {
                "dtype": _dtype(tensors[name]),
                "shape": list(_shape(tensors[name])),
                "data_offsets": [at, at + len(view)],
            }
            at += len(view)
    if len(tensors_of) != len(sliced) + len(snaps):
        raise ValueError("a snapshot's tensor name clashes with a field's")
    records = []
    for i, ((node, _), tensors) in enumerate(zip(blocks, flat)):
        h = xxhash.xxh3_64()
        size = 0
        for name in sorted(sliced):
            if i >= firsts[name]:
                for row in row_pieces[name][i - firsts[name]]:  # rows in order, as a read sees them
                    h.update(row)
                    size += row.nbytes
        for j, name, digest in snaps:
            if j == i:
                h.update(digest.to_bytes(8, "little"))
                size += _bytes(tensors[name]).nbytes
        node.segment, node.size, node.checksum = segment, size, h.intdigest()
        checksum = f"{node.checksum:016x}"
        records.append(
            [node.key.hex(), node.parent.hex(), node.position, node.n_tokens, node.flags, size, checksum, node.extra or {}]
        )
    metadata = {
        "format": SEGMENT_FORMAT,
        "segment": segment.hex(),
        "root": root.hex(),
        "model": model.decode("utf-8"),  # a JSON record: the index's bytes, exactly
        "block_size": str(int(block_size)),
        "blocks": json.dumps(records, separators=(",", ":")),
        "tokens": base64.b64encode(b"".join(node.tokens for node, _ in blocks)).decode(),
        "fields": json.dumps(firsts, separators=(",", ":")),
        "snaps": json.dumps({f"b{i}.{name}": f"{d:016x}" for i, name, d in snaps}, separators=(",", ":")),
        "digest": f"{whole.intdigest():016x}",
        "header_digest": "0" * 16,
    }
    text = json.dumps({"__metadata__": metadata, **tensors_of}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors allows space padding; aligns the data
    if len(text) > MAX_HEADER:  # ~1M tokens in one segment: a file no reader would open
        raise ValueError(f"a segment header of {len(text):,} bytes is over the limit of {MAX_HEADER:,}")
    head = len(text).to_bytes(8, "little") + text
    at = head.index(DIGEST_MARK) + len(DIGEST_MARK)
    head = head[:at] + f"{header_digest(head):016x}".encode() + head[at + 16 :]
    return head, chunks, whole.intdigest()

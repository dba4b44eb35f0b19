"""Segment files (format v5): the one owner of the bytes of stored blocks.

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
  digest; ``digest``: the whole-segment digest (over the blocks' checksums, each
  field's digest, then the snapshots' digests), as the index keeps it;
- ``header_digest``: xxh3-64 of the whole header with these 16 digits as zeros: a
  flipped byte anywhere in the header makes the segment fail to open (a miss).

A block's checksum (kept in its index record and the header, verified on every read)
is xxh3-64 over its record (key, parent, position, tokens, flags, extra), then per
sliced field the field's name, dtype and shape and the block's piece (row by row),
then the digests of its snapshots (each bound to its block and tensor name); every
other digest likewise starts with what it covers (`digest_tags`). A damaged byte, a
damaged header, a file of another block or a tensor relabelled in the header (swapped
offsets, another field's, layer's, block's or model's bytes) is a miss. Format v4
hashed the bytes alone (`migrations/formats/segment_v4.py`, converted by migration 0005).

Write order: write under ``tmp/`` (the data first, hashed as it goes, then the header
that records its digests; see `disk.segment_writer`), fsync, rename into ``segments/``,
fsync the folder; only then does the caller commit the index records. Segment ids are random, so no two
writers ever share a file; a file is unlinked only after the commit that removed its
last block (see `index_tables.Writer.freed`). A crash leaves at most a temporary file
or an unreferenced segment, both swept later.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..blocks import Node
from ..files import NotRegularFileError, open_regular, pid_alive, pid_of_temp
from .faults import pause_point
from .portable import durable_fsync
from .reads_first import ReadsFirst
from .segment_writer import Sink, plan_segment, pwritev_all
from .segment_reader import OpenSegment
from .store_guard import unsafe_entry
from .store_dir import TempFile, folder, folder_fd, make_dirs, remove_entry, subfolder

HEX = frozenset("0123456789abcdef")
# A sub-folder of segments/ emptied by a removal is pruned; a writer that meets it gone
# between opening and renaming into it opens (makes) it again, at most this many times.
PUBLISH_ATTEMPTS = 8


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
        # Restores mark themselves here; `write` gives way to them (see `reads_first`).
        self.reads_first = ReadsFirst()
        if not readonly:
            for sub in (self.segments, self.tmp):
                try:
                    make_dirs(sub, root)  # the store's modes, not the umask's; no link followed
                except NotRegularFileError:
                    raise unsafe_entry(
                        root, f"{os.path.basename(sub)} is a symbolic link or a file, not a folder"
                    ) from None

    def path_of(self, segment: bytes) -> str:
        """Absolute path of a segment's file."""
        h = segment.hex()
        return os.path.join(self.segments, h[:2], f"{h}.seg")

    # -- writing --------------------------------------------------------------------

    def write(
        self,
        blocks: Sequence[tuple[Node, dict[str, dict[str, Any]]]],
        *,
        root: bytes,
        model: bytes,
        block_size: int,
        sync_folder: bool = True,
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
            sync_folder: Fsync the folder the segment was renamed into; False: the
                caller does, with `sync_folders`, before it commits (a group commit
                fsyncs each folder once).

        Returns:
            (segment id, file size, digest of the whole segment: xxh3-64 over the
            xxh3-64 of each sliced field's data, then its snapshots' digests).

        Raises:
            OSError: On any failure (disk full, permissions); the temporary file is
                removed and nothing is referenced.
            ValueError: If the blocks are not one chain of one model, or their
                tensors disagree.
        """
        self.reads_first.wait()
        segment = os.urandom(16)
        plan = plan_segment(segment, blocks, root, model, block_size)
        skeleton = len(plan.header(None, None, None))  # the data starts after it
        # Created exclusively in tmp/ under a random name, with the store's file mode.
        tmp = TempFile(self.root, "tmp", segment.hex())
        try:
            fd = tmp.fileno()
            # The data first (hashed as it goes, written from a second thread), then the
            # header that records its digests, at offset 0: until the fsync and the
            # rename below, the file is a temporary one no reader ever opens.
            sink = Sink(fd, skeleton, nbytes=plan.nbytes, pause=self.reads_first.wait)
            try:
                checksums, digests, digest = plan.stream(sink.put)
            finally:
                size = sink.close()
            head = plan.header(checksums, digests, digest)
            if len(head) != skeleton:
                raise ValueError("a segment header changed length once its digests were known")
            pwritev_all(fd, [head], 0)
            self.reads_first.wait()
            durable_fsync(fd)
            tmp.close_file()
            pause_point("before_rename")
            self.publish(tmp, segment, sync_folder=sync_folder)
        finally:
            tmp.discard()  # removes the file unless it was renamed into place
        return segment, size, digest

    def publish(self, tmp: TempFile, segment: bytes, *, sync_folder: bool = True) -> None:
        """Rename a complete, fsynced temporary file into place as a segment's file, by
        descriptor: a link put among the store's folders is never followed.

        Args:
            tmp: The temporary file (closed and released here).
            segment: The segment id.
            sync_folder: Fsync the folder it was renamed into.

        Raises:
            OSError: If the rename fails (`TempFile.discard` then removes the file).
        """
        h = segment.hex()
        with folder(self.root, "segments", create=True) as top:
            for attempt in range(PUBLISH_ATTEMPTS):
                try:
                    sub, made = subfolder(top, h[:2], self.root)
                except FileNotFoundError:
                    continue  # made by another writer and pruned again meanwhile: make it anew
                try:
                    if made:
                        durable_fsync(top)  # the new folder's name is durable before a file in it
                    try:
                        tmp.move_to(sub, f"{h}.seg")
                    except FileNotFoundError:
                        # Its folder, empty when it was opened, was pruned since (`prune`, in
                        # another process): open or make it again.
                        if attempt + 1 < PUBLISH_ATTEMPTS:
                            continue
                        raise
                    if sync_folder:
                        durable_fsync(sub)
                    return
                finally:
                    os.close(sub)
            raise FileNotFoundError(
                f"segments/{h[:2]} vanished {PUBLISH_ATTEMPTS} times while a segment was renamed in"
            )

    def sync_folders(self, segments: Sequence[bytes]) -> None:
        """Fsync, once each, the folders these segments were renamed into (what
        `write` skips with ``sync_folder=False``): their names are then durable.

        Raises:
            OSError: If a folder cannot be synced.
        """
        self.reads_first.wait()
        for sub in sorted({s.hex()[:2] for s in segments}):
            with folder(self.root, f"segments/{sub}") as fd:
                durable_fsync(fd)

    # -- reading --------------------------------------------------------------------

    def open(self, segment: bytes) -> OpenSegment | None:
        """Open a segment and check its header; None if missing or damaged.

        The caller closes the handle (`OpenSegment.close`).
        """
        try:
            fd = open_regular(self.path_of(segment))  # a link or a FIFO here is a miss, never a hang
        except OSError:
            return None
        try:
            return OpenSegment(fd, segment)
        except (ValueError, OSError):
            os.close(fd)
            return None

    def block_tensors(self, node: Node) -> dict | None:
        """A stored block's tensors (`OpenSegment.block_tensors`: by leaf, then field,
        ``(bits, dtype name)``), verified; None if its file is missing or damaged."""
        seg = self.open(node.segment)
        if seg is None:
            return None
        try:
            return seg.block_tensors(node)
        finally:
            seg.close()

    def verify(self, node: Node) -> str | None:
        """What is wrong with a node's bytes (None if nothing): every piece is read
        and checksummed, every snapshot checked against its digest."""
        if not os.path.lexists(self.path_of(node.segment)):
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
                    f.name: seg.field_digest(
                        f, lambda f, r: rows[f.name][0][r * rows[f.name][1] : (r + 1) * rows[f.name][1]]
                    )
                    for f in seg.fields.values()
                }
            )
            return digest if digest == seg.header.digest else None
        finally:
            seg.close()

    # -- removing -------------------------------------------------------------------

    def unlink(self, segments: Sequence[bytes]) -> None:
        """Remove the files of segments the index no longer references (commit first),
        then the sub-folders they leave empty; by descriptor, so a link among the store's
        folders never leads elsewhere."""
        for segment in segments:
            h = segment.hex()
            self._remove(f"segments/{h[:2]}/{h}.seg")
        self.prune({segment.hex()[:2] for segment in segments})

    def prune(self, subs: Iterable[str]) -> None:
        """Remove those of the sub-folders `subs` of ``segments/`` that are empty (a
        writer that meets its folder gone makes it again: `publish`). A folder that is
        not empty, missing, a link or another user's is left as it is."""
        subs = sorted(subs)
        if not subs:
            return
        try:
            top = folder_fd(self.root, "segments")
        except (OSError, NotRegularFileError):
            return
        try:
            for sub in subs:
                try:
                    os.rmdir(sub, dir_fd=top)  # only an empty folder; a link is never followed
                except OSError:
                    pass
        finally:
            os.close(top)

    def _remove(self, rel: str) -> None:
        try:
            remove_entry(self.root, rel)
        except FileNotFoundError:
            pass

    def _entries(self, rel: str) -> Iterator[os.DirEntry]:
        """The entries of a folder of the store, opened without following a link (none
        if it is missing or a link)."""
        try:
            fd = folder_fd(self.root, rel)
        except (FileNotFoundError, NotRegularFileError):
            return
        try:
            with os.scandir(fd) as it:
                entries = sorted(it, key=lambda e: e.name)
            yield from entries  # their stat() is relative to the folder: it stays open meanwhile
        finally:
            os.close(fd)

    def stale_tmp(self) -> list[str]:
        """Temporary files whose writing process is gone (ours in flight are not): the
        regular files of ``tmp/`` (a name without a writer's pid, see `files.temp_name`,
        is nobody's in flight); links and special files are left to ``ppc check``."""
        stale = []
        for entry in self._entries("tmp"):
            if not entry.is_file(follow_symlinks=False):
                continue
            pid = pid_of_temp(entry.name)
            if pid is not None and (pid == os.getpid() or pid_alive(pid)):
                continue  # a live writer (this process or another) is still at work
            stale.append(entry.name)
        return stale

    def sweep_tmp(self) -> int:
        """Remove temporary files whose writing process is gone.

        Returns:
            How many were removed.
        """
        removed = 0
        for name in self.stale_tmp():
            try:
                removed += remove_entry(self.root, f"tmp/{name}", regular_only=True)
            except OSError:
                continue  # not ours to remove (another user's file in a shared store)
        return removed

    def orphans(self, is_referenced: Callable[[bytes], bool], *, grace: float, every: bool = False) -> list[str]:
        """Segment files (paths relative to the store) no index entry references, and
        files left by schema v1-v2 (``blocks/``, which nothing references any more).
        Folders that are links are not followed; only regular files are listed.

        Args:
            is_referenced: Whether the index references a segment id.
            grace: Leave out segments younger than this many seconds (a writer in
                another process may be about to commit them).
            every: Also list regular files whose names the store does not make
                (``ppc check``; a sweep at open removes only the store's own).
        """
        out = [rel for rel, _, _ in self._files_in("blocks")]
        cutoff = time.time() - grace
        for rel, entry, segment in self._files_in("segments"):
            if segment is None:
                if every:
                    out.append(rel)
                continue
            if is_referenced(segment):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                    continue
            except FileNotFoundError:
                continue
            out.append(rel)
        return out

    def listed(self) -> list[str]:
        """Every segment file (paths relative to the store): regular files with the
        names the store gives them, in folders that are not links."""
        return [rel for rel, _, segment in self._files_in("segments") if segment is not None]

    def _files_in(self, top: str) -> Iterator[tuple[str, os.DirEntry, bytes | None]]:
        """(relative path, entry, segment id or None) of each regular file one folder
        below `top`; links and special files are left to ``ppc check``."""
        for sub in self._entries(top):
            if sub.is_dir(follow_symlinks=False):
                for entry in self._entries(f"{top}/{sub.name}"):
                    if entry.is_file(follow_symlinks=False):
                        yield f"{top}/{sub.name}/{entry.name}", entry, _segment_id(sub.name, entry.name)

    def sweep_orphans(self, is_referenced: Callable[[bytes], bool], *, grace: float, every: bool = False) -> int:
        """Remove the files `orphans` lists (regular files only, by descriptor).

        Returns:
            How many were removed.
        """
        found = self.orphans(is_referenced, grace=grace, every=every)
        removed = 0
        for rel in found:
            try:
                removed += remove_entry(self.root, rel, regular_only=True)
            except OSError:
                continue  # not ours to remove (another user's file in a shared store)
        self.prune({rel.split("/")[1] for rel in found if rel.startswith("segments/")})
        return removed


def _segment_id(sub: str, name: str) -> bytes | None:
    """The segment id a file name in ``segments/<sub>/`` stands for (None: a name the
    store never makes)."""
    h = name[:-4] if name.endswith(".seg") else ""
    if len(h) != 32 or not set(h) <= HEX or h[:2] != sub:
        return None
    return bytes.fromhex(h)

"""Block files: the one owner of their format, paths, writes, verified reads and sweeps.

A block file is a safetensors file (see `codec`) named ``blocks/ab/<key>-<xxh3>.safetensors``
whose header metadata names the format (`BLOCK_FORMAT`), the block's key and position.
Write order: write under ``tmp/``, fsync, rename into ``blocks/``, fsync the folder;
only then does the caller commit the index record (and it unlinks only after a
removal committed). A crash leaves at most a temporary file or an unreferenced block
file, both swept later. Every read checks size, header, format, key and checksum.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import xxhash

from . import codec
from .faults import pause_point
from .node import Node


BLOCK_FORMAT = "ppc-block/1"
_BATCH = 64  # files written (and fsynced) per batch: bounds open work and tmp space
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


def _load_sync_file_range():
    # Linux can start a file's writeback without waiting (sync_file_range), so that
    # the fsync that follows finds most of the data on its way to the disk already.
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _load_sync_file_range()


def _start_writeback(fd: int) -> None:
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE; a failure only costs speed


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
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


class BlockFiles:
    """The ``blocks/`` and ``tmp/`` folders of one store.

    Args:
        root: The store directory.
        readonly: Create nothing.
    """

    def __init__(self, root: str, *, readonly: bool = False):
        self.root = root
        self.blocks = os.path.join(root, "blocks")
        self.tmp = os.path.join(root, "tmp")
        if not readonly:
            for folder in (self.blocks, self.tmp):
                os.makedirs(folder, exist_ok=True)

    def path_of(self, node: Node) -> str:
        """Absolute path of a node's file."""
        return os.path.join(self.blocks, node.file_name)

    @staticmethod
    def encode(node: Node, tensors: dict[str, dict[str, Any]]) -> tuple[bytes, bytes, list]:
        """Lay out one block's tensors (by leaf, then field) for `write_many`.

        Returns:
            ``(key, header, buffers)``.
        """
        flat = {f"{lid}.{f}": x for lid, part in tensors.items() for f, x in part.items()}
        meta = {"format": BLOCK_FORMAT, "key": node.key.hex(), "position": str(node.position)}
        return (node.key, *codec.encode(flat, meta))

    def open_block(self, node: Node) -> "OpenBlock | None":
        """Open a node's file and check its size and header; None if missing or damaged.

        The body is read (and its checksum verified) by `OpenBlock.read_into`; the
        caller closes the handle.
        """
        try:
            fd = os.open(self.path_of(node), os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size != node.size:
                raise codec.BlockDecodeError("size differs from the index")
            head = os.pread(fd, min(size, 65536), 0)
            n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
            if len(head) >= 8 and 8 + n > len(head) and n <= codec.MAX_HEADER and 8 + n <= size:
                head = os.pread(fd, 8 + n, 0)
            body_at, entries, metadata = codec.parse_header(head, size)
            _check_metadata(metadata, node)
            return OpenBlock(node, fd, size, head[:body_at], body_at, entries)
        except (codec.BlockDecodeError, OSError, ValueError):
            os.close(fd)
            return None

    def verify(self, node: Node) -> str | None:
        """What is wrong with a node's file (None if nothing): the whole file is read,
        checksummed and decoded."""
        if not os.path.exists(self.path_of(node)):
            return "missing file"
        data = self.read(node)
        if data is None:
            return "file size or checksum mismatch"
        try:
            _, metadata = codec.decode(data)
        except codec.BlockDecodeError:
            return "file does not decode"
        try:
            _check_metadata(metadata, node)
        except codec.BlockDecodeError as exc:
            return str(exc)
        return None

    def write_many(self, items: Sequence[tuple[bytes, bytes, list]]) -> list[tuple[int, int, str]]:
        """Write encoded blocks durably under their final names.

        Files are written in batches: each file is written with ``writev`` straight from
        the tensors' memory and its writeback started at once, then the batch is
        fsynced, renamed into ``blocks/`` and each folder fsynced. The caller commits
        the index only after this returns.

        Args:
            items: ``(key, header, buffers)`` per block, from `codec.encode`.

        Returns:
            ``(size, checksum, folder)`` per block.

        Raises:
            OSError: On any failure (disk full, permissions). Temporary files are
                removed; files already renamed are left for the orphan sweep, since a
                writer in another process may have published the same (content-named)
                file and be about to commit it.
        """
        results: list[tuple[int, int, str]] = []
        folders: set[str] = set()
        for i in range(0, len(items), _BATCH):
            batch = items[i : i + _BATCH]
            written = []  # (fd, tmp path, final path, size, checksum, folder)
            try:
                for key, header, buffers in batch:
                    written.append(self._write_tmp(key, header, buffers))
                # Every file's writeback is under way: wait for each to be durable.
                while written and written[-1][0] is not None:
                    for k, (fd, *rest) in enumerate(written):
                        os.fsync(fd)
                        os.close(fd)
                        written[k] = (None, *rest)
                pause_point("before_rename")
                for _, tmp, final, size, checksum, folder in written:
                    if not os.path.isdir(folder):
                        os.makedirs(folder, exist_ok=True)
                        _fsync_dir(self.blocks)
                    os.replace(tmp, final)
                    folders.add(folder)
                    results.append((size, checksum, folder))
            except BaseException:
                for fd, tmp, *_ in written:
                    if fd is not None:
                        os.close(fd)
                    self._remove(tmp)
                raise
        for folder in folders:
            _fsync_dir(folder)
        return results

    def _write_tmp(self, key: bytes, header: bytes, buffers: list) -> tuple:
        """Write one file under ``tmp/`` and start its writeback; the fd stays open."""
        hex_key = key.hex()
        tmp = os.path.join(self.tmp, f"{hex_key}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            h = xxhash.xxh3_64()
            chunks = [memoryview(header)] + [memoryview(b).cast("B") for b in buffers if len(b)]
            size = 0
            for j in range(0, len(chunks), _IOV_MAX):
                group = chunks[j : j + _IOV_MAX]
                want = sum(len(c) for c in group)
                done = os.writev(fd, group)
                while done < want:  # a short write: finish it piece by piece
                    rest = b"".join(bytes(c) for c in group)[done:]
                    done += os.write(fd, rest)
                size += want
                for c in group:
                    h.update(c)
            _start_writeback(fd)
        except BaseException:
            os.close(fd)
            self._remove(tmp)
            raise
        checksum = h.intdigest()
        folder = os.path.join(self.blocks, hex_key[:2])
        final = os.path.join(folder, f"{hex_key}-{checksum:016x}.safetensors")
        return fd, tmp, final, size, checksum, folder

    def read(self, node: Node) -> bytes | None:
        """The verified bytes of a node's file, or None if missing, resized or damaged."""
        try:
            with open(self.path_of(node), "rb") as f:
                if os.fstat(f.fileno()).st_size != node.size:
                    return None
                data = f.read(node.size + 1)
        except OSError:
            return None
        if len(data) != node.size or codec.checksum(data) != node.checksum:
            return None
        return data

    def unlink(self, nodes: Iterable[Node]) -> None:
        """Remove the files of nodes whose index records were removed (commit first)."""
        for node in nodes:
            self._remove(self.path_of(node))

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

    def orphans(self, is_referenced: Callable[[str], bool], *, grace: float) -> list[str]:
        """Block files (paths relative to ``blocks/``) that no index record names.

        Args:
            is_referenced: Given a file's relative path, whether an index record names it.
            grace: Leave out files younger than this many seconds (a writer in another
                process may be about to commit them).
        """
        out = []
        cutoff = time.time() - grace
        for sub in sorted(os.scandir(self.blocks), key=lambda e: e.name) if os.path.isdir(self.blocks) else ():
            if not sub.is_dir():
                continue
            for entry in sorted(os.scandir(sub.path), key=lambda e: e.name):
                rel = f"{sub.name}/{entry.name}"
                if is_referenced(rel):
                    continue
                try:
                    if entry.stat().st_mtime > cutoff:
                        continue
                except FileNotFoundError:
                    continue
                out.append(rel)
        return out

    def sweep_orphans(self, is_referenced: Callable[[str], bool], *, grace: float) -> int:
        """Remove the files `orphans` lists.

        Returns:
            How many were removed.
        """
        found = self.orphans(is_referenced, grace=grace)
        for rel in found:
            self._remove(os.path.join(self.blocks, rel))
        return len(found)


def _check_metadata(metadata: dict, node: Node) -> None:
    if metadata.get("format") != BLOCK_FORMAT:
        raise codec.BlockDecodeError(f"unknown block format {metadata.get('format')!r}")
    if metadata.get("key") != node.key.hex():
        raise codec.BlockDecodeError("file belongs to another block")


@dataclass
class OpenBlock:
    """An open block file whose header was checked: where its tensors lie in the body.

    `targets` is set by the reader: for each entry (in body order), the buffers its
    bytes are read into.
    """

    node: Node
    fd: int
    size: int
    head: bytes
    body_at: int
    entries: list[codec.Entry]
    targets: list[list[memoryview]] = field(default_factory=list)

    def read_into(self) -> bool:
        """Read the body into `targets` with ``preadv`` and verify size and checksum."""
        vectors = [v for targets in self.targets for v in targets]
        offset = self.body_at
        for i in range(0, len(vectors), _IOV_MAX):
            batch = vectors[i : i + _IOV_MAX]
            want = sum(len(v) for v in batch)
            try:
                if os.preadv(self.fd, batch, offset) != want:
                    return False  # a short read: the file shrank under us
            except OSError:
                return False
            offset += want
        if offset != self.size:
            return False
        h = xxhash.xxh3_64(self.head)
        for v in vectors:
            h.update(v)
        return h.intdigest() == self.node.checksum

    def close(self) -> None:
        """Close the file."""
        self.targets = []
        os.close(self.fd)

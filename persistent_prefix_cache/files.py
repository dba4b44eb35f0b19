"""Block files on disk: crash-safe writes, verified reads, sweeping of leftovers.

Write order (DESIGN.md): write under ``tmp/``, fsync, rename into ``blocks/``, fsync the
folder; only then does the caller commit the index record. A crash leaves at most a
temporary file or an unreferenced block file, both swept later.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable

from . import codec
from .faults import pause_point
from .node import Node


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
        self.blocks = os.path.join(root, "blocks")
        self.tmp = os.path.join(root, "tmp")
        if not readonly:
            for folder in (self.blocks, self.tmp):
                os.makedirs(folder, exist_ok=True)

    def path_of(self, node: Node) -> str:
        """Absolute path of a node's file."""
        return os.path.join(self.blocks, node.file_name)

    def write(self, key: bytes, header: bytes, buffers: list) -> tuple[int, int, str]:
        """Write one encoded block durably under its final name.

        Args:
            key: The block key (names the file, with the checksum).
            header, buffers: From `codec.encode`.

        Returns:
            (size, checksum, folder the file was renamed into); the caller fsyncs that
            folder (once per batch) before committing the index.

        Raises:
            OSError: On any failure (disk full, permissions); the temporary file is
                removed first.
        """
        hex_key = key.hex()
        tmp = os.path.join(self.tmp, f"{hex_key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                size, checksum = codec.write(f, header, buffers)
                f.flush()
                os.fsync(f.fileno())
            pause_point("before_rename")
            folder = os.path.join(self.blocks, hex_key[:2])
            if not os.path.isdir(folder):
                os.makedirs(folder, exist_ok=True)
                _fsync_dir(self.blocks)
            os.replace(tmp, os.path.join(folder, f"{hex_key}-{checksum:016x}.safetensors"))
        except BaseException:
            self._remove(tmp)
            raise
        return size, checksum, folder

    def sync_folders(self, folders: Iterable[str]) -> None:
        """fsync each folder once, so that the renames into it are durable."""
        for folder in set(folders):
            _fsync_dir(folder)

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

    def sweep_orphans(self, is_referenced: Callable[[str], bool], *, grace: float) -> int:
        """Remove block files that no index record names.

        Args:
            is_referenced: Given a file's path relative to ``blocks/``, whether an
                index record names it.
            grace: Leave files younger than this many seconds (a writer in another
                process may be about to commit them).

        Returns:
            How many were removed.
        """
        removed = 0
        cutoff = time.time() - grace
        for sub in os.scandir(self.blocks) if os.path.isdir(self.blocks) else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                rel = f"{sub.name}/{entry.name}"
                if is_referenced(rel):
                    continue
                try:
                    if entry.stat().st_mtime > cutoff:
                        continue
                except FileNotFoundError:
                    continue
                self._remove(entry.path)
                removed += 1
        return removed

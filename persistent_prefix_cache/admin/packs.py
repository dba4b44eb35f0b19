"""Packs: a store, or one model's part of it, as one tar file (``ppc export`` / ``ppc import``).

A pack holds ``manifest.json`` (format, block size, models, block count), ``nodes.bin``
(the blocks' index records), the segment files they use, and ``signature.json``: the
digest of every member and a MAC per key that signed them (`pack_sign`: the exporting
store's own key, and a user's secret if one was given). An import reads the members in
that order, each bounded before it is read (`pack_members.PackReader`) and streamed to
the store's ``tmp/``; every block is verified against its record; the segments are in
place but unreferenced until the pack has proven where it comes from:

- signed by this store's key or by the secret the import was given: committed;
- otherwise (another store's, an unsigned pack, every pack of an older format): only
  with a check against the model (a `check` callable, ``ppc import --model M``), or
  with an explicit `trust` (``--trust``); else `UnverifiedPackError` and nothing is
  written (the files are removed).
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from ..blocks import Node
from ..disk.commit import commit
from ..disk.index import Index
from ..disk.portable import durable_fsync
from ..disk.segment import SegmentFiles
from ..disk.segment_header import MAX_HEADER
from ..disk.store_dir import TempFile, file_mode
from ..errors import InvalidArgumentError, UnverifiedPackError
from ..files import open_regular, replace_beside
from ..keys import key_follows
from ..migrations.formats import block_files_v2, segment_v3, segment_v4
from ..paths import expand_path
from . import pack_sign
from .pack_members import NODES, MANIFEST, RECORD_HEAD, SIGNATURE, PackReader, add_bytes, digest, dumps

EXPORT_FORMAT = "ppc-export/4"  # segment files of format v5 (and, since issue 29, a signature)
V4_EXPORT_FORMAT = "ppc-export/3"  # segment files of format v4 (rewritten on import)
V3_EXPORT_FORMAT = "ppc-export/2"  # segment files of format v3 (rewritten on import)
LEGACY_EXPORT_FORMAT = "ppc-export/1"  # schema v1-v2: one file per block
# A segment file holds its live blocks, dead ones not compacted yet (at most about as
# many again: compaction rewrites a segment once half of it is dead) and its header.
SEGMENT_SLACK = 4


@dataclass
class PackBlocks:
    """The blocks an import is about to commit, for a check against the model.

    Attributes:
        path: The pack.
        nodes: The blocks to import, by key (their segment files are in place, not yet
            referenced by the index).
        models: Root key -> the model's description from the pack's manifest.
        files: The store's segment files (the pack's and the store's own blocks).
        index: The store's index (blocks already stored, which chains may start with).
    """

    path: str
    nodes: dict[bytes, Node]
    models: dict[bytes, dict]
    files: SegmentFiles
    index: Index

    def node(self, key: bytes) -> Node | None:
        """A block of the pack, or one the store holds already."""
        found = self.nodes.get(key)
        if found is None:
            with self.index.reader() as reader:
                found = reader.get(key)
        return found

    def tensors(self, node: Node) -> dict | None:
        """A block's tensors (by leaf, then field: ``(bits, dtype name)``), verified; None if damaged."""
        return self.files.block_tensors(node)


Check = Callable[[PackBlocks], dict]


def export_pack(files: SegmentFiles, index: Index, nodes: list[Node], models: dict[bytes, dict], out_path: str,
                *, root: str, secret: bytes | None = None, stream: BinaryIO | None = None) -> dict:  # fmt: skip
    """Write `nodes` (parents first) and the segment files they use into one tar file,
    signed by the store's key (made on its first export) and by `secret` if given.

    Args:
        stream: Write the pack to this binary stream, in one pass (``ppc export -``:
            stdout), instead of to the file `out_path`.

    Returns:
        Counts of models, blocks and bytes exported, and ``signed_by`` (the keys that signed).
    """
    nodes = sorted(nodes, key=lambda n: n.position)  # parents before children
    keys = [k for k in (pack_sign.store_key(root, create=True),) if k is not None]
    if secret is not None:
        keys.append(pack_sign.secret_key(secret))
    if stream is None:
        out_path = expand_path(out_path, what="out_path")
    digests: dict[str, bytes] = {}

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        digests[name] = digest_of(data)
        add_bytes(tar, name, data)

    def write(raw) -> None:
        # A stream (a pipe) cannot tell its position: tarfile's stream mode writes the same bytes.
        with tarfile.open(fileobj=raw, mode="w" if stream is None else "w|") as tar:
            manifest = {
                "format": EXPORT_FORMAT,
                "block_size": index.block_size,
                "models": {r.hex(): d for r, d in models.items()},
                "blocks": len(nodes),
            }
            add(tar, MANIFEST, dumps(manifest))
            add(tar, NODES, b"".join(RECORD_HEAD.pack(n.key, len(n.pack())) + n.pack() for n in nodes))
            for seg in dict.fromkeys(n.segment for n in nodes):
                name = f"segments/{seg.hex()}.seg"
                # A regular file only: a link or a FIFO put there is refused, not followed.
                with os.fdopen(open_regular(files.path_of(seg)), "rb") as f:
                    hashed = _Hashing(f)
                    tar.addfile(tar.gettarinfo(arcname=name, fileobj=f), hashed)
                    digests[name] = hashed.h.digest()
            add_bytes(tar, SIGNATURE, dumps(pack_sign.sign(digests, keys)))

    if stream is not None:
        write(stream)
        stream.flush()
    else:
        # Beside OUT under a name nobody can predict, created exclusively (its folder may be
        # shared), with the store's file mode: a pack holds the prompts too.
        replace_beside(out_path, write, mode=file_mode(root)[0], sync=durable_fsync)
    return {
        "models": len(models), "blocks": len(nodes), "bytes": sum(n.size for n in nodes),
        "signed_by": [k.by for k in keys],
    }  # fmt: skip


class _Hashing:
    """A file read through a hash (what `tarfile.addfile` copies)."""

    def __init__(self, f):
        self.f, self.h = f, digest()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data


def digest_of(data: bytes) -> bytes:
    """The digest a signature lists for a member's bytes."""
    h = digest()
    h.update(data)
    return h.digest()


def import_pack(files: SegmentFiles, index: Index, in_path: str, *, secret: bytes | None = None,
                trust: bool = False, check: Check | None = None, reader: PackReader | None = None) -> dict:  # fmt: skip
    """Load a pack written by `export_pack` (or by an older version) into a store.

    Every block is verified against its record before it is added; blocks already
    stored are skipped. Segment files are written (and fsynced) before the index
    records that name them, and are committed only once the pack is verified (see the
    module's docstring).

    Args:
        files: The store's segment files.
        index: The store's index.
        in_path: The pack.
        secret: A secret a signature may have been made with.
        trust: Import a pack that is not verified (by a signature or `check`) as it is.
        check: Called with the blocks of a pack no key of this import signed, before
            they are committed; returns what it checked, raises to refuse them.
        reader: The pack already opened (its manifest may have been read: ``ppc import``
            learns a new store's block size from it, and reads stdin in one pass); the
            caller closes it. None: `in_path` is opened here.

    Returns:
        Counts of blocks added and skipped, bytes added, and ``verified``: ``"store"``,
        ``"secret"``, ``"model"`` (with ``checked``: what `check` returned) or ``"trust"``.

    Raises:
        InvalidArgumentError: If the file is not an export, a damaged or altered one,
            was made with another block size, or is refused by `check`.
        UnverifiedPackError: If nothing verifies it and neither `trust` nor `check` was given.
    """
    in_path = expand_path(in_path, what="in_path") if reader is None else reader.path
    keys = [k for k in (pack_sign.store_key(files.root, create=False),) if k is not None]
    if secret is not None:
        keys.append(pack_sign.secret_key(secret))
    with PackReader(in_path) if reader is None else contextlib.nullcontext(reader) as reader:
        manifest = reader.manifest()
        if manifest["format"] not in (EXPORT_FORMAT, V4_EXPORT_FORMAT, V3_EXPORT_FORMAT, LEGACY_EXPORT_FORMAT):
            raise InvalidArgumentError(f"{in_path}: unknown export format {manifest['format']!r}")
        if manifest["block_size"] != index.block_size:
            raise InvalidArgumentError(
                f"{in_path} has block_size {manifest['block_size']}, the store {index.block_size}",
                hint="import into a new store directory",
            )
        nodes = reader.nodes(manifest)
        if not all(key_follows(n) for n in nodes):
            raise InvalidArgumentError(
                f"{in_path}: damaged node records (a key that its parent and tokens do not give)"
            )
        with index.reader() as r:
            present = {n.key for n in nodes if r.get(n.key) is not None}
            known = set(r.segments())
        todo = [n for n in nodes if n.key not in present]
        written: dict[bytes, tuple[int, int]] = {}  # segment -> (file size, digest) written here
        try:
            job = _Import(reader, files, index, in_path, nodes, todo, written)
            if manifest["format"] == LEGACY_EXPORT_FORMAT:
                job.legacy(_models_of(index, nodes, manifest, in_path))
            elif manifest["format"] in (V3_EXPORT_FORMAT, V4_EXPORT_FORMAT):
                older = segment_v3 if manifest["format"] == V3_EXPORT_FORMAT else segment_v4
                job.older(_models_of(index, nodes, manifest, in_path), older)
            else:
                job.segments(known)
            signature = reader.signature()
            signed = {name: d for name, d in reader.digests.items() if name != SIGNATURE}
            verified = pack_sign.verify(in_path, signature, signed, keys)
            checked = None
            if verified is None and not trust:
                if check is None:
                    raise _unverified(in_path, signature, secret is not None)
                models = {bytes.fromhex(r): d for r, d in manifest["models"].items() if _is_hex(r)}
                checked = check(PackBlocks(in_path, {n.key: n for n in todo}, models, files, index))
            verified = verified or ("model" if checked is not None else "trust")
            result = _commit(files, index, manifest, todo, written)
        except BaseException:
            files.unlink(list(written))
            raise
    out = {"added": result, "skipped": len(nodes) - len(todo), "bytes": sum(n.size for n in todo), "verified": verified}
    return {**out, "checked": checked} if checked is not None else out


def _is_hex(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) == 16
    except ValueError:
        return False


def _unverified(path: str, signature: dict | None, have_secret: bool) -> UnverifiedPackError:
    who = pack_sign.signers(signature)
    if not who:
        return UnverifiedPackError(f"{path} is not signed (a pack of an older version, or written by hand)")
    mine = " and not with your secret" if have_secret else ""
    return UnverifiedPackError(f"{path} is signed by {' and '.join(who)}: not by this store{mine}")


def _commit(files: SegmentFiles, index: Index, manifest: dict, todo: list[Node], written: dict) -> int:
    now = time.time_ns()
    for n in todo:
        n.child_count, n.last_access = 0, now
    models = [(bytes.fromhex(r), json.dumps(desc).encode()) for r, desc in manifest["models"].items()]
    new = [(seg, size, seg_digest) for seg, (size, seg_digest) in written.items()]
    return commit(index, files, lambda w: sum(w.insert(n) for n in todo), new=new, models=models)


class _Import:
    """The members after ``nodes.bin``, by format, written into the store's files."""

    def __init__(self, reader: PackReader, files: SegmentFiles, index: Index, path: str, nodes, todo, written):
        self.reader, self.files, self.index, self.path = reader, files, index, path
        self.nodes, self.todo, self.written = nodes, todo, written

    def _members(self, prefix: str, wanted: dict[str, Any]):
        """(member, what it stands for) for each member under `prefix` until another kind."""
        while True:
            member = self.reader.next()
            if member is None or not member.name.startswith(prefix):
                if member is not None:
                    self.reader.push_back(member)
                return
            if member.name not in wanted:
                raise InvalidArgumentError(f"{self.path} is a damaged ppc export: unexpected member {member.name}")
            yield member, wanted.pop(member.name)

    def _bound(self, blocks: list[Node]) -> int:
        return SEGMENT_SLACK * sum(n.size for n in blocks) + MAX_HEADER + 8 * len(blocks) + (1 << 20)

    def _to_tmp(self, member, name: str, bound: int, *, flags: int = os.O_WRONLY) -> TempFile:
        """`member` streamed into a new temporary file of the store (exclusive, a random
        name: `store_dir.TempFile`), fsynced; the caller publishes or discards it."""
        tmp = TempFile(self.files.root, "tmp", name, flags=flags)
        try:
            with os.fdopen(tmp.fileno(), "wb", closefd=False) as f:
                self.reader.stream(member, bound, f)
                f.flush()
                durable_fsync(f.fileno())
        except BaseException:
            tmp.discard()
            raise
        return tmp

    def segments(self, known: set) -> None:
        by_segment: dict[bytes, list[Node]] = {}
        for n in self.nodes:
            by_segment.setdefault(n.segment, []).append(n)
        needed = {n.segment for n in self.todo} - known  # imported before: the file is there
        wanted = {f"segments/{seg.hex()}.seg": seg for seg in by_segment}
        for member, seg in self._members("segments/", wanted):
            bound = self._bound(by_segment[seg])
            if seg not in needed:
                self.reader.stream(member, bound, _Discard())  # hashed for the signature only
                continue
            tmp = self._to_tmp(member, seg.hex(), bound)
            try:
                self.files.publish(tmp, seg)
            finally:
                tmp.discard()
            seg_digest = self.files.digest_of(seg)
            self.written[seg] = (member.size, seg_digest)
            if seg_digest is None:
                raise InvalidArgumentError(f"{self.path}: segment {seg.hex()} is damaged")
        if wanted:
            raise InvalidArgumentError(f"{self.path} is a damaged ppc export: {next(iter(wanted))} is missing")
        for n in self.todo:
            if self.files.verify(n) is not None:
                raise InvalidArgumentError(f"{self.path}: block {n.key.hex()} is damaged")

    def legacy(self, models: dict) -> None:
        # An export of schema v1-v2: one block file each, rewritten as one segment each.
        todo = {n.key for n in self.todo}
        wanted = {f"blocks/{block_files_v2.file_name(n)}": n for n in self.nodes}
        for member, n in self._members("blocks/", wanted):
            data = self.reader.stream(member, self._bound([n]))
            if n.key not in todo:
                continue
            try:
                tensors = block_files_v2.decode_block(data, n)
            except ValueError:
                raise InvalidArgumentError(f"{self.path}: block {n.key.hex()} is damaged") from None
            seg, size, seg_digest = self._rewrite([(n, tensors)], models)
            self.written[seg] = (size, seg_digest)
        self._complete(wanted, todo)

    def older(self, models: dict, older: Any) -> None:
        # An export of segment format v3 or v4: each segment read (the frozen reader
        # `older`, whose rule verifies each block) and its blocks rewritten, run by run
        # of one chain.
        todo = {n.key for n in self.todo}
        by_segment: dict[bytes, list[Node]] = {}
        for n in self.nodes:
            by_segment.setdefault(n.segment, []).append(n)
        wanted = {f"segments/{seg.hex()}.seg": seg for seg in by_segment}
        for member, old in self._members("segments/", wanted):
            mine = [n for n in by_segment[old] if n.key in todo]
            if not mine:
                self.reader.stream(member, self._bound(by_segment[old]), _Discard())
                continue
            tmp = self._to_tmp(member, old.hex(), self._bound(by_segment[old]), flags=os.O_RDWR)
            fd = tmp.fd  # read back through its descriptor
            try:
                try:
                    seg = older.OpenSegment(fd, old)
                except ValueError:
                    raise InvalidArgumentError(f"{self.path}: segment {old.hex()} is damaged") from None
                runs: list[list] = []
                for n in sorted(mine, key=lambda n: n.position):
                    tensors = seg.block_tensors(n)
                    if tensors is None:
                        raise InvalidArgumentError(f"{self.path}: block {n.key.hex()} is damaged")
                    if not runs or runs[-1][-1][0].key != n.parent:
                        runs.append([])
                    runs[-1].append((n, tensors))
            finally:
                tmp.discard()
            for run in runs:
                seg_id, size, seg_digest = self._rewrite(run, models)
                self.written[seg_id] = (size, seg_digest)
        self._complete(wanted, todo)

    def _complete(self, wanted: dict, todo: set) -> None:
        for name, what in wanted.items():
            blocks = [what] if isinstance(what, Node) else [n for n in self.nodes if n.segment == what]
            if any(n.key in todo for n in blocks):
                raise InvalidArgumentError(f"{self.path} is a damaged ppc export: {name} is missing")

    def _rewrite(self, run: list, models: dict) -> tuple[bytes, int, int]:
        # Blocks of an older format into a new segment, once their own format's rule has
        # verified them: the checksums are new (v5 binds them to the records).
        try:
            return self.files.write(run, **models[run[0][0].key], block_size=self.index.block_size)
        except ValueError as exc:
            raise InvalidArgumentError(f"{self.path}: damaged blocks: {exc}") from None


class _Discard:
    """A sink that keeps nothing (a member read only to be hashed)."""

    def write(self, data: bytes) -> None:
        pass


def _models_of(index: Index, nodes: list[Node], manifest: dict, path: str) -> dict[bytes, dict]:
    """Block key -> ``root`` and ``model`` record (as the import registers it) for
    `SegmentFiles.write`, found by walking each block's parents up to its root."""
    roots: dict[bytes, bytes] = {}
    by_key = {n.key: n for n in nodes}
    for n in sorted(nodes, key=lambda n: n.position):
        root = n.parent if n.position == 0 else roots.get(n.parent)
        if root is None and n.parent in by_key:
            raise InvalidArgumentError(f"{path}: damaged node records")  # a parent after its child
        if root is not None:
            roots[n.key] = root
    models = manifest.get("models") or {}
    out = {}
    for key, root in roots.items():
        if root.hex() not in models:
            raise InvalidArgumentError(f"{path}: a block of a model the export does not describe")
        out[key] = {"root": root, "model": json.dumps(models[root.hex()]).encode()}
    orphans = [n for n in nodes if n.key not in out]
    if orphans:  # a parent outside the export: this store may hold it (else it is skipped)
        with index.reader() as reader:
            for n in orphans:
                up, seen = reader.get(n.parent), 0
                while up is not None and up.position > 0 and seen < 1 << 20:
                    up, seen = reader.get(up.parent), seen + 1
                root = up.parent if up is not None else bytes(16)
                out[n.key] = {"root": root, "model": reader.model(root) or b"{}"}
    return out

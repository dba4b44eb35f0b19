"""Store maintenance without a model: summaries, verification and repair, eviction,
migrations, and packing a store (or one model's part of it) into one file.

`StoreAdmin` opens a store directory's index and files directly; the ``ppc`` commands
``stats``, ``inspect``, ``check``, ``gc``, ``migrate``, ``export`` and ``import`` are
thin layers over it.
"""

from __future__ import annotations

import json
import os
import stat
import tarfile
import time
from typing import Iterator

from ..errors import InvalidArgumentError, StoreVersionError
from ..keys import block_key
from ..paths import expand_path
from ..migrations.formats import block_files_v2, segment_v3, segment_v4
from . import store_guard
from .compaction import compact_sparse
from .segment import SegmentFiles
from .index import SCHEMA_VERSION, Index, Reader, Writer
from .check_report import CheckReport
from ..blocks import Node
from .pack_members import RECORD_HEAD, add_bytes, read_json, read_member, unpack_records
from ..files import open_regular, replace_beside
from .portable import durable_fsync
from .segment_writer import pwritev_all
from .store_dir import TempFile, check_location, check_readable, create_root, file_mode, require_writable

EXPORT_FORMAT = "ppc-export/4"  # segment files of format v5
V4_EXPORT_FORMAT = "ppc-export/3"  # segment files of format v4 (rewritten on import)
V3_EXPORT_FORMAT = "ppc-export/2"  # segment files of format v3 (rewritten on import)
LEGACY_EXPORT_FORMAT = "ppc-export/1"  # schema v1-v2: one file per block
WRITE_HINT = (
    "this writes the store: run it as the store's owner, make the store writable (its permissions, a "
    "read-write mount), or copy it to a directory you can write; stats, inspect, export and check "
    "without --fix only read it"
)


class StoreAdmin:
    """A store directory opened for maintenance (no model needed).

    Args:
        path: The store directory.
        readonly: Open without writing.
        create: Create an empty store if there is none (for `import_pack`).
        block_size: Block size of a store created here.
        shared: Make a store created here for a group (see `store_dir.create_root`).

    Raises:
        InvalidArgumentError: If there is no store at `path` (and not `create`).
        StorePathError: If `create` and `path` is a file or a folder of other files.
        StoreNotWritableError: If not `readonly` and the store (or the place to create
            it) cannot be written by this process.
        StoreVersionError: If the store's schema is not this library's (run
            ``ppc migrate`` for an older one).
    """

    def __init__(
        self, path: str, *, readonly: bool = False, create: bool = False, block_size: int = 64, shared: bool = False
    ):
        self.path = os.path.abspath(expand_path(path, what="path"))
        check_readable(self.path)
        if not create and not os.path.isdir(os.path.join(self.path, "index")):
            store_guard.check_no_pending_repair(self.path)  # a repair stopped mid-swap
            raise InvalidArgumentError(f"no store at {self.path}")
        if create and not check_location(self.path):  # a file, other files, unwritable: refused
            create_root(self.path, shared=shared)
        if not readonly:
            require_writable(self.path, hint=WRITE_HINT)
        self.index = Index(
            os.path.join(self.path, "index"), readonly=readonly, block_size=block_size, migrate=create
        )
        version = self.index.version()
        if version != SCHEMA_VERSION:
            self.index.close()
            if version > SCHEMA_VERSION:
                raise StoreVersionError(f"store {self.path} has schema v{version}, newer than v{SCHEMA_VERSION}")
            raise StoreVersionError(
                f"store {self.path} has schema v{version}; this library uses v{SCHEMA_VERSION}",
                hint=f"run `ppc migrate --store {path}`",
            )
        self.files = SegmentFiles(self.path, readonly=readonly)

    def close(self) -> None:
        """Release the index."""
        self.index.close()

    def __enter__(self) -> "StoreAdmin":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------

    def models(self, reader: Reader) -> dict[bytes, dict]:
        """Root key -> description (fingerprint, namespace, layout) of every model."""
        out = {}
        for root, raw in reader.models().items():
            try:
                out[root] = json.loads(raw)
            except ValueError:
                out[root] = {"fingerprint": "?", "namespace": "?", "layout": "?"}
        return out

    def walk(self, reader: Reader, root: bytes) -> Iterator[Node]:
        """Every node under one model's root, parents before children."""
        stack = list(reader.children(root))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reader.children(node.key))

    def summary(self, *, longest: int = 0) -> dict:
        """Totals, counters, per-model figures and (optionally) the longest prefixes."""
        with self.index.reader() as reader:
            size, count = reader.totals()
            models = []
            prefixes = []
            for root, desc in self.models(reader).items():
                nodes = list(self.walk(reader, root))
                models.append(
                    {
                        "root": root.hex(),
                        "fingerprint": desc.get("fingerprint"),
                        "name": desc.get("name"),  # the folder or hub id it was stored from, if known
                        "namespace": desc.get("namespace"),
                        "layout": desc.get("layout"),
                        "blocks": len(nodes),
                        "bytes": sum(n.size for n in nodes),
                        # Fetches that restored each block, summed (not queries: see counters).
                        "block_hits": sum(reader.hits(n.key) for n in nodes),
                        # When any of its blocks was last stored or restored (ns since the epoch).
                        "last_used": max((n.last_access for n in nodes), default=0),
                    }
                )
                if longest:
                    for n in nodes:
                        if n.child_count == 0:
                            prefixes.append(
                                {
                                    "model": root.hex()[:12],
                                    "tokens": n.end,
                                    "resumable": n.resumable,
                                    "block_hits": reader.hits(n.key),
                                    "last_access": n.last_access,
                                    "leaf": n.key.hex(),
                                }
                            )
            counters = reader.counters()
            file_bytes = reader.file_bytes()
        prefixes.sort(key=lambda p: (-p["tokens"], p["leaf"]))
        out = {
            "store": self.path,
            "schema_version": self.index.version(),
            "block_size": self.index.block_size,
            "blocks": count,
            "bytes_on_disk": file_bytes,
            "block_bytes": size,
            **counters,
            "hit_rate": _rate(counters.get("hits", 0), counters.get("misses", 0)),  # all processes
            "models": models,
        }
        if longest:
            out["longest_prefixes"] = prefixes[:longest]
        return out

    # -- verification -------------------------------------------------------------------

    def check(self, *, fix: bool = False, grace: float = 60.0) -> CheckReport:
        """Verify every stored block and the index's invariants; with `fix`, repair.

        Checks: each node's parent exists (or is a model root), its position follows
        the parent, its key follows from parent and tokens, its segment is referenced
        and holds it with the recorded checksum; child counts, trie edges, LRU entries
        and segment counts agree with the nodes; the recorded totals equal the nodes'
        sum; no segment file is unreferenced and no temporary file is left by a dead
        writer.

        Args:
            fix: Drop broken nodes (and everything below them), rebuild counts, edges,
                LRU entries and totals, and remove leftover files.
            grace: Leave unreferenced segment files younger than this (seconds): a
                writer in another process may be about to commit them.

        Returns:
            A `CheckReport`.
        """
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgumentError(f"grace must be a number of seconds >= 0, got {grace!r}")
        report = CheckReport()
        with self.index.reader() as reader:
            nodes = {n.key: n for n in reader.iter_nodes()}
            roots = set(reader.models())
            edges = reader.edges()
            lru = reader.lru_entries()
            totals = reader.totals()
            segments = reader.segments()
            file_bytes = reader.file_bytes()
        report.nodes = len(nodes)
        broken, verified_in = set(), set()
        for key, node in nodes.items():
            problem = self._node_problem(node, nodes, roots)
            if problem is None and node.segment not in segments:
                problem = "segment not referenced"
            if problem is None:
                problem = self.files.verify(node)
                report.files_verified += problem is None
                if problem is None:
                    verified_in.add(node.segment)
            if problem:
                where = os.path.relpath(self.files.path_of(node.segment), self.path)
                report.problems.append((problem, f"block {key.hex()} in {where}"))
                broken.add(key)
        report.segments_verified = len(verified_in)
        # Everything below a broken node goes with it.
        doomed = self._descendants(broken, nodes)
        alive = {k: n for k, n in nodes.items() if k not in doomed}
        child_counts: dict[bytes, int] = {}
        for n in nodes.values():
            child_counts[n.parent] = child_counts.get(n.parent, 0) + 1
        for key, n in nodes.items():
            if n.child_count != child_counts.get(key, 0):
                report.problems.append(("child count", f"{key.hex()}: {n.child_count} != {child_counts.get(key, 0)}"))
        want_edges = {(n.parent, k) for k, n in nodes.items()}
        for p, c in edges ^ want_edges:
            report.problems.append(("trie edge", f"{p.hex()} -> {c.hex()}"))
        want_lru = {(n.last_access, k) for k, n in nodes.items()}
        for _, k in lru ^ want_lru:
            report.problems.append(("lru entry", k.hex()))
        if totals != (sum(n.size for n in nodes.values()), len(nodes)):
            report.problems.append(("totals", f"recorded {totals}"))
        live: dict[bytes, tuple[int, int]] = {}
        for n in nodes.values():
            blocks, nbytes = live.get(n.segment, (0, 0))
            live[n.segment] = (blocks + 1, nbytes + n.size)
        for seg, (blocks, nbytes, size) in segments.items():
            if live.get(seg, (0, 0)) != (blocks, nbytes):
                report.problems.append(("segment count", f"{seg.hex()}: {blocks} blocks recorded"))
            path = self.files.path_of(seg)
            damaged = any(n.segment == seg for k, n in nodes.items() if k in broken)
            if not damaged and _regular_size(path) not in (None, size):
                report.problems.append(("segment size", f"{seg.hex()}: {size} recorded"))
        if file_bytes != sum(size for _, _, size in segments.values()):
            report.problems.append(("totals", f"recorded {file_bytes} segment bytes"))
        for rel in self.files.orphans(segments.__contains__, grace=grace, every=True):
            report.problems.append(("unreferenced file", rel))
        for name in self.files.stale_tmp():
            report.problems.append(("leftover temporary file", name))
        if fix and report.problems:
            report.removed_nodes, freed = self._repair(alive, doomed)
            kept = {n.segment for n in alive.values()}
            report.removed_files = len(freed) + self.files.sweep_orphans(kept.__contains__, grace=grace, every=True)
            report.removed_files += self.files.sweep_tmp()
            report.fixed = True
        return report

    @staticmethod
    def _node_problem(node: Node, nodes: dict, roots: set) -> str | None:
        if node.parent in roots:
            if node.position != 0:
                return "position after a root"
        elif node.parent not in nodes:
            return "missing parent"
        elif nodes[node.parent].end != node.position:
            return "position does not follow parent"
        if block_key(node.parent, node.tokens) != node.key:
            return "key does not match tokens"
        return None

    @staticmethod
    def _descendants(keys: set[bytes], nodes: dict[bytes, Node]) -> set[bytes]:
        children: dict[bytes, list[bytes]] = {}
        for k, n in nodes.items():
            children.setdefault(n.parent, []).append(k)
        out, stack = set(), list(keys)
        while stack:
            k = stack.pop()
            if k not in out:
                out.add(k)
                stack.extend(children.get(k, ()))
        return out

    def _repair(self, alive: dict[bytes, Node], doomed: set[bytes]) -> tuple[int, list[bytes]]:
        """Rewrite the index from the surviving nodes, then unlink segments none uses.

        Returns:
            (nodes removed, segments unlinked).
        """

        def rewrite(w: Writer):
            w.rebuild(alive, doomed)
            return w.freed

        freed = self.index.write(rewrite)
        self.files.unlink(freed)
        return len(doomed), freed

    # -- eviction -------------------------------------------------------------------------

    def gc(self, max_bytes: int | None = None, *, model: str | None = None, unused_for: float | None = None) -> list[Node]:
        """Remove blocks: every block of one model, then those unused for a while, then
        least recently used leaves until the blocks total `max_bytes` (each if given).

        Args:
            max_bytes: The budget of the blocks' bytes.
            model: A model (see `find_model`) whose blocks all go.
            unused_for: Seconds: blocks not stored or restored for this long go.

        Returns:
            The removed nodes.

        Raises:
            InvalidArgumentError: If `model` matches no stored model, or several.
        """
        with self.index.reader() as reader:
            root = None if model is None else self.find_model(reader, model)

        def work(w: Writer):
            removed = w.forget_model(root) if root is not None else []
            if unused_for is not None:
                removed += w.evict_unused(time.time_ns() - int(unused_for * 1e9))
            if max_bytes is not None:
                removed += w.evict(max_bytes)
            return removed, w.freed

        removed, freed = self.index.write(work)
        self.files.unlink(freed)
        compact_sparse(self.index, self.files, (n.segment for n in removed))
        return removed

    def find_model(self, reader: Reader, spec: str) -> bytes:
        """The root key of the one stored model `spec` names: its folder or hub id (as
        recorded with its blocks), or a prefix of its root key or fingerprint.

        Raises:
            InvalidArgumentError: If `spec` matches no model, or several.
        """
        local = expand_path(spec, what="--model")
        folder = os.path.realpath(local) if os.path.isdir(local) else None
        chosen = [
            root
            for root, d in self.models(reader).items()
            if spec in (d.get("name"), root.hex()[: len(spec)], str(d.get("fingerprint", ""))[: len(spec)])
            or (folder is not None and d.get("name") and os.path.realpath(str(d["name"])) == folder)
        ]
        if len(chosen) != 1:
            raise InvalidArgumentError(
                f"--model {spec!r} matches {len(chosen)} models in {self.path}",
                hint="name a model by its folder, hub id, or a prefix of its hash (see `ppc inspect`)",
            )
        return chosen[0]

    # -- packing ----------------------------------------------------------------------------

    def export_pack(self, out_path: str, *, model: str | None = None) -> dict:
        """Write the store (or the part for one model) into one tar file.

        The tar holds a manifest, the node records and the segment files they use.

        Args:
            out_path: The file to write (replaced atomically).
            model: A model's folder or hub id, or a prefix of its root key or
                fingerprint (see ``ppc inspect``); None exports every model.

        Returns:
            Counts of models, blocks and bytes exported.

        Raises:
            InvalidArgumentError: If `model` matches no model, or several.
        """
        with self.index.reader() as reader:
            models = self.models(reader)
            if model is not None:
                chosen = self.find_model(reader, model)
                models = {chosen: models[chosen]}
            nodes = [n for root in models for n in self.walk(reader, root)]
        nodes.sort(key=lambda n: n.position)  # parents before children
        out_path = expand_path(out_path, what="out_path")

        def write(raw) -> None:
            with tarfile.open(fileobj=raw, mode="w") as tar:
                manifest = {
                    "format": EXPORT_FORMAT,
                    "block_size": self.index.block_size,
                    "models": {r.hex(): d for r, d in models.items()},
                    "blocks": len(nodes),
                }
                add_bytes(tar, "manifest.json", json.dumps(manifest, indent=1).encode())
                records = b"".join(RECORD_HEAD.pack(n.key, len(n.pack())) + n.pack() for n in nodes)
                add_bytes(tar, "nodes.bin", records)
                for seg in dict.fromkeys(n.segment for n in nodes):
                    # A regular file only: a link or a FIFO put there is refused, not followed.
                    with os.fdopen(open_regular(self.files.path_of(seg)), "rb") as f:
                        tar.addfile(tar.gettarinfo(arcname=f"segments/{seg.hex()}.seg", fileobj=f), f)

        # Beside OUT under a name nobody can predict, created exclusively (its folder may
        # be shared), with the store's file mode: a pack holds the prompts too.
        replace_beside(out_path, write, mode=file_mode(self.path)[0], sync=durable_fsync)
        return {"models": len(models), "blocks": len(nodes), "bytes": sum(n.size for n in nodes)}

    def import_pack(self, in_path: str) -> dict:
        """Load a file written by `export_pack` (this version or an older one) into
        this store.

        Every block is verified against its record before it is added; blocks already
        stored are skipped. Segment files are written (and fsynced) before the index
        records that name them, as for any store write.

        Returns:
            Counts of blocks added and skipped, and bytes added.

        Raises:
            InvalidArgumentError: If the file is not an export, a damaged one, or was
                made with another block size.
        """
        try:
            in_path = expand_path(in_path, what="in_path")
            tar = tarfile.open(in_path, "r")
        except (tarfile.TarError, OSError) as exc:
            raise InvalidArgumentError(f"{in_path} is not a ppc export: {exc}") from None
        with tar:
            manifest = read_json(tar, "manifest.json", in_path)
            if manifest.get("format") not in (EXPORT_FORMAT, V4_EXPORT_FORMAT, V3_EXPORT_FORMAT, LEGACY_EXPORT_FORMAT):
                raise InvalidArgumentError(f"{in_path}: unknown export format {manifest.get('format')!r}")
            if manifest["block_size"] != self.index.block_size:
                raise InvalidArgumentError(
                    f"{in_path} has block_size {manifest['block_size']}, the store {self.index.block_size}",
                    hint="import into a new store directory",
                )
            nodes = list(unpack_records(read_member(tar, "nodes.bin", in_path), in_path))
            with self.index.reader() as reader:
                present = {n.key for n in nodes if reader.get(n.key) is not None}
                known = set(reader.segments())
            todo = [n for n in nodes if n.key not in present]
            written: dict[bytes, tuple[int, int]] = {}  # segment -> (file size, digest) written here
            try:
                if manifest["format"] == LEGACY_EXPORT_FORMAT:
                    self._import_legacy(tar, in_path, todo, written, _models_of(self.index, nodes, manifest, in_path))
                elif manifest["format"] in (V3_EXPORT_FORMAT, V4_EXPORT_FORMAT):
                    older = segment_v3 if manifest["format"] == V3_EXPORT_FORMAT else segment_v4
                    self._import_older(tar, in_path, todo, written, _models_of(self.index, nodes, manifest, in_path), older)
                else:
                    self._import_segments(tar, in_path, todo, known, written)
            except BaseException:
                self.files.unlink(list(written))
                raise
            now = time.time_ns()
            for n in todo:
                n.child_count, n.last_access = 0, now

            def commit(w: Writer):
                for root_hex, desc in manifest["models"].items():
                    w.register_model(bytes.fromhex(root_hex), json.dumps(desc).encode())
                for seg, (size, digest) in written.items():
                    w.add_segment(seg, size, digest)
                inserted = sum(w.insert(n) for n in todo)
                for seg in written:
                    held = w.segment(seg)
                    if held is not None and held[0] == 0:
                        w.free_segment(seg)
                return inserted, w.freed

            inserted, freed = self.index.write(commit)
            self.files.unlink(freed)
        return {"added": inserted, "skipped": len(nodes) - len(todo), "bytes": sum(n.size for n in todo)}

    def _import_segments(self, tar, in_path: str, todo: list[Node], known: set, written: dict) -> None:
        for seg in dict.fromkeys(n.segment for n in todo):
            if seg in known:
                continue  # imported before: the file is there
            data = read_member(tar, f"segments/{seg.hex()}.seg", in_path)
            tmp = TempFile(self.path, "tmp", seg.hex())  # exclusive, a random name: see files.temp_name
            try:
                with os.fdopen(tmp.fd, "wb", closefd=False) as f:
                    f.write(data)
                    f.flush()
                    durable_fsync(f.fileno())
                self.files.publish(tmp, seg)
            finally:
                tmp.discard()
            digest = self.files.digest_of(seg)
            written[seg] = (len(data), digest)
            if digest is None:
                raise InvalidArgumentError(f"{in_path}: segment {seg.hex()} is damaged")
        for n in todo:
            if self.files.verify(n) is not None:
                raise InvalidArgumentError(f"{in_path}: block {n.key.hex()} is damaged")

    def _import_legacy(self, tar, in_path: str, todo: list[Node], written: dict, models: dict) -> None:
        # An export of schema v1-v2: one block file each, rewritten as one segment each.
        for n in todo:
            data = read_member(tar, f"blocks/{block_files_v2.file_name(n)}", in_path)
            try:
                tensors = block_files_v2.decode_block(data, n)
            except ValueError:
                raise InvalidArgumentError(f"{in_path}: block {n.key.hex()} is damaged") from None
            seg, size, digest = self._rewrite([(n, tensors)], models, in_path)
            written[seg] = (size, digest)

    def _import_older(self, tar, in_path: str, todo: list[Node], written: dict, models: dict, older) -> None:
        # An export of segment format v3 or v4: each segment read (the frozen reader
        # `older`, whose rule verifies each block) and its blocks rewritten, run by run
        # of one chain.
        for old in dict.fromkeys(n.segment for n in todo):
            data = read_member(tar, f"segments/{old.hex()}.seg", in_path)
            tmp = TempFile(self.path, "tmp", old.hex(), flags=os.O_RDWR)  # read back through its descriptor
            fd = tmp.fd
            try:
                pwritev_all(fd, [data], 0)
                try:
                    seg = older.OpenSegment(fd, old)
                except ValueError:
                    raise InvalidArgumentError(f"{in_path}: segment {old.hex()} is damaged") from None
                runs: list[list] = []
                for n in sorted((n for n in todo if n.segment == old), key=lambda n: n.position):
                    tensors = seg.block_tensors(n)
                    if tensors is None:
                        raise InvalidArgumentError(f"{in_path}: block {n.key.hex()} is damaged")
                    if not runs or runs[-1][-1][0].key != n.parent:
                        runs.append([])
                    runs[-1].append((n, tensors))
            finally:
                tmp.discard()
            for run in runs:
                seg_id, size, digest = self._rewrite(run, models, in_path)
                written[seg_id] = (size, digest)

    def _rewrite(self, run: list, models: dict, in_path: str) -> tuple[bytes, int, int]:
        # Blocks of an older format into a new segment, once their own format's rule has
        # verified them: the checksums are new (v5 binds them to the records).
        try:
            return self.files.write(run, **models[run[0][0].key], block_size=self.index.block_size)
        except ValueError as exc:
            raise InvalidArgumentError(f"{in_path}: damaged blocks: {exc}") from None


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


def _regular_size(path: str) -> int | None:
    """The size of a regular file (None: missing, or not a regular file)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None

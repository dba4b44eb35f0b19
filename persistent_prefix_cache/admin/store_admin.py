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
import time
from typing import Any, BinaryIO, Iterable, Iterator

from ..blocks import Node
from ..disk import store_guard
from ..disk.commit import commit
from ..disk.compaction import compact_sparse
from ..disk.index import Index, Reader, Writer
from ..disk.schema import check_schema
from ..disk.segment import SegmentFiles
from ..disk.store_dir import check_location, check_readable, create_root, require_writable
from ..errors import EmptiesStoreError, InvalidArgumentError
from ..keys import key_follows
from ..paths import expand_path
from . import packs
from .check_report import CheckReport
from .pack_members import PackReader

WRITE_HINT = (
    "this writes the store: run it as the store's owner, make the store writable (its permissions, a "
    "read-write mount), or copy it to a directory you can write; stats, inspect, export and check "
    "without --fix only read it"
)


# What `summary` adds up over the models about SSD wear: the bytes fetches restored from
# the blocks held, and the blocks (and bytes) held that no fetch restored.
WEAR_KEYS = ("bytes_restored", "never_restored_blocks", "never_restored_bytes")


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
        self.index = Index(os.path.join(self.path, "index"), readonly=readonly, block_size=block_size, migrate=create)
        try:
            check_schema(self.path, self.index.version(), shown=path)
        except BaseException:
            self.index.close()
            raise
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

    def by_namespace(self, reader: Reader, roots: Iterable[bytes]) -> dict[bytes, list[Node]]:
        """Every node under each root, a tenant's blocks after a shared prefix counted as
        its own (they hang under the shared root's blocks but name their tenant's root:
        `keys.TenantRoot`), not the shared namespace's."""
        out: dict[bytes, list[Node]] = {root: [] for root in roots}
        linked: list[Node] = []
        for root in out:
            stack = list(reader.children(root))
            while stack:
                node = stack.pop()
                if node.link is not None and node.link != root:
                    linked.append(node)  # the first block of a tenant's own chain: counted below
                    continue
                out[root].append(node)
                stack.extend(reader.children(node.key))
        for node in linked:
            if node.link in out:
                out[node.link] += [node, *self.walk(reader, node.key)]
        return out

    def linked_to(self, reader: Reader, target: bytes, roots: Iterable[bytes]) -> dict[bytes, list[Node]]:
        """By shared root, the blocks of `target`'s chains that hang under it
        (`keys.TenantRoot`): the shared prefix blocks they continue, then each first block
        naming `target` with everything under it; parents before children, once each.
        Roots with none are left out."""
        out: dict[bytes, list[Node]] = {}
        for root in roots:
            kept: dict[bytes, Node] = {}
            stack: list[tuple[Node, tuple[Node, ...]]] = [(n, ()) for n in reader.children(root)]
            while stack:
                node, above = stack.pop()
                if node.link is None:
                    stack.extend((child, (*above, node)) for child in reader.children(node.key))
                elif node.link == target:
                    for n in (*above, node, *self.walk(reader, node.key)):
                        kept.setdefault(n.key, n)
            if kept:
                out[root] = list(kept.values())
        return out

    def summary(self, *, longest: int = 0) -> dict:
        """Totals, counters, per-model figures and (optionally) the longest prefixes."""
        with self.index.reader() as reader:
            size, count = reader.totals()
            models: list[dict[str, Any]] = []
            prefixes: list[dict[str, Any]] = []
            described = self.models(reader)
            owned = self.by_namespace(reader, described)
            for root, desc in described.items():
                nodes = owned[root]
                hits = [reader.hits(n.key) for n in nodes]
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
                        "block_hits": sum(hits),
                        # SSD wear (docs/wear.md): the bytes those fetches restored, and the
                        # blocks held that no fetch ever restored (written for nothing so far).
                        "bytes_restored": sum(h * n.size for h, n in zip(hits, nodes)),
                        "never_restored_blocks": hits.count(0),
                        "never_restored_bytes": sum(n.size for h, n in zip(hits, nodes) if not h),
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
            # Segment bytes written per block byte restored, all processes (None before a restore).
            "write_amplification": counters["written_bytes"] / counters["restored_bytes"]
            if counters["restored_bytes"]
            else None,
            # SSD wear over every model (docs/wear.md).
            **{key: sum(int(m[key]) for m in models) for key in WEAR_KEYS},
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
        and segment counts agree with the nodes; each segment file has its recorded
        size; the recorded totals equal the nodes' sum; no segment file is unreferenced
        and no temporary file is left by a dead writer.

        Args:
            fix: Drop broken nodes (and everything below them), rebuild counts, edges,
                LRU entries and totals, record the size of segment files whose blocks
                all verify, and remove leftover files; then look again (without
                reading the blocks a second time): what is still found is `remaining`.
            grace: Leave unreferenced segment files younger than this (seconds): a
                writer in another process may be about to commit them.

        Returns:
            A `CheckReport`.
        """
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgumentError(f"grace must be a number of seconds >= 0, got {grace!r}")
        report = CheckReport()
        alive, doomed, sizes = self._examine(report, grace=grace, verify=True)
        if fix and report.problems:
            report.removed_nodes, freed = self._repair(alive, doomed, sizes)
            kept = {n.segment for n in alive.values()}
            report.removed_files = len(freed) + self.files.sweep_orphans(kept.__contains__, grace=grace)
            report.removed_files += self.files.sweep_tmp()
            report.fixed = True
            report.notes += [f"recorded the size of segment {seg.hex()}: {size} bytes" for seg, size in sizes.items()]
            again = CheckReport()
            self._examine(again, grace=grace, verify=False)
            report.remaining = again.problems
        return report

    def _examine(self, report: CheckReport, *, grace: float, verify: bool) -> tuple[dict, set, dict]:
        """Add what `check` finds to `report`; `verify`: read and verify every block
        (else only the index's invariants and the files' presence and sizes).

        Returns:
            (the nodes that stay, the keys that go, segment -> its file's size where
            the index records another and every block in it verified).
        """
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
            if problem is None and verify:
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
        sizes: dict[bytes, int] = {}
        for seg, (blocks, nbytes, size) in segments.items():
            if live.get(seg, (0, 0)) != (blocks, nbytes):
                report.problems.append(("segment count", f"{seg.hex()}: {blocks} blocks recorded"))
            path = self.files.path_of(seg)
            damaged = any(n.segment == seg for k, n in nodes.items() if k in broken)
            actual = _regular_size(path) if not damaged else None
            if actual not in (None, size):
                report.problems.append(("segment size", f"{seg.hex()}: {size} recorded, the file has {actual}"))
                sizes[seg] = actual  # its blocks verify: the file is right, the record is not
        if file_bytes != sum(size for _, _, size in segments.values()):
            report.problems.append(("totals", f"recorded {file_bytes} segment bytes"))
        for rel in self.files.orphans(segments.__contains__, grace=grace, every=True):
            report.problems.append(("unreferenced file", rel))
        for name in self.files.stale_tmp():
            report.problems.append(("leftover temporary file", name))
        return alive, doomed, sizes

    @staticmethod
    def _node_problem(node: Node, nodes: dict, roots: set) -> str | None:
        if node.parent in roots:
            if node.position != 0:
                return "position after a root"
        elif node.parent not in nodes:
            return "missing parent"
        elif nodes[node.parent].end != node.position:
            return "position does not follow parent"
        if not key_follows(node):
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

    def _repair(self, alive: dict[bytes, Node], doomed: set[bytes], sizes: dict[bytes, int]) -> tuple[int, list[bytes]]:
        """Rewrite the index from the surviving nodes (with the segment file sizes
        `sizes` corrects), then unlink segments none uses.

        Returns:
            (nodes removed, segments unlinked).
        """

        def rewrite(w: Writer) -> list[bytes]:
            w.rebuild(alive, doomed, sizes=sizes)
            return w.freed

        freed = commit(self.index, self.files, rewrite)
        return len(doomed), freed

    # -- eviction -------------------------------------------------------------------------

    def gc(
        self,
        max_bytes: int | None = None,
        *,
        model: str | None = None,
        unused_for: float | None = None,
        empty_ok: bool = True,
    ) -> list[Node]:
        """Remove blocks: every block of one model, then those unused for a while, then
        least recently used leaves until the blocks total `max_bytes` (each if given).

        Args:
            max_bytes: The budget of the blocks' bytes (0: every block goes).
            model: A model (see `find_model`) whose blocks all go.
            unused_for: Seconds: blocks not stored or restored for this long go.
            empty_ok: False: if the rest would remove every block of a store that holds
                some, remove nothing and raise `EmptiesStoreError` (``ppc gc`` asks first).

        Returns:
            The removed nodes.

        Raises:
            InvalidArgumentError: If `model` matches no stored model, or several.
            EmptiesStoreError: If not `empty_ok` and every block would go (the
                transaction is abandoned: nothing was removed).
        """
        with self.index.reader() as reader:
            root = None if model is None else self.find_model(reader, model)

        def work(w: Writer):
            held, held_blocks = w.totals()
            removed = w.forget_model(root) if root is not None else []
            if unused_for is not None:
                removed += w.evict_unused(time.time_ns() - int(unused_for * 1e9))
            if max_bytes is not None:
                removed += w.evict(max_bytes)
            if not empty_ok and held_blocks and w.totals()[1] == 0:
                # Raised inside the write transaction, which is then aborted.
                raise EmptiesStoreError(
                    f"this would remove every block of store {self.path} ({held_blocks:,} blocks, {held:,} bytes)",
                    blocks=held_blocks, block_bytes=held,
                )  # fmt: skip
            return removed

        removed = commit(self.index, self.files, work)
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

    def export_pack(
        self, out_path: str, *, model: str | None = None, secret: bytes | None = None, stream: BinaryIO | None = None
    ) -> dict:
        """Write the store (or the part for one model) into one tar file (`packs.export_pack`),
        signed by the store's key and by `secret` if given.

        Args:
            out_path: The file to write (replaced atomically).
            model: A model's folder or hub id, or a prefix of its root key or
                fingerprint (see ``ppc inspect``); None exports every model.
            secret: A secret to sign it with too (another store verifies it with the same secret).
            stream: Write it to this binary stream instead (``ppc export -``: stdout).

        Returns:
            Counts of models, blocks and bytes exported, and the keys that signed it.

        Raises:
            InvalidArgumentError: If `model` matches no model, or several.
        """
        with self.index.reader() as reader:
            models = self.models(reader)
            if model is not None:
                chosen = self.find_model(reader, model)
                nodes = list(self.walk(reader, chosen))
                # A tenant's prompts after a shared prefix hang under the shared root: their
                # chains go too, with the prefix blocks they continue and that root's record.
                shared = self.linked_to(reader, chosen, [r for r in models if r != chosen])
                nodes += [n for path in shared.values() for n in path]
                models = {root: models[root] for root in (chosen, *shared)}
            else:
                nodes = [n for root in models for n in self.walk(reader, root)]
        return packs.export_pack(
            self.files, self.index, nodes, models, out_path, root=self.path, secret=secret, stream=stream
        )

    def import_pack(
        self,
        in_path: str,
        *,
        secret: bytes | None = None,
        trust: bool = False,
        check: packs.Check | None = None,
        reader: PackReader | None = None,
    ) -> dict:
        """Load a file written by `export_pack` (this version or an older one) into this
        store: see `packs.import_pack` (a pack this store or `secret` did not sign needs
        `check` or `trust`; `reader`: the pack already opened, e.g. on stdin).

        Returns:
            Counts of blocks added and skipped, bytes added, and how the pack was verified.

        Raises:
            InvalidArgumentError: If the file is not an export, a damaged or altered one,
                was made with another block size, or `check` refuses it.
            UnverifiedPackError: If nothing verifies it.
        """
        return packs.import_pack(
            self.files, self.index, in_path, secret=secret, trust=trust, check=check, reader=reader
        )


def _regular_size(path: str) -> int | None:
    """The size of a regular file (None: missing, or not a regular file)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _rate(hits: int, misses: int) -> float | None:
    return round(hits / (hits + misses), 4) if hits + misses else None

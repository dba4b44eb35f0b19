"""`PersistentPrefixCache`: the store facade (`fetch`, `store`, `flush`, `close`, `stats`).

A `store()` call: validate, compute the chain of block keys, find the first block not
yet stored, cut the new blocks out of each layer (evaluated on the caller's thread, as
MLX wants), put them in the RAM tier, and hand them to the writer thread, which writes
the files and then commits their index records (see `files.py` for the order).

A `fetch()` call: walk the chain of full blocks through the RAM tier and the index,
verifying each node's parent and tokens; step into the child that shares the longest
prefix with what is left; back off to the longest point where every layer can be
rebuilt; load the blocks (RAM tier, else verified files) and build fresh caches.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Sequence

import lmdb
import mlx.core as mx
import numpy as np

from . import codec
from .adapters import (
    STATE,
    BlockSource,
    BlockView,
    Tensors,
    ViewPath,
    adapter_for,
    cache_length,
    leaves,
    rebuild_cache,
    signature_of,
    template_cache,
)
from .assemble import JoinedSource, read_path
from .errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    ReadOnlyStoreError,
    UnsupportedCacheError,
)
from .faults import pause_point
from .files import BlockFiles
from .fingerprint import cached_fingerprint
from .index import Index, Reader, Writer
from .keys import as_token_array, block_key, chain_keys, common_prefix, root_key
from .memory import MemoryTier
from .node import RESUMABLE, TRIMMABLE, Node
from .worker import Worker

log = logging.getLogger("persistent_prefix_cache")

DEFAULT_BLOCK_SIZE = 64
DEFAULT_MEMORY_BYTES = 512 * 1024 * 1024
BLOCK_FORMAT = "ppc-block/1"
ORPHAN_GRACE_SECONDS = 600.0

_OPEN_STORES: "weakref.WeakSet[PersistentPrefixCache]" = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    # Pending writes are durable work the caller already paid for: finish them.
    for store in list(_OPEN_STORES):
        store.close()


class PersistentPrefixCache:
    """A prefix (KV) cache for one mlx-lm model, kept in a store directory.

    Args:
        path: The store directory (created if missing, unless `readonly`).
        model: The loaded mlx-lm model (used for its cache layout and fingerprint).
        fingerprint: Use this string as the model fingerprint instead of hashing the
            weights. Two models given the same string share blocks: only pass one you
            derive from the weights yourself.
        model_path: The folder `model` was loaded from; the fingerprint is then
            remembered in the store under the files' (path, size, mtime, inode).
        namespace: Keeps tenants apart: different namespaces never share a block.
        block_size: Tokens per block for a new store (64 if None); an existing store
            keeps its own, and a different explicit value is an error.
        memory_bytes: Budget of the RAM tier (0 disables it).
        disk_bytes: Budget of the block files; least recently used leaves are
            evicted past it. None means unbounded.
        readonly: Serve hits only; `store()` warns once and writes nothing.
        kv_bits: Quantize KV like mlx-lm's ``kv_bits`` (the store then holds and
            returns ``QuantizedKVCache`` layers).
        kv_group_size: Group size for `kv_bits`.
        sync_writes: Make `store()` return only once its blocks are on disk.

    Raises:
        InvalidArgumentError: On bad arguments.
        StoreVersionError: If a newer version of this library wrote the store.
        StoreCorruptError: If the index cannot be read safely.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: Any,
        *,
        fingerprint: str | None = None,
        model_path: str | os.PathLike | None = None,
        namespace: str = "",
        block_size: int | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        disk_bytes: int | None = None,
        readonly: bool = False,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        sync_writes: bool = False,
    ):
        _check_int("block_size", block_size, minimum=1, optional=True)
        _check_int("memory_bytes", memory_bytes, minimum=0)
        _check_int("disk_bytes", disk_bytes, minimum=0, optional=True)
        if not isinstance(namespace, str):
            raise InvalidArgumentError(f"namespace must be a str, got {type(namespace).__name__}")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise InvalidArgumentError("fingerprint must be a non-empty str")
        if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
            raise InvalidArgumentError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8 (or None), got {kv_bits!r}")
        if kv_group_size not in (32, 64, 128):
            raise InvalidArgumentError(f"kv_group_size must be 32, 64 or 128, got {kv_group_size!r}")
        if model_path is not None and not os.path.isdir(model_path):
            raise InvalidArgumentError(f"model_path {model_path!r} is not a folder")
        self.path = os.path.abspath(os.fspath(path))
        self.readonly = readonly
        self.disk_bytes = disk_bytes
        self.sync_writes = sync_writes
        if readonly and not os.path.isdir(os.path.join(self.path, "index")):
            raise InvalidArgumentError(f"no store at {self.path} to open read-only")
        if not readonly and _existing_but_not_writable(self.path):
            # Serve what is there (a store shipped on a read-only volume, say).
            warnings.warn(str(ReadOnlyStoreError(f"store {self.path} is not writable: serving hits only")))
            readonly = self.readonly = True
            self._warned_readonly = True
        self._pid = os.getpid()

        self.template = template_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
        try:
            self.layout = signature_of(self.template)
            # (leaf id, empty template layer, adapter) for every leaf of the layout.
            self.leaves = [(lid, t, adapter_for(t, lid)) for lid, t in leaves(self.template)]
            self._kinds = {lid: adapter.kind for lid, _, adapter in self.leaves}
            self._unsupported = None
        except UnsupportedCacheError as exc:
            # Open anyway (fetch misses), so that a server can run uncached; store() raises.
            self.layout = "unsupported:" + "|".join(type(c).__name__ for c in self.template)
            self.leaves = []
            self._unsupported = exc
        if not readonly:
            os.makedirs(self.path, exist_ok=True)
        self.files = BlockFiles(self.path, readonly=readonly)
        self.index = Index(
            os.path.join(self.path, "index"),
            readonly=readonly,
            block_size=block_size or DEFAULT_BLOCK_SIZE,
        )
        self._closed = False
        try:
            if block_size is not None and block_size != self.index.block_size:
                raise InvalidArgumentError(
                    f"store {self.path} uses block_size={self.index.block_size}, "
                    f"not {block_size}",
                    hint="omit block_size, or use another store directory",
                )
            self.block_size = self.index.block_size
            self.namespace = namespace
            self.fingerprint = fingerprint or cached_fingerprint(
                model,
                None if model_path is None else os.fspath(model_path),
                self._remembered_fingerprint,
                self._remember_fingerprint,
            )
            self.root = root_key(self.fingerprint, namespace, self.layout)
            self._description = json.dumps(
                {"fingerprint": self.fingerprint, "namespace": namespace, "layout": self.layout}
            ).encode()
        except BaseException:
            self.index.close()
            raise

        self.memory = MemoryTier(memory_bytes)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            ("queries", "hits", "misses", "tokens_saved", "corrupt", "evictions", "write_errors"),
            0,
        )
        self._book = _Bookkeeping()
        self._futures: set[Future] = set()
        self._warned_readonly = getattr(self, "_warned_readonly", False)
        self._executor = None
        if not readonly:
            self._executor = Worker("ppc-writer")
            self._submit(self._sweep)
        _OPEN_STORES.add(self)

    # -- public API ---------------------------------------------------------------------

    def fetch(self, tokens: Any) -> tuple[list | None, Any]:
        """Restore the longest stored prefix of `tokens`.

        Args:
            tokens: The prompt: a list of ints, or a 1-D numpy or mlx array.

        Returns:
            ``(cache, remaining)``: fresh mlx-lm cache objects covering the restored
            prefix (None on a miss) and the tokens still to be fed, of the same kind as
            `tokens`. For a non-empty query `remaining` is never empty: the model needs
            at least one token to produce logits, so a full hit is cut back by one.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        self._check_open()
        toks = as_token_array(tokens)
        with self._lock:
            self._counters["queries"] += 1
        path, matched = self._lookup(toks) if self._unsupported is None else ([], 0)
        layers = None
        while path and layers is None:
            first = self._first_needed(path, matched)
            layers, intact = self._restore(path[first:], matched)
            if layers is not None or intact == len(path) - first:
                break  # restored, or the blocks do not fit the layout (a miss)
            # A damaged block cut the path short: fall back to what comes before it.
            path, matched = self._cut(path[: first + intact], matched)
        path = list(path)
        if layers is None:
            with self._lock:
                self._counters["misses"] += 1
            self._note(misses=1)
            return None, tokens
        with self._lock:
            self._counters["hits"] += 1
            self._counters["tokens_saved"] += matched
        keys = [node.key for node in path]
        self._note(touch=keys, hit=keys, hits=1, tokens_saved=matched)
        return layers, tokens[matched:]

    def peek(self, tokens: Any) -> int:
        """How many tokens `fetch` would restore, from the index alone (nothing is loaded).

        A block file found damaged by the fetch itself can make the fetch restore fewer.

        Args:
            tokens: The prompt.

        Returns:
            The number of leading tokens of `tokens` a fetch would restore now.
        """
        self._check_open()
        if self._unsupported is not None:
            return 0
        return self._lookup(as_token_array(tokens), decode=False)[1]

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def store(self, tokens: Any, cache: Sequence[Any]) -> int:
        """Store the KV of `tokens`; blocks already stored are not written again.

        The caller's cache is not modified. Unless the store was opened with
        ``sync_writes=True``, files are written on a background thread: call
        `flush()` to wait for them.

        Args:
            tokens: The tokens `cache` was computed from.
            cache: mlx-lm cache objects covering exactly ``len(tokens)`` positions,
                with the layout the store was opened with.

        Returns:
            The number of new blocks.

        Raises:
            InvalidArgumentError: If the cache does not cover ``len(tokens)`` positions.
            LayoutMismatchError: If the cache's classes differ from the store's layout.
            UnsupportedCacheError: If a layer's class cannot be stored.
        """
        self._check_open()
        toks = as_token_array(tokens)
        if self._unsupported is not None:
            raise self._unsupported
        if not isinstance(cache, (list, tuple)):
            raise InvalidArgumentError(f"cache must be a list of cache layers, got {type(cache).__name__}")
        layout = signature_of(cache)
        if layout != self.layout:
            raise LayoutMismatchError(
                f"cache layout {layout!r} does not match the store's {self.layout!r}"
            )
        covered = cache_length(cache)
        if covered is not None and covered != len(toks):
            raise InvalidArgumentError(f"cache covers {covered} positions but {len(toks)} tokens were given")
        if self.readonly:
            if not self._warned_readonly:
                self._warned_readonly = True
                warnings.warn(str(ReadOnlyStoreError(f"store {self.path} is read-only: store() writes nothing")))
            return 0
        if len(toks) == 0:
            return 0

        keys = chain_keys(self.root, toks, self.block_size)
        data = toks.tobytes()
        step = 4 * self.block_size
        path: list[Node] = []  # the stored blocks this prompt starts with
        with self.index.reader() as reader:
            parent = self.root
            for i, key in enumerate(keys):
                node = self._node(reader, key)
                if node is None:
                    break
                if node.parent != parent or node.tokens != data[i * step : (i + 1) * step]:
                    log.warning("block key collision at block %d; not storing the rest", i)
                    return 0
                path.append(node)
                parent = key
        first_new = len(path)
        self._note(touch=keys[:first_new])
        if first_new == len(keys):
            return 0

        now = time.time_ns()
        layers_by_id = dict(leaves(cache))
        views = {lid: ViewPath(self._view(n, lid) for n in path) for lid, _, _ in self.leaves}
        new = []
        for i in range(first_new, len(keys)):
            start = i * self.block_size
            end = min(start + self.block_size, len(toks))
            tensors, noslice, snap = {}, [], []
            for lid, _, adapter in self.leaves:
                part, has_slice, has_snap = adapter.pieces(layers_by_id[lid], start, end, i == len(keys) - 1)
                tensors[lid] = part
                if not has_slice and adapter.kind != STATE:
                    noslice.append(lid)
                if has_snap:
                    snap.append(lid)
                views[lid].append(BlockView(start, end, part, has_slice, has_snap))
            node = Node(
                key=keys[i],
                parent=keys[i - 1] if i else self.root,
                position=start,
                tokens=data[4 * start : 4 * end],
                flags=self._flags(views, start, end),
                size=0,
                checksum=0,
                last_access=now,
                extra={k: v for k, v in (("noslice", noslice), ("snap", snap)) if v},
            )
            new.append((node, tensors))
        mx.eval([x for _, tensors in new for part in tensors.values() for x in part.values()])
        for node, tensors in new:
            self.memory.put(node, tensors)
        future = self._submit(self._write_blocks, new)
        if self.sync_writes:
            future.result()
        return len(new)

    def make_cache(self) -> list:
        """A fresh, empty cache of this store's layout (what `fetch` returns on a hit)."""
        return copy.deepcopy(self.template)

    def flush(self) -> None:
        """Wait until every pending write and access update is committed."""
        self._check_open()
        if self._executor is None:
            return
        self._submit(self._apply_bookkeeping)
        while True:
            with self._lock:
                pending = list(self._futures)
            if not pending:
                return
            for f in pending:
                f.result()

    def close(self) -> None:
        """Flush and release the store. Safe to call twice."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            # A copy inherited through fork(): its writer thread and LMDB environment
            # belong to the parent, and the child has already dropped the latter.
            self._closed = True
            return
        if self._executor is not None:
            self.flush()
            self._executor.stop()
        self._closed = True
        self.memory.clear()
        self.index.close()
        _OPEN_STORES.discard(self)

    def stats(self) -> dict[str, int]:
        """Counters of this handle plus the store's totals.

        Raises:
            InvalidArgumentError: If the store is closed, or was opened before a fork.

        Returns:
            queries, hits, misses, tokens_saved, corrupt, evictions, write_errors (this
            handle); blocks, bytes_on_disk (the store, all processes);
            bytes_in_memory, blocks_in_memory (the RAM tier); pending_writes;
            store_hits, store_misses, store_tokens_saved, store_corrupt (all processes
            since the store was made, as far as committed).
        """
        self._check_open()
        with self._lock:
            out = dict(self._counters)
            out["pending_writes"] = len(self._futures)
        out["bytes_on_disk"], out["blocks"] = self.index.totals()
        out["bytes_in_memory"] = self.memory.nbytes
        out["blocks_in_memory"] = len(self.memory)
        out["memory_evictions"] = self.memory.evictions
        with self.index.reader() as reader:
            out.update({f"store_{k}": v for k, v in reader.counters().items()})
        return out

    def __enter__(self) -> "PersistentPrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- lookup ---------------------------------------------------------------------

    def _node(self, reader: Reader, key: bytes) -> Node | None:
        return self.memory.node(key) or reader.get(key)

    def _children(self, reader: Reader, parent: bytes) -> list[Node]:
        found = {n.key: n for n in reader.children(parent)}
        for n in self.memory.children(parent):
            found.setdefault(n.key, n)
        return list(found.values())

    def _lookup(self, toks: np.ndarray, *, decode: bool = True) -> tuple[list[Node], int]:
        """The nodes to restore and how many tokens of them to use.

        With ``decode=False`` (`peek`) only the records the cut-back looks at are
        decoded, and the returned path is not for use.
        """
        n = len(toks)
        if n == 0:
            return [], 0
        data = toks.tobytes()
        step = 4 * self.block_size
        path = _LazyPath()
        parent, pos = self.root, 0
        with self.index.reader() as reader:
            # Full blocks: their keys follow from the tokens, no scan needed; records
            # are checked as stored bytes and decoded only when used.
            while n - pos >= self.block_size:
                block = data[4 * pos : 4 * pos + step]
                key = block_key(parent, block)
                node = self.memory.node(key)
                if node is not None:
                    if node.parent != parent or node.tokens != block or node.position != pos:
                        break
                    path.append(node)
                else:
                    raw = reader.get_raw(key)
                    if raw is None or not Node.raw_matches(raw, parent, pos, block):
                        break
                    path.append((key, raw))
                parent, pos = key, pos + self.block_size
            # Then the stored child sharing the longest prefix with what is left
            # (a partial block, or a longer block that will be trimmed).
            rest = toks[pos : pos + self.block_size]
            best = None
            for child in self._children(reader, parent):
                if child.parent != parent or child.position != pos:
                    continue
                if block_key(parent, child.tokens) != child.key:
                    continue  # a record whose key does not follow from its tokens
                shared = common_prefix(np.frombuffer(child.tokens, dtype="<i4"), rest)
                if shared == 0 or (shared < child.n_tokens and not child.trimmable):
                    continue
                rank = (-shared, child.n_tokens, child.key)  # longest, then smallest
                if best is None or rank < best[0]:
                    best = (rank, child, shared)
        matched = pos
        if best is not None:
            path.append(best[1])
            matched = pos + best[2]
        path, matched = self._cut(path, min(matched, n - 1))
        return ([path[i] for i in range(len(path))] if decode else path), matched

    @staticmethod
    def _cut(path: list[Node], matched: int) -> tuple[list[Node], int]:
        """Back off to the longest point at most `matched` where every layer can be rebuilt.

        Pops from `path` (the caller's list) in place.
        """
        while path:
            last = path[-1]
            matched = min(matched, last.end)
            if matched == last.end and last.resumable:
                return path, matched
            if matched > last.position and last.trimmable:
                return path, matched
            path.pop()
        return [], 0

    # -- loading and rebuilding ---------------------------------------------------------

    def _view(self, node: Node, lid: str, tensors: Tensors | None = None) -> BlockView:
        return BlockView(
            node.position,
            node.end,
            tensors,
            lid not in node.extra.get("noslice", ()),
            lid in node.extra.get("snap", ()),
        )

    def _flags(self, views: dict[str, list[BlockView]], start: int, end: int) -> int:
        """RESUMABLE if every leaf can be rebuilt at `end` from the path's views;
        TRIMMABLE if also at every position inside the block."""
        flags = 0
        if all(a.can_rebuild(t, views[lid], end) for lid, t, a in self.leaves):
            flags |= RESUMABLE
        inside = [p for p in (start + 1, end - 1) if start < p < end]
        if all(a.kind != STATE for _, _, a in self.leaves) and all(
            a.can_rebuild(t, views[lid], p) for lid, t, a in self.leaves for p in inside
        ):
            flags |= TRIMMABLE
        return flags

    def _first_needed(self, path: list[Node], matched: int) -> int:
        """Index of the first block of `path` any leaf needs to be rebuilt at `matched`."""
        first = len(path) - 1
        for lid, template, adapter in self.leaves:
            ranges = [(lo, hi) for lo, hi in adapter.needed(template, matched) if lo < hi]
            last = path[-1]
            if not ranges or (last.end == matched and lid in last.extra.get("snap", ())):
                continue  # rebuilt from the last block's snapshot
            lo = min(r[0] for r in ranges)
            first = min(first, next(i for i, n in enumerate(path) if n.end > lo))
        return first

    def _restore(self, nodes: list[Node], matched: int) -> tuple[list | None, int]:
        """Rebuild the cache at `matched` from `nodes` (the blocks any leaf needs).

        Returns:
            (cache or None, how many of `nodes` were intact). Blocks in the RAM tier
            are used as they are; the rest are read from disk into joined buffers (see
            `assemble`).
        """
        cached = []
        for node in nodes:
            entry = self.memory.get(node.key)
            cached.append(entry[1] if entry is not None else None)
        intact, runs, snaps = read_path(
            nodes, cached, [self.files.path_of(n) for n in nodes], self._kinds, matched
        )
        if intact < len(nodes):
            self._damaged(nodes[intact])
            return None, intact
        # Blocks read from disk do not join the RAM tier: views of the returned buffers
        # would stop mlx-lm from growing them in place (it copies shared buffers).
        last = nodes[-1]
        sources = {
            lid: JoinedSource(self._view(last, lid, snaps.get(lid, {})), runs.get(lid, {}))
            for lid, _, _ in self.leaves
        }
        return self._build(sources, matched), len(nodes)

    def _damaged(self, node: Node) -> None:
        """Count a damaged block and drop it, with everything stored after it."""
        self.memory.discard(node.key)
        with self.index.reader() as reader:
            current = reader.get(node.key)
        if current is None or current.checksum != node.checksum:
            return  # removed (evicted, superseded) or replaced by another process meanwhile
        log.warning("block %s is missing or damaged; dropping it", node.key.hex())
        with self._lock:
            self._counters["corrupt"] += 1
        self._note(corrupt=1)
        if self._executor is not None:
            self._submit(self._drop_subtree, node.key)

    def _build(self, sources: dict, matched: int) -> list | None:
        try:
            rebuilt = {
                lid: adapter.rebuild(template, sources[lid], matched)
                for lid, template, adapter in self.leaves
            }
        except (KeyError, ValueError, IndexError) as exc:
            log.warning("stored blocks do not fit the layout: %s", exc)
            return None
        return rebuild_cache(self.template, rebuilt)

    # -- the writer thread ------------------------------------------------------------

    def _submit(self, fn, *args) -> Future:
        future = self._executor.submit(self._guarded, fn, *args)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget_future)
        return future

    def _forget_future(self, future: Future) -> None:
        with self._lock:
            self._futures.discard(future)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # never let a failed background write reach the caller
            log.exception("background work failed in store %s", self.path)
            with self._lock:
                self._counters["write_errors"] += 1

    def _write_blocks(self, new: list[tuple[Node, dict[str, Tensors]]]) -> None:
        items = []
        for node, tensors in new:
            flat = {f"{lid}.{f}": x for lid, part in tensors.items() for f, x in part.items()}
            meta = {"format": BLOCK_FORMAT, "key": node.key.hex(), "position": str(node.position)}
            items.append((node.key, *codec.encode(flat, meta)))
        try:
            for (node, _), (size, checksum, _) in zip(new, self.files.write_many(items)):
                node.size, node.checksum = size, checksum
        except OSError as exc:
            # Nothing was committed; renamed files (if any) are left to the orphan sweep.
            log.warning("could not write blocks to %s: %s", self.path, exc)
            with self._lock:
                self._counters["write_errors"] += 1
            for node, _ in new:
                self.memory.discard(node.key)
            return
        written = [node for node, _ in new]
        book = self._book.take(self._lock)

        def commit(w: Writer):
            # The model is recorded with its first block, not at open: a run that
            # stores nothing leaves no trace in the store.
            w.register_model(self.root, self._description)
            rejected, removed = [], []
            for node in written:
                existing = w.get(node.key)
                if not w.insert(node):
                    # Someone else stored this block first (same key): keep theirs.
                    if existing is None or existing.checksum != node.checksum:
                        rejected.append(node)
                    continue
                removed.extend(self._superseded(w, node))
            book.apply(w)
            if self.disk_bytes is not None:
                removed.extend(w.evict(self.disk_bytes))
            return rejected, removed

        pause_point("before_commit")
        try:
            rejected, removed = self.index.write(commit)
        except (lmdb.Error, OSError) as exc:
            # The index could not take the records (disk full, say) and is as it was.
            # The files stay for the orphan sweep: their names are content-addressed,
            # and another writer may have published the same file and committed it.
            log.warning("could not commit blocks to %s: %s", self.path, exc)
            with self._lock:
                self._counters["write_errors"] += 1
            for node in written:
                self.memory.discard(node.key)
            return
        pause_point("after_commit")
        self.files.unlink(rejected + removed)
        self._forget_removed(removed)

    @staticmethod
    def _superseded(w: Writer, node: Node) -> list[Node]:
        # A partial leaf whose tokens start the new block serves nothing the new
        # block cannot (by trimming): drop it so shared prefixes are stored once.
        if not node.trimmable:
            return []
        removed = []
        for sib in w.children(node.parent):
            if (
                sib.key != node.key
                and sib.child_count == 0
                and sib.n_tokens < node.n_tokens
                and node.tokens.startswith(sib.tokens)
            ):
                w.remove_leaf(sib)
                removed.append(sib)
        return removed

    def _forget_removed(self, removed: list[Node]) -> None:
        for node in removed:
            self.memory.discard(node.key)
        if removed:
            with self._lock:
                self._counters["evictions"] += len(removed)

    def _drop_subtree(self, key: bytes) -> None:
        removed = self.index.write(lambda w: w.remove_subtree(key))
        self.files.unlink(removed)
        for node in removed:
            self.memory.discard(node.key)

    def _note(self, *, touch=(), hit=(), **deltas: int) -> None:
        """Queue LRU touches, block hit counts and counter deltas for the writer thread."""
        if self._executor is None:
            return
        with self._lock:
            was_empty = self._book.empty()
            self._book.add(touch, hit, deltas)
        if was_empty:
            self._submit(self._apply_bookkeeping)

    def _apply_bookkeeping(self) -> None:
        book = self._book.take(self._lock)
        if not book.empty():
            self.index.write(book.apply)

    def _sweep(self) -> None:
        self.files.sweep_tmp()
        self.sweep_orphans(grace=ORPHAN_GRACE_SECONDS)

    def sweep_orphans(self, *, grace: float) -> int:
        """Remove block files no index record names, older than `grace` seconds.

        Returns:
            How many files were removed.
        """
        self._check_open()
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgumentError(f"grace must be a number of seconds >= 0, got {grace!r}")
        with self.index.reader() as reader:
            named = {n.file_name for n in reader.iter_nodes()}
        return self.files.sweep_orphans(named.__contains__, grace=grace)

    # -- fingerprints remembered in the store ---------------------------------------

    def _remembered_fingerprint(self, signature: bytes) -> str | None:
        with self.index.reader() as reader:
            raw = reader.txn.get(signature, db=self.index.dbs["fingerprints"])
        return raw.decode() if raw else None

    def _remember_fingerprint(self, signature: bytes, fingerprint: str) -> None:
        if not self.readonly:
            self.index.write(
                lambda w: w.txn.put(signature, fingerprint.encode(), db=self.index.dbs["fingerprints"])
            )

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"store {self.path} is closed")
        if os.getpid() != self._pid:
            raise InvalidArgumentError(
                f"store {self.path} was opened in process {self._pid}, before a fork",
                hint="open the store again in this process",
            )


def _existing_but_not_writable(path: str) -> bool:
    index = os.path.join(path, "index")
    return os.path.isdir(index) and not all(
        os.access(p, os.W_OK) for p in (path, index, os.path.join(path, "blocks"))
        if os.path.exists(p)
    )


def _check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


class _LazyPath(list):
    """A lookup's path: `Node`s, or ``(key, packed record)`` pairs decoded on access."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        if isinstance(i, slice):
            return _LazyPath(item)
        if isinstance(item, tuple):
            item = Node.unpack(*item)
            super().__setitem__(i, item)
        return item


class _Bookkeeping:
    """What fetches and stores leave for the index: recency, hit counts, counters.

    Batched so that a fetch costs no write transaction; the writer thread applies it
    with its next commit.
    """

    def __init__(self):
        self.touched: set[bytes] = set()
        self.hits: dict[bytes, int] = {}
        self.deltas: dict[str, int] = {}

    def empty(self) -> bool:
        return not (self.touched or self.hits or self.deltas)

    def add(self, touch, hit, deltas: dict[str, int]) -> None:
        self.touched.update(touch)
        for key in hit:
            self.hits[key] = self.hits.get(key, 0) + 1
        for name, n in deltas.items():
            self.deltas[name] = self.deltas.get(name, 0) + n

    def take(self, lock: threading.Lock) -> "_Bookkeeping":
        """Hand over what was queued and start afresh."""
        taken = _Bookkeeping()
        with lock:
            taken.touched, self.touched = self.touched, set()
            taken.hits, self.hits = self.hits, {}
            taken.deltas, self.deltas = self.deltas, {}
        return taken

    def apply(self, w: Writer) -> None:
        now = time.time_ns()
        for key in self.touched:
            w.touch(key, now)
        w.count_hits(self.hits)
        w.add_counters(self.deltas)

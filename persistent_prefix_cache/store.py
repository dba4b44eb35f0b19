"""`PersistentPrefixCache`: the store facade (`fetch`, `store`, `flush`, `close`, `stats`).

A `store()` call: validate, compute the chain of block keys, find the first block not
yet stored (`lookup.Trie.stored_prefix`), cut the new blocks out of the cache
(`layers.Layout.cut`, evaluated on the caller's thread, as MLX wants), put them in the
RAM tier and hand them to the writer thread (`writeback.WriteBack.write`: every block
write joins its group commit), which writes the files and then commits their index
records; with a remote, the blocks are published once committed. A synchronous store (no remote)
hands the writer views of the caller's cache and makes the RAM tier's copy meanwhile
(`writeback.WriteBack.write_from_caller`).

A `fetch()` call: find the longest usable stored prefix (`lookup.Trie.longest`), then
rebuild fresh caches from the blocks any layer needs (`restore.restore`: RAM tier, else
verified files read into joined buffers); a damaged block cuts the prefix short there.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

from .blocks import Node
from .errors import InvalidArgumentError, LayoutMismatchError, StoreClosedError, StoreCorruptError
from .fingerprint import cached_fingerprint, forget_fingerprints
from .keys import as_token_array, chain_keys, root_key
from .layers import Layout, all_sliced, cache_length, signature_of, template_cache
from .layers.mlx_lm_versions import layout_variant
from .lookup import Trie, back_off
from .calibration import CalibrationMixin
from .costs import Costs, CostsMixin, SavedCosts
from .disk.read_path import device_target
from .opening import OPEN_HANDLES, disk_budget, give_back, memory_budget, open_directory
from .options import OpenedWith, check_options, check_remote
from .paths import expand_path
from .restore import restore
from .warm import Warmer
from .tiers import REMOTE_COUNTERS, REMOTE_QUEUE_BYTES, REMOTE_TIMEOUT
from .tiers.memory import MemoryTier
from .counters import HANDLE_COUNTERS, Counters
from .writeback import WriteBack, sweep_orphans

log = logging.getLogger("persistent_prefix_cache")


class PersistentPrefixCache(OpenedWith, CostsMixin, CalibrationMixin):
    """A prefix (KV) cache for one mlx-lm model, kept in a store directory.

    Args:
        path: The store directory (created if missing, unless `readonly`); ``~`` and
            ``$VARS`` are expanded (`paths.expand_path`), as in `model_path`.
        model: The loaded mlx-lm model (used for its cache layout and fingerprint).
        fingerprint: Use this string as the model fingerprint instead of hashing the
            weights. Two models given the same string share blocks: only pass one you
            derive from the weights yourself.
        model_path: The folder `model` was loaded from; the fingerprint is then
            remembered in the store under the files' (path, size, mtime, inode),
            with a sample of the weights that every later open checks against the
            model loaded (`fingerprint.cached_fingerprint`).
        model_name: The model's name in the store's record (``ppc inspect`` and
            ``ppc stats`` show it): a folder or hub id. Default: `model_path`.
        namespace: Keeps tenants apart: different namespaces never share a block.
        block_size: Tokens per block for a new store (64 if None); an existing store
            keeps its own, and a different explicit value is an error.
        memory_bytes: Budget of the RAM tier (0 disables it). ``"auto"`` (the
            default): 1/8 of the device's memory beside the model's weights, at least
            512 MiB (`opening.memory_budget`).
        disk_bytes: Budget of the blocks' bytes; least recently used leaves are
            evicted past it. ``"auto"`` (the default): what the store holds plus half
            the space free on its file system at open (`opening.disk_budget`). None
            means unbounded.
        readonly: Serve hits only; `store()` writes nothing (silently: it was asked
            for). A store this process cannot write opens read-only with one warning.
        kv_bits: Quantize KV like mlx-lm's ``kv_bits`` (the store then holds and
            returns ``QuantizedKVCache`` layers).
        kv_group_size: Group size for `kv_bits`.
        sync_writes: Make `store()` return only once its blocks are on disk.
        cost_model: Restore only the prefix that is faster to restore than to compute,
            by the costs measured for this model on this device kind, kept in the
            store (see `costs`); False restores whatever is stored.
        remote: A Redis / Valkey URL (``redis://``, ``rediss://``, ``unix://``,
            ``redis+cluster://h:p,h:p``): the fleet's shared block tier, read after
            the local store and published to in the background (see `tiers.remote`).
        remote_secret: MAC every published value with this secret and accept only
            values carrying a valid MAC (each secret's blocks have keys of their own).
        remote_insecure: Share blocks without a secret (then required: it trusts whoever can write to the server).
        remote_ttl: Seconds a published block lives on the server (None: until the
            server evicts it).
        remote_timeout: Seconds one round trip to the server may take; a server that
            does not answer costs a fetch at most about this, then is skipped for a
            back-off.
        shared: Make a new store for a group: its folder 2770 (setgid) and its files
            0660, instead of private (0700 / 0600). An existing store keeps the mode
            of its folder (see `disk.store_dir`); others never get a bit.

    After `close()` every method but `close` raises `StoreClosedError`; what the handle
    was opened with (`path`, ..., `this_model()`) and `closed` still answer.

    Raises:
        InvalidArgumentError: On bad arguments.
        StorePathError: If `path` is a file or a folder of other files (an
            `InvalidArgumentError`); nothing is created.
        StoreNotWritableError: If the store must be created where this process cannot
            write; nothing is created. (An existing store it cannot write opens
            read-only, with a warning.)
        StoreVersionError: If a newer version of this library wrote the store.
        StoreCorruptError: If the index cannot be read safely.
        StoreBusyError: If ``ppc check --fix`` holds the store for longer than 2 s.
        ModelMismatchError: If `model` is proven not to be the model in `model_path`.
        RemoteConfigError: If the `remote` server refuses its URL's db, user or password.
        MissingDependencyError: If `remote` is given and redis-py is not installed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: Any,
        *,
        fingerprint: str | None = None,
        model_path: str | os.PathLike | None = None,
        model_name: str | None = None,
        namespace: str = "",
        block_size: int | None = None,
        memory_bytes: int | str = "auto",
        disk_bytes: int | str | None = "auto",
        readonly: bool = False,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        sync_writes: bool = False,
        cost_model: bool = True,
        remote: str | None = None,
        remote_secret: str | bytes | None = None,
        remote_ttl: float | None = None,
        remote_timeout: float = REMOTE_TIMEOUT,
        remote_insecure: bool = False,
        shared: bool = False,
    ):
        path = expand_path(path, what="path")
        if model_path is not None:
            model_path = expand_path(model_path, what="model_path")
        if model_name is not None and not isinstance(model_name, str):
            raise InvalidArgumentError(f"model_name must be a string, got {type(model_name).__name__}")
        self._model_name = model_name or (None if model_path is None else os.path.abspath(model_path))
        check_remote(remote=remote, secret=remote_secret, ttl=remote_ttl, timeout=remote_timeout,
                     insecure=remote_insecure)  # fmt: skip
        check_options(
            fingerprint=fingerprint, model_path=model_path, namespace=namespace, block_size=block_size,
            memory_bytes=memory_bytes, disk_bytes=disk_bytes, kv_bits=kv_bits, kv_group_size=kv_group_size,
            shared=shared,
        )  # fmt: skip
        self._path = os.path.abspath(path)
        self._sync_writes = sync_writes
        self._warned_index = False
        self._pid = os.getpid()
        # Open anyway if a layer cannot be stored (fetch misses), so that a server can
        # run uncached; store() raises.
        self._layout = Layout(
            template_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size), variant=layout_variant()
        )
        opened = open_directory(self._path, readonly=readonly, shared=shared, block_size=block_size)
        self._readonly, self._files, self._index = opened.readonly, opened.files, opened.index
        self._closed = False
        try:
            self._block_size = self._index.block_size
            self._namespace = namespace
            self._fingerprint = fingerprint or cached_fingerprint(
                model,
                None if model_path is None else os.fspath(model_path),
                self._index.remembered_fingerprint,
                self._index.remember_fingerprint,
                self._index.stored_fingerprints,
            )
            self._root = root_key(self._fingerprint, namespace, self._layout.signature + self._layout.variant)
            self._layout.fields = self._recorded_fields()
            self._memory = MemoryTier(memory_budget(model, memory_bytes))
            # Where restored bytes live (MLX's device: CPU, unified memory, a CUDA GPU's),
            # decided once for the handle, whichever thread calls it.
            self._target = device_target()
            self._trie = Trie(self._index, self._memory, self._root, self._block_size)
            self._counters = Counters(*HANDLE_COUNTERS, *REMOTE_COUNTERS)
            self._costs = Costs(enabled=cost_model)
            self._saved_costs = SavedCosts(self._path, self._root.hex(), self._costs, readonly=self._readonly)
            self._writeback = None
            if not self._readonly:
                self._writeback = WriteBack(
                    self._index, self._files, self._memory, self._counters,
                    root=self._root, describe=self._describe,
                    disk_bytes=disk_budget(self._path, disk_bytes, self._index.totals()[0]),
                    on_device=self._target.device,
                )  # fmt: skip
            self._remote = self._remote_fill = None
            if remote is not None:
                from .remote_fill import RemoteFill  # the remote's client: imported only where used
                from .tiers.remote import RemoteTier

                try:
                    self._remote = RemoteTier(
                        remote, root=self._root, secret=remote_secret, ttl=remote_ttl, timeout=remote_timeout,
                        queue_bytes=REMOTE_QUEUE_BYTES, counters=self._counters,
                    )  # fmt: skip
                except BaseException:
                    self.close()  # the writer thread stops; the index is given back below
                    raise
                self._remote_fill = RemoteFill(
                    self._remote, trie=self._trie, memory=self._memory, layout=self._layout, writeback=self._writeback,
                    costs=self._costs, root=self._root, block_size=self._block_size, target=self._target,
                )  # fmt: skip
            # Last: its thread runs from here on (the tier learns what the cost model skips).
            self._warmer = Warmer(self._layout, self._memory, self._files, self._index.segment_digests, self._target)
        except BaseException:
            give_back(self._path, opened)
            raise
        OPEN_HANDLES.add(self)

    # -- reading ------------------------------------------------------------------------

    def fetch(self, tokens: Any, *, longer_than: int | None = None) -> tuple[list | None, Any]:
        """Restore the longest stored prefix of `tokens`.

        Args:
            tokens: The prompt: a list of ints, or a 1-D numpy or mlx array.
            longer_than: Load nothing unless more than this many tokens can be
                restored (a caller that already holds a cache of that many, say;
                0: unless anything can); such a call is counted as ``not_longer``
                only, not as a query, except with 0, where nothing stored is a miss.

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
        try:
            return self._fetch(tokens, toks, longer_than)
        except StoreCorruptError as exc:  # a damaged index page: a miss, never an error
            self._index_damaged(exc)
            self._counters.add(queries=1, misses=1)
            return None, tokens

    def _fetch(self, tokens: Any, toks: Any, longer_than: int | None) -> tuple[list | None, Any]:
        """`fetch` past its checks: the trie walk, the remote's part, the restore."""
        path, matched = self._trie.longest(toks) if self._layout.unsupported is None else ([], 0)
        pending = None
        if self._remote_fill is not None and matched < len(toks) - 1 and self._layout.unsupported is None:
            pending = self._remote_fill.fill(toks, matched)
            if pending is not None:  # the fleet held more: its blocks are in the RAM tier now
                path, matched = self._trie.longest(toks)
        result = self._restore(tokens, path, matched, longer_than)
        if pending:
            self._remote_fill.write(pending)  # into the local store, once the caller's restore is done
        self._save_costs_soon()
        return result

    def _restore(self, tokens: Any, path: list[Node], matched: int, longer_than: int | None) -> tuple[list | None, Any]:
        """The rest of `fetch`: restore `path` up to `matched` tokens (cost model, damage)."""
        if longer_than is not None and matched <= longer_than:
            if longer_than == 0:
                # The caller holds nothing and the store has nothing: a plain miss
                # (a server's request that found nothing must show in `ppc stats`).
                self._counters.add(queries=1, misses=1)
                self._note(misses=1)
            else:
                self._counters.add(not_longer=1)
            return None, tokens
        if path:
            path, matched = self._cheaper(path, matched, len(tokens))
        layers = None
        while path and layers is None:
            first = self._layout.first_needed(path, matched)
            from_disk = sum(self._memory.node(n.key) is None for n in path[first:])  # before admission
            in_ram = not from_disk
            started = time.perf_counter()
            layers, intact = restore(
                self._layout, self._memory, self._files, path[first:], matched,
                self._index.segment_digests(path[first:]), target=self._target,
            )  # fmt: skip
            if layers is not None:
                self._timed(path[first:], time.perf_counter() - started, in_ram)
            if intact < len(path) - first:
                self._damaged(path[first + intact])
            elif layers is None:
                break  # intact blocks that do not fit the layout: a miss
            # A damaged block cut the path short: fall back to what comes before it.
            if layers is None:
                path, matched = back_off(path[: first + intact], matched)
        if layers is None:
            self._counters.add(queries=1, misses=1)
            self._note(misses=1)
            return None, tokens
        self._counters.add(queries=1, hits=1, tokens_saved=matched, restored_blocks_disk=from_disk)
        keys = [node.key for node in path]
        self._note(touch=keys, hit=keys, hits=1, tokens_saved=matched)
        return layers, tokens[matched:]

    def peek(self, tokens: Any) -> int:
        """How many tokens `fetch` would restore, from the index alone (nothing is loaded).

        A segment file found damaged by the fetch itself can make the fetch restore fewer.

        Args:
            tokens: The prompt.

        Returns:
            The number of leading tokens of `tokens` a fetch would restore now.
        """
        self._check_open()
        if self._layout.unsupported is not None:
            return 0
        return self._trie.longest(as_token_array(tokens), decode=False)[1]

    def make_cache(self) -> list:
        """A fresh, empty cache of this store's layout (what `fetch` returns on a hit)."""
        self._check_open()
        return self._layout.make_cache()

    def stored_models(self) -> list[dict]:
        """Every model (with namespace and layout) that has blocks in this store.

        Returns:
            ``{"root", "fingerprint", "namespace", "layout", "name"}`` per model
            (``root`` in hex; ``name`` the folder or hub id, None if unknown); unreadable
            records are left out.
        """
        self._check_open()
        with self._index.reader() as reader:
            return reader.filled_models()

    def forget_fingerprints(self, model_path: str | os.PathLike | None = None) -> int:
        """Forget the fingerprints remembered by model folder (the next open of each
        hashes its weights again); this handle keeps its own fingerprint.

        Args:
            model_path: Only those remembered for this folder; None: every one.

        Returns:
            How many were forgotten.

        Raises:
            ReadOnlyStoreError: If the store was opened read-only.
        """
        self._check_open()
        return forget_fingerprints(self._index, model_path)

    # -- writing ------------------------------------------------------------------------

    def store(self, tokens: Any, cache: Sequence[Any]) -> int:
        """Store the KV of `tokens`; blocks already stored are not written again.

        The caller's cache is not modified. Unless the store was opened with
        ``sync_writes=True``, files are written on a background thread: call
        `flush()` to wait for them.

        Args:
            tokens: The tokens `cache` was computed from.
            cache: mlx-lm cache objects covering ``len(tokens)`` positions (or more,
                where every layer is sliced along the sequence: ``KVCache``,
                ``QuantizedKVCache``), with the layout the store was opened with.

        Returns:
            The number of new blocks.

        Raises:
            InvalidArgumentError: If the cache covers fewer than ``len(tokens)`` positions
                (or more, with a layer that is not sliced).
            LayoutMismatchError: If the cache's classes differ from the store's layout.
            UnsupportedCacheError: If a layer's class cannot be stored.
        """
        self._check_open()
        toks = as_token_array(tokens)
        if self._layout.unsupported is not None:
            raise self._layout.unsupported
        if not isinstance(cache, (list, tuple)):
            raise InvalidArgumentError(f"cache must be a list of cache layers, got {type(cache).__name__}")
        signature = signature_of(cache)
        if signature != self._layout.signature:
            raise LayoutMismatchError(f"cache layout {signature!r} does not match the store's {self._layout.signature!r}")
        covered = cache_length(cache)
        # A sliced cache may hold more (what was computed after `tokens`): their blocks are cut from it.
        if covered is not None and covered != len(toks) and not (covered > len(toks) and all_sliced(cache)):
            raise InvalidArgumentError(f"cache covers {covered} positions but {len(toks)} tokens were given")
        if self._readonly:  # what was asked for (or said once at open): nothing to warn about
            return 0
        if len(toks) == 0:
            return 0
        keys = chain_keys(self._root, toks, self._block_size)
        data = toks.tobytes()
        try:
            path = self._trie.stored_prefix(keys, data)
        except StoreCorruptError as exc:  # the caller's work goes on; nothing is written
            self._index_damaged(exc)
            self._counters.add(write_errors=1)
            return 0
        if path is None:
            log.warning("block key collision; not storing the rest of this prompt")
            return 0
        self._note(touch=keys[: len(path)])
        # A synchronous store (no remote, which publishes after the return) writes from
        # the caller's cache while the caller waits: no copy before the disk starts. Not
        # on a CUDA GPU: the host reading the caller's cache would move its pages into
        # managed memory and over to the host, and the next forward would fault them back.
        direct = self._sync_writes and self._remote is None and not self._target.device
        new = self._layout.new_blocks(
            cache, keys, data, path, root=self._root, block_size=self._block_size, direct=direct,
            host=self._target.host_bits,
        )  # fmt: skip
        for node, tensors, _, _ in new:
            self._layout.learn_fields(tensors)  # the dtypes and shapes a read must find
        if direct and new:
            self._writeback.write_from_caller(new, lambda: self._layout.evaluate(new))
            return len(new)
        if any(self._memory.fits(tensors) for _, tensors, _, _ in new):
            self._layout.evaluate(new)
            for node, tensors, _, origin in new:
                self._memory.put(node, tensors, origin)
        if new:
            # Published after the commit that holds them, on the writer thread: `flush` finds them queued.
            then = self._remote.publish if self._remote is not None else None
            future = self._writeback.write([(node, bits) for node, _, bits, _ in new], then=then)
            if self._sync_writes:
                future.result()
        return len(new)

    def flush(self) -> None:
        """Wait until every pending write and access update is committed, every
        block stored so far is published to the remote (or has failed, counted), and a
        background fill of the RAM tier is done."""
        self._check_open()
        self._saved_costs.maybe_save(force=True)
        self._warmer.wait()
        if self._writeback is not None:
            self._writeback.flush()
        if self._remote is not None:
            self._remote.flush()

    def sweep_orphans(self, *, grace: float) -> int:
        """Remove segment files no index record names, older than `grace` seconds.

        Returns:
            How many files were removed.
        """
        self._check_open()
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgumentError(f"grace must be a number of seconds >= 0, got {grace!r}")
        return sweep_orphans(self._index, self._files, grace=grace)

    # -- the handle -----------------------------------------------------------------

    def limit_memory(self, max_bytes: int | None = None) -> tuple[int, int]:
        """Set the RAM tier's budget (None: keep it), evicting least recently used blocks down
        to it now (they stay on disk); `compat.lru_prompt_cache` keeps itself and the tier in one.

        Returns:
            ``(bytes held, budget)`` of the RAM tier.
        """
        self._check_open()
        if max_bytes is not None:
            self._memory.resize(max_bytes)
        return self._memory.nbytes, self._memory.max_bytes

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def close(self) -> None:
        """Flush and release the store. Safe to call twice."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            # A copy inherited through fork(): its writer thread and LMDB environment
            # belong to the parent, and the child has already dropped the latter.
            self._closed = True
            return
        self._saved_costs.maybe_save(force=True)
        if hasattr(self, "_warmer"):  # not there if the open failed before it
            self._warmer.stop()
        finished = self._writeback.stop() if self._writeback is not None else True
        if self._remote is not None:
            self._remote.close()
        self._closed = True
        self._memory.clear()
        if finished:  # else the writer thread may still wait on the index's lock
            self._index.close()
        OPEN_HANDLES.discard(self)

    def stats(self) -> dict[str, int]:
        """Counters of this handle plus the store's totals.

        Raises:
            StoreClosedError: If the store is closed (InvalidArgumentError: opened before a fork).

        Returns:
            queries, hits, misses (queries = hits + misses), not_longer (fetches
            stopped by ``longer_than``, loading nothing), tokens_saved,
            the cost model's decision of each fetch that found blocks: restored_all,
            restored_ram_only (only the leading part held in RAM), restored_shorter
            (another shorter prefix), skipped_slower (nothing: computing was faster),
            and tokens_skipped (the tokens the cuts left to compute), corrupt,
            evictions, write_errors, restored_blocks_disk (blocks restores read from
            segment files; the RAM tier's are its memory_hits_*), blocks_written and
            bytes_written (blocks this
            handle committed and the bytes of the segment files it wrote for them:
            another process's blocks are not counted), segments_merged and
            bytes_rewritten (segments this handle's writer merged away, a chain stored
            piece by piece, and the bytes it wrote doing so: see `merging`), group_commits
            and group_commit_writes (index transactions of its block writes, and the
            writes they held) (this handle);
            prefill_tokens_per_s (of a 1,024-token prompt), prefill_growth (seconds
            per token per position: attention's share), prefill_per_forward_s,
            restore_bytes_per_s_ram and _disk, restore_fixed_s_ram and _disk,
            first_forward_s, first_restore_s_ram and _disk (what a process's first
            restore from a tier takes beyond its rate: MLX's kernel compiles, buffers
            made), cost_device (the costs measured for this model on this
            device kind, None until measured, remembered in the store);
            blocks, block_bytes (their tensors' bytes: what ``disk_bytes`` bounds) and
            bytes_on_disk (of the segment files: headers and space not yet reclaimed
            included) for the store, all processes; disk_budget (the blocks' byte budget this
            handle evicts to: `disk_bytes` resolved, None if unbounded); bytes_in_memory,
            blocks_in_memory, memory_evictions, memory_admitted[_bytes] and
            memory_hits_store/_disk/_remote, memory_warm* (the RAM tier: `MemoryTier.stats`); pending_writes;
            store_hits, store_misses, store_tokens_saved, store_corrupt (all processes
            since the store was made, as far as committed); remote (the URL, password
            hidden, or None), remote_hits and remote_misses (fetches the remote
            served blocks to, or was asked in vain), remote_blocks, remote_bytes_read,
            remote_errors (failed round trips), remote_corrupt and
            remote_unauthenticated (values rejected), remote_skipped (calls skipped
            while the server backs off), remote_slower (continuations left on the
            server: reading them was slower than a prefill, by the cost model; their
            tokens count in tokens_skipped), remote_published, remote_bytes_published,
            remote_already (held by the server before), remote_dropped (publish queue
            full), remote_publish_failed, remote_pending, remote_key_id (the secret's
            key id; None: no secret), restore_bytes_per_s_remote.
        """
        self._check_open()
        out = self._counters.snapshot()
        out["pending_writes"] = self._writeback.pending if self._writeback is not None else 0
        out["disk_budget"] = self._writeback.disk_bytes if self._writeback is not None else None
        with self._index.reader() as reader:
            out["block_bytes"], out["blocks"] = reader.totals()
            out["bytes_on_disk"] = reader.file_bytes()
            out.update({f"store_{k}": v for k, v in reader.counters().items()})
        out.update(self._memory.stats())
        out.update(self._costs.figures())
        out["remote"] = self._remote.url if self._remote is not None else None  # its password hidden
        out["remote_pending"] = self._remote.pending if self._remote is not None else 0
        out["remote_key_id"] = self._remote.kid if self._remote is not None else None  # whose key space
        return out

    def __enter__(self) -> "PersistentPrefixCache":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------

    def _index_damaged(self, exc: StoreCorruptError) -> None:
        """Count a read that met a damaged index page; say so once per handle (with
        what ``ppc check --fix`` will do)."""
        self._counters.add(corrupt=1)
        if not self._warned_index:
            self._warned_index = True
            log.warning("%s; serving what can be read, everything else misses", exc)

    def _damaged(self, node: Node) -> None:
        """Count a damaged block and drop it, with everything stored after it."""
        self._memory.discard(node.key)
        with self._index.reader() as reader:
            current = reader.get(node.key)
        if current is None or (current.checksum, current.segment) != (node.checksum, node.segment):
            return  # removed, replaced or moved (compacted) by this or another process meanwhile
        log.warning("block %s is missing or damaged; dropping it", node.key.hex())
        self._counters.add(corrupt=1)
        self._note(corrupt=1)
        if self._writeback is not None:
            self._writeback.submit(self._writeback.drop_subtree, node.key)

    def _note(self, **kwargs: Any) -> None:
        if self._writeback is not None:
            self._writeback.note(**kwargs)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self._path} is closed")
        if os.getpid() != self._pid:
            raise InvalidArgumentError(
                f"store {self._path} was opened in process {self._pid}, before a fork",
                hint="open the store again in this process",
            )

"""The API of ``vllm_mlx.prefix_cache``, built on `PersistentPrefixCache`.

`PrefixCacheManager` keeps whole prompt caches in memory, keyed by their tokens;
`BlockAwarePrefixCache` cuts them into the blocks of a `PagedCacheManager`. Given
``store=`` (a `PersistentPrefixCache` or a store directory) both also read through to
disk when memory does not cover a query and write through on every store, so a new
process finds what an earlier one stored.

What ``remaining`` means
------------------------
Every fetch returns ``(cache, remaining)``: ``remaining`` are the tokens of the query
that the cache does *not* hold, to be fed to the model on top of it. A KV cache holds
no logits, so the first new token always comes from feeding at least one token:

- `PrefixCacheManager.fetch_cache` keeps vllm-mlx's contract: an exact hit returns the
  stored cache itself and ``[]``. That cache already holds the last prompt token: never
  feed ``tokens[-1:]`` on top of it (vllm-mlx's scheduler did, which puts the token in
  the cache twice). To generate, use `PrefixCacheManager.fetch_for_generation`: its
  ``remaining`` is never empty and its cache is the caller's own.
- `BlockAwarePrefixCache.fetch_cache` and every hit read from disk never return an
  empty ``remaining``: a full hit is cut back by one token.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from .adapters import (
    BlockSource,
    BlockView,
    adapter_for,
    cache_length,
    leaves,
    rebuild_cache,
    signature_of,
)
from .errors import InvalidArgumentError, PrefixCacheError, UnsupportedCacheError
from .keys import as_token_array, common_prefix
from .paged_cache import BlockTable, CacheBlock, PagedCacheManager
from .store import PersistentPrefixCache

log = logging.getLogger("persistent_prefix_cache")

# -- cache layers -----------------------------------------------------------------------


def _covered(cache: Any) -> int | None:
    """Positions a list of mlx-lm cache layers holds; None if not known (other objects)."""
    if not isinstance(cache, (list, tuple)) or not cache:
        return None
    try:
        return cache_length(cache)
    except PrefixCacheError:
        return None


def _can_trim(cache: Any) -> bool:
    # Every layer must agree: trimming the attention layers of a hybrid model while its
    # recurrent layers keep the longer state gives a cache that matches no prompt.
    return (
        isinstance(cache, (list, tuple))
        and len(cache) > 0
        and all(callable(getattr(c, "is_trimmable", None)) and c.is_trimmable() for c in cache)
    )


def _copy_prefix(cache: Sequence[Any], keep: int, total: int) -> list:
    """New layers holding the first `keep` of the `total` positions of `cache`.

    Only those positions are copied, and `cache` itself is never modified.
    """
    try:
        rebuilt = {}
        for leaf, layer in leaves(cache):
            adapter = adapter_for(layer, leaf)
            view = BlockView(0, keep, *adapter.pieces(layer, 0, keep, keep == total))
            if not adapter.can_rebuild(layer, [view], keep):
                raise UnsupportedCacheError(f"layer {leaf} cannot be rebuilt at {keep}")
            rebuilt[leaf] = adapter.rebuild(layer, BlockSource([view]), keep)
        return rebuild_cache(cache, rebuilt)
    except PrefixCacheError:
        # Objects the adapters do not know: copy them whole, then trim.
        out = copy.deepcopy(list(cache))
        for layer in out if keep < total else ():
            layer.trim(total - keep)
        return out


def _empty_like(layer: Any) -> Any:
    """An empty layer with the parameters `adapters` rebuild `layer` with."""
    kind = type(layer)
    if kind is CacheList:
        return CacheList(*(_empty_like(c) for c in layer.caches))
    if kind is QuantizedKVCache:
        return QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
    if kind is RotatingKVCache:
        return RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
    if kind is ChunkedKVCache:
        return ChunkedKVCache(layer.chunk_size)
    if kind is ArraysCache:
        return ArraysCache(len(layer.cache))
    return kind()


def _seed_layer(entry: dict) -> Any:
    """An mlx-lm layer from vllm-mlx's per-layer dict (``state``, ``class_name``, ...)."""
    state = entry.get("state")
    ref = entry.get("class_ref")
    name = entry.get("class_name") or getattr(ref, "__name__", "")
    try:
        if ref is KVCache or (ref is None and name == "KVCache"):
            keys, values = state[0], state[1]
            if keys.ndim != 4:
                return None  # only [batch, heads, seq, dim] is what mlx-lm's KVCache holds
            offset = int(state[2]) if len(state) > 2 else keys.shape[2]
            return KVCache.from_state((keys, values, offset))
        if ref is ArraysCache or (ref is None and name == "ArraysCache"):
            arrays = state[0] if len(state) == 3 and isinstance(state[0], list) else state
            layer = ArraysCache(len(arrays))
            layer.cache = list(arrays)
            return layer
        return ref.from_state(state) if ref is not None else None
    except (TypeError, ValueError, IndexError, AttributeError):
        return None


def _as_layers(cache_data: Any) -> list | None:
    """`cache_data` as mlx-lm layers the adapters can cut, or None (kept opaque)."""
    if not isinstance(cache_data, (list, tuple)) or not cache_data:
        return None
    if all(isinstance(d, dict) and "state" in d for d in cache_data):
        layers = [_seed_layer(d) for d in cache_data]
        if any(layer is None for layer in layers):
            return None
    else:
        layers = list(cache_data)
    try:
        signature_of(layers)
    except PrefixCacheError:
        return None
    return layers


# -- the store link -------------------------------------------------------------------


class _StoreLink:
    """Read-through and write-through to an optional `PersistentPrefixCache`."""

    def _open_store(self, store: Any, model: Any) -> None:
        self._owns_store = isinstance(store, (str, os.PathLike))
        if self._owns_store:
            store = PersistentPrefixCache(store, model)
        elif store is not None and not isinstance(store, PersistentPrefixCache):
            raise InvalidArgumentError(
                f"store must be a PersistentPrefixCache or a path, got {type(store).__name__}"
            )
        self.store: PersistentPrefixCache | None = store
        self._warned = False

    def _warn_once(self, what: str, exc: Exception) -> None:
        # One warning per manager: a server would otherwise repeat it on every request.
        log.debug("%s: %s", what, exc)
        if not self._warned:
            self._warned = True
            warnings.warn(f"{what}: {exc}", RuntimeWarning, stacklevel=4)

    def _read_through(self, tokens: Any, keep: int = 0) -> tuple[list | None, Any]:
        """The store's hit for `tokens` if it covers more than `keep` tokens."""
        try:
            if self.store.peek(tokens) <= keep:  # index only: load nothing needlessly
                return None, tokens
            return self.store.fetch(tokens)
        except PrefixCacheError as exc:
            self._warn_once("could not read the store", exc)
            return None, tokens

    def _write_through(self, tokens: Any, cache: Sequence[Any]) -> None:
        try:
            self.store.store(tokens, cache)
        except PrefixCacheError as exc:
            self._warn_once("cache kept in memory only, not written to the store", exc)

    def close(self) -> None:
        """Close the store if this object opened it (from a path); idempotent."""
        if self.store is not None and self._owns_store:
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- PrefixCacheManager --------------------------------------------------------------


@dataclass
class PrefixCacheStats:
    """Counters of a `PrefixCacheManager`.

    Attributes:
        hits: Fetches that returned a cache.
        misses: Fetches that returned None.
        tokens_saved: Positions held by the caches returned.
        total_queries: Fetches.
        evictions: Entries dropped from memory to stay within ``max_entries``.
    """

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    total_queries: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits per query (0.0 before the first query)."""
        return self.hits / self.total_queries if self.total_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The counters and `hit_rate` as a dict.

        Returns:
            hits, misses, hit_rate, tokens_saved, total_queries, evictions.
        """
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "tokens_saved": self.tokens_saved,
            "total_queries": self.total_queries,
            "evictions": self.evictions,
        }


@dataclass
class CacheEntry:
    """One entry of a `PrefixCacheManager`.

    Attributes:
        prompt_cache: The object given to `PrefixCacheManager.store_cache`.
        count: How many times those tokens were stored.
    """

    prompt_cache: list[Any]
    count: int


class PrefixCacheManager(_StoreLink):
    """Whole prompt caches in memory, keyed by their tokens, evicted least recently
    used first when there are more than `max_entries`.

    A fetch prefers, in this order: the entry equal to the query; a stored sequence
    that extends the query, trimmed to it (only if every layer is trimmable; the
    shortest such sequence, ties broken by its tokens); the longest stored prefix of the
    query. With a store, a query the memory does not cover fully is also looked up on
    disk, and the longer hit wins. Every hit makes its entry the most recently used.

    Entries are the very objects given to `store_cache` and an exact hit returns that
    object (no copy, as in vllm-mlx, whose `BatchGenerator` copies caches on insert):
    never run the model on a cache `fetch_cache` returned; `fetch_for_generation`
    returns one you may extend.

    Args:
        model: The mlx-lm model (used to open a store from a path).
        max_entries: Entries kept in memory.
        store: A `PersistentPrefixCache`, or a store directory opened for `model` with
            default options (closed by `close`); None keeps everything in memory.

    Raises:
        InvalidArgumentError: If `max_entries` < 1 or `store` is of the wrong type.
    """

    def __init__(self, model: Any, max_entries: int = 100, *, store: Any = None):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise InvalidArgumentError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.model = model
        self.model_key = id(model)
        self.max_size = max_entries
        self.stats = PrefixCacheStats()
        # int32 token bytes -> entry, least recently used first.
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self._lock = threading.RLock()
        self._open_store(store, model)

    def fetch_cache(self, tokens: Any) -> tuple[list | None, Any]:
        """The cache of the longest usable stored prefix of `tokens` (vllm-mlx's contract).

        Args:
            tokens: The prompt (list of ints, or a 1-D numpy or mlx array).

        Returns:
            ``(cache, remaining)``. Exact hit: the stored object and ``[]`` (it already
            holds every token: see the module docstring before generating from it).
            Shorter stored prefix: the stored object and the tokens after the prefix.
            Longer stored sequence: a new cache trimmed to `tokens` and ``[]``. Disk hit:
            fresh objects and a non-empty rest. Miss: ``(None, tokens)``.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        return self._fetch(tokens, generation=False)

    def fetch_for_generation(self, tokens: Any) -> tuple[list | None, Any]:
        """Like `fetch_cache`, ready to run the model on (an addition to vllm-mlx's API).

        Args:
            tokens: The prompt (list of ints, or a 1-D numpy or mlx array).

        Returns:
            ``(cache, remaining)``: a cache the caller owns (never a stored object)
            holding at most ``len(tokens) - 1`` positions, and the tokens to feed, never
            empty for a non-empty query; ``(None, tokens)`` on a miss.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        return self._fetch(tokens, generation=True)

    def _fetch(self, tokens: Any, *, generation: bool) -> tuple[list | None, Any]:
        toks = as_token_array(tokens)
        limit = len(toks) - 1 if generation else len(toks)
        cache, keep = None, 0
        with self._lock:
            self.stats.total_queries += 1
            found = self._search(toks.tobytes(), limit) if limit > 0 else None
            if found is not None:
                key, entry, keep = found
                self._entries.move_to_end(key)
                total = len(key) // 4
                if keep == total and not generation:
                    cache = entry.prompt_cache
                else:
                    cache = _copy_prefix(entry.prompt_cache, keep, total)
        if self.store is not None and keep < min(limit, len(toks) - 1):
            disk, rest = self._read_through(tokens, keep)
            if disk is not None and len(toks) - len(rest) > keep:
                cache, keep = disk, len(toks) - len(rest)
        with self._lock:
            if cache is None:
                self.stats.misses += 1
                return None, tokens
            self.stats.hits += 1
            self.stats.tokens_saved += keep
        return cache, tokens[keep:]

    def _search(self, data: bytes, limit: int) -> tuple[bytes, CacheEntry, int] | None:
        """Best entry for the first `limit` tokens of `data`: (key, entry, positions to use)."""
        want = data[: 4 * limit]
        shorter, longer = b"", None
        # A scan of byte-prefix tests: cheap for the few hundred entries this holds,
        # and it finds a shorter prefix wherever the query diverges from a longer entry.
        for key, entry in self._entries.items():
            if len(key) <= len(want):
                if len(key) > len(shorter) and want.startswith(key):
                    shorter = key
            elif key.startswith(want) and _can_trim(entry.prompt_cache):
                if longer is None or (len(key), key) < (len(longer), longer):
                    longer = key
        if longer is not None and len(shorter) < len(want):
            return longer, self._entries[longer], limit
        if shorter:
            return shorter, self._entries[shorter], len(shorter) // 4
        return None

    def store_cache(self, tokens: Any, prompt_cache: list[Any]) -> None:
        """Keep `prompt_cache` for `tokens` (and write it through to the store).

        The entry is keyed by the positions the cache holds when those can be read
        (mlx-lm layers): vllm-mlx's scheduler stores the prompt plus every generated
        token while the last one was never fed, and fetching that entry then returns
        that token as ``remaining`` instead of skipping it. Storing the same tokens again
        only counts and refreshes the entry. Empty token lists are not stored.

        Args:
            tokens: The tokens the cache was computed from.
            prompt_cache: The cache (kept as is, not copied).

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        toks = as_token_array(tokens)
        n = len(toks)
        covered = _covered(prompt_cache)
        if covered is not None:
            if covered > n:
                log.warning(
                    "cache holds %d positions but %d tokens were given: not stored", covered, n
                )
                return
            n = covered
        if n == 0:
            return
        key = toks[:n].tobytes()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.count += 1
                self._entries.move_to_end(key)
            else:
                self._entries[key] = CacheEntry(prompt_cache, 1)
                while len(self._entries) > self.max_size:
                    self._entries.popitem(last=False)
                    self.stats.evictions += 1
        if self.store is not None:
            self._write_through(toks[:n], prompt_cache)

    def get_stats(self) -> dict[str, Any]:
        """The counters (see `PrefixCacheStats.to_dict`).

        Returns:
            The counters as a dict.
        """
        with self._lock:
            return self.stats.to_dict()

    def reset_stats(self) -> None:
        """Zero the counters."""
        with self._lock:
            self.stats = PrefixCacheStats()

    def clear(self) -> None:
        """Forget every entry in memory and zero the counters (the store is untouched)."""
        with self._lock:
            self._entries.clear()
            self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)


# -- BlockAwarePrefixCache ------------------------------------------------------------


@dataclass
class BlockCacheEntry:
    """A request known to a `BlockAwarePrefixCache`.

    Attributes:
        block_table: Its blocks.
        cache_data: What `store_cache` was given (None for a request that only fetched).
        last_access: `time.time()` of the last store, fetch or generation.
    """

    block_table: BlockTable
    cache_data: list[Any] | None
    last_access: float


@dataclass
class _BlockData:
    """What `BlockAwarePrefixCache` keeps in ``CacheBlock.cache_data``."""

    layout: str  # `signature_of` the cache the block was cut from
    template: list  # empty layers with that layout's parameters, shared by its blocks
    views: dict[str, BlockView]  # per leaf: the block's tensors


class BlockAwarePrefixCache(_StoreLink):
    """KV cut into the blocks of a `PagedCacheManager`, shared between requests by
    positional block keys (the API of ``vllm_mlx.prefix_cache.BlockAwarePrefixCache``).

    `store_cache` accepts mlx-lm cache layers or vllm-mlx's per-layer dicts; anything
    else is kept opaque (blocks are accounted for, `reconstruct_cache` returns None).
    A request's blocks stay referenced until `release_cache`; released blocks keep their
    KV for later requests until the pool reuses them.

    Args:
        model: The mlx-lm model (used to open a store from a path).
        paged_cache_manager: The pool of blocks.
        store: A `PersistentPrefixCache`, or a store directory opened for `model` with
            default options (closed by `close`); None keeps everything in memory.

    Raises:
        InvalidArgumentError: If `store` is of the wrong type.
    """

    def __init__(self, model: Any, paged_cache_manager: PagedCacheManager, *, store: Any = None):
        self.model = model
        self.model_key = id(model)
        self.paged_cache = paged_cache_manager
        self.block_size = paged_cache_manager.block_size
        self._request_tables: dict[str, BlockCacheEntry] = {}
        self._hits = self._misses = self._tokens_saved = 0
        self._open_store(store, model)

    def fetch_cache(self, request_id: str, tokens: Any) -> tuple[BlockTable | None, Any]:
        """Give `request_id` the blocks of the longest stored prefix of `tokens`.

        A full hit is cut back by one token, so ``remaining`` is never empty; the table
        may end inside its last block. A previous table of the request is released.

        Args:
            request_id: The request.
            tokens: The prompt.

        Returns:
            ``(table, remaining)``: pass the table to `reconstruct_cache` (or
            `get_cache_for_generation`) and feed ``remaining``; ``(None, tokens)`` on a
            miss (and for an empty query).

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        toks = as_token_array(tokens)
        n = len(toks)
        if n == 0:
            return None, tokens
        lock = self.paged_cache.lock
        with lock:
            blocks, matched = self._usable(*self._match(toks, n - 1))
            if matched == n - 1 or self.store is None:
                return self._hit(request_id, tokens, blocks, matched, held=False)
        disk, rest = self._read_through(tokens)
        covered = n - len(rest) if disk is not None else 0
        with lock:
            # Match again: while the store was read, the pool may have reused blocks.
            blocks, matched = self._usable(*self._match(toks, n - 1))
            if covered <= matched:
                return self._hit(request_id, tokens, blocks, matched, held=False)
            put = self._put_blocks(toks[:covered], disk)
            blocks, matched = self._usable(put, sum(b.token_count for b in put))
            for block in put[len(blocks) :]:
                self.paged_cache.free_block(block.block_id)
            return self._hit(request_id, tokens, blocks, matched, held=True)

    def store_cache(self, request_id: str, tokens: Any, cache_data: list[Any]) -> BlockTable | None:
        """Cut the KV of `tokens` into blocks, sharing those already stored.

        Args:
            request_id: The request (a previous table of it is released).
            tokens: The tokens `cache_data` was computed from; if the cache holds fewer
                positions (the last generated token not fed yet), only those are stored.
            cache_data: mlx-lm cache layers, or vllm-mlx's per-layer dicts
                (``{"state": ..., "class_name": ...}``); anything else is kept opaque.

        Returns:
            The request's table (shorter than `tokens` if the pool ran dry), or None
            for empty tokens.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        toks = as_token_array(tokens)
        n = len(toks)
        layers = _as_layers(cache_data)
        covered = _covered(layers)
        if covered is not None and covered != n:
            if covered > n:
                log.warning(
                    "cache holds %d positions but %d tokens were given: not stored", covered, n
                )
                return None
            n = covered
        if n == 0:
            return None
        with self.paged_cache.lock:
            blocks = self._put_blocks(toks[:n], layers)
            table = self._install(request_id, blocks, cache_data)
        if self.store is not None and layers is not None:
            self._write_through(toks[:n], layers)
        return table

    def get_cache_for_generation(self, request_id: str) -> tuple[list[Any] | None, bool]:
        """The request's cache, copied first if its last block is shared (copy-on-write).

        Args:
            request_id: The request.

        Returns:
            ``(cache_data, was_copied)``: what `store_cache` was given (a deep copy if
            copied), or for a request that only fetched, fresh layers rebuilt from its
            blocks; ``(None, False)`` for an unknown request.
        """
        with self.paged_cache.lock:
            entry = self._request_tables.get(request_id)
            if entry is None:
                return None, False
            _, was_copied = self.paged_cache.get_blocks_for_generation(entry.block_table)
            entry.last_access = time.time()
            if entry.cache_data is None:
                return self.reconstruct_cache(entry.block_table), was_copied
            return (copy.deepcopy(entry.cache_data) if was_copied else entry.cache_data), was_copied

    def release_cache(self, request_id: str) -> None:
        """Drop the request and its block references (fetched or stored); the blocks keep
        their KV for later requests until the pool reuses them.

        Args:
            request_id: The request (unknown ids are ignored).
        """
        with self.paged_cache.lock:
            self._request_tables.pop(request_id, None)
            self.paged_cache.delete_block_table(request_id)

    def fork_cache(self, source_request_id: str, new_request_id: str) -> BlockTable | None:
        """Share a request's blocks and cache data with a new request.

        Args:
            source_request_id: The request to share.
            new_request_id: The new request.

        Returns:
            The new table, or None if the source is unknown.
        """
        with self.paged_cache.lock:
            source = self._request_tables.get(source_request_id)
            if source is None:
                return None
            table = self.paged_cache.fork_block_table(source.block_table, new_request_id)
            self._request_tables[new_request_id] = BlockCacheEntry(
                table, source.cache_data, time.time()
            )
            return table

    def reconstruct_cache(self, block_table: BlockTable) -> list[Any] | None:
        """Fresh mlx-lm cache layers holding the first ``num_tokens`` positions of a table.

        Args:
            block_table: The table.

        Returns:
            The layers, or None if a block holds no KV (opaque data, or cut from
            another layout) or a layer cannot be rebuilt at that position (a recurrent
            layer without a snapshot there).
        """
        with self.paged_cache.lock:
            ids = block_table.block_ids if block_table else []
            if not ids or block_table.num_tokens <= 0:
                return None
            if not all(0 < i < self.paged_cache.max_blocks for i in ids):
                return None
            blocks = [self.paged_cache.blocks[i] for i in ids]
            position = block_table.num_tokens
            if blocks[0].cache_data is None or not self._can_rebuild(blocks, position):
                return None
            datas = [b.cache_data for b in blocks]
            template = datas[0].template
            rebuilt = {
                leaf: adapter_for(t, leaf).rebuild(t, BlockSource([d.views[leaf] for d in datas]), position)
                for leaf, t in leaves(template)
            }
            return rebuild_cache(template, rebuilt)

    def get_stats(self) -> dict[str, Any]:
        """Counters of this cache and usage of its pool.

        Returns:
            hits, misses, hit_rate, tokens_saved, active_requests, and every key of
            `PagedCacheManager.get_memory_usage`.
        """
        with self.paged_cache.lock:
            queries = self._hits + self._misses
            return {
                "hits": self._hits,
                "misses": self._misses,
                "hit_rate": self._hits / queries if queries else 0.0,
                "tokens_saved": self._tokens_saved,
                "active_requests": len(self._request_tables),
                **self.paged_cache.get_memory_usage(),
            }

    def reset_stats(self) -> None:
        """Zero the counters (and the pool's)."""
        with self.paged_cache.lock:
            self._hits = self._misses = self._tokens_saved = 0
            self.paged_cache.reset_stats()

    def clear(self) -> None:
        """Forget every request and block and zero the counters (the store is untouched)."""
        with self.paged_cache.lock:
            self._request_tables.clear()
            self.paged_cache.clear()
            self._hits = self._misses = self._tokens_saved = 0

    def __len__(self) -> int:
        return len(self._request_tables)

    # -- blocks ---------------------------------------------------------------------

    def _hit(
        self, request_id: str, tokens: Any, blocks: list[CacheBlock], matched: int, *, held: bool
    ) -> tuple[BlockTable | None, Any]:
        """Count a fetch and give its blocks (references taken unless `held`) a table."""
        if not blocks:
            self._misses += 1
            return None, tokens
        if not held:
            for block in blocks:
                self.paged_cache.increment_ref(block.block_id)
        table = self._install(request_id, blocks, None)
        table.num_tokens = matched
        self._hits += 1
        self._tokens_saved += matched
        return table, tokens[matched:]

    def _install(self, request_id: str, blocks: list[CacheBlock], data: Any) -> BlockTable:
        """Make `blocks` (references already taken) the table of `request_id`."""
        table = self.paged_cache.create_block_table(request_id)  # releases an older one
        for block in blocks:
            table.add_block(block.block_id, block.token_count)
        self._request_tables[request_id] = BlockCacheEntry(table, data, time.time())
        return table

    def _match(self, toks: np.ndarray, limit: int) -> tuple[list[CacheBlock], int]:
        """Indexed blocks holding the longest prefix of ``toks[:limit]`` (no references)."""
        bs, paged = self.block_size, self.paged_cache
        blocks, parent, pos = [], None, 0
        while limit - pos >= bs:
            block = paged.find_cached_block(toks[pos : pos + bs], parent_hash=parent)
            if block is None:
                break
            blocks.append(block)
            parent, pos = block.block_hash, pos + bs
        # Then the child sharing most with what is left: a partial last block, or a
        # block the query leaves part-way (the table then ends inside it).
        rest, best = toks[pos : min(limit, pos + bs)], None
        for child in paged.find_cached_children(parent) if len(rest) else ():
            shared = common_prefix(np.frombuffer(child.token_ids, dtype="<i4"), rest)
            if shared and (best is None or (-shared, child.token_count) < best[0]):
                best = ((-shared, child.token_count), child, shared)
        if best is None:
            return blocks, pos
        return blocks + [best[1]], pos + best[2]

    def _usable(self, blocks: list[CacheBlock], matched: int) -> tuple[list[CacheBlock], int]:
        """Back off to the longest point at most `matched` where every layer rebuilds."""
        while blocks:
            if self._can_rebuild(blocks, matched):
                return blocks, matched
            matched = (len(blocks) - 1) * self.block_size
            blocks = blocks[:-1]
        return [], 0

    def _can_rebuild(self, blocks: list[CacheBlock], position: int) -> bool:
        datas = [b.cache_data for b in blocks]
        if all(d is None for d in datas):
            return True  # opaque data: bookkeeping only, as vllm-mlx does with mocks
        if not all(isinstance(d, _BlockData) and d.layout == datas[0].layout for d in datas):
            return False
        return all(
            adapter_for(t, leaf).can_rebuild(t, [d.views[leaf] for d in datas], position)
            for leaf, t in leaves(datas[0].template)
        )

    def _put_blocks(self, toks: np.ndarray, layers: list | None) -> list[CacheBlock]:
        """Blocks holding `toks` (and the KV of `layers`), each with a reference taken."""
        paged, bs, n = self.paged_cache, self.block_size, len(toks)
        layout = template = None
        if layers is not None:
            layout, template = signature_of(layers), [_empty_like(c) for c in layers]
        out, parent, fresh = [], None, []
        for start in range(0, n, bs):
            end, last = min(start + bs, n), start + bs >= n
            chunk = toks[start:end]
            block = paged.find_cached_block(chunk, parent_hash=parent)
            if block is not None and paged.increment_ref(block.block_id):
                data = block.cache_data
                if layers is not None and (data is None or _lacks_snapshot(data, last)):
                    views = _cut(layers, start, end, last)
                    fresh.append(views)
                    block.cache_data = _merge(data, _BlockData(layout, template, views))
            else:
                block = paged.allocate_block()
                if block is None:
                    log.warning("block pool exhausted: stored %d of %d tokens", start, n)
                    break
                paged.register_block_hash(block, chunk, parent_hash=parent)
                if layers is not None:
                    views = _cut(layers, start, end, last)
                    fresh.append(views)
                    block.cache_data = _BlockData(layout, template, views)
            out.append(block)
            parent = paged.compute_block_hash(chunk, parent)
        # Evaluate now: lazy slices would pin the caller's whole buffers until first use.
        mx.eval([x for views in fresh for v in views.values() for x in v.tensors.values()])
        return out


def _cut(layers: list, start: int, end: int, last: bool) -> dict[str, BlockView]:
    """Per leaf, the tensors a block keeps for positions ``[start, end)``."""
    return {
        leaf: BlockView(start, end, *adapter_for(layer, leaf).pieces(layer, start, end, last))
        for leaf, layer in leaves(layers)
    }


def _lacks_snapshot(data: Any, last: bool) -> bool:
    # A block first stored mid-sequence has no snapshot; one that now ends a sequence
    # should gain it, or recurrent layers could not resume there.
    return (
        last
        and isinstance(data, _BlockData)
        and not all(v.has_snapshot or v.has_slice for v in data.views.values())
    )


def _merge(old: Any, new: _BlockData) -> _BlockData:
    """Add what `new` knows about a block to what `old` held (same tokens, same place)."""
    if not isinstance(old, _BlockData) or old.layout != new.layout:
        return new if old is None else old
    for leaf, view in new.views.items():
        mine = old.views[leaf]
        mine.tensors = {**view.tensors, **(mine.tensors or {})}
        mine.has_slice |= view.has_slice
        mine.has_snapshot |= view.has_snapshot
    return old

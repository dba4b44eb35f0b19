"""`BlockAwarePrefixCache`: the block-level half of ``vllm_mlx.prefix_cache``.

KV is cut into the blocks of a `PagedCacheManager` (see `paged_cache`) and shared
between requests by positional block keys; see `prefix_cache` for what ``remaining``
means in every fetch.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import PrefixCacheError
from ..keys import as_token_array, best_continuation
from ..layers import (
    BlockSource,
    BlockView,
    adapter_for,
    cut_block,
    empty_like,
    layer_from_seed,
    leaves,
    rebuild_cache,
    seed_without_batch_axis,
    signature_of,
    without_batch_axis,
)
from .paged_cache import BlockTable, CacheBlock, PagedCacheManager
from .through import Linked, StoreLink, covered, warn_once_per_object

log = logging.getLogger("persistent_prefix_cache")


def _as_layers(cache_data: Any) -> list | None:
    """`cache_data` as mlx-lm layers the adapters can cut, or None (kept opaque)."""
    if not isinstance(cache_data, (list, tuple)) or not cache_data:
        return None
    if all(isinstance(d, dict) and "state" in d for d in cache_data):
        layers = [layer_from_seed(d) for d in cache_data]
        if any(layer is None for layer in layers):
            return None
    else:
        layers = list(cache_data)
    try:
        signature_of(layers)
    except PrefixCacheError:
        return None
    return layers


def _batchless(cache_data: Any) -> tuple[int, ...]:
    """Indices of the layers given as ``[heads, seq, dim]`` states (no batch axis:
    vllm-mlx's "Qwen3.5-style" caches); they are held with a batch axis of 1 and
    handed back without it."""
    if not isinstance(cache_data, (list, tuple)):
        return ()
    return tuple(i for i, d in enumerate(cache_data) if seed_without_batch_axis(d))


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

    layout: str  # `signature_of` the cache the block was cut from (and `batchless`)
    template: list  # empty layers with that layout's parameters, shared by its blocks
    views: dict[str, BlockView]  # per leaf: the block's tensors
    batchless: tuple[int, ...] = ()  # layers handed back without their batch axis


class BlockAwarePrefixCache(Linked):
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
        self.link = StoreLink(store, model, warn=warn_once_per_object())

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
        disk, rest = self.link.read(tokens)
        from_disk = n - len(rest) if disk is not None else 0
        with lock:
            # Match again: while the store was read, the pool may have reused blocks.
            blocks, matched = self._usable(*self._match(toks, n - 1))
            if from_disk <= matched:
                return self._hit(request_id, tokens, blocks, matched, held=False)
            put = self._put_blocks(toks[:from_disk], disk)
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
        held = covered(layers)
        if held is not None and held != n:
            if held > n:
                log.warning("cache holds %d positions but %d tokens were given: not stored", held, n)
                return None
            n = held
        if n == 0:
            return None
        with self.paged_cache.lock:
            blocks = self._put_blocks(toks[:n], layers, _batchless(cache_data))
            table = self._install(request_id, blocks, cache_data)
        if self.store is not None and layers is not None:
            self.link.write(toks[:n], layers)
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
            self._request_tables[new_request_id] = BlockCacheEntry(table, source.cache_data, time.time())
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
            cache = rebuild_cache(template, rebuilt)
            for i in datas[0].batchless:
                cache[i] = without_batch_axis(cache[i])
            return cache

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
        rest = toks[pos : min(limit, pos + bs)]
        children = paged.find_cached_children(parent) if len(rest) else ()
        best = best_continuation(rest, [(c.token_ids, c.block_hash, c) for c in children], partial_ok=lambda c: True)
        if best is None:
            return blocks, pos
        return blocks + [best[0]], pos + best[1]

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

    def _put_blocks(self, toks: np.ndarray, layers: list | None, batchless: tuple[int, ...] = ()) -> list[CacheBlock]:
        """Blocks holding `toks` (and the KV of `layers`), each with a reference taken."""
        paged, bs, n = self.paged_cache, self.block_size, len(toks)
        layout, template = "", []  # (what a block records of `layers`: unused without them)
        if layers is not None:
            layout, template = signature_of(layers), [empty_like(c) for c in layers]
            if batchless:
                layout += f"|batchless={','.join(map(str, batchless))}"
        out, parent, fresh = [], None, []
        for start in range(0, n, bs):
            end, last = min(start + bs, n), start + bs >= n
            chunk = toks[start:end]
            block = paged.find_cached_block(chunk, parent_hash=parent)
            if block is not None and paged.increment_ref(block.block_id):
                data = block.cache_data
                if layers is not None and (data is None or _lacks_snapshot(data, last)):
                    views = cut_block(layers, start, end, last)
                    fresh.append(views)
                    block.cache_data = _merge(data, _BlockData(layout, template, views, batchless))
            else:
                block = paged.allocate_block()
                if block is None:
                    log.warning("block pool exhausted: stored %d of %d tokens", start, n)
                    break
                paged.register_block_hash(block, chunk, parent_hash=parent)
                if layers is not None:
                    views = cut_block(layers, start, end, last)
                    fresh.append(views)
                    block.cache_data = _BlockData(layout, template, views, batchless)
            out.append(block)
            parent = paged.compute_block_hash(chunk, parent)
        # Evaluate now: lazy slices would pin the caller's whole buffers until first use.
        mx.eval([x for views in fresh for v in views.values() for x in (v.tensors or {}).values()])
        return out


def _lacks_snapshot(data: Any, last: bool) -> bool:
    # A block first stored mid-sequence has no snapshot; one that now ends a sequence
    # should gain it, or recurrent layers could not resume there.
    return last and isinstance(data, _BlockData) and not all(v.has_snapshot or v.has_slice for v in data.views.values())


def _merge(old: Any, new: _BlockData) -> _BlockData:
    """Add what `new` knows about a block to what `old` held (same tokens, same place)."""
    if not isinstance(old, _BlockData) or old.layout != new.layout:
        return new if old is None else old
    for leaf, view in new.views.items():
        mine = old.views[leaf]
        mine.tensors = {**(view.tensors or {}), **(mine.tensors or {})}
        mine.has_slice |= view.has_slice
        mine.has_snapshot |= view.has_snapshot
    return old

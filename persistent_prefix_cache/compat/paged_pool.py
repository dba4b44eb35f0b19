"""The vLLM-style pool calls of ``vllm_mlx.paged_cache.PagedCacheManager``.

vllm-mlx's manager has two generations of API: the original one (`allocate_block`,
`find_cached_block`, `register_block_hash`, ...) and calls modelled on vLLM's
``BlockPool`` (`get_new_blocks`, `free_block_batch`, `touch`, `get_cached_block`,
`cache_full_blocks`, `get_computed_blocks`, `reset_prefix_cache`). `PoolCalls`, the base
class of `paged_cache.PagedCacheManager`, holds the pool's free list and positional index
(and the helpers on them both generations use), and makes the second set of calls on
them, with vllm-mlx's documented semantics and these differences (its bugs):

- a block given twice to `free_block_batch`, or one that is already free, is ignored
  (the original drives its reference count negative, then raises ``KeyError``);
- a block of another pool is refused with `InvalidArgumentError` (the original
  corrupts its own free list);
- `cache_full_blocks` chains each block's key from the tokens themselves, so a block
  left private because an equal one was indexed first does not break the chain of the
  blocks after it (the original restarts them at the root), and it refuses a range
  that the tokens do not fill (the original caches a short block as full);
- ``enable_caching=False`` turns the whole positional index off, the original calls as
  well: nothing is registered, so nothing is ever found.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import InvalidArgumentError
from ..keys import as_token_array, block_key
from .paged_blocks import CacheBlock, CacheStats


class PoolCalls:
    """The free list and positional index of `PagedCacheManager`'s pool, and the
    vLLM-style calls on them (the subclass holds the blocks, `stats` and `lock`)."""

    # What the subclass holds (`PagedCacheManager` sets them) and the calls of it used here.
    block_size: int
    max_blocks: int
    enable_caching: bool
    lock: threading.RLock
    stats: CacheStats
    blocks: list[CacheBlock]
    allocated_blocks: dict[int, CacheBlock]
    root_hash: bytes

    if TYPE_CHECKING:

        @property
        def free_blocks(self) -> int: ...
        def allocate_block(self) -> CacheBlock | None: ...
        def free_block(self, block_id: int) -> bool: ...
        def register_block_hash(self, block: CacheBlock, tokens: Any, parent_hash: bytes | None = None) -> bytes: ...
        def find_shared_prefix(self, tokens: Any) -> tuple[list[int], Any]: ...

    def _reset_pool(self) -> None:
        """Every block but the null block free, nothing indexed."""
        # Free blocks, least recently used first; allocation pops from the front.
        self._free: OrderedDict[int, CacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._by_hash: dict[bytes, CacheBlock] = {}
        self._children: dict[bytes, dict[int, CacheBlock]] = {}

    def _lookup(self, parent: bytes, data: bytes) -> CacheBlock | None:
        block = self._by_hash.get(block_key(parent, data))
        if block is None or block.parent_hash != parent or block.token_ids != data:
            return None
        return block

    def _counted(self, block: CacheBlock | None) -> CacheBlock | None:
        """A lookup's answer, counted as a hit (and refreshed) or a miss; under the lock."""
        if block is None:
            self.stats.cache_misses += 1
            return None
        self.stats.cache_hits += 1
        self._refresh(block)
        return block

    def _refresh(self, block: CacheBlock) -> None:
        block.touch()
        if block.ref_count == 0:
            self._free.move_to_end(block.block_id)

    def _unindex(self, block: CacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._by_hash.get(block.block_hash) is block:
            del self._by_hash[block.block_hash]
        parent = block.parent_hash
        siblings = self._children.get(parent) if parent is not None else None
        if parent is not None and siblings is not None:
            siblings.pop(block.block_id, None)
            if not siblings:
                del self._children[parent]
        block.block_hash = block.parent_hash = None
        block.token_ids = b""

    def _forget(self, block: CacheBlock) -> None:
        """Empty a block that is being reused or evicted."""
        if block.block_hash is not None:
            self.stats.evictions += 1
        self._unindex(block)
        block.token_count = 0
        block.cache_data = None

    def _allocate_many(self, n: int) -> list[CacheBlock]:
        """`n` blocks from `allocate_block`; under the lock, with `n` free (the caller checked)."""
        out = []
        for _ in range(n):
            block = self.allocate_block()
            if block is None:  # cannot be: the caller saw `n` free under the lock
                raise RuntimeError("the pool's free list ran short under its lock")
            out.append(block)
        return out

    def _own(self, block: Any) -> CacheBlock:
        if (
            not isinstance(block, CacheBlock)
            or not 0 <= block.block_id < self.max_blocks
            or self.blocks[block.block_id] is not block
        ):
            raise InvalidArgumentError(f"{block!r} is not a block of this PagedCacheManager")
        return block

    def get_new_blocks(self, num_blocks: int) -> list[CacheBlock]:
        """Allocate `num_blocks` blocks, all or none (least recently used free first).

        Args:
            num_blocks: How many.

        Returns:
            The blocks, each with ``ref_count == 1`` and nothing cached.

        Raises:
            ValueError: If fewer blocks are free (nothing is allocated then);
                `InvalidArgumentError` (a ValueError) if `num_blocks` is not an int >= 0.
        """
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        with self.lock:
            if num_blocks > self.free_blocks:
                raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.free_blocks} free")
            return self._allocate_many(num_blocks)

    def free_block_batch(self, blocks: Iterable[CacheBlock]) -> None:
        """Drop one reference of each block; those that reach zero become free, in the
        order given (the first is reused first), their cached KV still findable.

        Args:
            blocks: Blocks of this pool; the null block and free blocks are skipped.

        Raises:
            InvalidArgumentError: If a block is not one of this pool's.
        """
        with self.lock:
            for block in list(blocks):
                self.free_block(self._own(block).block_id)

    def touch(self, blocks: Iterable[CacheBlock]) -> None:
        """Take a reference of each block (a prefix hit shared by another request): a
        free block leaves the free list, so it is not reused while referenced.

        Args:
            blocks: Blocks of this pool; the null block is skipped.

        Raises:
            InvalidArgumentError: If a block is not one of this pool's.
        """
        with self.lock:
            for block in list(blocks):
                if self._own(block).is_null:
                    continue
                if block.ref_count == 0:
                    self._free.pop(block.block_id, None)
                    self.allocated_blocks[block.block_id] = block
                block.ref_count += 1
                block.touch()

    def get_cached_block(self, block_hash: bytes) -> CacheBlock | None:
        """The indexed block with key `block_hash` (see `compute_block_hash`), counted as
        a hit or a miss. The block may be free: `touch` it before relying on it.

        Args:
            block_hash: A block's positional key.

        Returns:
            The block, or None (always None with ``enable_caching=False``).
        """
        if not self.enable_caching:
            return None
        with self.lock:
            return self._counted(self._by_hash.get(block_hash))

    def cache_full_blocks(
        self,
        blocks: list[CacheBlock],
        token_ids: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` as holding the matching
        full blocks of `token_ids` (a request's blocks, in order).

        Args:
            blocks: The request's blocks.
            token_ids: The request's tokens.
            num_cached_blocks: Blocks already indexed (skipped).
            num_full_blocks: Blocks to index up to (exclusive).

        Raises:
            InvalidArgumentError: If the range is not within `blocks`, or the tokens do
                not fill its last block.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        toks = as_token_array(token_ids)
        bs = self.block_size
        if num_cached_blocks < 0 or num_full_blocks > len(blocks) or num_full_blocks * bs > len(toks):
            raise InvalidArgumentError(
                f"cannot cache blocks {num_cached_blocks}..{num_full_blocks}: the request has "
                f"{len(blocks)} blocks and {len(toks)} tokens ({len(toks) // bs} full blocks)"
            )
        data, step = toks.tobytes(), 4 * bs
        with self.lock:
            parent = self.root_hash
            for i in range(num_cached_blocks):
                parent = block_key(parent, data[i * step : (i + 1) * step])
            for i in range(num_cached_blocks, num_full_blocks):
                block = self._own(blocks[i])
                parent = self.register_block_hash(block, toks[i * bs : (i + 1) * bs], parent)

    def get_computed_blocks(self, token_ids: Any) -> tuple[list[CacheBlock], int]:
        """Indexed full blocks holding the start of `token_ids` (no references taken;
        `touch` them to share them).

        Args:
            token_ids: The prompt.

        Returns:
            ``(blocks, num_cached_tokens)``; ``([], 0)`` with ``enable_caching=False``.
        """
        if not self.enable_caching:
            return [], 0
        with self.lock:
            ids, _ = self.find_shared_prefix(token_ids)
            return [self.blocks[i] for i in ids], len(ids) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every block's key and KV, and zero the hit, miss and eviction counts,
        if no request holds a block.

        Returns:
            True if reset; False (nothing changed) while any block is referenced.
        """
        with self.lock:
            if len(self.allocated_blocks) > 1:  # the null block is always allocated
                return False
            for block in self.blocks[1:]:
                self._unindex(block)
                block.cache_data = None
            self.stats.cache_hits = self.stats.cache_misses = self.stats.evictions = 0
            return True

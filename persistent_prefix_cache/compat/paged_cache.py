"""Block bookkeeping with the API of ``vllm_mlx.paged_cache``.

`PagedCacheManager` owns a fixed pool of `CacheBlock` records (block 0 is a reserved
null block), hands them out with reference counts, maps requests to `BlockTable`s and
indexes the blocks that hold a prompt's KV under a *positional* key: the chained hash
of `keys.block_key` over every block before it. A block is therefore only ever found at
the position, and after the history, it was computed with.

A block whose last reference is dropped keeps its key and its KV, so a later request can
still share it, until the pool needs the block again: allocation takes the least recently
used free block and removes it from the index first, so a reused block is never found
under the key of what it held before.

`BlockAwarePrefixCache` (in `block_aware`) stores KV in these blocks; this module only
does the bookkeeping and never looks inside ``cache_data``. The records it hands out
(`CacheBlock`, `BlockTable`, `CacheStats`) are in `paged_blocks`.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import InvalidArgumentError
from ..keys import as_token_array, block_key, root_key
from .paged_blocks import BlockTable, CacheBlock, CacheStats
from .paged_pool import PoolCalls

#: Parent key of every block at position 0.
ROOT_HASH = root_key("vllm_mlx.paged_cache", "", "")


def _token_bytes(tokens: Any) -> bytes:
    return as_token_array(tokens).tobytes()


class PagedCacheManager(PoolCalls):
    """A thread-safe pool of reference-counted blocks with a positional block index.

    Every public method takes `lock` (re-entrant); hold it yourself to make several
    calls atomic. The free list and the positional index, with the vLLM-style calls on
    them (`get_new_blocks`, `free_block_batch`, `touch`, `get_cached_block`,
    `cache_full_blocks`, `get_computed_blocks`, `reset_prefix_cache`), are its base class's,
    `paged_pool.PoolCalls`.

    Args:
        block_size: Tokens per block.
        max_blocks: Blocks in the pool, the null block included.
        enable_caching: Keep the positional index (prefix sharing). False: blocks are
            only allocated and reference-counted; nothing is registered or found.

    Raises:
        InvalidArgumentError: If `block_size` < 1 or `max_blocks` < 2.
    """

    root_hash = ROOT_HASH

    def __init__(self, block_size: int = 64, max_blocks: int = 1000, enable_caching: bool = True):
        for name, value, low in (("block_size", block_size, 1), ("max_blocks", max_blocks, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.enable_caching = bool(enable_caching)
        self.lock = threading.RLock()
        self.stats = CacheStats(total_blocks=max_blocks)
        self._reset()

    def _reset(self) -> None:
        self.blocks = [CacheBlock(i) for i in range(self.max_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.null_block.ref_count = 1
        self.allocated_blocks: dict[int, CacheBlock] = {0: self.null_block}
        self.request_tables: dict[str, BlockTable] = {}
        self._reset_pool()

    # -- allocation and references ---------------------------------------------------

    def allocate_block(self) -> CacheBlock | None:
        """Take the least recently used free block (dropping what it cached).

        Returns:
            The block with ``ref_count == 1``, or None if every block is referenced.
        """
        with self.lock:
            if not self._free:
                return None
            _, block = self._free.popitem(last=False)
            self._forget(block)
            block.ref_count = 1
            block.touch()
            self.allocated_blocks[block.block_id] = block
            return block

    def allocate_blocks_for_tokens(self, num_tokens: int) -> list[CacheBlock]:
        """Allocate enough blocks for `num_tokens` tokens, all or none.

        Args:
            num_tokens: Tokens to hold.

        Returns:
            The blocks.

        Raises:
            ValueError: If fewer blocks are free (nothing is allocated then).
        """
        with self.lock:
            needed = -(-num_tokens // self.block_size)
            if needed > len(self._free):
                raise ValueError(f"need {needed} blocks, only {len(self._free)} free")
            return self._allocate_many(needed)

    def free_block(self, block_id: int) -> bool:
        """Drop one reference; at zero the block becomes free (its cached KV stays
        findable until the block is reallocated).

        Args:
            block_id: The block.

        Returns:
            True if the block became free.
        """
        with self.lock:
            block = self.allocated_blocks.get(block_id)
            if block is None or block.is_null:
                return False
            block.ref_count -= 1
            if block.ref_count > 0:
                return False
            del self.allocated_blocks[block_id]
            self._free[block_id] = block
            if block.block_hash is None:
                # Nothing worth keeping: reuse it before blocks that still cache KV.
                self._free.move_to_end(block_id, last=False)
            return True

    def decrement_ref(self, block_id: int) -> bool:
        """Alias of `free_block`.

        Args:
            block_id: The block.

        Returns:
            True if the block became free.
        """
        return self.free_block(block_id)

    def increment_ref(self, block_id: int) -> bool:
        """Add a reference; a free block that still caches KV is taken back.

        Args:
            block_id: The block.

        Returns:
            False for the null block, an unknown id, or a free block that holds
            nothing (there is nothing to share in it).
        """
        with self.lock:
            if not 0 < block_id < self.max_blocks:
                return False
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if block.block_hash is None:
                    return False
                del self._free[block_id]
                self.allocated_blocks[block_id] = block
            block.ref_count += 1
            block.touch()
            return True

    # -- the positional index ------------------------------------------------------

    @staticmethod
    def compute_block_hash(tokens: Any, parent_hash: bytes | None = None) -> bytes:
        """The positional key of a block.

        Args:
            tokens: The block's tokens.
            parent_hash: Key of the block before it; None for position 0.

        Returns:
            16 bytes.
        """
        return block_key(parent_hash or ROOT_HASH, _token_bytes(tokens))

    def register_block_hash(self, block: CacheBlock, tokens: Any, parent_hash: bytes | None = None) -> bytes:
        """Index `block` as holding `tokens` right after the block keyed `parent_hash`.

        A block registered without a parent is a position-0 block: it is never found
        anywhere else. If an equal block is indexed already, that one stays indexed and
        `block` remains private (as does every block with ``enable_caching=False``).

        Args:
            block: The block (its ``token_count`` is set to ``len(tokens)``).
            tokens: The tokens it holds.
            parent_hash: Key of the block before it; None for position 0.

        Returns:
            The block's key.
        """
        with self.lock:
            parent = parent_hash or ROOT_HASH
            data = _token_bytes(tokens)
            key = block_key(parent, data)
            block.token_count = len(data) // 4
            if block.block_hash == key:
                return key
            self._unindex(block)
            if key in self._by_hash or not self.enable_caching:
                return key
            block.block_hash, block.parent_hash, block.token_ids = key, parent, data
            self._by_hash[key] = block
            self._children.setdefault(parent, {})[block.block_id] = block
            return key

    def find_cached_block(self, tokens: Any, parent_hash: bytes | None = None) -> CacheBlock | None:
        """The indexed block holding `tokens` right after the block keyed `parent_hash`.

        The block may be free (``ref_count == 0``): take a reference with
        `increment_ref` before relying on it.

        Args:
            tokens: The block's tokens.
            parent_hash: Key of the block before it; None for position 0.

        Returns:
            The block, or None.
        """
        with self.lock:
            return self._counted(self._lookup(parent_hash or ROOT_HASH, _token_bytes(tokens)))

    def find_cached_children(self, parent_hash: bytes | None = None) -> list[CacheBlock]:
        """Indexed blocks that follow the block keyed `parent_hash`, by block id.

        Args:
            parent_hash: Key of the parent block; None for position 0.

        Returns:
            The blocks (full or partial).
        """
        with self.lock:
            found = self._children.get(parent_hash or ROOT_HASH, {})
            return [found[i] for i in sorted(found)]

    def find_shared_prefix(self, tokens: Any) -> tuple[list[int], Any]:
        """Indexed full blocks that hold the start of `tokens`, in order.

        References are not taken.

        Args:
            tokens: The prompt.

        Returns:
            ``(block_ids, remaining)``: the blocks and the tokens after them.
        """
        with self.lock:
            data = _token_bytes(tokens)
            step = 4 * self.block_size
            parent, ids = ROOT_HASH, []
            for start in range(0, len(data) - step + 1, step):
                block = self._lookup(parent, data[start : start + step])
                if block is None or block.block_hash is None:  # (an indexed block has its key)
                    self.stats.cache_misses += 1
                    break
                self.stats.cache_hits += 1
                self._refresh(block)
                ids.append(block.block_id)
                parent = block.block_hash
            return ids, tokens[len(ids) * self.block_size :]

    # -- block tables ----------------------------------------------------------------

    def create_block_table(self, request_id: str) -> BlockTable:
        """A new, empty table for `request_id`; an older table of it is deleted first
        (its references would otherwise never be dropped).

        Args:
            request_id: The request.

        Returns:
            The table.
        """
        with self.lock:
            self.delete_block_table(request_id)
            table = BlockTable(request_id)
            self.request_tables[request_id] = table
            return table

    def get_block_table(self, request_id: str) -> BlockTable | None:
        """The table of `request_id`.

        Args:
            request_id: The request.

        Returns:
            The table, or None.
        """
        with self.lock:
            return self.request_tables.get(request_id)

    def get_or_create_block_table(self, request_id: str) -> BlockTable:
        """The table of `request_id`, created empty if missing.

        Args:
            request_id: The request.

        Returns:
            The table.
        """
        with self.lock:
            table = self.request_tables.get(request_id)
            return table if table is not None else self.create_block_table(request_id)

    def delete_block_table(self, request_id: str) -> None:
        """Delete the table of `request_id` and drop its references.

        Args:
            request_id: The request (unknown ids are ignored).
        """
        with self.lock:
            table = self.request_tables.pop(request_id, None)
            for block_id in table.block_ids if table else ():
                self.free_block(block_id)

    def add_block_to_table(self, table: BlockTable, block: CacheBlock, tokens_in_block: int) -> None:
        """Append a block the caller holds a reference to.

        Args:
            table: The table.
            block: The block (its ``token_count`` becomes `tokens_in_block`).
            tokens_in_block: Tokens it holds.
        """
        with self.lock:
            block.token_count = tokens_in_block
            table.add_block(block.block_id, tokens_in_block)

    def fork_block_table(self, source_table: BlockTable, new_request_id: str) -> BlockTable:
        """Share the blocks of `source_table` with another request.

        Args:
            source_table: The table to share.
            new_request_id: The other request (an older table of it is deleted).

        Returns:
            The new table; every block gains a reference.
        """
        with self.lock:
            table = source_table.copy(new_request_id)
            for block_id in table.block_ids:
                self.increment_ref(block_id)
            self.delete_block_table(new_request_id)
            self.request_tables[new_request_id] = table
            return table

    def get_blocks_for_generation(self, table: BlockTable) -> tuple[list[CacheBlock], bool]:
        """The table's blocks, copying the last one first if it is shared.

        Generation only appends after the last block, so that is the only block a
        request could write into; earlier shared blocks stay shared. The copy shares
        the source's ``cache_data`` (immutable arrays) and is not indexed.

        Args:
            table: The request's table (its last id is replaced by the copy's).

        Returns:
            ``(blocks, was_copied)``; no copy is made when the pool is exhausted.
        """
        with self.lock:
            blocks = [self.blocks[i] for i in table.block_ids]
            for block in blocks:
                block.touch()
            if not blocks or not blocks[-1].is_shared():
                return blocks, False
            source = blocks[-1]
            copy = self.allocate_block()
            if copy is None:
                return blocks, False
            copy.token_count, copy.cache_data = source.token_count, source.cache_data
            table.block_ids[-1] = copy.block_id
            self.free_block(source.block_id)
            self.stats.cow_copies += 1
            return blocks[:-1] + [copy], True

    # -- eviction and statistics ---------------------------------------------------

    def evict_lru_blocks(self, num_blocks: int) -> int:
        """Drop the cached KV of up to `num_blocks` least recently used free blocks.

        Args:
            num_blocks: How many to drop at most.

        Returns:
            How many were dropped.
        """
        with self.lock:
            victims = [b for b in self._free.values() if b.block_hash is not None][:num_blocks]
            for block in victims:
                self._forget(block)
                self._free.move_to_end(block.block_id, last=False)
            return len(victims)

    def handle_memory_pressure(self, requested_blocks: int) -> bool:
        """Whether `requested_blocks` can be allocated now.

        Free blocks that still cache KV count as available: allocation evicts them on
        demand, least recently used first, so nothing is dropped ahead of time.
        Referenced blocks are never evicted; release finished requests to free them.

        Args:
            requested_blocks: Blocks about to be allocated.

        Returns:
            True if enough blocks are free.
        """
        with self.lock:
            return len(self._free) >= requested_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks (null block excluded) in use."""
        return 1.0 - len(self._free) / (self.max_blocks - 1)

    def get_stats(self) -> CacheStats:
        """Refresh the counts and return the live `stats` object.

        Returns:
            The stats.
        """
        with self.lock:
            s = self.stats
            s.allocated_blocks = len(self.allocated_blocks)
            s.free_blocks = len(self._free)
            s.shared_blocks = sum(1 for b in self.allocated_blocks.values() if b.ref_count > 1)
            s.cached_blocks = len(self._by_hash)
            s.total_tokens_cached = sum(b.token_count for b in self.allocated_blocks.values() if not b.is_null)
            return s

    def get_memory_usage(self) -> dict[str, Any]:
        """Usage of the pool.

        Returns:
            block_size, max_blocks, allocated_blocks (null block included),
            free_blocks, shared_blocks, cached_blocks, total_tokens_cached (in
            referenced blocks), utilization (allocated / max_blocks), cache_hit_rate.
        """
        with self.lock:
            s = self.get_stats()
            lookups = s.cache_hits + s.cache_misses
            return {
                "block_size": self.block_size,
                "max_blocks": self.max_blocks,
                "allocated_blocks": s.allocated_blocks,
                "free_blocks": s.free_blocks,
                "shared_blocks": s.shared_blocks,
                "cached_blocks": s.cached_blocks,
                "total_tokens_cached": s.total_tokens_cached,
                "utilization": s.allocated_blocks / self.max_blocks,
                "cache_hit_rate": s.cache_hits / lookups if lookups else 0.0,
            }

    def reset_stats(self) -> None:
        """Zero the hit, miss, copy and eviction counters."""
        with self.lock:
            self.stats.cache_hits = self.stats.cache_misses = 0
            self.stats.cow_copies = self.stats.evictions = 0

    def clear(self) -> None:
        """Forget every block, table and counter (block 0 is reserved again)."""
        with self.lock:
            self.stats = CacheStats(total_blocks=self.max_blocks)
            self._reset()

"""The records of ``vllm_mlx.paged_cache``: blocks of the pool, request tables, counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class CacheBlock:
    """One block of the pool.

    Attributes:
        block_id: Index in the pool (0 is the null block).
        ref_count: Holders of the block; 0 means free (maybe still cached).
        block_hash: Positional key while the block is indexed, else None.
        parent_hash: Key of the block before it (`ROOT_HASH` at position 0).
        token_ids: The block's tokens (int32 little-endian), checked on every lookup so
            that a hash collision is a miss.
        token_count: Tokens the block holds.
        cache_data: Whatever the owner keeps in the block (KV tensors for
            `BlockAwarePrefixCache`).
        last_access: `time.time()` of the last allocation, reference or lookup.
        is_null: True for the reserved block 0.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: bytes = b""
    token_count: int = 0
    cache_data: Any = None
    last_access: float = field(default_factory=time.time)
    is_null: bool = False

    def is_full(self, block_size: int) -> bool:
        """Whether the block holds `block_size` tokens.

        Args:
            block_size: Tokens per block of the pool.

        Returns:
            True if full.
        """
        return self.token_count >= block_size

    def is_shared(self) -> bool:
        """Whether more than one holder references the block.

        Returns:
            True if ``ref_count > 1``.
        """
        return self.ref_count > 1

    def touch(self) -> None:
        """Record an access now."""
        self.last_access = time.time()


@dataclass
class BlockTable:
    """The blocks of one request, in order.

    Attributes:
        request_id: The request.
        block_ids: Pool indices of its blocks.
        num_tokens: Positions of those blocks the request uses; it may end inside the
            last block (a prefix hit that shares part of a block).
    """

    request_id: str
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def add_block(self, block_id: int, num_tokens: int) -> None:
        """Append a block that adds `num_tokens` positions.

        Args:
            block_id: The block.
            num_tokens: Positions it adds.
        """
        self.block_ids.append(block_id)
        self.num_tokens += num_tokens

    def __len__(self) -> int:
        return len(self.block_ids)

    def copy(self, new_request_id: str) -> "BlockTable":
        """A table with the same blocks for another request (references not taken).

        Args:
            new_request_id: The other request.

        Returns:
            The new table.
        """
        return BlockTable(new_request_id, list(self.block_ids), self.num_tokens)


@dataclass
class CacheStats:
    """Counters of a `PagedCacheManager` (counts are refreshed by `get_stats`)."""

    total_blocks: int = 0
    allocated_blocks: int = 0
    free_blocks: int = 0
    shared_blocks: int = 0
    cached_blocks: int = 0
    total_tokens_cached: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cow_copies: int = 0
    evictions: int = 0

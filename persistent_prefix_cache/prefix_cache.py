"""The import path of ``vllm_mlx.prefix_cache``'s API (see `compat.prefix_cache` and
`compat.block_aware`)."""

from .compat.block_aware import BlockAwarePrefixCache, BlockCacheEntry
from .compat.prefix_cache import CacheEntry, PrefixCacheManager, PrefixCacheStats

__all__ = [
    "BlockAwarePrefixCache",
    "BlockCacheEntry",
    "CacheEntry",
    "PrefixCacheManager",
    "PrefixCacheStats",
]

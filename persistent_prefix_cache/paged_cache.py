"""The import path of ``vllm_mlx.paged_cache``'s API (see `compat.paged_cache`)."""

from .compat.paged_blocks import BlockTable, CacheBlock, CacheStats
from .compat.paged_cache import ROOT_HASH, PagedCacheManager

__all__ = ["BlockTable", "CacheBlock", "CacheStats", "PagedCacheManager", "ROOT_HASH"]

"""persistent_prefix_cache: a prefix (KV) cache for mlx-lm that survives process restarts.

Start with `PersistentPrefixCache`: ``fetch(tokens)`` restores the longest stored prefix
as fresh mlx-lm cache objects, ``store(tokens, cache)`` keeps a prompt's KV on disk.
"""

from .errors import (
    InvalidArgumentError,
    LayoutMismatchError,
    PrefixCacheError,
    ReadOnlyStoreError,
    StoreCorruptError,
    StoreVersionError,
    UnsupportedCacheError,
)
from .fingerprint import fingerprint_model
from .store import PersistentPrefixCache

__version__ = "0.1.0"

__all__ = [
    "PersistentPrefixCache",
    "fingerprint_model",
    "PrefixCacheError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "ReadOnlyStoreError",
    "StoreCorruptError",
    "StoreVersionError",
    "UnsupportedCacheError",
]

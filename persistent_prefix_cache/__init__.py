"""persistent_prefix_cache: a prefix (KV) cache for mlx-lm that survives process restarts.

Start with `PersistentPrefixCache`: ``fetch(tokens)`` restores the longest stored prefix
as fresh mlx-lm cache objects, ``store(tokens, cache)`` keeps a prompt's KV on disk.

The package's folders are its wings (see docs/architecture.md): ``disk/`` (the index
and segment files), ``layers/`` (mlx-lm's cache classes), ``tiers/`` (the RAM
and remote tiers), the facade `store` with `lookup`, `restore` and `writeback` beside it,
``admin/`` (check, repair, export, import, push, pull), ``compat/`` (vllm-mlx's and
mlx-lm's APIs) and ``cli/`` (``ppc``).

Names are imported on first use, so that store maintenance (``ppc stats``, ``ppc
check``, …) does not pay for importing mlx-lm and transformers. `__all__` is the API:
the only public names ``dir()`` shows here, whatever submodules a program has imported.
"""

from importlib import import_module as _import_module

# Every typed error, what a call of the API or ppc can raise (errors.py is their one home;
# tests/test_errors.py checks that none is left out).
from .errors import (
    EmptiesStoreError,
    InvalidArgumentError,
    LayoutMismatchError,
    MissingDependencyError,
    ModelMismatchError,
    PrefixCacheError,
    PromptCacheFileError,
    ReadOnlyStoreError,
    RemoteConfigError,
    RemoteUnreachableError,
    StoreBusyError,
    StoreClosedError,
    StoreCorruptError,
    StoreNotWritableError,
    StorePathError,
    StoreVersionError,
    UnsupportedCacheError,
    UnsupportedServerError,
    UnverifiedPackError,
)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "PersistentPrefixCache": ".store",
    "fingerprint_model": ".fingerprint",
    "prefill": ".prefill",
    "FetchReport": ".core.miss_reasons",
    "PersistentLRUPromptCache": ".compat.lru_prompt_cache",
    # the seed's API (vllm_mlx.prefix_cache / vllm_mlx.paged_cache)
    "PrefixCacheStats": ".compat.prefix_cache",
    "CacheEntry": ".compat.prefix_cache",
    "PrefixCacheManager": ".compat.prefix_cache",
    "BlockCacheEntry": ".compat.block_aware",
    "BlockAwarePrefixCache": ".compat.block_aware",
    "PagedCacheManager": ".compat.paged_cache",
    "BlockTable": ".compat.paged_blocks",
    "CacheBlock": ".compat.paged_blocks",
}

__all__ = [
    "PersistentPrefixCache",
    "fingerprint_model",
    "prefill",
    "FetchReport",
    "PersistentLRUPromptCache",
    "PrefixCacheStats",
    "CacheEntry",
    "PrefixCacheManager",
    "BlockCacheEntry",
    "BlockAwarePrefixCache",
    "PagedCacheManager",
    "BlockTable",
    "CacheBlock",
    "PrefixCacheError",
    "InvalidArgumentError",
    "StoreClosedError",
    "StorePathError",
    "EmptiesStoreError",
    "UnverifiedPackError",
    "RemoteConfigError",
    "LayoutMismatchError",
    "ModelMismatchError",
    "PromptCacheFileError",
    "ReadOnlyStoreError",
    "StoreNotWritableError",
    "StoreBusyError",
    "StoreCorruptError",
    "StoreVersionError",
    "UnsupportedCacheError",
    "UnsupportedServerError",
    "MissingDependencyError",
    "RemoteUnreachableError",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(_import_module(module, __name__), name)
    except ImportError as exc:
        if "libmlx" not in str(exc):
            raise
        # mlx without a backend (a plain `pip install` on Linux): say which to pick.
        raise ImportError(
            f"MLX is installed without a backend ({exc}); on Linux install one: "
            "reinstall this package with its [cpu] extra (pip install '.[cpu]' in its checkout), "
            "or [cuda] for an NVIDIA GPU"
        ) from exc
    globals()[name] = value
    return value


def __dir__():
    # Python binds every imported submodule (``errors``, ``store``, ...) as an attribute
    # here: they are the package's rooms, not its API, so they stay out of the listing.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("_")})

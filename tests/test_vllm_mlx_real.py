"""Our drop-ins beside the real vllm-mlx 0.6.0 (``vllm_mlx.prefix_cache`` and
``vllm_mlx.paged_cache``), where it is installed: the mlx-lm 0.31 venv of
``make test-mlx-lm-0.31`` installs it (without its dependencies: these two modules need
only mlx). Elsewhere (vllm-mlx 0.6.0 requires mlx-lm < 0.32) the module is skipped.

The API check lists every public class and method of vllm-mlx's modules and asks ours
for the same names with the same leading parameters; the differences we know of are
listed below with the reason, and the check fails on any other, and on any of those
that is gone (so the list stays true). The behaviour check runs the same calls on both
managers with real mlx-lm cache layers and compares what they return.
"""

from __future__ import annotations

import importlib
import inspect

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from persistent_prefix_cache.layers.mlx_lm_versions import make_layer

vllm_prefix = pytest.importorskip("vllm_mlx.prefix_cache", reason="vllm-mlx is not installed here")
vllm_paged = importlib.import_module("vllm_mlx.paged_cache")

MODULES = [
    (vllm_prefix, importlib.import_module("persistent_prefix_cache.prefix_cache")),
    (vllm_paged, importlib.import_module("persistent_prefix_cache.paged_cache")),
]

# What differs on purpose, and why.
KNOWN = {
    # vllm-mlx's free list is a doubly linked list threaded through the blocks
    # (prev_free_block / next_free_block, FreeKVCacheBlockQueue) and its hash index a
    # BlockHashToBlockMap: internals of its pool that callers do not touch. Ours keeps
    # free blocks in an ordered dict and checks every block's tokens on lookup, so its
    # blocks carry parent_hash and token_ids instead.
    "missing class vllm_mlx.paged_cache.KVCacheBlock",
    "missing class vllm_mlx.paged_cache.FreeKVCacheBlockQueue",
    "missing class vllm_mlx.paged_cache.BlockHashToBlockMap",
    "missing CacheBlock.reset_hash",
    "CacheBlock.__init__ takes (block_id, ref_count, block_hash, parent_hash, token_ids, token_count, "
    "cache_data, last_access, is_null)",
    # One more counter, inserted where it reads best: only keyword construction is alike.
    "CacheStats.__init__ takes (total_blocks, allocated_blocks, free_blocks, shared_blocks, cached_blocks, "
    "total_tokens_cached, cache_hits, cache_misses, cow_copies, evictions)",
}


def _differences() -> set[str]:
    found = set()
    for theirs, ours in MODULES:
        for name, cls in vars(theirs).items():
            if name.startswith("_") or not inspect.isclass(cls) or cls.__module__ != theirs.__name__:
                continue
            mine = getattr(ours, name, None)
            if mine is None:
                found.add(f"missing class {theirs.__name__}.{name}")
                continue
            for attr, member in vars(cls).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if not (callable(member) or isinstance(member, property)):
                    continue
                other = getattr(mine, attr, None)
                if other is None:
                    found.add(f"missing {name}.{attr}")
                    continue
                try:
                    want, got = inspect.signature(member), inspect.signature(other)
                except (TypeError, ValueError):  # properties and builtins: the name is what counts
                    continue
                want_names, got_names = list(want.parameters), list(got.parameters)
                if got_names[: len(want_names)] != want_names:
                    found.add(f"{name}.{attr} takes ({', '.join(got_names[1:])})")
    return found


def test_every_public_name_of_vllm_mlx_is_ours_but_the_known_differences():
    assert _differences() == KNOWN


def kv(n: int, marker: float) -> list:
    """Two ``KVCache`` layers holding `n` positions filled with `marker`."""
    x = mx.full((1, 2, n, 4), marker)
    return [make_layer(KVCache, (x, x), offset=n) for _ in range(2)]


def _shape(result) -> tuple:
    cache, remaining = result
    return (None if cache is None else [layer.offset for layer in cache]), list(remaining)


def test_prefix_cache_manager_answers_as_vllm_mlx_does():
    from persistent_prefix_cache.prefix_cache import PrefixCacheManager

    theirs, ours = vllm_prefix.PrefixCacheManager(None, max_entries=4), PrefixCacheManager(None, max_entries=4)
    for manager in (theirs, ours):
        manager.store_cache([1, 2, 3, 4, 5], kv(5, 1.0))
        manager.store_cache([7, 8, 9], kv(3, 2.0))
    queries = [
        [1, 2, 3, 4, 5, 6, 7],  # a stored prefix and more
        [7, 8, 9, 10],
        [4, 4, 4],  # nothing stored
        [9],
    ]
    for q in queries:
        assert _shape(ours.fetch_cache(q)) == _shape(theirs.fetch_cache(q)), q
    mine, want = ours.get_stats(), theirs.get_stats()
    for key in ("hits", "misses", "tokens_saved", "total_queries"):
        assert mine[key] == want[key], key


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_block_aware_cache_takes_what_vllm_mlx_extracts(family):
    """The per-layer dicts vllm-mlx 0.6.0's own scheduler extracts (its real
    ``_extract_cache_states``: ``state`` and ``meta_state`` of mlx-lm 0.31) are stored by
    our `BlockAwarePrefixCache` and rebuilt into a cache that continues exactly like the
    original: KV (llama), a rotating window (gemma3_text), recurrent state (qwen3_next)."""
    import numpy as np
    from families import build
    from mlx_lm.models.cache import make_prompt_cache

    from persistent_prefix_cache.paged_cache import PagedCacheManager
    from persistent_prefix_cache.prefix_cache import BlockAwarePrefixCache

    scheduler = importlib.import_module("vllm_mlx.scheduler")
    model = build(family)
    tokens = np.random.default_rng(5).integers(0, 256, 30).tolist()  # past gemma3_text's window of 24
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    extracted = scheduler.Scheduler._extract_cache_states(None, cache)
    assert len(extracted) == len(cache)  # vllm-mlx could read every layer (it cannot on mlx-lm 0.32)
    prefix = BlockAwarePrefixCache(model, PagedCacheManager(block_size=4, max_blocks=32))
    prefix.store_cache("r1", tokens, extracted)
    table, remaining = prefix.fetch_cache("r2", tokens + [7])
    assert table is not None and table.num_tokens == len(tokens) and remaining == [7]
    rebuilt = prefix.reconstruct_cache(table)
    assert rebuilt is not None
    got = model(mx.array([[7]]), cache=rebuilt)[0, -1]
    want = model(mx.array([[7]]), cache=cache)[0, -1]
    assert mx.array_equal(got, want).item()

"""`PrefixCacheManager`: vllm-mlx's documented behaviour, the seed's bugs, persistence.

The contract tests use opaque objects as caches, as vllm-mlx's own tests do (the
manager must keep working with them); everything that runs a model uses the tiny real
mlx-lm llama from conftest and compares logits bit for bit with a cold prefill.
"""

from __future__ import annotations

import copy
import json
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from helpers import assert_same_logits, cold_logits, feed, prefill, random_tokens, run_python_json
from persistent_prefix_cache import InvalidArgumentError, PersistentPrefixCache
from persistent_prefix_cache.layers.mlx_lm_versions import make_layer
from persistent_prefix_cache.prefix_cache import CacheEntry, PrefixCacheManager, PrefixCacheStats


def kv(n: int, marker: float, layers: int = 1) -> list:
    """`layers` KVCache layers holding `n` positions filled with `marker` (no model)."""
    x = mx.full((1, 1, n, 4), marker)
    return [make_layer(KVCache, (x, x), offset=n) for _ in range(layers)]


def marker(cache: list) -> float:
    return cache[0].keys[0, 0, 0, 0].item()


def greedy(model, prompt, cache=None, n: int = 4) -> list[int]:
    """`n` greedy tokens from mlx-lm's own `generate_step` (fresh cache if None)."""
    cache = make_prompt_cache(model) if cache is None else cache
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n)
    return [int(t) for t, _ in steps]


@pytest.fixture
def manager():
    return PrefixCacheManager(object(), max_entries=10)


# -- PrefixCacheStats and CacheEntry -----------------------------------------------


def test_stats_start_at_zero_and_hit_rate_needs_queries():
    stats = PrefixCacheStats()
    assert (stats.hits, stats.misses, stats.tokens_saved, stats.total_queries) == (0, 0, 0, 0)
    assert stats.evictions == 0
    assert stats.hit_rate == 0.0


def test_stats_hit_rate_and_dict():
    stats = PrefixCacheStats(hits=3, misses=7, tokens_saved=100, total_queries=10, evictions=2)
    assert stats.hit_rate == 0.3
    assert stats.to_dict() == {
        "hits": 3,
        "misses": 7,
        "hit_rate": 0.3,
        "tokens_saved": 100,
        "total_queries": 10,
        "evictions": 2,
    }


def test_cache_entry_holds_cache_and_count():
    entry = CacheEntry(prompt_cache=["kv"], count=1)
    entry.count += 1
    assert (entry.prompt_cache, entry.count) == (["kv"], 2)


# -- the seed's documented contract ------------------------------------------------


def test_init_records_model_and_size():
    model = object()
    m = PrefixCacheManager(model, max_entries=50)
    assert (m.model, m.model_key, m.max_size, len(m)) == (model, id(model), 50, 0)
    with pytest.raises(InvalidArgumentError):
        PrefixCacheManager(model, max_entries=0)
    with pytest.raises(InvalidArgumentError):
        PrefixCacheManager(model, store=42)


def test_miss_returns_the_tokens(manager):
    tokens = [1, 2, 3, 4, 5]
    cache, remaining = manager.fetch_cache(tokens)
    assert cache is None and remaining == tokens
    assert (manager.stats.misses, manager.stats.hits, manager.stats.total_queries) == (1, 0, 1)


def test_exact_hit_returns_the_stored_object_and_nothing_left(manager):
    stored = [["kv", 1]]
    manager.store_cache([1, 2, 3, 4, 5], stored)
    assert len(manager) == 1
    cache, remaining = manager.fetch_cache([1, 2, 3, 4, 5])
    assert cache is stored and remaining == []
    assert (manager.stats.hits, manager.stats.tokens_saved) == (1, 5)


def test_shorter_prefix_hit_returns_the_rest(manager):
    manager.store_cache([1, 2, 3], ["short"])
    cache, remaining = manager.fetch_cache([1, 2, 3, 4, 5, 6])
    assert cache == ["short"] and remaining == [4, 5, 6]
    assert (manager.stats.hits, manager.stats.tokens_saved) == (1, 3)


def test_longer_trimmable_entry_is_trimmed_to_the_query(manager):
    manager.store_cache([1, 2, 3, 4, 5], kv(5, 1.0))
    cache, remaining = manager.fetch_cache([1, 2, 3])
    assert remaining == [] and cache[0].offset == 3
    assert manager.stats.tokens_saved == 3


def test_longer_untrimmable_entry_is_a_miss(manager):
    manager.store_cache([1, 2, 3, 4, 5], ["opaque"])  # no is_trimmable(): never trimmed
    assert manager.fetch_cache([1, 2, 3]) == (None, [1, 2, 3])


def test_branching_prefixes_keep_their_own_entries(manager):
    manager.store_cache([1, 2], ["a"])
    manager.store_cache([3, 4], ["b"])
    manager.store_cache([1, 2, 3], ["c"])
    manager.store_cache([1, 2, 4], ["d"])
    found = [manager.fetch_cache(t)[0] for t in ([1, 2], [3, 4], [1, 2, 3], [1, 2, 4])]
    assert found == [["a"], ["b"], ["c"], ["d"]]


def test_lru_eviction_by_entry_count_is_counted():
    m = PrefixCacheManager(object(), max_entries=3)
    for t in ([1], [2], [3], [4]):
        m.store_cache(t, [f"c{t[0]}"])
    assert len(m) == 3 and m.stats.evictions == 1
    assert m.fetch_cache([1])[0] is None
    assert m.fetch_cache([4])[0] == ["c4"]


def test_a_hit_refreshes_the_lru_position():
    m = PrefixCacheManager(object(), max_entries=3)
    for t in ([1], [2], [3]):
        m.store_cache(t, [f"c{t[0]}"])
    m.fetch_cache([1])
    m.store_cache([4], ["c4"])
    assert m.fetch_cache([1])[0] == ["c1"]
    assert m.fetch_cache([2])[0] is None


def test_storing_again_counts_and_refreshes():
    m = PrefixCacheManager(object(), max_entries=2)
    m.store_cache([1], ["first"])
    m.store_cache([2], ["two"])
    m.store_cache([1], ["second"])  # same tokens: the entry is kept, counted, refreshed
    m.store_cache([3], ["three"])
    assert m.fetch_cache([1])[0] == ["first"]
    assert m._entries[np.array([1], "<i4").tobytes()].count == 2
    assert m.fetch_cache([2])[0] is None


def test_empty_tokens_are_not_stored(manager):
    manager.store_cache([], ["empty"])
    assert len(manager) == 0
    assert manager.fetch_cache([]) == (None, [])


def test_get_stats_reset_stats_and_clear(manager):
    manager.store_cache([1, 2, 3], ["c"])
    manager.fetch_cache([1, 2, 3])
    manager.fetch_cache([4, 5, 6])
    stats = manager.get_stats()
    assert (stats["hits"], stats["misses"], stats["total_queries"]) == (1, 1, 2)
    assert stats["hit_rate"] == 0.5
    manager.reset_stats()
    assert manager.get_stats()["total_queries"] == 0 and len(manager) == 1
    manager.fetch_cache([1, 2, 3])
    manager.clear()
    assert len(manager) == 0 and manager.stats.hits == 0
    assert manager.fetch_cache([1, 2, 3])[0] is None


def test_tokens_may_be_numpy_or_mlx_arrays(manager):
    manager.store_cache(np.array([1, 2, 3]), ["c"])
    cache, remaining = manager.fetch_cache(mx.array([1, 2, 3, 4]))
    assert cache == ["c"] and remaining.tolist() == [4]
    with pytest.raises(InvalidArgumentError):
        manager.fetch_cache([[1, 2]])


# -- the seed's bugs -------------------------------------------------------------------


def test_bug1_shorter_prefix_found_where_a_longer_entry_diverges(manager):
    # Seed: the walk reached [1,2,3,4], found no entry there and no child 9: a miss.
    manager.store_cache([1, 2, 3], ["c123"])
    manager.store_cache([1, 2, 3, 4, 5], ["c12345"])
    assert manager.fetch_cache([1, 2, 3, 4, 9]) == (["c123"], [4, 9])


def test_bug1_shorter_prefix_found_when_the_longer_entry_is_not_usable(manager):
    # A trimmable longer entry the query leaves part-way, and an untrimmable one it
    # extends into: neither can serve [1,2,3,4,9] / [1,2,3,4]; the shorter prefix must.
    manager.store_cache([1, 2], ["c12"])
    manager.store_cache([1, 2, 3, 4, 5], kv(5, 5.0))
    manager.store_cache([1, 2, 3, 4, 6, 7], ["opaque"])
    assert manager.fetch_cache([1, 2, 3, 4, 9]) == (["c12"], [3, 4, 9])
    m = PrefixCacheManager(object())
    m.store_cache([1, 2], ["c12"])
    m.store_cache([1, 2, 3, 4, 6, 7], ["opaque"])
    assert m.fetch_cache([1, 2, 3, 4]) == (["c12"], [3, 4])


def test_bug2_longer_hit_refreshes_lru_and_copies_only_the_query():
    m = PrefixCacheManager(object(), max_entries=3)
    long = kv(5, 1.0)
    m.store_cache([1, 2, 3, 4, 5], long)
    m.store_cache([7, 8], ["b"])
    m.store_cache([9, 10], ["c"])
    cache, remaining = m.fetch_cache([1, 2, 3])
    assert remaining == [] and cache is not long
    # Only the query's three positions were copied, not the longer entry's buffer.
    assert cache[0].keys.shape[2] == 3 and cache[0].offset == 3
    m.store_cache([11], ["d"])  # evicts [7, 8], not the entry the hit just used
    assert m.fetch_cache([7, 8])[0] is None
    # Extending the trimmed copy leaves the stored entry as it was.
    new = mx.full((1, 1, 2, 4), 9.0)
    cache[0].update_and_fetch(new, new)
    mx.eval(cache[0].keys)
    again, _ = m.fetch_cache([1, 2, 3, 4, 5])
    assert again is long and long[0].offset == 5
    assert mx.array_equal(long[0].keys, mx.full((1, 1, 5, 4), 1.0)).item()


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_bug3_shortest_usable_longer_entry_chosen_deterministically(order):
    entries = [([1, 2, 3, 4, 5, 6], 6.0), ([1, 2, 3, 4, 7], 7.0), ([1, 2, 3, 4, 5], 5.0)]
    m = PrefixCacheManager(object())
    for i in order:
        tokens, mark = entries[i]
        m.store_cache(tokens, kv(len(tokens), mark))
    m.store_cache([1, 2, 3, 8, 8], ["not trimmable, not a candidate"])
    cache, remaining = m.fetch_cache([1, 2, 3])
    # Both 5-token entries are shortest; the tie goes the same way in every order.
    assert remaining == [] and cache[0].offset == 3
    assert marker(cache) == 5.0


def test_bug7_trimming_needs_every_layer_trimmable(manager):
    # Layer 0 is a trimmable KVCache, layer 1 a recurrent ArraysCache: trimming layer 0
    # alone (the seed looked at layer 0 only) would pair 3 positions with a 5-token state.
    hybrid = kv(5, 1.0) + [ArraysCache(1)]
    hybrid[1][0] = mx.ones((1, 4))
    manager.store_cache([1, 2, 3, 4, 5], hybrid)
    assert manager.fetch_cache([1, 2, 3]) == (None, [1, 2, 3])
    manager.store_cache([1, 2], ["c12"])
    assert manager.fetch_cache([1, 2, 3]) == (["c12"], [3])


# -- bug 8: what `remaining` means for generation, end to end ---------------------------


def test_bug8_full_hit_generates_like_a_cold_run(model):
    prompt = random_tokens(40, seed=11, first=11)
    want_logits, stored = prefill(model, prompt)
    m = PrefixCacheManager(model)
    m.store_cache(prompt, stored)

    # vllm-mlx's contract: the stored object, nothing left to feed.
    cache, remaining = m.fetch_cache(prompt)
    assert cache is stored and remaining == []

    # The generation path: a private cache one token short and that token to feed.
    cache, remaining = m.fetch_for_generation(prompt)
    assert cache is not stored and remaining == prompt[-1:] and cache[0].offset == 39
    assert_same_logits(feed(model, cache, remaining), want_logits)
    cache, remaining = m.fetch_for_generation(prompt)
    assert greedy(model, remaining, cache) == greedy(model, prompt)
    assert stored[0].offset == 40  # generating never touched the stored entry

    # What vllm-mlx's scheduler did with `[]`: feed the last token again. It lands in
    # the cache a second time and the logits are no longer the prompt's.
    doubled = feed(model, copy.deepcopy(stored), prompt[-1:])
    assert not mx.array_equal(doubled, want_logits).item()


def test_bug8_cache_lagging_one_token_is_keyed_by_what_it_holds(model):
    # vllm-mlx's scheduler stores prompt + generated tokens with a cache that never
    # saw the last generated token. Keyed by its 41 positions, the entry hands that
    # token back as `remaining` instead of skipping it.
    prompt = random_tokens(40, seed=12, first=12)
    logits, cache = prefill(model, prompt)
    t1 = int(mx.argmax(logits).item())
    t2 = int(mx.argmax(feed(model, cache, [t1])).item())
    m = PrefixCacheManager(model)
    m.store_cache(prompt + [t1, t2], cache)
    turn = random_tokens(6, seed=13)
    query = prompt + [t1, t2] + turn
    got, remaining = m.fetch_cache(query)
    assert got is cache and remaining == [t2] + turn
    # vllm-mlx's BatchGenerator copies a cache on insert; copy it the same way here.
    assert_same_logits(feed(model, copy.deepcopy(got), remaining), cold_logits(model, query))
    assert m.fetch_cache(prompt + [t1, t2]) == (cache, [t2])


def test_trimmed_and_shorter_hits_continue_exactly(model):
    long = random_tokens(50, seed=14, first=14)
    m = PrefixCacheManager(model)
    m.store_cache(long, prefill(model, long)[1])
    m.store_cache(long[:10], prefill(model, long[:10])[1])
    for query in (long[:30], long[:10] + random_tokens(8, seed=15), long + [3, 4]):
        cache, remaining = m.fetch_for_generation(query)
        assert len(remaining) >= 1
        assert_same_logits(feed(model, cache, remaining), cold_logits(model, query))


# -- persistence --------------------------------------------------------------------


def test_write_through_and_read_through(model, store_dir):
    prompt = random_tokens(40, seed=21, first=21)
    with PersistentPrefixCache(store_dir, model, block_size=16) as store:
        first = PrefixCacheManager(model, store=store)
        first.store_cache(prompt, prefill(model, prompt)[1])
        store.flush()
        assert store.stats()["blocks"] == 3
        second = PrefixCacheManager(model, store=store)  # empty memory, same store
        query = prompt + [7, 8]
        cache, remaining = second.fetch_cache(query)
        assert remaining == [7, 8] and len(second) == 0
        assert_same_logits(feed(model, cache, remaining), cold_logits(model, query))
        # A disk hit is never full: even the whole prompt leaves its last token.
        cache, remaining = second.fetch_cache(prompt)
        assert remaining == prompt[-1:]
        # Memory holds a shorter prefix, the store a longer one: the longer wins.
        second.store_cache(prompt[:5], prefill(model, prompt[:5])[1])
        assert second.fetch_cache(query)[1] == [7, 8]
        assert second.get_stats()["hits"] == 3


def test_store_keeps_caches_it_cannot_write_in_memory(model, store_dir):
    with PersistentPrefixCache(store_dir, model) as store:
        m = PrefixCacheManager(model, store=store)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.store_cache([1, 2], ["opaque"])
            m.store_cache([3, 4], ["opaque"])
        assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
        assert m.fetch_cache([1, 2]) == (["opaque"], [])


RESTART_STORE = """
    import json, sys
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from persistent_prefix_cache.prefix_cache import PrefixCacheManager
    from persistent_prefix_cache.tiny_model import load_tiny_model

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    with PrefixCacheManager(model, store=spec["store"]) as manager:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(spec["prompt"])[None], cache=cache))
        manager.store_cache(spec["prompt"], cache)
    print(json.dumps({"stored": len(manager)}))
"""

RESTART_FETCH = """
    import json, os, sys
    import mlx.core as mx
    import numpy as np
    from persistent_prefix_cache.prefix_cache import PrefixCacheManager
    from persistent_prefix_cache.tiny_model import load_tiny_model

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    out = {}
    with PrefixCacheManager(model, store=spec["store"]) as manager:
        for name, query in spec["queries"].items():
            cache, remaining = manager.fetch_cache(query)
            logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
            np.save(os.path.join(spec["out"], name + ".npy"), np.array(logits))
            out[name] = {"restored": len(query) - len(remaining), "memory": len(manager)}
        out["stats"] = manager.get_stats()
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_restart_hit_in_a_fresh_process(model, tiny_model_dir, tmp_path):
    prompt = random_tokens(100, seed=31, first=31)
    queries = {"same": prompt, "longer": prompt + random_tokens(9, seed=32)}
    spec = {
        "model": str(tiny_model_dir),
        "store": str(tmp_path / "store"),
        "prompt": prompt,
        "queries": queries,
        "out": str(tmp_path),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert run_python_json(RESTART_STORE, str(tmp_path / "spec.json")) == {"stored": 1}
    got = run_python_json(RESTART_FETCH, str(tmp_path / "spec.json"))
    assert got["same"] == {"restored": 99, "memory": 0}  # from disk, one token to feed
    assert got["longer"] == {"restored": 100, "memory": 0}
    assert got["stats"]["hits"] == 2 and got["stats"]["tokens_saved"] == 199
    for name, query in queries.items():
        logits = mx.array(np.load(tmp_path / f"{name}.npy"))
        assert_same_logits(logits, cold_logits(model, query))


# -- other cache families -------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_recurrent_and_window_layers_continue_exactly(family):
    # qwen3_next mixes KVCache with recurrent ArraysCache layers; gemma3_text has
    # RotatingKVCache layers whose 24-token window the 60-token prompt wraps. Neither
    # can be cut back, so a private copy is rebuilt from the whole entry.
    from families import VOCAB, build

    model = build(family)
    prompt = random_tokens(60, seed=51, first=51)
    prompt = [t % VOCAB for t in prompt]
    m = PrefixCacheManager(model)
    m.store_cache(prompt, prefill(model, prompt)[1])
    query = prompt + [1, 2, 3, 4, 5]
    cache, remaining = m.fetch_for_generation(query)
    assert remaining == [1, 2, 3, 4, 5]
    assert_same_logits(feed(model, cache, remaining), cold_logits(model, query))
    # The same prompt again cannot be served for generation: the cache holds all 60
    # positions and cannot give back the last one.
    assert m.fetch_for_generation(prompt) == (None, prompt)
    assert m.fetch_cache(prompt)[1] == []


def test_names_are_exported_from_the_package_root():
    import persistent_prefix_cache as root
    from persistent_prefix_cache import paged_cache, prefix_cache

    names = {
        prefix_cache: ["PrefixCacheStats", "CacheEntry", "PrefixCacheManager"]
        + ["BlockCacheEntry", "BlockAwarePrefixCache"],
        paged_cache: ["PagedCacheManager", "BlockTable", "CacheBlock"],
    }
    if not hasattr(root, "PrefixCacheManager"):
        pytest.skip("persistent_prefix_cache/__init__.py does not re-export these names yet")
    for module, public in names.items():
        for name in public:
            assert getattr(root, name) is getattr(module, name)
            assert name in root.__all__

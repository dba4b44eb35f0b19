"""`PagedCacheManager` and `BlockAwarePrefixCache`: vllm-mlx's documented behaviour,
the seed's block bugs, and KV that continues exactly (also from the store).

Bookkeeping tests use opaque cache data, as vllm-mlx's own tests do; everything that
runs a model uses the tiny real mlx-lm llama from conftest.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from helpers import assert_same_logits, cold_logits, feed, prefill, random_tokens
from persistent_prefix_cache import InvalidArgumentError, PersistentPrefixCache
from persistent_prefix_cache.paged_cache import BlockTable, CacheBlock, PagedCacheManager
from persistent_prefix_cache.prefix_cache import BlockAwarePrefixCache, BlockCacheEntry

A, B, C = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]  # one block each (size 4)


@pytest.fixture
def pool():
    return PagedCacheManager(block_size=4, max_blocks=10)


@pytest.fixture
def prefix(pool):
    return BlockAwarePrefixCache(None, pool)


def greedy(model, prompt, cache=None, n: int = 4) -> list[int]:
    cache = make_prompt_cache(model) if cache is None else cache
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n)
    return [int(t) for t, _ in steps]


# -- CacheBlock and BlockTable ---------------------------------------------------------


def test_cache_block_defaults_and_predicates():
    block = CacheBlock(block_id=3)
    assert (block.ref_count, block.token_count) == (0, 0)
    assert block.block_hash is None and block.cache_data is None
    assert not CacheBlock(0, token_count=63).is_full(64)
    assert CacheBlock(0, token_count=64).is_full(64)
    assert not CacheBlock(0, ref_count=1).is_shared() and CacheBlock(0, ref_count=2).is_shared()
    before = block.last_access
    block.last_access -= 1
    block.touch()
    assert block.last_access >= before


def test_block_table_add_copy_len():
    table = BlockTable("r1")
    assert (table.block_ids, table.num_tokens, len(table)) == ([], 0, 0)
    table.add_block(3, 64)
    table.add_block(4, 10)
    other = table.copy("r2")
    other.block_ids.append(9)
    assert other.request_id == "r2" and table.block_ids == [3, 4]
    assert (table.num_tokens, len(table)) == (74, 2)


# -- PagedCacheManager: allocation and references ----------------------------------------


def test_init_reserves_the_null_block():
    pool = PagedCacheManager(block_size=64, max_blocks=100)
    assert (pool.block_size, pool.max_blocks, pool.free_blocks) == (64, 100, 99)
    assert pool.null_block.is_null and list(pool.allocated_blocks) == [0]
    stats = pool.get_stats()
    assert (stats.total_blocks, stats.allocated_blocks, stats.free_blocks) == (100, 1, 99)
    assert not pool.free_block(0) and not pool.increment_ref(0)
    with pytest.raises(InvalidArgumentError):
        PagedCacheManager(block_size=0)
    with pytest.raises(InvalidArgumentError):
        PagedCacheManager(max_blocks=1)


def test_allocate_until_exhausted_then_free(pool):
    blocks = [pool.allocate_block() for _ in range(9)]
    assert all(b.ref_count == 1 and b.block_id != 0 for b in blocks)
    assert len({b.block_id for b in blocks}) == 9
    assert pool.allocate_block() is None and pool.free_blocks == 0
    assert pool.free_block(blocks[0].block_id) is True
    assert blocks[0].block_id not in pool.allocated_blocks and pool.free_blocks == 1
    assert pool.free_block(blocks[0].block_id) is False  # already free


def test_reference_counting(pool):
    block = pool.allocate_block()
    assert pool.increment_ref(block.block_id) and block.ref_count == 2
    assert pool.get_stats().shared_blocks == 1
    assert pool.decrement_ref(block.block_id) is False and block.ref_count == 1
    assert pool.free_block(block.block_id) is True and block.ref_count == 0
    # A free block that caches nothing cannot be taken back.
    assert pool.increment_ref(block.block_id) is False


def test_allocate_blocks_for_tokens_all_or_nothing():
    pool = PagedCacheManager(block_size=64, max_blocks=100)
    assert [len(pool.allocate_blocks_for_tokens(n)) for n in (100, 64, 65)] == [2, 1, 2]
    small = PagedCacheManager(block_size=64, max_blocks=3)
    with pytest.raises(ValueError):
        small.allocate_blocks_for_tokens(300)
    assert small.free_blocks == 2


def test_register_and_find_cached_block(pool):
    tokens = list(range(4))
    assert pool.find_cached_block(tokens) is None
    block = pool.allocate_block()
    key = pool.register_block_hash(block, tokens)
    assert key == pool.compute_block_hash(tokens) and block.token_count == 4
    assert pool.find_cached_block(tokens) is block
    assert pool.compute_block_hash(tokens) != pool.compute_block_hash([0, 1, 2, 4])
    # An equal block registered later stays private: the first one keeps the key.
    twin = pool.allocate_block()
    pool.register_block_hash(twin, tokens)
    assert pool.find_cached_block(tokens) is block and twin.block_hash is None


def test_block_tables_create_get_delete(pool):
    table = pool.create_block_table("r1")
    assert pool.get_block_table("r1") is table and pool.get_block_table("nope") is None
    assert pool.get_or_create_block_table("r1") is table
    for _ in range(2):
        pool.add_block_to_table(table, pool.allocate_block(), 4)
    assert (table.num_tokens, len(pool.allocated_blocks)) == (8, 3)
    pool.delete_block_table("r1")
    assert "r1" not in pool.request_tables and list(pool.allocated_blocks) == [0]
    assert pool.free_blocks == 9


def test_recreating_a_table_releases_the_old_one(pool):
    table = pool.create_block_table("r1")
    pool.add_block_to_table(table, pool.allocate_block(), 4)
    pool.create_block_table("r1")
    assert pool.free_blocks == 9


def test_find_shared_prefix(pool):
    tokens = A + B + C
    assert pool.find_shared_prefix(tokens) == ([], tokens)
    first = pool.allocate_block()
    key = pool.register_block_hash(first, A)
    second = pool.allocate_block()
    pool.register_block_hash(second, B, parent_hash=key)
    assert pool.find_shared_prefix(tokens) == ([first.block_id, second.block_id], C)
    assert pool.find_shared_prefix(A + [1, 2]) == ([first.block_id], [1, 2])


def test_fork_shares_every_block(pool):
    source = pool.create_block_table("r1")
    blocks = [pool.allocate_block() for _ in range(2)]
    for block in blocks:
        pool.add_block_to_table(source, block, 4)
    forked = pool.fork_block_table(source, "r2")
    assert (forked.request_id, forked.block_ids, forked.num_tokens) == ("r2", source.block_ids, 8)
    assert [b.ref_count for b in blocks] == [2, 2]
    assert pool.get_block_table("r2") is forked


def test_copy_on_write_copies_the_shared_last_block(pool):
    table = pool.create_block_table("r1")
    block = pool.allocate_block()
    block.cache_data = ["kv"]
    pool.add_block_to_table(table, block, 4)
    assert pool.get_blocks_for_generation(table) == ([block], False)
    forked = pool.fork_block_table(table, "r2")
    blocks, copied = pool.get_blocks_for_generation(forked)
    assert copied and blocks[0] is not block and blocks[0].cache_data == ["kv"]
    assert forked.block_ids == [blocks[0].block_id] and block.ref_count == 1
    assert pool.get_stats().cow_copies == 1
    # No free block: nothing is copied and the table is unchanged.
    full = PagedCacheManager(block_size=4, max_blocks=2)
    t = full.create_block_table("x")
    full.add_block_to_table(t, full.allocate_block(), 4)
    f = full.fork_block_table(t, "y")
    assert full.get_blocks_for_generation(f)[1] is False and f.block_ids == t.block_ids


def test_lru_eviction_of_unreferenced_blocks():
    pool = PagedCacheManager(block_size=4, max_blocks=5)
    blocks = [pool.allocate_block() for _ in range(4)]
    for block, tokens in zip(blocks, (A, B, C, [1, 2, 3, 4])):
        pool.register_block_hash(block, tokens)
    pool.free_block(blocks[1].block_id)
    pool.free_block(blocks[0].block_id)
    pool.find_cached_block(B)  # B was freed first but used since: A is now the LRU one
    assert pool.free_blocks == 2 and pool.get_stats().cached_blocks == 4
    assert pool.evict_lru_blocks(1) == 1
    assert pool.find_cached_block(A) is None and pool.find_cached_block(B) is blocks[1]
    assert pool.get_stats().evictions == 1 and pool.free_blocks == 2
    assert pool.handle_memory_pressure(2) and not pool.handle_memory_pressure(3)


def test_memory_usage_stats_reset_and_clear():
    pool = PagedCacheManager(block_size=64, max_blocks=100)
    table = pool.create_block_table("r1")
    for _ in range(25):
        pool.add_block_to_table(table, pool.allocate_block(), 64)
    pool.find_cached_block([1, 2, 3])
    usage = pool.get_memory_usage()
    assert (usage["block_size"], usage["max_blocks"]) == (64, 100)
    assert (usage["allocated_blocks"], usage["free_blocks"]) == (26, 74)
    assert (usage["utilization"], usage["total_tokens_cached"]) == (0.26, 1600)
    assert usage["cache_hit_rate"] == 0.0 and pool.usage == pytest.approx(25 / 99)
    pool.reset_stats()
    assert (pool.stats.cache_misses, pool.stats.cow_copies) == (0, 0)
    pool.clear()
    assert (pool.free_blocks, list(pool.allocated_blocks), pool.request_tables) == (99, [0], {})


def test_concurrent_allocation_is_safe():
    pool = PagedCacheManager(block_size=64, max_blocks=101)
    got, errors = [], []

    def worker():
        try:
            for _ in range(10):
                block = pool.allocate_block()
                if block is not None:
                    got.append(block.block_id)
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(got) == 50 == len(set(got))


# -- the seed's block bugs -----------------------------------------------------------


def test_bug4_a_block_is_only_reused_at_its_position(pool, prefix):
    # The seed hashed each block's tokens alone: a request starting with B reused the
    # second block of [A, B], whose KV was computed after A.
    prefix.store_cache("r1", A + B, ["kv"])
    table, remaining = prefix.fetch_cache("r2", B + C)
    assert table is None and remaining == B + C
    assert pool.find_shared_prefix(B + C) == ([], B + C)
    assert pool.find_cached_block(B) is None
    key = pool.find_cached_block(A).block_hash
    assert pool.find_cached_block(B, parent_hash=key) is not None


def test_bug5_a_reallocated_block_is_never_found_under_its_old_hash():
    pool = PagedCacheManager(block_size=4, max_blocks=3)
    prefix = BlockAwarePrefixCache(None, pool)
    prefix.store_cache("r1", A, ["kv"])
    prefix.release_cache("r1")
    # Released but not reused: still shared with a later request.
    assert prefix.fetch_cache("r2", A + [1])[0] is not None
    prefix.release_cache("r2")
    first, second = pool.allocate_block(), pool.allocate_block()  # reuses A's block
    assert pool.find_cached_block(A) is None and pool.find_shared_prefix(A) == ([], A)
    assert all(b.block_hash is None and b.cache_data is None for b in (first, second))
    assert prefix.fetch_cache("r3", A + [1]) == (None, A + [1])


def test_bug6_released_requests_give_their_blocks_back():
    pool = PagedCacheManager(block_size=4, max_blocks=7)
    prefix = BlockAwarePrefixCache(None, pool)
    shared = A + B
    for i in range(40):  # far more blocks than the pool holds
        rid = f"r{i}"
        prefix.fetch_cache(rid, shared + [i, i + 1])  # hit refs are released too
        table = prefix.store_cache(rid, shared + random_tokens(8, seed=i), ["kv"])
        assert table.num_tokens == 16
        prefix.release_cache(rid)
    assert len(prefix) == 0 and pool.free_blocks == 6
    assert all(b.ref_count == 0 for b in pool.blocks[1:])
    assert prefix.get_stats()["hits"] == 39


# -- BlockAwarePrefixCache: the seed's contract -------------------------------------------


def test_store_fetch_release(pool, prefix):
    assert prefix.block_size == 4 and len(prefix) == 0
    table = prefix.store_cache("r1", A + B, ["kv"])
    assert (table.num_tokens, len(table.block_ids), len(prefix)) == (8, 2, 1)
    got, remaining = prefix.fetch_cache("r2", A + B + [999, 1000])
    assert remaining == [999, 1000] and got.block_ids == table.block_ids
    assert isinstance(prefix._request_tables["r2"], BlockCacheEntry)
    assert [pool.blocks[i].ref_count for i in table.block_ids] == [2, 2]
    prefix.release_cache("r1")
    prefix.release_cache("r2")
    assert len(prefix) == 0 and pool.free_blocks == 9
    assert prefix.fetch_cache("r3", []) == (None, [])
    assert prefix.store_cache("r3", [], ["kv"]) is None


def test_partial_blocks_and_divergence_inside_a_block(prefix):
    prefix.store_cache("r1", A + [1, 2], ["kv"])  # a partial last block
    table, remaining = prefix.fetch_cache("r2", A + [1, 2, 3])
    assert table.num_tokens == 6 and remaining == [3]
    table, remaining = prefix.fetch_cache("r3", A + [1, 9, 9])
    assert table.num_tokens == 5 and remaining == [9, 9]  # the table ends inside a block


def test_fork_and_copy_on_write(prefix):
    data = [["layer"]]
    prefix.store_cache("r1", A + B, data)
    assert prefix.get_cache_for_generation("r1") == (data, False)
    forked = prefix.fork_cache("r1", "r2")
    assert forked is not None and len(prefix) == 2 and prefix.get_stats()["shared_blocks"] == 2
    got, copied = prefix.get_cache_for_generation("r2")
    assert copied and got == data and got is not data
    assert prefix.fork_cache("nope", "r3") is None
    assert prefix.get_cache_for_generation("nope") == (None, False)


def test_stats_reset_and_clear(prefix):
    prefix.fetch_cache("r1", [1, 2, 3])
    prefix.store_cache("r1", A + B, ["kv"])
    prefix.fetch_cache("r2", A + B + [5])
    stats = prefix.get_stats()
    assert (stats["hits"], stats["misses"], stats["tokens_saved"]) == (1, 1, 8)
    assert stats["hit_rate"] == 0.5
    assert stats["active_requests"] == 2 and stats["allocated_blocks"] == 3
    prefix.reset_stats()
    assert prefix.get_stats()["hits"] == 0
    prefix.clear()
    assert len(prefix) == 0 and prefix.get_stats()["allocated_blocks"] == 1
    assert prefix.fetch_cache("r3", A + B + [5])[0] is None


def test_opaque_data_is_not_reconstructed(prefix):
    table = prefix.store_cache("r1", A + B, ["kv"])
    assert prefix.reconstruct_cache(table) is None
    assert prefix.reconstruct_cache(BlockTable("x")) is None


# -- BlockAwarePrefixCache: real KV ----------------------------------------------------


@pytest.fixture
def model_prefix(model):
    return BlockAwarePrefixCache(model, PagedCacheManager(block_size=16, max_blocks=40))


def test_reconstructed_cache_continues_exactly(model, model_prefix):
    prompt = random_tokens(45, seed=41, first=41)  # two full blocks and a partial one
    model_prefix.store_cache("r1", prompt, prefill(model, prompt)[1])
    other = random_tokens(8, seed=42)
    queries = [prompt + other, prompt[:20] + other, prompt[:40], prompt[:16] + other]
    for i, query in enumerate(queries):
        table, remaining = model_prefix.fetch_cache(f"q{i}", query)
        assert len(query) - len(remaining) == table.num_tokens > 0
        cache = model_prefix.reconstruct_cache(table)
        assert_same_logits(feed(model, cache, remaining), cold_logits(model, query))


def test_bug8_full_hit_leaves_one_token_and_generates_like_cold(model, model_prefix):
    prompt = random_tokens(32, seed=43, first=43)  # ends on a block boundary
    want, cache = prefill(model, prompt)
    model_prefix.store_cache("r1", prompt, cache)
    table, remaining = model_prefix.fetch_cache("r2", prompt)
    assert remaining == prompt[-1:] and table.num_tokens == 31 and len(table) == 2
    assert_same_logits(feed(model, model_prefix.reconstruct_cache(table), remaining), want)
    # For a request that only fetched, the cache is rebuilt from its blocks; r1 still
    # holds the last one, so r2 gets its own copy of it first.
    cache, copied = model_prefix.get_cache_for_generation("r2")
    assert copied and cache[0].offset == 31
    assert greedy(model, remaining, cache) == greedy(model, prompt)


def test_seed_per_layer_dicts_are_accepted(model, model_prefix):
    prompt = random_tokens(30, seed=44, first=44)
    cache = prefill(model, prompt)[1]
    dicts = [{"state": c.state, "meta_state": "", "class_ref": KVCache, "class_name": "KVCache"} for c in cache]
    model_prefix.store_cache("r1", prompt, dicts)
    query = prompt + [1, 2]
    table, remaining = model_prefix.fetch_cache("r2", query)
    assert remaining == [1, 2]
    assert_same_logits(feed(model, model_prefix.reconstruct_cache(table), remaining), cold_logits(model, query))


def test_recurrent_layers_resume_only_where_a_snapshot_was_stored():
    prefix = BlockAwarePrefixCache(None, PagedCacheManager(block_size=4, max_blocks=10))
    keys = mx.arange(2 * 8 * 3, dtype=mx.float32).reshape(1, 2, 8, 3)
    state = [mx.ones((1, 3, 8)), mx.full((1, 2, 4, 4), 2.0)]
    data = [
        {"state": (keys, keys + 1), "class_name": "KVCache"},
        {"state": state, "class_name": "ArraysCache"},
    ]
    tokens = list(range(8))
    table = prefix.store_cache("r1", tokens, data)
    rebuilt = prefix.reconstruct_cache(table)
    assert isinstance(rebuilt[0], KVCache) and isinstance(rebuilt[1], ArraysCache)
    assert mx.array_equal(rebuilt[0].state[0], keys).item()
    assert all(mx.array_equal(x, y).item() for x, y in zip(rebuilt[1].cache, state))
    # Position 4 (end of block 1) has no snapshot of the recurrent state.
    assert prefix.reconstruct_cache(BlockTable("p", table.block_ids[:1], 4)) is None
    assert prefix.fetch_cache("r2", tokens + [9])[0].num_tokens == 8
    # Cut back by one (7) and then to block 1 (4): neither has a snapshot, so a miss.
    assert prefix.fetch_cache("r3", tokens) == (None, tokens)


def test_persistence_through_the_store(model, store_dir):
    prompt = random_tokens(40, seed=45, first=45)
    want, cache = prefill(model, prompt)
    with PersistentPrefixCache(store_dir, model, block_size=16) as store:
        first = BlockAwarePrefixCache(model, PagedCacheManager(16, 20), store=store)
        first.store_cache("r1", prompt, cache)
    # Another pool, another store handle: only the files on disk are shared.
    with BlockAwarePrefixCache(model, PagedCacheManager(8, 20), store=store_dir) as second:
        table, remaining = second.fetch_cache("r1", prompt)
        assert remaining == prompt[-1:] and table.num_tokens == 39
        assert_same_logits(feed(model, second.reconstruct_cache(table), remaining), want)
        # The disk hit now lives in the pool: a second request shares its blocks.
        again, _ = second.fetch_cache("r2", prompt)
        assert again.block_ids == table.block_ids


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_other_families_resume_where_every_layer_can(family):
    # qwen3_next's recurrent layers resume only where a snapshot was stored (the end
    # of the stored prompt); gemma3_text's window layers resume anywhere their window's
    # slices are held, so a query diverging at 30 still restores 30 positions.
    from families import VOCAB, build

    model = build(family)
    prompt = [t % VOCAB for t in random_tokens(60, seed=52, first=52)]
    prefix = BlockAwarePrefixCache(model, PagedCacheManager(block_size=16, max_blocks=20))
    prefix.store_cache("r1", prompt, prefill(model, prompt)[1])
    extra = [(prompt[30] + 1) % VOCAB, 2, 3, 4, 5]  # diverges from the prompt at 30
    expected = {"qwen3_next": [60, 0], "gemma3_text": [60, 30]}[family]
    for i, query in enumerate((prompt + extra, prompt[:30] + extra)):
        table, remaining = prefix.fetch_cache(f"q{i}", query)
        assert len(query) - len(remaining) == expected[i]
        if table is not None:
            cache = prefix.reconstruct_cache(table)
            assert_same_logits(feed(model, cache, remaining), cold_logits(model, query))

"""What callers of vllm-mlx's ``PagedCacheManager`` call that the first drop-in lacked
(`compat.paged_pool`), and 3-D KV states (no batch axis) in `BlockAwarePrefixCache`.

Bookkeeping tests use opaque cache data, as vllm-mlx's own tests do; the 3-D test runs
the tiny real mlx-lm llama and checks the rebuilt cache bit for bit and by continuing it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import feed, prefill, random_tokens
from mlx_lm.models.cache import KVCache

from persistent_prefix_cache import InvalidArgumentError
from persistent_prefix_cache.layers.mlx_lm_versions import make_layer
from persistent_prefix_cache.paged_cache import BlockTable, PagedCacheManager
from persistent_prefix_cache.prefix_cache import BlockAwarePrefixCache

BS = 4
TOKENS = list(range(100, 100 + 3 * BS + 2))  # three full blocks and a partial one


@pytest.fixture
def pool():
    return PagedCacheManager(block_size=BS, max_blocks=8)


def _cached(pool, tokens=TOKENS):
    """A request's blocks allocated and indexed the vLLM way; returns the blocks."""
    blocks = pool.get_new_blocks(-(-len(tokens) // BS))
    pool.cache_full_blocks(blocks, tokens, 0, len(tokens) // BS)
    return blocks


# -- get_new_blocks / free_block_batch ---------------------------------------------------


def test_get_new_blocks_all_or_none(pool):
    blocks = pool.get_new_blocks(3)
    assert [b.ref_count for b in blocks] == [1, 1, 1] and pool.free_blocks == 4
    assert len({b.block_id for b in blocks}) == 3 and all(b.block_id != 0 for b in blocks)
    with pytest.raises(ValueError, match="only 4 free"):
        pool.get_new_blocks(5)
    assert pool.free_blocks == 4  # nothing taken by the refused call
    assert pool.get_new_blocks(0) == []
    with pytest.raises(InvalidArgumentError):
        pool.get_new_blocks(-1)


def test_free_block_batch_frees_in_order_and_keeps_the_kv_findable(pool):
    blocks = _cached(pool)
    pool.free_block_batch(blocks)
    assert pool.free_blocks == 7 and all(b.ref_count == 0 for b in blocks)
    found, n = pool.get_computed_blocks(TOKENS)
    assert found == blocks[:3] and n == 3 * BS
    # Reuse order: the partial block (it caches nothing) first, then the blocks never
    # used, then the freed full blocks in the order they were given.
    ids = lambda bs: [b.block_id for b in bs]  # noqa: E731
    assert ids(pool.get_new_blocks(1)) == ids(blocks[3:])
    assert not set(ids(pool.get_new_blocks(3))) & set(ids(blocks))
    assert ids(pool.get_new_blocks(1)) == ids(blocks[:1])
    assert pool.get_computed_blocks(TOKENS) == ([], 0)  # block 0 of the chain was reused


def test_free_block_batch_ignores_double_frees_and_refuses_foreign_blocks(pool):
    blocks = pool.get_new_blocks(2)
    pool.free_block_batch([blocks[0], blocks[0], pool.null_block])
    assert blocks[0].ref_count == 0 and pool.null_block.ref_count == 1
    pool.free_block_batch([blocks[0]])  # already free: nothing happens
    assert blocks[0].ref_count == 0 and pool.free_blocks == 6
    other = PagedCacheManager(block_size=BS, max_blocks=8).get_new_blocks(1)
    with pytest.raises(InvalidArgumentError, match="not a block of this"):
        pool.free_block_batch(other)
    assert blocks[1].ref_count == 1


# -- touch / get_cached_block / cache_full_blocks / get_computed_blocks -------------------


def test_touch_takes_references_and_protects_free_blocks(pool):
    blocks = _cached(pool)
    pool.free_block_batch(blocks)
    hit, _ = pool.get_computed_blocks(TOKENS)
    pool.touch(hit)
    assert [b.ref_count for b in hit] == [1, 1, 1] and pool.free_blocks == 4
    pool.touch(hit[:1] + [pool.null_block])
    assert hit[0].ref_count == 2 and pool.null_block.ref_count == 1
    taken = pool.get_new_blocks(4)  # every free block: none of the touched ones
    assert not {b.block_id for b in taken} & {b.block_id for b in hit}
    assert pool.get_computed_blocks(TOKENS)[0] == hit
    with pytest.raises(InvalidArgumentError):
        pool.touch([object()])


def test_get_cached_block_by_key_counts_hits_and_misses(pool):
    blocks = _cached(pool)
    first = pool.compute_block_hash(TOKENS[:BS])
    second = pool.compute_block_hash(TOKENS[BS : 2 * BS], first)
    assert pool.get_cached_block(first) is blocks[0]
    assert pool.get_cached_block(second) is blocks[1]
    # A block's key is positional: the second block's tokens at position 0 are not it.
    assert pool.get_cached_block(pool.compute_block_hash(TOKENS[BS : 2 * BS])) is None
    stats = pool.get_stats()
    assert (stats.cache_hits, stats.cache_misses) == (2, 1)


def test_cache_full_blocks_indexes_only_full_blocks_and_resumes(pool):
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, TOKENS, 0, 1)
    assert pool.get_computed_blocks(TOKENS) == (blocks[:1], BS)
    pool.cache_full_blocks(blocks, TOKENS, 1, 3)  # later, as the request grows
    assert pool.get_computed_blocks(TOKENS) == (blocks[:3], 3 * BS)
    assert blocks[3].block_hash is None  # the partial block is never indexed
    with pytest.raises(InvalidArgumentError, match="full blocks"):
        pool.cache_full_blocks(blocks, TOKENS, 3, 4)  # tokens do not fill block 3


def test_cache_full_blocks_keeps_the_chain_past_a_duplicate():
    pool = PagedCacheManager(block_size=BS, max_blocks=10)
    first = _cached(pool)
    # Another request with the same tokens: its blocks stay private (the first request's
    # are indexed), and the chain of its later blocks is still right.
    longer = TOKENS[: 3 * BS] + list(range(900, 900 + BS))
    second = pool.get_new_blocks(4)
    pool.cache_full_blocks(second, longer, 0, 4)
    assert all(b.block_hash is None for b in second[:3])
    found, n = pool.get_computed_blocks(longer)
    assert found == first[:3] + [second[3]] and n == 4 * BS


def test_get_computed_blocks_stops_at_the_first_miss(pool):
    _cached(pool)
    changed = TOKENS[:BS] + [0] + TOKENS[BS + 1 :]
    found, n = pool.get_computed_blocks(changed)
    assert len(found) == 1 and n == BS
    assert pool.get_computed_blocks(TOKENS[: BS - 1]) == ([], 0)


# -- reset_prefix_cache / enable_caching ----------------------------------------------------


def test_reset_prefix_cache_only_when_nothing_is_referenced(pool):
    blocks = _cached(pool)
    pool.get_cached_block(pool.compute_block_hash(TOKENS[:BS]))
    assert pool.reset_prefix_cache() is False
    assert pool.get_computed_blocks(TOKENS)[1] == 3 * BS  # unchanged
    pool.free_block_batch(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_computed_blocks(TOKENS) == ([], 0)
    assert all(b.block_hash is None and b.cache_data is None for b in pool.blocks[1:])
    stats = pool.get_stats()
    assert (stats.cache_hits, stats.evictions, stats.cached_blocks) == (0, 0, 0)
    assert stats.cache_misses == 1  # the lookup just above, after the reset


def test_enable_caching_false_keeps_nothing_findable():
    pool = PagedCacheManager(BS, 8, enable_caching=False)
    blocks = _cached(pool)
    assert all(b.block_hash is None for b in blocks)
    assert pool.get_computed_blocks(TOKENS) == ([], 0)
    assert pool.get_cached_block(pool.compute_block_hash(TOKENS[:BS])) is None
    block = pool.allocate_block()
    pool.register_block_hash(block, TOKENS[:BS])
    assert pool.find_cached_block(TOKENS[:BS]) is None
    # Reference counting still works.
    pool.free_block_batch(blocks)
    assert pool.free_blocks == 6
    prefix = BlockAwarePrefixCache(None, pool)
    prefix.store_cache("a", TOKENS, None)
    assert prefix.fetch_cache("b", TOKENS) == (None, TOKENS)


# -- 3-D KV states ------------------------------------------------------------------------


def _as_3d(cache) -> list[dict]:
    """vllm-mlx's per-layer dicts of `cache` with [heads, seq, dim] tensors."""
    return [
        {"state": (c.keys[0, :, : c.offset, :], c.values[0, :, : c.offset, :]), "meta_state": "",
         "class_ref": KVCache, "class_name": "KVCache"}
        for c in cache
    ]  # fmt: skip


@pytest.mark.parametrize("keep", [4, 13, 17])
def test_3d_kv_states_are_stored_and_rebuilt_exactly(model, keep):
    tokens = random_tokens(18, seed=31)
    _, cache = prefill(model, tokens)
    given = _as_3d(cache)
    prefix = BlockAwarePrefixCache(model, PagedCacheManager(block_size=BS, max_blocks=16))
    table = prefix.store_cache("r", tokens, given)
    assert table.num_tokens == 18
    part = BlockTable("p", block_ids=table.block_ids[: -(-keep // BS)], num_tokens=keep)
    rebuilt = prefix.reconstruct_cache(part)
    assert rebuilt is not None and all(isinstance(c, KVCache) for c in rebuilt)
    for layer, entry in zip(rebuilt, given):
        offset = layer.offset
        keys, values = layer.keys[..., :offset, :], layer.values[..., :offset, :]
        assert offset == keep and keys.ndim == 3
        assert np.array_equal(np.array(keys), np.array(entry["state"][0][:, :keep, :]))
        assert np.array_equal(np.array(values), np.array(entry["state"][1][:, :keep, :]))
    # A fetch of a longer prompt shares the blocks, and the rebuilt cache continues like
    # the original once the batch axis is put back.
    table, rest = prefix.fetch_cache("q", tokens[:keep] + [7])
    assert table.num_tokens == keep and rest == [7]
    again = [
        make_layer(KVCache, (c.keys[None], c.values[None]), offset=c.offset) for c in prefix.reconstruct_cache(table)
    ]
    _, original = prefill(model, tokens[:keep])
    assert mx.array_equal(feed(model, again, [7]), feed(model, original, [7]))

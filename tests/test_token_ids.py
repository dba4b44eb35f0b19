"""Negative token ids (mlx-lm 0.32's image placeholders) and ids wider than the store's.

mlx-lm's server keys a VLM prompt by its tokens with every image patch replaced by a
negative id derived from the image, and computes the KV of those positions from the
image. The tiny text model here cannot embed a negative id, so the KV is computed from
the prompt with the placeholders replaced by a real token, and keyed by the negative
ids, which is what the server does.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import BLOCK, prefill, random_tokens

from persistent_prefix_cache import InvalidArgumentError, PersistentPrefixCache
from persistent_prefix_cache.compat.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.keys import TOKEN_MAX, TOKEN_MIN, as_token_array

IMAGE_A, IMAGE_B = -7, -9  # ids of two images of the same size
EDGES = [TOKEN_MIN, -1, TOKEN_MAX]


def _prompt(image: int, n_text: int = 40) -> list[int]:
    text = random_tokens(n_text, seed=11, first=1)
    return text[:10] + [image] * 20 + text[10:] + EDGES  # patches span a block boundary


def _computed(model, keyed: list[int]):
    """The cache the model computes for `keyed` (placeholders fed as token 3)."""
    fed = [t if 0 <= t < 512 else 3 for t in keyed]
    return prefill(model, fed)[1]


def _states(cache) -> list[np.ndarray]:
    # KVCache.state is the whole step-padded buffer: compare the positions it holds.
    return [np.array(a[..., : layer.offset, :]) for layer in cache for a in (layer.keys, layer.values)]


@pytest.mark.parametrize("ids", [[-1, -2, 5], EDGES, [TOKEN_MIN] * 3])
def test_negative_ids_round_trip_through_the_key_encoding(ids):
    arr = as_token_array(ids)
    assert arr.tolist() == ids and arr.dtype == np.dtype("<i4")
    assert np.frombuffer(arr.tobytes(), dtype="<i4").tolist() == ids


def test_negative_ids_are_stored_and_matched_exactly(store_dir, model):
    keyed = _prompt(IMAGE_A)
    cache = _computed(model, keyed)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.store(keyed, cache)
    # A new handle without a RAM tier: every block comes from disk.
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        got, rest = store.fetch(keyed + [4])
        assert list(rest) == [4]
        for a, b in zip(_states(got), _states(cache)):
            assert a.shape == b.shape and np.array_equal(a, b)
        # Another image of the same size: the match stops where its patches start.
        other = _prompt(IMAGE_B)
        got, rest = store.fetch(other)
        assert len(other) - len(rest) == 10
        for a, b in zip(_states(got), _states(cache)):
            assert np.array_equal(a, b[..., :10, :])
        # The image id's absolute value is another token, not the same one.
        flipped = [abs(t) if t == IMAGE_A else t for t in keyed]
        got, rest = store.fetch(flipped)
        assert len(flipped) - len(rest) == 10
        # A prompt that starts with the image matches nothing.
        starts = [IMAGE_A] * 5 + keyed
        got, rest = store.fetch([abs(IMAGE_A)] + starts[1:])
        assert got is None
        got, rest = store.fetch(starts)
        assert got is None
        stats = store.stats()
        assert stats["hits"] == 3 and stats["misses"] == 2


def test_ids_wider_than_int32_are_refused_clearly(store_dir, model):
    vlm_id = -1 - int("f" * 15, 16)  # as wide as mlx-lm 0.32.2's image ids get
    keyed = [1, 2, vlm_id, 4]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for call in (lambda: store.fetch(keyed), lambda: store.store(keyed, _computed(model, keyed))):
            with pytest.raises(InvalidArgumentError, match=rf"token id {vlm_id} does not fit .* int32"):
                call()
        assert store.stats()["blocks"] == 0


def test_lru_prompt_cache_persists_negative_ids_and_keeps_wide_ones_in_memory(store_dir, model, caplog):
    keyed = _prompt(IMAGE_A)
    wide = [1, 2] + [-1 - 2**40] * 20 + [5]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        lru = PersistentLRUPromptCache(store)
        lru.insert_cache("m", keyed, _computed(model, keyed))
        with caplog.at_level(logging.WARNING):
            lru.insert_cache("m", wide, _computed(model, wide))
        lru.flush()
        counters = lru.persistent_stats()
        assert counters["stored_sequences"] == 1 and counters["store_skipped"] == 1
        assert "int32" in caplog.text
        # The in-memory LRU still answers the wide prompt; the store answers a restart.
        cache, rest = lru.fetch_nearest_cache("m", wide)
        assert cache is not None and rest == []
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        cache, rest = PersistentLRUPromptCache(store).fetch_nearest_cache("m", keyed + [4])
        assert cache is not None and rest == [4]
        for a, b in zip(_states(cache), _states(_computed(model, keyed))):
            assert np.array_equal(a, b)

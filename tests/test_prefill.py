"""`prefill()`: mlx-lm's forwards, blocks cut from the state they leave, exact logits.

Nothing here decides by timing: the tests count forward passes (their sizes), calls of
`store()`, segment files, and compare logits bit for bit with a cold prefill.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from families import build
from helpers import BLOCK, assert_same_logits, cold_logits, random_tokens, segment_files

from persistent_prefix_cache import PersistentPrefixCache, prefill
from persistent_prefix_cache.costs import Costs


class Counted:
    """The model, recording the length of every forward it runs."""

    def __init__(self, model):
        self.model, self.sizes = model, []

    def __call__(self, inputs, cache=None):
        self.sizes.append(inputs.shape[1])
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


class Steering:
    """A store whose `resumable_step` answers what the test says (the cost model's answer
    depends on timings); every other call goes to the real store, `store()` counted."""

    def __init__(self, store, steps):
        self.real, self.steps, self.stored = store, list(steps), []
        self.block_size = store.block_size

    def resumable_step(self):
        return self.steps.pop(0) if len(self.steps) > 1 else self.steps[0] if self.steps else self.real.resumable_step()

    def store(self, tokens, cache):
        self.stored.append(len(tokens))
        return self.real.store(tokens, cache)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_an_attention_model_runs_mlx_lms_forwards_and_is_stored_once(store_dir, model):
    tokens = random_tokens(300, seed=41)
    counted = Counted(model)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        steering = Steering(store, [])
        cache, logits = prefill(counted, tokens, steering)
        store.flush()
        # As mlx_lm.generate: every token but the last in one forward (< 2,048), then the
        # last one for the logits; the prompt stored once, up to its last token.
        assert counted.sizes == [299, 1]
        assert steering.stored == [299]
        assert len(segment_files(store_dir)) == 1
        assert store.stats()["blocks"] == -(-299 // BLOCK)
        assert_same_logits(logits[0], cold_logits(model, tokens))

    counted.sizes.clear()
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        steering = Steering(store, [])
        longer = tokens + random_tokens(150, seed=42)
        # A smaller step: more forwards, still one store (every block boundary resumes).
        restored = store.peek(longer)
        _, logits = prefill(counted, longer, steering, prefill_step_size=64)
        assert restored == 299
        assert counted.sizes == [64, 64, 22, 1]
        assert steering.stored == [len(longer) - 1]
        assert_same_logits(logits[0], cold_logits(model, longer))


def test_a_prompt_longer_than_a_step_is_cut_in_mlx_lms_steps(store_dir, model):
    tokens = random_tokens(5000, seed=43)
    counted = Counted(model)
    with PersistentPrefixCache(store_dir, model, block_size=64) as store:
        steering = Steering(store, [])
        prefill(counted, tokens, steering)
        store.flush()
        assert counted.sizes == [2048, 2048, 903, 1]
        assert steering.stored == [4999]
        assert len(segment_files(store_dir)) == 1


def test_a_hybrid_model_stores_a_snapshot_where_each_forward_ends(tmp_path):
    model = build("qwen3_next")  # GatedDeltaNet (ArraysCache) and attention layers
    tokens = [t % 256 for t in random_tokens(200, seed=44)]  # its vocabulary
    counted = Counted(model)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK) as store:
        # Costs unknown: one block, then doubling; then the step the costs give (two blocks).
        steering = Steering(store, [None, None, 2 * BLOCK])
        _, logits = prefill(counted, tokens, steering)
        assert counted.sizes == [BLOCK] + [2 * BLOCK] * 5 + [23, 1]
        assert steering.stored == [BLOCK, 3 * BLOCK, 5 * BLOCK, 7 * BLOCK, 9 * BLOCK, 11 * BLOCK, 199]
        assert_same_logits(logits[0], cold_logits(model, tokens))
        store.flush()
        # Every stored forward end resumes: a prompt diverging after 3 blocks restores them.
        other = tokens[: 3 * BLOCK + 5] + [(tokens[3 * BLOCK + 5] + 1) % 256] + tokens[3 * BLOCK + 6 :]
        cache, remaining = store.fetch(other)
        assert len(other) - len(remaining) == 3 * BLOCK
        logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
        assert_same_logits(logits, cold_logits(model, other))


def test_snapshot_spacing_follows_the_cost_per_call():
    costs = Costs()
    assert costs.resumable_step(64) is None  # unknown: prefill probes
    costs.set_prefill(500.0, per_forward=0.002)  # a CPU: a call costs 1 token's time
    assert costs.resumable_step(64) == 64
    costs.set_prefill(35000.0, per_forward=0.010)  # an H200 and an 8B model: 350 tokens a call
    assert costs.resumable_step(64) == 2048
    costs.set_prefill(20000.0, per_forward=0.0002)  # 4 tokens a call: 80 within 5 %
    assert costs.resumable_step(64) == 128


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_steps_are_refused(store_dir, model, bad):
    from persistent_prefix_cache import InvalidArgumentError

    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        with pytest.raises(InvalidArgumentError):
            prefill(model, [1, 2, 3], store, prefill_step_size=bad)
        with pytest.raises(InvalidArgumentError):
            prefill(model, [1, 2, 3], store, prefill_step_size=16, blocks_per_chunk=1)

"""`prefill()`: mlx-lm's forwards, blocks cut from the state they leave, exact logits.

Nothing here decides by timing: the tests count forward passes (their sizes), calls of
`store()`, segment files, and compare logits bit for bit with a cold prefill.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import build
from helpers import BLOCK, assert_same_logits, cold_logits, random_tokens, segment_files

from persistent_prefix_cache import PersistentPrefixCache, prefill
from persistent_prefix_cache.core.costs import Costs


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
        # last one for the logits; the whole prompt stored once, after the last forward.
        assert counted.sizes == [299, 1]
        assert steering.stored == [300]
        assert len(segment_files(store_dir)) == 1
        assert store.stats()["blocks"] == -(-300 // BLOCK)
        assert_same_logits(logits[0], cold_logits(model, tokens))
        # The same prompt again: all but its last token restored (the last block trimmed).
        again, rest = store.fetch(tokens)
        assert len(rest) == 1
        assert_same_logits(model(mx.array(rest)[None], cache=again)[0, -1], cold_logits(model, tokens))

    counted.sizes.clear()
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        steering = Steering(store, [])
        longer = tokens + random_tokens(150, seed=42)
        # A smaller step: more forwards, still one store (every block boundary resumes).
        restored = store.peek(longer)
        _, logits = prefill(counted, longer, steering, prefill_step_size=64)
        assert restored == 300
        assert counted.sizes == [64, 64, 21, 1]
        assert steering.stored == [len(longer)]
        assert_same_logits(logits[0], cold_logits(model, longer))


def _in_order(store, order: list) -> "Steering":
    """`store` as `prefill()` sees it, noting each forward ``("forward", tokens)`` and each
    store ``("store", tokens)`` in `order` as they come."""
    steering = Steering(store, [])
    observe, put = store.observe_prefill, steering.store
    steering.observe_prefill = lambda n, *a, **k: order.append(("forward", n)) or observe(n, *a, **k)
    steering.store = lambda toks, cache: order.append(("store", len(toks))) or put(toks, cache)
    return steering


@pytest.mark.parametrize("beside", [False, True])
def test_the_prompt_is_stored_with_the_last_forward_where_a_device_runs_it(store_dir, model, monkeypatch, beside):
    # On a GPU the store runs while the device runs the last token's forward
    # (`device.target.forwards_run_beside`): all but the last token, from the cache as it
    # was before that forward, its copies on a stream of their own. On a CPU the whole
    # prompt, after it. Either way: the same blocks, the same logits, a cache the store
    # left as it was (the caller generates on from it), and a fetch of the same prompt
    # that takes all but its last token.
    import sys

    monkeypatch.setattr(sys.modules["persistent_prefix_cache.prefill"], "forwards_run_beside", lambda: beside)
    tokens = random_tokens(300, seed=46)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        order = []
        cache, logits = prefill(model, tokens, _in_order(store, order))
        if beside:  # stored before the last forward was waited for (and timed)
            assert order == [("forward", 299), ("store", 299), ("forward", 1)]
        else:
            assert order == [("forward", 299), ("forward", 1), ("store", 300)]
        assert_same_logits(logits[0], cold_logits(model, tokens))
        more = random_tokens(5, seed=47)
        assert_same_logits(model(mx.array(more)[None], cache=cache)[0, -1], cold_logits(model, tokens + more))
        store.flush()
        assert store.stats()["blocks"] == -(-300 // BLOCK)
        again, rest = store.fetch(tokens)
        assert len(rest) == 1
        assert_same_logits(model(mx.array(rest)[None], cache=again)[0, -1], cold_logits(model, tokens))
        # A prompt that extends it: every stored token taken, the rest computed on top, exactly.
        again, rest = store.fetch(tokens + more)
        assert len(rest) == (6 if beside else 5)
        assert_same_logits(model(mx.array(rest)[None], cache=again)[0, -1], cold_logits(model, tokens + more))


def test_without_room_for_a_second_copy_of_the_kv_the_store_waits_for_the_last_forward(store_dir, model, monkeypatch):
    # The store beside the last forward holds the cache as it was, so that forward writes a
    # copy of the KV beside the store's own: where MLX has no room for both (`device.target.room_for`:
    # a Mac near its working set), the whole prompt is stored after the forward, as on a CPU.
    import sys

    module = sys.modules["persistent_prefix_cache.prefill"]
    asked = []
    monkeypatch.setattr(module, "forwards_run_beside", lambda: True)
    monkeypatch.setattr(module, "room_for", lambda nbytes: asked.append(nbytes) and False)
    tokens = random_tokens(300, seed=48)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        order = []
        cache, logits = prefill(model, tokens, _in_order(store, order))
    assert order == [("forward", 299), ("forward", 1), ("store", 300)]
    assert asked == [2 * sum(layer.keys.nbytes + layer.values.nbytes for layer in cache)]  # two copies of its KV
    assert_same_logits(logits[0], cold_logits(model, tokens))


def test_room_for_counts_against_three_quarters_of_what_mlx_may_use(monkeypatch):
    from persistent_prefix_cache.device import target

    GiB = 1 << 30
    monkeypatch.setattr(target, "device_memory", lambda: 64 * GiB)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 10 * GiB)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 16 * GiB})
    assert target.room_for(2 * GiB) and not target.room_for(2 * GiB + 1)  # Apple's working set: 12 GiB usable
    monkeypatch.setattr(mx, "device_info", lambda: {"memory_size": 64 * GiB})  # else the device's memory
    assert target.room_for(38 * GiB) and not target.room_for(38 * GiB + 1)

    def unknown():
        raise RuntimeError("no device info")

    monkeypatch.setattr(mx, "device_info", unknown)
    assert not target.room_for(1)  # what cannot be told is no room


@pytest.mark.parametrize("kind", ["KVCache", "QuantizedKVCache", "CacheList"])
def test_a_frozen_cache_keeps_what_it_held_while_the_cache_goes_on(kind):
    # What the store beside the last forward reads: mlx-lm writes the next step's keys into
    # the cache's arrays in place (and grows them), never into the frozen layers' views.
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

    from persistent_prefix_cache.layers import frozen, signature_of

    def layer():
        return QuantizedKVCache(group_size=32, bits=8) if kind == "QuantizedKVCache" else KVCache()

    cache = [CacheList(layer(), layer())] if kind == "CacheList" else [layer(), layer()]
    inner = [c for top in cache for c in (top.caches if kind == "CacheList" else [top])]
    step = lambda seed, n: mx.random.normal((1, 2, n, 64), key=mx.random.key(seed))  # noqa: E731
    for c in inner:
        c.update_and_fetch(step(1, 10), step(2, 10))
    mx.eval([c.state for c in inner])

    def flat(layers):  # each layer's tensors up to its offset
        parts = [p for c in layers for p in (c.keys, c.values)]
        offsets = [c.offset for c in layers for _ in (0, 1)]
        return [np.array(x[..., :n, :]) for p, n in zip(parts, offsets) for x in (p if isinstance(p, tuple) else (p,))]

    before = flat(inner)
    held = frozen(cache)

    # Arrays of their own: mlx-lm's in-place write rebinds the cache's array objects to the
    # step's result, and a store reading those would wait for the step.
    def own(layers):
        return {id(x) for c in layers for p in (c.keys, c.values) for x in (p if isinstance(p, tuple) else (p,))}

    assert not own(c for top in held for c in (top.caches if kind == "CacheList" else [top])) & own(inner)
    for c in inner:  # in place, then past the buffer's end (a new, longer buffer)
        c.update_and_fetch(step(3, 1), step(4, 1))
        c.update_and_fetch(step(5, 300), step(6, 300))
    mx.eval([c.state for c in inner])
    assert signature_of(held) == signature_of(cache)
    kept = [c for top in held for c in (top.caches if kind == "CacheList" else [top])]
    assert [c.offset for c in kept] == [10, 10] and [c.offset for c in inner] == [311, 311]
    after = flat(kept)
    assert len(after) == len(before) == (12 if kind == "QuantizedKVCache" else 4)
    assert all(np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("beside", [False, True])
def test_a_restored_prompt_is_not_cut_again(store_dir, model, monkeypatch, beside):
    # prefill() stores the prompt after a restore too: with every block stored, nothing of
    # the cache is copied or cut (on a GPU that was a copy per field).
    import sys

    from persistent_prefix_cache.layers import Layout

    monkeypatch.setattr(sys.modules["persistent_prefix_cache.prefill"], "forwards_run_beside", lambda: beside)
    tokens = random_tokens(300, seed=44)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        prefill(model, tokens, store)
        store.flush()
    cuts = []
    real = Layout.new_blocks
    monkeypatch.setattr(Layout, "new_blocks", lambda self, *a, **k: cuts.append(1) or real(self, *a, **k))
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        _, logits = prefill(model, tokens, store)
        assert store.last_fetch.restored == 299
        assert cuts == []
        assert_same_logits(logits[0], cold_logits(model, tokens))


@pytest.mark.parametrize("length", [256, 300, 512])
def test_a_restored_cache_has_the_rows_mlx_lms_own_prefill_leaves(store_dir, model, length):
    # On CUDA, MLX builds a cuDNN attention graph per cache length, once per thread: a
    # restored cache as long as mlx-lm's own makes its next forwards build no graph that an
    # uncached prefill would not (a length of its own cost 50-60 ms on an H100).
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    tokens = random_tokens(length, seed=45)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        prefill(model, tokens, store)
        store.flush()
    theirs = make_prompt_cache(model)
    for _ in generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=theirs):
        pass
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        ours, _ = prefill(model, tokens, store)
        assert store.last_fetch.restored == length - 1
    assert [c.offset for c in ours] == [c.offset for c in theirs] == [length] * len(ours)
    assert [c.keys.shape[2] for c in ours] == [c.keys.shape[2] for c in theirs]


def test_a_prompt_longer_than_a_step_is_cut_in_mlx_lms_steps(store_dir, model):
    tokens = random_tokens(5000, seed=43)
    counted = Counted(model)
    with PersistentPrefixCache(store_dir, model, block_size=64) as store:
        steering = Steering(store, [])
        prefill(counted, tokens, steering)
        store.flush()
        assert counted.sizes == [2048, 2048, 903, 1]
        assert steering.stored == [5000]
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


# -- the layout never depends on how the caller stored ------------------------------------


def _stored_piecewise(store, model, tokens, step):
    """Store `tokens` as a caller that prefills `step` tokens at a time and stores after
    each forward (as earlier versions of prefill() did, or a server after every turn)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for end in range(step, len(tokens) + 1, step):
        model(mx.array(tokens[end - step : end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        store.store(tokens[:end], cache)
        store.flush()  # the writer idle between stores: no two writes share a commit
    return cache


def test_a_prompt_stored_block_by_block_ends_in_few_segments(store_dir, model):
    tokens = random_tokens(64 * BLOCK, seed=45)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        _stored_piecewise(store, model, tokens, BLOCK)
        stats = store.stats()
        # 64 store() calls of one block: a binary counter of merges ends in one segment
        # (64 is a power of two), every block rewritten at most log2(64) = 6 times.
        assert stats["blocks"] == 64 and len(segment_files(store_dir)) == 1
        assert stats["segments_merged"] == 63
        assert stats["bytes_on_disk"] == sum(segment_files(store_dir).values())
    more = tokens + random_tokens(7 * BLOCK, seed=46)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        _stored_piecewise(store, model, more, BLOCK)  # 7 more blocks: 4 + 2 + 1
        assert len(segment_files(store_dir)) == 4
    # At close the burst's leftovers merge (never the 64 blocks stored before it).
    assert len(segment_files(store_dir)) == 2
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0) as store:
        cache, remaining = store.fetch(more)
        assert len(more) - len(remaining) == len(more) - 1
        logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
        assert_same_logits(logits, cold_logits(model, more))


def test_a_chat_stored_turn_by_turn_is_restored_exactly_after_a_restart(store_dir, model):
    turns = [random_tokens(3 * BLOCK + 5 * k, seed=47 + k) for k in range(8)]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        chat: list[int] = []
        for turn in turns:
            chat += turn
            prefill(model, chat, store)  # each turn: restore the chat so far, store the rest
            store.flush()
        assert len(segment_files(store_dir)) <= 3
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0) as store:
        cache, remaining = store.fetch(chat)
        assert len(chat) - len(remaining) == len(chat) - 1
        logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
        assert_same_logits(logits, cold_logits(model, chat))


def test_a_shared_prefix_is_never_rewritten_by_its_continuations(store_dir, model):
    system = random_tokens(8 * BLOCK, seed=60, first=1)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        _stored_piecewise(store, model, system, 8 * BLOCK)
        shared = set(segment_files(store_dir))
        for k in range(3):  # three users' questions after the same system prompt
            _stored_piecewise(store, model, system + random_tokens(BLOCK, seed=61 + k, first=2 + k), 9 * BLOCK)
        # The prefix's segment holds blocks all three continue: it stays as it was.
        assert shared <= set(segment_files(store_dir))
        assert store.stats()["segments_merged"] == 0


def test_stores_queued_behind_a_busy_writer_share_one_segment(store_dir, model):
    from mlx_lm.models.cache import make_prompt_cache

    tokens = random_tokens(6 * BLOCK, seed=62)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        gate = __import__("threading").Event()
        store.hold_writer(gate)  # the writer busy: every store below queues
        try:
            cache = make_prompt_cache(model)
            for end in range(BLOCK, len(tokens) + 1, BLOCK):
                model(mx.array(tokens[end - BLOCK : end])[None], cache=cache)
                mx.eval([c.state for c in cache])
                store.store(tokens[:end], cache)
        finally:
            gate.set()  # never leave the writer held: close() would wait for it
        store.flush()
        assert len(segment_files(store_dir)) == 1 and store.stats()["segments_merged"] == 0


def test_the_package_name_prefill_calls_prefill_however_it_was_imported(store_dir, model):
    import persistent_prefix_cache
    import persistent_prefix_cache.prefill  # binds the package's attribute to the module

    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        cache, logits = persistent_prefix_cache.prefill(model, [1, 2, 3], store)
    assert logits.shape == (1, 512)


def test_a_burst_of_small_writes_merges_once_the_writer_is_quiet(store_dir, model, monkeypatch):
    import time

    from persistent_prefix_cache.core import merging

    monkeypatch.setattr(merging, "QUIET_SECONDS", 0.2)
    tokens = random_tokens(7 * BLOCK, seed=63)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        _stored_piecewise(store, model, tokens, BLOCK)
        # 4 + 2 + 1 by the binary counter, or fewer where a pause in the burst (a busy
        # machine) let a quiet spell's tidy in early: never more.
        assert len(segment_files(store_dir)) <= 3
        deadline = time.monotonic() + 60  # waits for an event, decides nothing by time
        while len(segment_files(store_dir)) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(segment_files(store_dir)) == 1
        assert store.stats()["bytes_rewritten"] > 0


def test_a_tidy_at_close_rewrites_a_bounded_amount(store_dir, model, monkeypatch):
    # A server stopped after hours without a quiet spell must not spend its shutdown
    # merging: at close the tidy stops once it has rewritten CLOSE_TIDY_BYTES.
    from persistent_prefix_cache.core import merging

    monkeypatch.setattr(merging, "CLOSE_TIDY_BYTES", 1)  # the first merge passes it
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for seed in (64, 65):  # two chains of 7 blocks, a block per store(): 4 + 2 + 1 segments each
            _stored_piecewise(store, model, random_tokens(7 * BLOCK, seed=seed, first=seed), BLOCK)
        assert len(segment_files(store_dir)) == 6
    assert len(segment_files(store_dir)) == 4  # the newest chain merged into one, then the budget was spent

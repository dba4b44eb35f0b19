"""The cost model (restore only what is faster than computing it) and the RAM tier's
join with MLX operations (what a GPU uses). Rates are set by the tests: timings of
this machine must never decide what a test sees."""

from __future__ import annotations

import pytest
from helpers import BLOCK, assert_same_logits, cold_logits, counted_forwards, prefill, random_tokens, warm_logits

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.device import target as device_target
from persistent_prefix_cache.core.costs import Costs
from persistent_prefix_cache.keys import as_token_array, chain_keys


def _store(path, model, tokens, **options):
    store = PersistentPrefixCache(path, model, block_size=BLOCK, **options)
    store.store(tokens, prefill(model, tokens)[1])
    store.flush()
    return store


def test_choice_saves_the_most_time():
    costs = Costs()
    ends, sizes = [16, 32, 48, 60], [1000] * 4
    ram = [True, True, False, False]
    cuts = [0, 1, 2, 3]
    assert costs.choose(ends, sizes, ram, cuts).tokens == 60  # nothing known: restore
    costs.observe_prefill(1000, 1.0)  # 1,000 tokens/s
    assert costs.choose(ends, sizes, ram, cuts).tokens == 60  # no tier timed yet
    costs.restore_bytes_per_s = {"ram": 1e9, "disk": 1e3}  # disk: 1 s per block
    choice = costs.choose(ends, sizes, ram, cuts)
    assert (choice.blocks, choice.tokens) == (2, 32)  # the RAM part only
    costs.restore_bytes_per_s = {"ram": 1e9, "disk": 1e9}
    assert costs.choose(ends, sizes, ram, cuts).tokens == 60
    costs.observe_prefill(10**9, 1.0)  # prefill far faster than any restore
    costs.prefill_tokens_per_s = 1e9
    costs.restore_bytes_per_s = {"ram": 1.0, "disk": 1.0}
    assert costs.choose(ends, sizes, ram, cuts).blocks == 0
    # Only resumable points are candidates.
    costs.prefill_tokens_per_s, costs.restore_bytes_per_s = 1000.0, {"ram": 1e9, "disk": 1e3}
    assert costs.choose(ends, sizes, ram, [3]).tokens in (0, 60)
    assert not Costs(enabled=False).choose(ends, sizes, ram, cuts).saved_seconds


def test_a_restore_saves_no_forward_call_the_caller_runs_anyway():
    # A GPU's prefill: 35,000 tokens/s and 12 ms per forward call (bound by launches).
    costs = Costs()
    costs.set_prefill(35000.0, per_forward=0.012)
    costs.set_restore({"disk": 8e9}, {"disk": 0.010})
    size = 64 << 20  # 512 tokens of an 8B model's KV
    # As a prefill of its own, 512 tokens cost 26.6 ms: the restore (18.4 ms) would win...
    assert costs.prefill_seconds(0, 512) > 0.010 + size / 8e9
    # ...but the caller runs one forward for the 513th token either way: the restore saves
    # the tokens only (14.6 ms) and loses.
    assert costs.choose([512], [size], [False], [0], total=513).blocks == 0
    # Where reading is cheap enough to beat the tokens alone, it still restores.
    costs.set_restore({"disk": 8e10}, {"disk": 0.001})
    assert costs.choose([512], [size], [False], [0], total=513).decision == "restored_all"


def test_a_store_skips_what_is_slower_and_counts_it(store_dir, model):
    tokens = random_tokens(3 * BLOCK + 5, seed=900)
    with _store(store_dir, model, tokens) as store:
        # Blocks stored by this handle are in its RAM tier; say RAM is slow, prefill fast.
        store.costs.learned.prefill_tokens_per_s = 1e12
        store.costs.learned.restore_bytes_per_s = {"ram": 1.0, "disk": 1.0}
        cache, remaining = store.fetch(tokens)
        assert cache is None and remaining == tokens
        stats = store.stats()
        assert stats["skipped_slower"] == 1 and stats["tokens_skipped"] == len(tokens) - 1
        assert stats["hits"] == 0
    with PersistentPrefixCache(store_dir, model, cost_model=False) as store:
        store.costs.learned.prefill_tokens_per_s = 1e12
        store.costs.learned.restore_bytes_per_s = {"ram": 1.0, "disk": 1.0}
        cache, remaining = store.fetch(tokens)
        assert len(tokens) - len(remaining) == len(tokens) - 1  # switched off: restores


def test_only_the_fast_tier_is_restored_and_continues_exactly(store_dir, model):
    tokens = random_tokens(3 * BLOCK + 5, seed=901)
    with _store(store_dir, model, tokens) as store:
        keys = chain_keys(bytes.fromhex(store.this_model()["root"]), as_token_array(tokens), BLOCK)
        assert store.ram_tier.evict(keys[1:]) == 3  # only the first block stays in RAM
        store.costs.learned.prefill_tokens_per_s = 100.0
        store.costs.learned.restore_bytes_per_s = {"ram": 1e12, "disk": 1.0}
        query = tokens + [1, 2]
        cache, remaining = store.fetch(query)
        assert len(query) - len(remaining) == BLOCK
        assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, query))
        assert store.stats()["tokens_skipped"] == len(tokens) - BLOCK


def test_prefill_and_calibrate_teach_the_prefill_rate(store_dir, model, monkeypatch):
    from persistent_prefix_cache.prefill import prefill as block_prefill

    # Timed by a clock of their own: the tiny model's forwards of a block are bound by their
    # calls, and on a busy machine priced a token at nothing (the prefill stays unknown then).
    counted_forwards(model, monkeypatch)
    tokens = random_tokens(2 * BLOCK + 3, seed=902)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert store.stats()["prefill_tokens_per_s"] is None
        block_prefill(model, tokens, store)
        assert store.stats()["prefill_tokens_per_s"] > 0
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert store.calibrate(model, tokens=32) > 0 and store.stats()["prefill_tokens_per_s"] > 0


def _calibrated(model, monkeypatch, tokens: int, seconds) -> tuple[list, list]:
    """`calibrate(tokens)` on the real model, timed by a clock that a forward of ``n``
    tokens moves by ``seconds(n)``: the forwards run, and those observed."""
    from mlx_lm.models.cache import make_prompt_cache

    from persistent_prefix_cache.core import calibration, costs

    seen, calls, clock = [], [], [0.0]
    monkeypatch.setattr(Costs, "observe_prefill", lambda self, n, s, start=0, forwards=1: seen.append((n, start, s)))
    monkeypatch.setattr(costs, "clock", lambda: clock[0])
    real = model.__call__

    def counted(inputs, cache=None):
        calls.append((inputs.shape[1], cache[0].offset))
        clock[0] += seconds(inputs.shape[1])
        return real(inputs, cache=cache)

    monkeypatch.setattr(type(model), "__call__", lambda self, inputs, cache=None: counted(inputs, cache))
    calibration.calibrate(Costs(), model, lambda: make_prompt_cache(model), tokens)
    return calls, [(n, start) for n, start, _ in seen]


def test_calibrate_times_its_forwards_once_warm_and_apart(model, monkeypatch):
    # A process's first forward of a shape compiles MLX's kernels (on an H200 a 64-token
    # continuation took 99 ms the first time, 17 ms after): calibrate runs its forwards
    # once untimed, then times the same ones. Two fresh-cache lengths set the per-token
    # cost apart from the per-call one.
    calls, seen = _calibrated(model, monkeypatch, 64, lambda n: 0.001 * n)  # bound by its tokens
    assert seen == [(8, 0), (64, 0), (16, 64), (32, 80), (16, 112)]
    pair, rest = [(8, 0), (64, 0)], [(64, 0), (16, 64), (32, 80), (16, 112)]
    assert calls == pair + pair + rest + rest  # untimed first, then timed


def test_calibrate_grows_the_prompt_while_a_forward_is_bound_by_its_call(model, monkeypatch):
    # An 8B model on an H200 takes ~12 ms for 32 tokens and for 256 alike: from such
    # timings alone a fit put 256 tokens at 22 ms (and restored them from disk at 2 x the
    # prefill). calibrate doubles the prompt until the tokens show, here never (up to 512).
    from persistent_prefix_cache.core import calibration as costs_module

    monkeypatch.setattr(costs_module, "MAX_CALIBRATION_TOKENS", 512)
    _, seen = _calibrated(model, monkeypatch, 64, lambda n: 0.012)
    assert seen == [
        (8, 0),
        (64, 0),
        (16, 0),
        (128, 0),
        (32, 0),
        (256, 0),
        (64, 0),
        (512, 0),
        (128, 512),
        (256, 640),
        (128, 896),
    ]
    # Where the tokens show from some length on, it stops there.
    _, seen = _calibrated(model, monkeypatch, 64, lambda n: max(0.012, 0.0001 * n))
    assert [n for n, start in seen if start == 0][-1] == 256


@pytest.mark.parametrize("join", ["mlx", "numpy"])
def test_ram_tier_join_on_the_device_restores_exactly(store_dir, model, monkeypatch, join):
    # What a GPU does (mx.concatenate of the RAM tier's blocks, with room to grow),
    # forced here on the CPU; and the host copy, for comparison.
    monkeypatch.setattr(device_target, "RAM_JOIN", join)
    tokens = random_tokens(4 * BLOCK + 7, seed=903)
    with _store(store_dir, model, tokens) as store:
        query = tokens + [3]
        cache, remaining = store.fetch(query)
        assert len(query) - len(remaining) == len(tokens)
        assert cache[0].keys.shape[2] >= len(tokens) + 1  # room: the next step writes in place
        assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, query))
        # The RAM tier's arrays are not the cache's: a second fetch is unaffected.
        cache2, remaining2 = store.fetch(query)
        assert_same_logits(warm_logits(model, cache2, remaining2), cold_logits(model, query))


def test_every_decision_by_the_rates_set():
    # Four blocks of 1,000 bytes ending at 16/32/48/60 tokens; the first two in RAM.
    ends, sizes, ram, cuts = [16, 32, 48, 60], [1000] * 4, [True, True, False, False], [0, 1, 2, 3]
    costs = Costs()
    costs.set_prefill(1000.0)  # 1 ms a token
    costs.set_restore({"ram": 1e9, "disk": 1e9})
    assert costs.choose(ends, sizes, ram, cuts).decision == "restored_all"
    costs.set_restore({"ram": 1e9, "disk": 1e3})  # a disk block: 1 s, 16 tokens save 16 ms
    assert (costs.choose(ends, sizes, ram, cuts).decision, costs.choose(ends, sizes, ram, cuts).tokens) == (
        "restored_ram_only", 32,
    )  # fmt: skip
    # Only block 0 may be cut after (block 1 is not resumable): a shorter prefix.
    choice = costs.choose(ends, sizes, ram, [0, 3])
    assert (choice.decision, choice.blocks, choice.tokens) == ("restored_shorter", 1, 16)
    costs.set_prefill(1e9)
    assert costs.choose(ends, sizes, ram, cuts).decision == "skipped_slower"
    assert Costs(enabled=False).choose(ends, sizes, ram, cuts).decision == "restored_all"


def test_fixed_costs_and_the_first_forward_decide_short_prefixes():
    ends, sizes, cuts = [64, 128, 4096], [10, 10, 10], [0, 1, 2]
    ram = [False] * 3
    costs = Costs()
    costs.set_prefill(10_000.0)  # 0.1 ms a token: 64 tokens 6.4 ms, 4,096 tokens 0.41 s
    costs.set_restore({"disk": 1e12}, {"disk": 0.05})  # bytes are free; 50 ms a restore
    assert costs.choose(ends[:2], sizes[:2], ram[:2], cuts[:2]).decision == "skipped_slower"
    assert costs.choose(ends, sizes, ram, cuts).decision == "restored_all"
    costs.first_forward_per_token = 0.5 / 4096  # the first forward after 4,096 restored tokens: 0.5 s more
    assert costs.choose(ends, sizes, ram, cuts).decision == "skipped_slower"


def test_a_first_forward_costs_what_its_restore_held():
    # A one-token forward after a 4,095-token restore on an H200 took 0.158 s more than
    # predicted (mlx-lm's copy of the restored cache, pages moving to the GPU). Kept as a
    # constant it priced every later restore 0.158 s higher: the next process recomputed
    # a prompt whose restore took half its prefill. Per restored token, a restore of 512
    # tokens pays an eighth of it, and one of 4,096 tokens pays it whole.
    costs = Costs()
    costs.set_prefill(30_000.0)  # 512 tokens 17 ms, 4,096 tokens 0.137 s
    costs.set_restore({"disk": 1e10}, {"disk": 0.002})
    costs.observe_first_forward(1, 0.158 + costs.prefill_seconds(4095, 4096), start=4095)
    assert costs.first_forward_per_token == pytest.approx(0.158 / 4095, rel=1e-3)
    kv = 128 << 10  # bytes of KV a token (an 8B llama)
    # 512 tokens: 7 ms of bytes + 2 ms + 20 ms of first forward, against 17 ms of prefill.
    short = costs.choose([512], [512 * kv], [False], [0])
    assert short.decision == "skipped_slower"
    # The same rates with a tenth of the extra: the restore wins.
    costs.first_forward_per_token /= 10
    assert costs.choose([512], [512 * kv], [False], [0]).decision == "restored_all"


def test_prefill_growth_with_length_is_fitted_and_decides():
    costs = Costs()
    # Observed chunks of 512 tokens at growing positions, each position costing more:
    # seconds = 1e-4 * n + 1e-8 * (end^2 - start^2) / 2.
    for start in range(0, 8192, 512):
        end = start + 512
        costs.observe_prefill(512, 1e-4 * 512 + 1e-8 * (end * end - start * start) / 2, start=start)
    a, b, c = costs.prefill.coefficients()
    assert a == pytest.approx(1e-4, rel=1e-3) and b == pytest.approx(1e-8, rel=1e-3) and c == pytest.approx(0, abs=1e-9)
    assert costs.prefill_seconds(0, 8192) == pytest.approx(1e-4 * 8192 + 1e-8 * 8192**2 / 2, rel=1e-3)
    # A restore of 1 s wins against this prefill of 8,192 tokens (1.15 s) but loses to a
    # linear one at the same rate at position 0 (0.82 s).
    costs.set_restore({"disk": 1.0})  # 1 byte/s
    ends, sizes = [8192], [1]
    assert costs.choose(ends, sizes, [False], [0]).decision == "restored_all"
    costs.prefill_tokens_per_s = 1e4  # linear, no growth
    assert costs.choose(ends, sizes, [False], [0]).decision == "skipped_slower"


def test_restore_fit_learns_a_fixed_cost_and_a_rate():
    costs = Costs()
    for nbytes in (1 << 20, 4 << 20, 16 << 20, 2 << 20):
        costs.observe_restore("disk", nbytes, 0.003 + nbytes / 2e9)
    assert costs.restore_bytes_per_s["disk"] == pytest.approx(2e9, rel=1e-3)
    assert costs.restore_fixed_seconds("disk") == pytest.approx(0.003, rel=1e-3)
    costs.observe_restore("disk", 1000, 0.003 + 1000 / 2e9)  # small: teaches the fixed cost only
    assert costs.restore_fixed_seconds("disk") == pytest.approx(0.003, rel=1e-2)


def test_a_store_counts_each_decision(store_dir, model):
    tokens = random_tokens(3 * BLOCK + 5, seed=904)
    with _store(store_dir, model, tokens) as store:
        query = tokens + [1, 2]
        store.costs.learned.set_prefill(1e12)
        store.costs.learned.set_restore({"ram": 1.0, "disk": 1.0})
        assert store.fetch(query)[0] is None
        store.costs.learned.set_prefill(100.0)
        store.costs.learned.set_restore({"ram": 1e12, "disk": 1e12})
        assert store.fetch(query)[0] is not None
        keys = chain_keys(bytes.fromhex(store.this_model()["root"]), as_token_array(tokens), BLOCK)
        assert store.ram_tier.evict(keys[1:]) == 3  # only the first block stays in RAM
        store.costs.learned.set_restore({"ram": 1e12, "disk": 1.0})
        cache, remaining = store.fetch(query)
        assert len(query) - len(remaining) == BLOCK
        stats = store.stats()
        decided = {k: stats[k] for k in ("restored_all", "restored_ram_only", "restored_shorter", "skipped_slower")}
        assert decided == {"restored_all": 1, "restored_ram_only": 1, "restored_shorter": 0, "skipped_slower": 1}
        assert stats["hits"] == 2 and stats["prefill_tokens_per_s"] == pytest.approx(100.0)
        assert stats["cost_device"].startswith(("cpu:", "gpu:"))


def test_a_cost_per_forward_call_is_told_apart_from_the_tokens():
    # A GPU: 64-token chunks are launch-bound (2 ms a call), tokens cost 25 us each.
    costs = Costs()
    for n, start in ((64, 0), (64, 64), (512, 128), (2048, 640), (128, 2688)):
        costs.observe_prefill(n, 0.002 + 25e-6 * n, start=start)
    a, b, c = costs.prefill.coefficients()
    assert a == pytest.approx(25e-6, rel=1e-3) and c == pytest.approx(0.002, rel=1e-3)
    assert b == pytest.approx(0, abs=1e-12)
    # So a prompt of 8,192 tokens prefills (in 2,048-token calls) at ~ 8,192 * 25 us + 4 calls.
    assert costs.prefill_seconds(0, 8192) == pytest.approx(8192 * 25e-6 + 4 * 0.002, rel=1e-3)
    # Chunks all alike cannot tell a call from its tokens. Small ones are explained by their
    # calls (a caller's 64-token forwards never teach "the model is slow": not 256 x 4 ms
    # for 16k tokens), which prices a token at nothing: the prefill stays unknown, and a
    # fetch restores all it finds, as before anything was timed. Large ones are explained
    # by their tokens.
    alike = Costs()
    for _ in range(3):
        alike.observe_prefill(64, 0.004)
    assert alike.prefill.coefficients() == pytest.approx([0.0, 0.0, 0.004])
    assert alike.prefill_seconds(0, 16384) is None and alike.prefill_tokens_per_s is None
    alike.set_restore({"ram": 3e10, "disk": 1e9}, {"ram": 1e-3, "disk": 5e-3})
    choice = alike.choose([2048, 4096], [1 << 28, 1 << 28], [False, False], [0, 1], 4097)
    assert (choice.blocks, choice.decision) == (2, "restored_all")
    large = Costs()
    for _ in range(3):
        large.observe_prefill(2048, 0.2)
    assert large.prefill.coefficients() == pytest.approx([0.2 / 2048, 0.0, 0.0])


def test_small_forwards_then_large_ones_learn_the_model_not_the_caller():
    # The README's old prefill on an H200: 256 forwards of 64 tokens, each bound by its
    # launch (10 ms; the model runs 2,048 tokens in 60 ms), then its last token alone. The
    # fit must not read that as ~6,000 tokens/s; prefill()'s steps then teach the rate.
    costs = Costs()
    for k in range(256):
        costs.observe_prefill(64, 0.010, start=64 * k)
    costs.observe_prefill(1, 0.0095, start=64 * 256)
    assert costs.prefill_seconds(0, 16384) <= 16384 / 30000 + 8 * 0.010
    for start in (0, 2048, 4096):
        costs.observe_prefill(2048, 0.0082 + 2048 / 40000, start=start)
    costs.observe_prefill(1, 0.0082, start=6144)
    assert 30000 < costs.prefill_tokens_per_s < 60000


def test_noise_cannot_make_a_call_cost_more_than_the_fastest_call():
    costs = Costs()
    # Three calls, the third slowed down by a neighbour: the exact fit would put
    # seconds on every call; no call's fixed cost can exceed the fastest call (0.1 s).
    for n, start, seconds in ((256, 0, 0.1), (64, 256, 0.12), (128, 320, 5.0)):
        costs.observe_prefill(n, seconds, start=start)
    assert costs.figures()["prefill_per_forward_s"] <= 0.1
    assert costs.prefill_seconds(0, 16) <= 0.1 + 16 * costs.prefill.coefficients()[0] + 1e-9


def test_a_tier_timed_once_is_timed_again_before_it_is_judged():
    # A process's first restore from a tier compiles MLX's kernels for its shapes: on an
    # H200 a 256-token RAM-tier restore took 7.2 ms the first time, 1.8 ms after. Judged on
    # that first timing alone the tier lost to the prefill and was never timed again.
    costs = Costs()
    costs.set_prefill(58000.0, per_forward=0.008)  # 256 tokens: 4.4 ms beyond the forward
    size = 32 << 20
    choose = lambda: costs.choose([256], [size], [True], [0], total=257)  # noqa: E731
    costs.observe_restore("ram", size, 0.0072)
    assert choose().decision == "restored_all"  # one timing: restore, and time it again
    costs.observe_restore("ram", size, 0.0018)
    assert choose().decision == "restored_all"  # (0.7 x 7.2 + 1.8) / 1.7 = 4.0 ms < 4.4 ms
    costs.observe_restore("ram", size, 0.0072)
    costs.observe_restore("ram", size, 0.0072)
    assert choose().decision == "skipped_slower"  # timed slow twice and more: judged
    costs.set_restore({"ram": size / 0.006})  # rates set by hand are trusted at once
    assert choose().decision == "skipped_slower"


def test_restores_of_one_size_teach_a_rate_even_through_noise():
    # A server restarted on one system prompt times restores of one size only, with noise
    # (the page cache, the device): the least-squares split of rate and fixed cost can then
    # come out with a negative rate. Before, the rate was dropped, the tier read as "not
    # timed yet", and every fetch restored blind at that size, forever (H200, 8k tokens:
    # 1.2-1.7 x the cold prefill). The rate is kept and the fixed cost goes instead.
    costs = Costs()
    for nbytes, seconds in [(1_000_000_000, 0.30), (1_000_000_000, 0.20), (1_010_000_000, 0.18), (1_000_000_000, 0.25)]:
        costs.observe_restore("disk", nbytes, seconds)
    rate = costs.restore_bytes_per_s.get("disk")
    assert rate is not None and 3e9 < rate < 6e9  # about 1 GB per 0.23 s
    costs.set_prefill(1e5)  # 10 us a token: a 1 GB restore (~0.23 s) loses to a 0.1 s prefill of 10k
    choice = costs.choose([10_000], [1_000_000_000], [False], [0])
    assert choice.decision == "skipped_slower"


def test_a_process_first_restore_has_its_own_cost(monkeypatch):
    # A fresh process's first restore from a tier pays one-off costs (kernel compiles, the
    # reader pool, pinned buffers): learned apart from the tier's rate, and counted in the
    # choice until this process has paid them (256 tokens of an 8B model on an H200).
    from persistent_prefix_cache.core import costs as costs_module

    monkeypatch.setattr(costs_module, "_restored_here", set())
    costs = Costs()
    costs.set_prefill(40000.0, per_forward=0.008)  # 256 tokens: 6.4 ms beyond the forward
    costs.set_restore({"disk": 10e9})  # 32 MiB in 3.4 ms
    size = 32 << 20
    choose = lambda: costs.choose([256], [size], [False], [0], total=257)  # noqa: E731
    assert choose().decision == "restored_all"
    costs.observe_restore("disk", size, 0.0134, first=True)  # 10 ms beyond the rate
    assert costs.first_restore["disk"] == pytest.approx(0.010, rel=1e-2)
    assert costs.restore_bytes_per_s["disk"] == pytest.approx(10e9)  # the rate is untouched
    assert choose().decision == "skipped_slower"  # this process would pay the 10 ms
    assert costs_module.first_restore_here("disk") and not costs_module.first_restore_here("disk")
    assert choose().decision == "restored_all"  # paid: the rate decides
    # Saved and loaded with the rest.
    again = Costs()
    assert again.load(costs.record()) and again.first_restore == costs.first_restore


def test_a_long_first_forward_teaches_no_first_forward_cost():
    # A forward of 2,000 tokens after a 5-token restore differs from its prediction by the
    # prediction's own error: blamed on the restore, it made every later one look slow.
    costs = Costs()
    costs.set_prefill(1000.0)
    costs.observe_first_forward(2000, 3.0, start=5)  # 1 s over the prediction
    assert costs.first_forward_per_token is None
    costs.observe_first_forward(16, 0.021, start=500)  # a short one: 5 ms over, 10 us a restored token
    assert costs.first_forward_per_token == pytest.approx(0.005 / 500, rel=1e-3)
    # Records saved before this rule keep their restore rates, not their first forward
    # (nor, before version 4, their prefill: it may mix a server's requests in).
    for version in (None, 2):  # before the rule; a constant per restore
        old = dict(costs.record(), first_forward=1.5)
        old.pop("version") if version is None else old.update(version=version)
        again = Costs()
        assert again.load(old) and again.first_forward_per_token is None
    assert again.prefill_tokens_per_s is None
    assert Costs().load(costs.record()) and costs.prefill_tokens_per_s == pytest.approx(1000.0)


def test_a_process_first_forward_teaches_nothing(store_dir, model, monkeypatch):
    # It compiles MLX's kernels: a restarted server's first request (a restore, then a
    # one-token forward) taught 0.16 s of compiling as every restore's first-forward cost
    # on an H200, and the next process skipped restores it should have made.
    from persistent_prefix_cache.core import costs as costs_module

    monkeypatch.setattr(costs_module, "_restored_here", set())  # a new process
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.observe_prefill(16, 0.5, start=300, restored=True)  # the process's first
        assert store.stats()["first_forward_s_per_token"] is None
        assert store.stats()["prefill_tokens_per_s"] is None
        store.observe_prefill(2048, 0.5)  # the next ones teach
        assert store.stats()["prefill_tokens_per_s"] is not None
        store.observe_prefill(16, 0.5, start=300, restored=True)
        assert store.stats()["first_forward_s_per_token"] is not None


def test_a_servers_requests_teach_its_prefill_and_never_a_calls_cost():
    # `ppc serve` times a request (read to write). On an H100 ~150 ms of each was not its
    # prefill's, and fitted as a call's cost it restored 64 tokens of 2,092 to "save a
    # call"; its tokens cost ~13,000 tokens/s there, 3 x what `calibrate`'s forwards show.
    costs = Costs()
    for n in (2044, 2080, 7968, 7909, 2209, 8220):
        costs.observe_prefill(n, 0.15 + n / 13000, forwards=-(-n // 2048), exact=False)
    assert costs.fastest_forward is None and not costs.timed_forwards
    coef = costs.figures()
    assert coef["prefill_per_forward_s"] == 0  # a request's own time is no call's
    assert costs.prefill_tokens_per_s == pytest.approx(13000, rel=0.05)  # its tokens, as the server runs them
    # Restoring 64 tokens of 2,092 saves 64 tokens' time, nothing more.
    saved = costs.prefill_seconds(0, 2092) - costs.prefill_seconds(64, 2092)
    assert saved == pytest.approx(64 / 13000, rel=0.05)
    # Timed forwards (a calibration: 10 ms a call) give a call's cost, the requests still the tokens'.
    for _ in range(2):
        for n in (32, 256, 512, 1024, 2048):
            costs.observe_prefill(n, 0.01 + n / 38000)
    assert costs.timed_forwards and costs.figures()["prefill_per_forward_s"] == pytest.approx(0.01, rel=0.1)
    assert costs.prefill_seconds(64, 1088) == pytest.approx(1024 / 13000 + 0.01, rel=0.1)
    # Kept apart in the record, and taken back apart.
    again = Costs()
    assert again.load(costs.record()) and again.timed_forwards
    assert again.prefill_seconds(0, 4096) == pytest.approx(costs.prefill_seconds(0, 4096))
    # An older record (version 3): its prefill may mix requests in, so it is learned again.
    older = Costs()
    assert older.load({**costs.record(), "version": 3}) and older.prefill_tokens_per_s is None
    assert not older.timed_forwards and older.fastest_forward is None


def test_two_requests_alike_still_give_a_rate():
    # A restarted server's store had seen two 8k prompts, the longer a little faster: fitted
    # as all overhead, its prefill read as unknown, and its first restore calibrated (0.8 s
    # inside a request on an H100). The tokens are kept; the overhead goes first.
    costs = Costs()
    costs.observe_prefill(8220, 0.70, forwards=5, exact=False)
    costs.observe_prefill(8255, 0.69, forwards=5, exact=False)
    assert costs.prefill_tokens_per_s == pytest.approx(8237 / 0.695, rel=0.02)

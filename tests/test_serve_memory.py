"""One memory budget for `PersistentLRUPromptCache` and ``ppc serve`` (issue #22).

Counted, never timed: the KV held in memory (the LRU's entries plus the store's RAM
tier, `PersistentLRUPromptCache.nbytes`) is read after every call of the server's call
sequence (fetch, prefill the rest, insert) and must never pass the budget, over many
distinct prompts and over many hits of one prompt; every hit stays exact. A hit's
allocation is measured with MLX's own counters (one cache, not a deep copy beside it).
The server end to end: a real ``ppc serve`` with ``--prompt-cache-bytes``, whose closing
line reports the highest figure it saw.
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from helpers import assert_same_logits, cold_logits, feed, random_tokens
from mlx_lm.models.cache import make_prompt_cache
from test_serve import BLOCK, Server, _answer, _cached

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.cli.serve import memory_budget
from persistent_prefix_cache.lru_prompt_cache import PersistentLRUPromptCache

# TEST_MODEL: 2 layers x 1 KV head x 32 x (k, v) x float32 = 512 bytes of KV per token;
# an LRU entry is allocated in steps of 256 tokens (128 KiB for up to 256 tokens).
TOKENS = 100
BUDGET = 200_000  # the blocks of ~3.9 such prompts; one LRU entry fits


def _serve_once(ours, model, tokens):
    """What mlx_lm.server does for one request: fetch, prefill the rest, insert."""
    cache, rest = ours.fetch_nearest_cache("m", tokens)
    covered = len(tokens) - len(rest)
    if cache is None:
        cache = make_prompt_cache(model)
    logits = feed(model, cache, rest)
    ours.insert_cache("m", list(tokens), cache)
    return covered, logits


def _kv_bytes(cache) -> int:
    return sum(layer.nbytes for layer in cache)


@pytest.fixture
def budgeted(serve_model, tmp_path):
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK)
    ours = PersistentLRUPromptCache(store, max_size=1000, max_bytes=BUDGET, keep_last_token=True)
    yield store, ours
    ours.close()
    store.close()


def test_distinct_prompts_stay_within_one_budget(serve_model, budgeted):
    store, ours = budgeted
    prompts = [random_tokens(TOKENS, seed=100 + i, first=1 + i) for i in range(12)]
    for tokens in prompts:
        covered, _ = _serve_once(ours, serve_model, tokens)
        assert covered == 0
        assert ours.nbytes <= BUDGET
        assert len(ours) == 0  # the store took it: its blocks live once, in the RAM tier
        assert ours.nbytes == store.stats()["bytes_in_memory"]
    stats = store.stats()
    assert stats["memory_evictions"] > 0  # the budget bit: 12 prompts' blocks do not fit
    assert ours.persistent_stats()["memory_peak_bytes"] <= BUDGET
    ours.flush()
    # Every prompt is still served, exactly: the recent ones from RAM, the rest from disk.
    for tokens in prompts[::-1]:
        query = tokens + [7, 8]
        cache, rest = ours.fetch_nearest_cache("m", query)
        assert rest == [7, 8]
        assert_same_logits(feed(serve_model, cache, rest), cold_logits(serve_model, query))
        assert ours.nbytes <= BUDGET
    assert store.stats()["restored_blocks_disk"] > 0
    assert ours.persistent_stats()["memory_peak_bytes"] <= BUDGET


def test_hits_of_one_prompt_stay_within_the_budget_and_exact(serve_model, budgeted):
    store, ours = budgeted
    system = random_tokens(TOKENS, seed=200, first=5)
    _serve_once(ours, serve_model, system)
    for i in range(10):
        # The same system prompt, another question each time (as a chat server sees it).
        query = system + random_tokens(6, seed=300 + i, first=9)
        covered, logits = _serve_once(ours, serve_model, query)
        assert covered >= len(system) - BLOCK  # the system prompt came back
        assert_same_logits(logits, cold_logits(serve_model, query))
        assert ours.nbytes <= BUDGET and len(ours) == 0
    # The exact prompt again, ten times: all but its last token, from the RAM tier.
    before = store.stats()["restored_blocks_disk"]
    for _ in range(10):
        covered, logits = _serve_once(ours, serve_model, system)
        assert covered == len(system) - 1
        assert_same_logits(logits, cold_logits(serve_model, system))
        assert ours.nbytes <= BUDGET
    assert store.stats()["restored_blocks_disk"] == before
    assert ours.persistent_stats()["memory_peak_bytes"] <= BUDGET


def test_a_hit_allocates_one_cache_and_shares_nothing_with_the_tier(serve_model, budgeted):
    store, ours = budgeted
    tokens = random_tokens(TOKENS, seed=400, first=3)
    _serve_once(ours, serve_model, tokens)
    held = ours.nbytes
    mx.eval(mx.zeros(1))  # nothing pending
    # MLX's buffer cache hands out a freed buffer somewhat larger than asked, and counts it
    # whole: buffers left there by an earlier test (of another model) made the peak grow
    # by more than the cache's bytes. Emptied, the peak counts what this fetch asks for.
    mx.clear_cache()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    cache, rest = ours.fetch_nearest_cache("m", tokens)
    mx.eval([layer.state for layer in cache])
    grown = mx.get_peak_memory() - active
    # The restore allocates the returned cache (its buffers, with their room to grow)
    # and no second copy of it.
    assert 0 < grown <= _kv_bytes(cache) + 4096, (grown, _kv_bytes(cache))
    # Writing into the hit (the generation) leaves the tier's blocks as they were.
    feed(serve_model, cache, rest + random_tokens(20, seed=401, first=4))
    again, rest = ours.fetch_nearest_cache("m", tokens)
    assert_same_logits(feed(serve_model, again, rest), cold_logits(serve_model, tokens))
    assert ours.nbytes == held


def test_caches_the_store_refuses_share_the_budget(serve_model, budgeted):
    store, ours = budgeted
    for i in range(4):
        _serve_once(ours, serve_model, random_tokens(TOKENS, seed=500 + i, first=1 + i))
    tier = store.stats()["bytes_in_memory"]
    assert tier > 0
    # Quantized KV cannot be stored: the LRU keeps it, and the tier makes room for it.
    tokens = random_tokens(TOKENS, seed=510, first=2)
    cache = make_prompt_cache(serve_model)
    feed(serve_model, cache, tokens)
    quantized = [layer.to_quantized(group_size=32, bits=4) for layer in cache]
    ours.insert_cache("m", tokens, quantized)
    assert len(ours) == 1
    assert ours.nbytes <= BUDGET
    assert store.stats()["bytes_in_memory"] <= BUDGET - _kv_bytes(quantized) < tier + _kv_bytes(quantized)
    # The server's batched path trims to its budget minus the active requests' caches.
    ours.trim_to(n_bytes=_kv_bytes(quantized) + 10_000)
    assert ours.nbytes <= _kv_bytes(quantized) + 10_000 and len(ours) == 1
    ours.trim_to(n_bytes=0)
    assert ours.nbytes == 0 and len(ours) == 0


def test_two_stores_in_turn_keep_their_hot_prompts_in_ram(serve_model, tmp_path):
    # A server whose requests alternate between two tenants (a handle each, one budget):
    # each tenant's hot prompt stays in its tier while the other's is served.
    stores = {
        name: PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK, namespace=name)
        for name in ("a", "b")
    }
    ours = PersistentLRUPromptCache(lambda key: stores[key], max_size=1000, max_bytes=BUDGET, keep_last_token=True)
    hot = {name: random_tokens(TOKENS, seed=700 + i, first=1 + i) for i, name in enumerate(stores)}

    def ask(name, tokens):
        cache, rest = ours.fetch_nearest_cache(name, tokens)
        covered = len(tokens) - len(rest)
        if cache is None:
            cache = make_prompt_cache(serve_model)
        logits = feed(serve_model, cache, rest)
        ours.insert_cache(name, list(tokens), cache)
        return covered, logits

    for name, tokens in hot.items():
        assert ask(name, tokens)[0] == 0
    ours.flush()
    for _ in range(4):
        for name, tokens in hot.items():
            before = stores[name].stats()
            covered, logits = ask(name, tokens)
            after = stores[name].stats()
            assert covered == len(tokens) - 1
            assert_same_logits(logits, cold_logits(serve_model, tokens))
            assert after["restored_blocks_disk"] == before["restored_blocks_disk"], name  # from RAM
            assert ours.nbytes <= BUDGET
    # A flood of one tenant's one-off prompts (more than the budget holds): its tier
    # evicts its own blocks, never the other's hot prompt (within an even share).
    held = stores["b"].limit_memory()[0]
    assert 0 < held <= BUDGET // 2
    for i in range(8):
        ask("a", random_tokens(TOKENS, seed=720 + i, first=3))
        assert ours.nbytes <= BUDGET
    assert stores["a"].stats()["memory_evictions"] > 0
    assert stores["b"].limit_memory()[0] == held
    before = stores["b"].stats()["restored_blocks_disk"]
    assert ask("b", hot["b"])[0] == len(hot["b"]) - 1
    assert stores["b"].stats()["restored_blocks_disk"] == before
    ours.close()
    for store in stores.values():
        store.close()


def test_without_a_budget_each_tier_keeps_its_own(serve_model, tmp_path):
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK, memory_bytes=1 << 20)
    ours = PersistentLRUPromptCache(store)
    _serve_once(ours, serve_model, random_tokens(TOKENS, seed=600, first=1))
    assert store.limit_memory() == (ours.nbytes, 1 << 20) and len(ours) == 0
    ours.trim_to(n_bytes=0)  # the server's batched trim: the tier too, for this once
    assert ours.nbytes == 0 and store.limit_memory() == (0, 0)
    _serve_once(ours, serve_model, random_tokens(TOKENS, seed=602, first=2))
    assert store.limit_memory() == (ours.nbytes, 1 << 20) and ours.nbytes > 0  # its own budget again
    # A store whose tier is off: the LRU keeps the cache (hits stay in memory).
    off = PersistentPrefixCache(tmp_path / "off", serve_model, block_size=BLOCK, memory_bytes=0)
    plain = PersistentLRUPromptCache(off)
    _serve_once(plain, serve_model, random_tokens(TOKENS, seed=601, first=1))
    assert len(plain) == 1 and plain.persistent_stats()["memory_only_sequences"] == 1
    for c, s in ((ours, store), (plain, off)):
        c.close()
        s.close()


def test_the_default_budget_is_said():
    class Args:
        prompt_cache_bytes = 12345

    assert memory_budget(type("P", (), {"cli_args": Args})()) == (12345, "--prompt-cache-bytes")
    size, said = memory_budget(None)
    assert size > 0 and "default" in said


PEAK = re.compile(r"in-memory KV peaked at (\d+) bytes of a (\d+)-byte budget")
SERVER_BUDGET = 300_000


def test_ppc_serve_stays_within_prompt_cache_bytes(serve_model_dir, tmp_path):
    words = "budget memory block store prefix cache server token".split()
    texts = [" ".join(words[(i * 3 + k) % len(words)] for k in range(40 + i)) for i in range(8)]
    hot = [{"role": "system", "content": "You answer briefly. " * 12}, {"role": "user", "content": "Hello?"}]
    flags = ("--prompt-cache-bytes", str(SERVER_BUDGET), "--prompt-cache-size", "1000")
    with Server(serve_model_dir, tmp_path / "store", tmp_path / "serve.log", *flags) as server:
        for i, text in enumerate(texts):  # distinct prompts, on the batched and the sequential path
            extra = {"seed": i} if i % 2 else {}
            server.chat([{"role": "user", "content": text}], **extra)
        answers = [server.chat(hot, **({"seed": 1} if i % 2 else {})) for i in range(6)]
        assert server.stop() == 0, server.log()
    log = server.log()
    assert f"in-memory KV at most {SERVER_BUDGET / 1e6:.1f} MB (--prompt-cache-bytes)" in log
    peak, budget = map(int, PEAK.search(log).groups())
    assert budget == SERVER_BUDGET and 0 < peak <= budget, log
    served = re.findall(r"Restored \d+ of \d+ prompt tokens .* served by (.*); [\d.]+ ms\)", log)
    # The hot prompt's hits: its blocks live once, in the tier (not read from disk).
    assert len(served) >= 5 and all(re.fullmatch(r"RAM \d+ blocks", s) for s in served[-5:]), log
    # Hits from the second on, each answering exactly as the first (a miss) did.
    assert _cached(answers[0]) == 0
    assert all(_cached(a) > 0 for a in answers[1:])
    assert all(_answer(a) == _answer(answers[0]) for a in answers[1:])


def test_bench_serve_reports_both_servers(tmp_path):
    # tools/bench_serve.py end to end, tiny: every figure present; none asserted on.
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "tools" / "bench_serve.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--prompts", "2", "--words", "40", "--json", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["server"] for r in rows] == ["mlx_lm server", "ppc serve"]
    for r in rows:
        assert all(r[k] > 0 for k in ("rss_after_third", "rss_after_distinct", "rss_after_hits", "peak_rss"))
        assert r["cached_tokens_hits"][0] == 0 and r["cached_tokens_hits"][1] > 0
    assert "ppc serve" in out.stderr  # the table

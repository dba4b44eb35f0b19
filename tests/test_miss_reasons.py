"""Why a fetch stopped where it did: one case per reason of `counters.MISS_REASONS`, the
report a fetch leaves (`PersistentPrefixCache.last_fetch`) and the counters of `stats()`."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from families import build
from helpers import BLOCK, flip_block_byte, nodes_by_position, prefill, random_tokens

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.core.counters import MISS_REASONS
from persistent_prefix_cache.disk import removed
from persistent_prefix_cache.disk.faults import VARIABLE, hooks_value
from persistent_prefix_cache.core.miss_reasons import FetchReport


def open_store(path, model, **kwargs) -> PersistentPrefixCache:
    kwargs.setdefault("block_size", BLOCK)
    return PersistentPrefixCache(path, model, **kwargs)


def put(store, model, tokens) -> None:
    store.store(tokens, prefill(model, tokens)[1])
    store.flush()


def reasons(stats: dict, kind: str) -> dict[str, int]:
    """The `miss_*` or `short_*` counters that are not 0."""
    return {r: stats[f"{kind}_{r}"] for r in MISS_REASONS if stats[f"{kind}_{r}"]}


def test_a_complete_hit_has_no_reason_and_a_longer_prompt_says_never_stored(store_dir, model):
    tokens = random_tokens(4 * BLOCK, seed=1)
    with open_store(store_dir, model) as store:
        assert store.last_fetch is None
        put(store, model, tokens)
        store.fetch(tokens)
        assert store.last_fetch == FetchReport(tokens=64, restored=63, found=63, reason=None, tier="ram")
        longer = tokens + random_tokens(2 * BLOCK, seed=2)
        store.fetch(longer)
        assert store.last_fetch == FetchReport(tokens=96, restored=64, found=64, reason="never_stored", tier="ram")
        stats = store.stats()
        assert reasons(stats, "miss") == {} and reasons(stats, "short") == {"never_stored": 1}
        assert (stats["hits_ram"], stats["tokens_saved_ram"]) == (2, 127)
        assert stats["hits_disk"] == stats["hits_remote"] == stats["tokens_saved_disk"] == 0
        assert stats["tokens_recomputed"] == 1 + 32
        assert stats["bytes_restored_ram"] > 0 and stats["bytes_restored_disk"] == 0


def test_never_stored(store_dir, model):
    with open_store(store_dir, model) as store:
        put(store, model, random_tokens(3 * BLOCK, seed=1))
        cache, rest = store.fetch(random_tokens(3 * BLOCK, seed=9))
        assert cache is None
        assert store.last_fetch == FetchReport(tokens=48, restored=0, found=0, reason="never_stored", tier=None)
        stats = store.stats()
        assert reasons(stats, "miss") == {"never_stored": 1} and stats["tokens_recomputed"] == 48


def test_a_disk_hit_is_counted_under_disk(store_dir, model):
    tokens = random_tokens(4 * BLOCK, seed=1)
    with open_store(store_dir, model) as store:
        put(store, model, tokens)
    with open_store(store_dir, model) as store:  # a new process, as far as the RAM tier knows
        store.fetch(tokens)
        assert store.last_fetch.tier == "disk"
        stats = store.stats()
        assert (stats["hits_disk"], stats["tokens_saved_disk"], stats["hits_ram"]) == (1, 63, 0)
        assert stats["bytes_restored_disk"] == stats["block_bytes"] and stats["bytes_restored_ram"] == 0


def test_evicted(store_dir, model):
    first, second = random_tokens(4 * BLOCK, seed=1), random_tokens(4 * BLOCK, seed=2)
    with open_store(store_dir, model, memory_bytes=0) as store:
        put(store, model, first)
        budget = store.stats()["block_bytes"]
    # A budget of one prompt's blocks: storing the second evicts the first (its LRU leaves).
    with open_store(store_dir, model, memory_bytes=0, disk_bytes=budget) as store:
        put(store, model, second)
        assert store.stats()["evictions"] == store.stats()["budget_evictions"] == 4
        assert store.fetch(first)[0] is None
        assert store.last_fetch.reason == "evicted"
        assert store.fetch(random_tokens(4 * BLOCK, seed=3))[0] is None
        assert store.last_fetch.reason == "never_stored"
        assert reasons(store.stats(), "miss") == {"evicted": 1, "never_stored": 1}


def test_an_eviction_is_remembered_by_every_handle_of_the_process(store_dir, model, other_model):
    first = random_tokens(4 * BLOCK, seed=1)
    with open_store(store_dir, model, memory_bytes=0) as store:
        put(store, model, first)
        budget = store.stats()["block_bytes"]
        # Another model's handle on the same store evicts this one's blocks.
        with open_store(store_dir, other_model, memory_bytes=0, disk_bytes=budget) as other:
            put(other, other_model, random_tokens(4 * BLOCK, seed=2))
        store.fetch(first)
        assert store.last_fetch.reason == "evicted"


def test_the_eviction_memory_is_bounded_and_forgets_the_oldest_generation(monkeypatch):
    monkeypatch.setattr(removed, "GENERATION", 4)
    memory = removed.Removed()
    keys = [os.urandom(16) for _ in range(12)]
    memory.evicted(keys[:4])
    assert all(memory.was_evicted(k) for k in keys[:4])
    memory.evicted(keys[4:8])  # a second generation: the first is still checked
    assert all(memory.was_evicted(k) for k in keys[:8])
    memory.evicted(keys[8:12])  # a third: the first is gone
    assert not any(memory.was_evicted(k) for k in keys[:4])
    assert all(memory.was_evicted(k) for k in keys[4:12])
    assert memory.evicted_keys.nbytes == 2 * removed.EVICTED_BITS // 8 == 256 * 1024


def test_damaged_in_this_fetch_and_then_dropped(store_dir, model, separate_segments):
    tokens = random_tokens(4 * BLOCK, seed=1)
    with open_store(store_dir, model, memory_bytes=0) as store:
        put(store, model, tokens[: 2 * BLOCK])
        put(store, model, tokens)
    flip_block_byte(store_dir, nodes_by_position(store_dir)[2])
    with open_store(store_dir, model, memory_bytes=0, cost_model=False) as store:
        store.fetch(tokens)
        assert store.last_fetch == FetchReport(tokens=64, restored=32, found=63, reason="damaged", tier="disk")
        store.flush()  # the damaged block and what follows it are dropped
        store.fetch(tokens)
        assert store.last_fetch == FetchReport(tokens=64, restored=32, found=32, reason="damaged", tier="disk")
        assert reasons(store.stats(), "short") == {"damaged": 2}


def test_other_model_or_namespace(store_dir, model, other_model):
    tokens = random_tokens(3 * BLOCK, seed=1)
    with open_store(store_dir, model, namespace="alice") as store:
        put(store, model, tokens)
    with open_store(store_dir, model, namespace="bob") as store:
        assert store.fetch(tokens)[0] is None
        assert store.last_fetch.reason == "other_model"
        assert store.fetch(random_tokens(3 * BLOCK, seed=2))[0] is None
        assert store.last_fetch.reason == "never_stored"
    with open_store(store_dir, other_model, namespace="alice") as store:
        assert store.fetch(tokens)[0] is None
        assert store.last_fetch.reason == "other_model"
        assert reasons(store.stats(), "miss") == {"other_model": 1}


def test_not_resumable_where_a_recurrent_layer_has_no_snapshot(store_dir):
    model = build("mamba2")
    tokens = random_tokens(4 * BLOCK, seed=1)
    with open_store(store_dir, model) as store:
        put(store, model, tokens)  # one snapshot of the recurrent state: at 64
        store.fetch(tokens[: 2 * BLOCK + 5] + random_tokens(BLOCK, seed=2))
        assert store.last_fetch == FetchReport(tokens=53, restored=0, found=0, reason="not_resumable", tier=None)
        store.fetch(tokens + random_tokens(BLOCK, seed=2))  # the snapshot's point: restored
        assert store.last_fetch.restored == 64 and store.last_fetch.reason == "never_stored"
        assert reasons(store.stats(), "miss") == {"not_resumable": 1}


def test_write_pending(store_dir, model, tmp_path, monkeypatch):
    tokens = random_tokens(3 * BLOCK, seed=1)
    marker = tmp_path / "hold"
    with open_store(store_dir, model, memory_bytes=0) as store:
        put(store, model, random_tokens(BLOCK, seed=5))  # the model is recorded: the held write is only blocks
        monkeypatch.setenv(VARIABLE, hooks_value(hold_at="before_commit", pause_file=marker))
        store.store(tokens, prefill(model, tokens)[1])
        while not marker.exists():  # the writer holds the write, uncommitted
            threading.Event().wait(0.01)
        assert store.fetch(tokens)[0] is None
        assert store.last_fetch.reason == "write_pending"
        monkeypatch.delenv(VARIABLE)
        marker.unlink()
        store.flush()
        store.fetch(tokens)
        assert store.last_fetch.reason is None
        assert reasons(store.stats(), "miss") == {"write_pending": 1}


def test_slower(store_dir, model):
    tokens = random_tokens(4 * BLOCK, seed=1)
    with open_store(store_dir, model) as store:
        put(store, model, tokens)
        # Computing is instant and restoring crawls: the cost model restores nothing.
        store.costs.learned.set_prefill(1e15)
        store.costs.learned.set_restore({"ram": 1.0, "disk": 1.0}, fixed={"ram": 10.0, "disk": 10.0})
        assert store.fetch(tokens)[0] is None
        assert store.last_fetch == FetchReport(tokens=64, restored=0, found=63, reason="slower", tier=None)
        stats = store.stats()
        assert reasons(stats, "miss") == {"slower": 1} and stats["skipped_slower"] == 1


def test_remote_unreachable(store_dir, model):
    pytest.importorskip("redis")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open_store(store_dir, model, remote=f"redis://127.0.0.1:{port}", remote_insecure=True) as store:
        assert store.fetch(random_tokens(3 * BLOCK, seed=1))[0] is None
        assert store.last_fetch.reason == "remote_unreachable"
        assert reasons(store.stats(), "miss") == {"remote_unreachable": 1}


class _Unstorable:
    """A model whose cache has a layer the store cannot hold."""

    def make_cache(self):
        return [object()]


def test_unsupported(store_dir):
    with open_store(store_dir, _Unstorable(), fingerprint="unstorable") as store:
        assert store.fetch(random_tokens(3 * BLOCK, seed=1))[0] is None
        assert store.last_fetch.reason == "unsupported"
        assert reasons(store.stats(), "miss") == {"unsupported": 1}


def test_each_thread_reads_its_own_report(store_dir, model):
    tokens = random_tokens(3 * BLOCK, seed=1)
    with open_store(store_dir, model) as store:
        put(store, model, tokens)
        seen = {}

        def other():
            store.fetch(random_tokens(3 * BLOCK, seed=2))
            seen["other"] = store.last_fetch

        store.fetch(tokens)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert store.last_fetch.reason is None and seen["other"].reason == "never_stored"

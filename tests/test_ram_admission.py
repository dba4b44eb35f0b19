"""The RAM tier learns from hits: blocks a fresh handle reads from disk (or the remote)
join it, under its admission rule and its budget, and never share a buffer with a
cache handed to the caller.

A fresh handle stands for a restarted process here: the RAM tier belongs to the handle,
and the store was written and closed by another handle first.
"""

from __future__ import annotations

import gc
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from families import build, family_params
from helpers import (
    assert_same_logits,
    cold_logits,
    feed,
    flip_block_byte,
    nodes_by_position,
    prefill as one_shot,
    random_tokens,
    warm_logits,
)
from test_remote import BS, open_host, publish

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.device import target as device_target
from persistent_prefix_cache.prefill import prefill

BLOCK = 16
MiB = 1 << 20


def family_prompt() -> list[int]:
    return np.random.default_rng(7).integers(0, 256, 150).tolist()


def tier_bits(store: PersistentPrefixCache) -> dict:
    """A bitwise copy of everything the RAM tier holds, by block key, leaf and field."""
    out = {}
    for key, tensors in store.ram_tier.items():
        for lid, part in tensors.items():
            for fld, x in part.items():
                bits = x.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.itemsize])
                out[key, lid, fld] = np.array(bits)
    return out


def assert_same_bits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k]), f"the RAM tier's {k[1]}.{k[2]} changed"


def data_pointer(x: mx.array) -> int:
    view = np.asarray(memoryview(x))
    return view.__array_interface__["data"][0]


def memory_counts(store: PersistentPrefixCache) -> dict:
    stats = store.stats()
    return {k: v for k, v in stats.items() if k.startswith("memory_") or k.endswith("_in_memory")}


def test_fresh_handle_serves_the_third_fetch_from_the_tier(tmp_path, model):
    toks = random_tokens(100, 1, first=1)
    _, cache = one_shot(model, toks)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        writer.store(toks, cache)
    query = toks + random_tokens(4, 2)
    want = cold_logits(model, query)
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        blocks = store.stats()["blocks"]
        got = []
        for _ in range(3):
            restored, rest = store.fetch(query)
            assert len(query) - len(rest) == len(toks)
            got.append(memory_counts(store))
            assert_same_logits(warm_logits(model, restored, rest), want)
        first, second, third = got
        # The first hit pays no copy (a prefix read once never pays one back) ...
        assert first["memory_admitted"] == 0 and first["bytes_in_memory"] == 0
        # ... the second admits every block, counted by bytes ...
        assert second["memory_admitted"] == blocks == second["blocks_in_memory"]
        assert second["memory_admitted_bytes"] == second["bytes_in_memory"] == store.stats()["block_bytes"]
        assert second["memory_hits_disk"] == 0
        # ... and the third is served from the tier, every block counted by its origin.
        assert third["memory_hits_disk"] == blocks
        assert third["memory_hits_store"] == third["memory_hits_remote"] == 0


@pytest.mark.parametrize("how", ["stored", "admitted"])
def test_the_tier_holds_blocks_as_their_copy_and_rows(tmp_path, model, how):
    """A block cut from one copy (a store's, or an admitted read's) is held as that copy
    and its rows, not as a view per field (each MLX array is an object Python's cyclic
    collector walks at every full collection); `ram_tier.items()` still shows each block's
    rows of the cache, bit for bit, and a fetch from the tier is exact."""
    toks = random_tokens(16 * BS + 5, 3, first=3)
    _, cache = one_shot(model, toks)

    def held_objects(budget: int):
        """The handle at `budget` after the steps, and the tracked objects they left."""
        path = tmp_path / f"s{budget}"
        if how == "admitted":
            with PersistentPrefixCache(path, model, block_size=BS, memory_bytes=0) as writer:
                writer.store(toks, cache)
        store = PersistentPrefixCache(path, model, block_size=BS, memory_bytes=budget, cost_model=False)
        store.fetch(toks[:BS])  # (what a handle sets up on first use, counted on neither side)
        # The count is the whole process's: the handle's background work (the open's sweep
        # on the writer thread, a fill) is done before and after, never half inside it.
        store.flush()
        gc.collect()
        before = len(gc.get_objects())
        if how == "stored":
            store.store(toks, cache)
        else:
            for _ in range(2):  # the second disk hit admits
                store.fetch(toks + [1])
        store.flush()
        gc.collect()
        return store, len(gc.get_objects()) - before

    off, without = held_objects(0)
    off.close()
    store, with_tier = held_objects(64 * MiB)
    with store:
        blocks = store.stats()["blocks_in_memory"]
        assert blocks == 17
        held = store.ram_tier.items()
        fields = sum(len(part) for part in held[0][1].values())
        per_block = (with_tier - without) / blocks
        # A block's record, its entry and its place among its parent's children: ~4 (the
        # fields' views and their dicts were 15 here, 102 for an 8B model).
        assert fields >= 4 and per_block <= 5, (
            f"the tier keeps {per_block:.1f} tracked objects a block ({fields} fields)"
        )
        # The tier's blocks in the order they came (the path's), joined: the cache's rows.
        for i, layer in enumerate(cache):
            for fld, want in (("k", layer.keys), ("v", layer.values)):
                rows = mx.concatenate([tensors[str(i)][fld] for _, tensors in held], axis=2)
                assert mx.array_equal(rows, want[..., : len(toks), :]).item(), f"{i}.{fld}"
        served = "memory_hits_" + ("store" if how == "stored" else "disk")
        before = store.stats()[served]
        restored, rest = store.fetch(toks + [1])
        assert len(rest) == 1 and store.stats()[served] - before == 17
        assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, toks + [1]))


@pytest.fixture(params=["numpy", "mlx"])
def join(request, monkeypatch):
    """Both ways the read path joins RAM-tier blocks: host copies (CPU, unified memory)
    and MLX operations (a GPU's; there the tier also admits on a first hit with room)."""
    monkeypatch.setattr(device_target, "RAM_JOIN", request.param)
    return request.param


@pytest.mark.parametrize("family", family_params())
def test_extending_a_restored_cache_never_changes_the_tier(tmp_path, family, join):
    model = build(family)
    prompt = family_prompt()
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK) as writer:
        prefill(model, prompt[:96], writer)  # its last block keeps snapshots: mid-path below
        prefill(model, prompt, writer)
    query = prompt + [3, 1, 4, 1, 5]
    more = [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3  # past a block boundary and, for the windows, their size
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        restored, rest = store.fetch(query)
        assert restored is not None
        reference = [feed(model, restored, rest), feed(model, restored, more)]
        restored, rest = store.fetch(query)  # the second hit: admitted
        second_counts = memory_counts(store)
        assert second_counts["memory_admitted"] > 0
        held = tier_bits(store)
        second = [feed(model, restored, rest), feed(model, restored, more)]
        assert_same_bits(tier_bits(store), held)
        for name in os.listdir(tmp_path / "s" / "segments"):  # nothing can be read from disk now
            shutil.rmtree(tmp_path / "s" / "segments" / name)
        restored, rest = store.fetch(query)  # served from the tier, every block of the path
        served = memory_counts(store)["memory_hits_disk"] - second_counts["memory_hits_disk"]
        assert served == second_counts["memory_admitted"] > 0
        third = [feed(model, restored, rest), feed(model, restored, more)]
        assert_same_bits(tier_bits(store), held)
        assert memory_counts(store)["blocks_in_memory"] > 0 and store.stats()["corrupt"] == 0
        for got in (second, third):
            for g, w in zip(got, reference):
                assert_same_logits(g, w)


def test_admission_keeps_mlx_lm_growing_in_place(tmp_path, model, join):
    """The buffer a fetch hands over is the caller's alone: mlx-lm's first decode step
    writes into it in place (MLX copies a buffer something else holds)."""
    toks = random_tokens(90, 3, first=3)
    _, cache = one_shot(model, toks)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        writer.store(toks, cache)
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        for _ in range(3):  # disk; disk + admission; the tier
            restored, rest = store.fetch(toks + [5])
            assert restored[0].keys.shape[2] > restored[0].offset  # room to grow
            before = [data_pointer(c.keys) for c in restored]
            feed(model, restored, rest)
            assert [data_pointer(c.keys) for c in restored] == before
        assert memory_counts(store)["memory_hits_disk"] > 0


def test_a_restored_cache_has_room_for_the_rest_of_its_prompt(tmp_path, model, join):
    """A fetch of a prompt longer than what is stored hands over buffers with room for the
    whole prompt: the caller's forward of the rest (here 300 tokens, past the 256-row step
    that mlx-lm grows by) writes in place, with no copy of the restored cache."""
    toks = random_tokens(90, 3, first=3)
    _, cache = one_shot(model, toks)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        writer.store(toks, cache)
    prompt = toks + random_tokens(300, 4)
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        for _ in range(3):  # disk; disk + admission; the tier
            restored, rest = store.fetch(prompt)
            assert len(rest) == 300 and all(c.keys.shape[2] > len(prompt) for c in restored)
            before = [data_pointer(c.keys) for c in restored]
            feed(model, restored, rest)
            assert [data_pointer(c.keys) for c in restored] == before
            assert_same_logits(warm_logits(model, store.fetch(prompt)[0], rest), cold_logits(model, prompt))


def test_admission_respects_the_budget(tmp_path, model):
    prompts = [random_tokens(96, 10 + i, first=10 + i) for i in range(3)]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        for toks in prompts:
            writer.store(toks, one_shot(model, toks)[1])
        writer.flush()
        per_prompt = writer.stats()["block_bytes"] // 3
    budget = per_prompt * 2 + per_prompt // 2  # two prompts fit, not three
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=budget, cost_model=False) as store:
        for _ in range(3):
            for toks in prompts:
                restored, rest = store.fetch(toks + [1])
                assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, toks + [1]))
                counts = memory_counts(store)
                assert counts["bytes_in_memory"] <= budget
        assert counts["memory_admitted"] > 0 and counts["memory_evictions"] > 0
        entries = store.ram_tier.items()
        held = sum(x.nbytes for _, tensors in entries for part in tensors.values() for x in part.values())
        assert held == counts["bytes_in_memory"]
    # A prompt larger than the whole tier is never admitted (it would flush it).
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=per_prompt // 2, cost_model=False) as store:
        for _ in range(3):
            store.fetch(prompts[0] + [1])
        assert memory_counts(store)["memory_admitted"] == 0


def test_a_prefix_read_once_is_not_admitted_past_the_window(tmp_path, model):
    """Second hit *within a window*: a prefix read again only after more than twice the
    budget of other disk reads counts as new."""
    prompts = [random_tokens(64, 20 + i, first=20 + i) for i in range(8)]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        for toks in prompts:
            writer.store(toks, one_shot(model, toks)[1])
        writer.flush()
        per_prompt = writer.stats()["block_bytes"] // len(prompts)
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=per_prompt * 2, cost_model=False) as store:
        for toks in prompts:  # 8 prompts read once: 4 x the budget
            store.fetch(toks + [1])
        store.fetch(prompts[0] + [1])  # out of the window: a first hit again
        assert memory_counts(store)["memory_admitted"] == 0
        store.fetch(prompts[-1] + [1])  # still in it: a second hit
        assert memory_counts(store)["memory_admitted"] == 4  # its 4 blocks


def test_remote_hits_are_served_from_the_tier_next_time(tmp_path, model, redis_server):
    toks = random_tokens(80, 5, first=5)
    with open_host(tmp_path / "a", model, redis_server.url) as a:
        assert publish(a, model, toks) == 5
    query = toks + random_tokens(3, 6)
    want = cold_logits(model, query)
    with open_host(tmp_path / "b", model, redis_server.url, cost_model=False) as b:
        restored, rest = b.fetch(query)
        assert_same_logits(warm_logits(model, restored, rest), want)
        first = memory_counts(b)
        assert first["memory_admitted"] == 5 and first["memory_hits_remote"] == 5  # read into the tier, then restored
        b.flush()  # written into b's own store too
        restored, rest = b.fetch(query)
        assert_same_logits(warm_logits(model, restored, rest), want)
        assert memory_counts(b)["memory_hits_remote"] == 10
        assert b.stats()["remote_hits"] == 1  # the second fetch asked the server nothing


def test_a_device_copy_admits_on_the_first_hit_where_there_is_room(tmp_path, model, monkeypatch):
    """Where blocks are joined with MLX operations (a GPU), admitting is a device copy:
    the first hit is admitted when it evicts nothing; a full tier waits for a second."""
    monkeypatch.setattr(device_target, "RAM_JOIN", "mlx")
    prompts = [random_tokens(64, 50 + i, first=50 + i) for i in range(2)]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        for toks in prompts:
            writer.store(toks, one_shot(model, toks)[1])
        writer.flush()
        per_prompt = writer.stats()["block_bytes"] // 2
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=per_prompt, cost_model=False) as store:
        query = prompts[0] + [1]
        for hits in (0, 4):
            restored, rest = store.fetch(query)
            assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, query))
            assert memory_counts(store)["memory_admitted"] == 4 and memory_counts(store)["memory_hits_disk"] == hits
        store.fetch(prompts[1] + [1])  # no room left: a first hit only
        assert memory_counts(store)["memory_admitted"] == 4


def test_a_path_partly_in_the_tier_admits_the_rest(tmp_path, model):
    """A longer query over a prefix the tier holds: its first blocks come from the tier,
    the rest from disk, and those join the tier on their second hit, counted exactly."""
    toks = random_tokens(112, 60, first=60)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BS, memory_bytes=0) as writer:
        writer.store(toks, one_shot(model, toks)[1])
        writer.flush()
        total = writer.stats()["block_bytes"]
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        for _ in range(2):
            store.fetch(toks[:48] + [1])  # 3 blocks admitted
        assert memory_counts(store)["memory_admitted"] == 3
        for served in (3, 3 + 3, 3 + 3 + 7):
            restored, rest = store.fetch(toks + [1])
            assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, toks + [1]))
            assert memory_counts(store)["memory_hits_disk"] == served
        counts = memory_counts(store)
        assert counts["memory_admitted"] == 7 and counts["bytes_in_memory"] == counts["memory_admitted_bytes"] == total


def test_a_damaged_snapshot_mid_path_keeps_only_its_block_out_of_the_tier(tmp_path):
    # mypy found it: admission reads a mid-path block's snapshots itself, and a damaged one
    # (None) then reached the copy loop: fetch raised AttributeError instead of leaving it out.
    model = build("qwen3_next")  # KV and recurrent layers: every block of the path is read
    prompt = family_prompt()
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK) as writer:
        prefill(model, prompt[:96], writer)  # its last block keeps snapshots: mid-path below
        prefill(model, prompt, writer)
    nodes = nodes_by_position(tmp_path / "s")
    by_key = {n.key: n for n in nodes}
    path = [max(nodes, key=lambda n: n.end)]
    while path[-1].position > 0:
        path.append(by_key[path[-1].parent])
    mid = next(n for n in path[1:] if n.extra.get("snap"))  # the read path reads the last block's only
    flip_block_byte(tmp_path / "s", mid, piece=-1)  # a byte of its snapshot (its last piece)
    query = prompt + [3, 1, 4, 1, 5]
    want = cold_logits(model, query)
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        for _ in range(2):  # the second hit admits what it read from disk
            restored, rest = store.fetch(query)
            assert len(query) - len(rest) == path[0].end
            assert_same_logits(warm_logits(model, restored, rest), want)
        assert memory_counts(store)["memory_admitted"] == len(path) - 1


@pytest.mark.slow
def test_a_restarted_process_learns_the_hot_prefix(tmp_path, tiny_model_dir):
    """Real processes: one stores and exits; a new one (empty RAM tier) fetches the same
    prompt three times and serves the third from the tier, every answer exact."""
    from store_worker import Worker

    toks = random_tokens(80, 70, first=70)
    query = toks + [3, 2]
    common = {"model": str(tiny_model_dir), "store": str(tmp_path / "s"), "block_size": BS}
    first = Worker({**common, "steps": [["store", toks], ["flush"]]}, str(tmp_path), name="first")
    try:
        first.result(timeout=300)
    finally:
        first.reap()
    steps = [["fetch", query], ["fetch", query], ["stats"], ["fetch", query], ["stats"]]
    spec = {**common, "memory_bytes": 64 * MiB, "cost_model": False, "steps": steps}  # restores decided by no timing
    second = Worker(spec, str(tmp_path), name="second")
    try:
        out = second.result(timeout=300)["steps"]
    finally:
        second.reap()
    fetches = [out[0], out[1], out[3]]
    assert all(f == {"matched": len(toks), "exact": True} for f in fetches)
    assert out[2]["memory_admitted"] == 5 and out[2]["memory_hits_disk"] == 0
    assert out[4]["memory_hits_disk"] == 5 and out[4]["bytes_in_memory"] == out[4]["block_bytes"]


def test_auto_ram_budgets_are_shared_by_a_process_open_handles(monkeypatch, tmp_path):
    # Each handle taking 1/8 of the device's memory ran an H100 out of memory with seven
    # handles open in one process: "auto" tiers share the one share, each gets at least the
    # floor, a closed handle gives its share back, and a budget given as an int is its own.
    from persistent_prefix_cache.core import opening

    model = build("llama")
    floor = opening.MIN_MEMORY_BYTES
    monkeypatch.setattr(opening, "device_memory", lambda: opening.weight_bytes(model) + 8 * 3 * floor)
    monkeypatch.setattr(opening, "_auto_tiers", opening._AutoTiers())

    def budget(store: PersistentPrefixCache) -> int:
        return store.stats()["memory_budget"]

    first = PersistentPrefixCache(tmp_path / "a", model, fingerprint="own")
    second = PersistentPrefixCache(tmp_path / "b", model, fingerprint="own", memory_bytes=5 * floor)
    third = PersistentPrefixCache(tmp_path / "c", model, fingerprint="own")
    assert (budget(first), budget(second), budget(third)) == (3 * floor, 5 * floor, floor)
    first.close()
    fourth = PersistentPrefixCache(tmp_path / "d", model, fingerprint="own")
    assert budget(fourth) == 2 * floor  # the first's share came back; the third still holds its own
    for store in (second, third, fourth):
        store.close()
    with PersistentPrefixCache(tmp_path / "e", model, fingerprint="own") as alone:
        assert budget(alone) == 3 * floor


def test_admitted_blocks_are_held_as_origins_and_a_leaf_cut_two_ways_stays_out():
    """`join_admitted` on runs made by hand: a leaf whose fields lie in one run (from row
    0) gives every block an origin in the copies, no view; where one field's run starts
    later than the other's (runs that disagree: no family makes them), the block whose
    fields would start at different rows of their copies stays out of the tier, and the
    block before it, whose fields both start at row 0, is held with one origin."""
    from persistent_prefix_cache.blocks import Node
    from persistent_prefix_cache.core.restore import join_admitted
    from persistent_prefix_cache.tiers.memory import MemoryTier

    def node(i: int) -> Node:
        return Node(bytes([i + 1]) * 16, bytes([i]) * 16, 64 * i, bytes(4 * 64), 0, 0, 0)

    def rows(n: int, seed: int) -> mx.array:
        return mx.array(np.random.default_rng(seed).integers(0, 1000, (1, 2, n, 4)).astype(np.float16))

    nodes = [node(i) for i in range(3)]
    keys, other, values, late = rows(192, 1), rows(192, 2), rows(64, 3), rows(128, 4)
    runs = {
        "0": {"k": [(0, 192, keys)], "v": [(0, 192, other)]},  # one run per field
        "1": {"k": [(0, 192, keys)], "v": [(0, 64, values), (64, 192, late)]},  # the values' run cut at 64
    }
    tier = MemoryTier(1 << 30)
    assert join_admitted(tier, nodes, [0, 1, 2], runs, {}, on_device=True) == 1
    held = dict(tier.held())
    assert list(held) == [nodes[0].key]  # blocks 1 and 2: leaf 1's keys from row 64, values from row 0
    want = {("0", "k"): keys, ("0", "v"): other, ("1", "k"): keys, ("1", "v"): values}
    for (lid, fld), rows_of in want.items():
        assert mx.array_equal(held[nodes[0].key][lid][fld], rows_of[..., :64, :]).item(), f"{lid}.{fld}"
    assert tier.stats()["bytes_in_memory"] == 4 * 64 * 2 * 4 * 2  # 4 fields x 64 rows x 2 heads x 4 wide x 2 bytes

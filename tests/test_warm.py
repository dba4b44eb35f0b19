"""What the cost model leaves on disk still joins the RAM tier (`warm.Warmer`).

Where a prefill is faster than a disk read (an H200 below ~32k tokens), a fetch reads
nothing; a background fill then reads the skipped blocks into the tier, so the next
fetch of that prefix restores from RAM. Rates are set explicitly (tests never decide by
timing); ``store.flush()`` waits for the fill. ``device.target.RAM_JOIN = "mlx"`` takes the GPU's route
(host reads into an arena of MLX memory, restored from as views of it) on this CPU.
"""

from __future__ import annotations

import glob
import os

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_same_logits, cold_logits, feed, prefill as one_shot, random_tokens, warm_logits
from test_ram_admission import assert_same_bits, memory_counts

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.device import buffers
from persistent_prefix_cache.device import target as device_target
from persistent_prefix_cache.device.buffers import HostBits

BS = 16
MiB = 1 << 20
UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def tier_bits(store: PersistentPrefixCache) -> dict:
    """A bitwise copy of what the tier holds: MLX arrays, or host bits on the CPU."""
    out = {}
    for key, tensors in store.ram_tier.items():
        for lid, part in tensors.items():
            for fld, x in part.items():
                bits = x.bits if isinstance(x, HostBits) else np.array(x.view(UINT[x.itemsize]))
                out[key, lid, fld] = bits.copy()
    return out


def write_store(path, model, prompts) -> int:
    """Store `prompts` with a handle that holds nothing in RAM; the blocks' bytes."""
    with PersistentPrefixCache(path, model, block_size=BS, memory_bytes=0) as writer:
        for toks in prompts:
            writer.store(toks, one_shot(model, toks)[1])
        writer.flush()
        return writer.stats()["block_bytes"]


def disk_loses(store: PersistentPrefixCache) -> None:
    """Rates where a disk read always loses to a prefill and a RAM restore always wins."""
    store.costs.learned.set_prefill(1e6)  # 1 µs a token
    store.costs.learned.set_restore({"ram": 1e15, "disk": 1.0})  # a byte a second from disk


@pytest.mark.parametrize("join", ["numpy", "mlx", "mlx, arena zeroed on the default stream"])
def test_a_skipped_prefix_is_served_from_the_tier_next_time(tmp_path, model, monkeypatch, join):
    if join.startswith("mlx, "):  # ARENA_ZEROS's other way (the default zeroes on the CPU stream)
        monkeypatch.setattr(buffers, "ARENA_ZEROS", "gpu")
        join = "mlx"
    monkeypatch.setattr(device_target, "RAM_JOIN", join)
    toks = random_tokens(96, 1, first=1)
    total = write_store(tmp_path / "s", model, [toks])
    query = toks + random_tokens(3, 2)
    want = cold_logits(model, query)
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB) as store:
        disk_loses(store)
        blocks = store.stats()["blocks"]
        cache, rest = store.fetch(query)
        assert cache is None and rest == query  # computing is faster: nothing read for the caller
        store.flush()  # the fill is done
        counts = memory_counts(store)
        # In the tier already (on a GPU's route as views of the arena the fill read into)
        assert counts["memory_warmed"] == blocks and counts["memory_warmed_bytes"] == total
        assert counts["bytes_in_memory"] == total
        held = [x for _, tensors in store.ram_tier.items() for part in tensors.values() for x in part.values()]
        assert all(isinstance(x, HostBits) and (x.arena is not None) == (join == "mlx") for x in held)
        restored, rest = store.fetch(query)
        stats = store.stats()
        assert stats["skipped_slower"] == 1 and stats["restored_all"] == 1
        assert stats["memory_warmed"] == blocks and stats["bytes_in_memory"] == total
        assert stats["memory_hits_disk"] == blocks and stats["restored_blocks_disk"] == 0
        assert len(query) - len(rest) == len(toks)
        before = tier_bits(store)
        assert len(before) >= blocks
        assert_same_logits(warm_logits(model, restored, rest), want)
        feed(model, restored, random_tokens(40, 3))  # the caller's cache grows: the tier's copy does not
        assert_same_bits(tier_bits(store), before)


def test_a_full_tier_takes_a_skipped_prefix_on_its_second_skip(tmp_path, model):
    prompts = [random_tokens(64, 10 + i, first=10 + i) for i in range(2)]
    total = write_store(tmp_path / "s", model, prompts)
    budget = total // 2  # one prompt fits
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=budget) as store:
        disk_loses(store)
        store.fetch(prompts[0] + [1])
        store.flush()
        assert memory_counts(store)["memory_warmed"] == 4  # free room: at once
        store.fetch(prompts[1] + [1])
        store.flush()
        assert memory_counts(store)["memory_warmed"] == 4  # no room: a first skip only
        store.fetch(prompts[1] + [1])
        store.flush()
        counts = memory_counts(store)
        assert counts["memory_warmed"] == 8 and counts["memory_evictions"] == 4
        assert counts["bytes_in_memory"] <= budget
        restored, rest = store.fetch(prompts[1] + [1])
        assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, prompts[1] + [1]))
        assert store.stats()["restored_blocks_disk"] == 0


def test_a_prefix_larger_than_the_tier_is_never_filled(tmp_path, model):
    toks = random_tokens(64, 20, first=20)
    total = write_store(tmp_path / "s", model, [toks])
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=total // 2) as store:
        disk_loses(store)
        for _ in range(3):
            store.fetch(toks + [1])
            store.flush()
        assert memory_counts(store)["memory_warmed"] == 0 and memory_counts(store)["bytes_in_memory"] == 0


def test_a_damaged_block_never_joins_the_tier(tmp_path, model):
    toks = random_tokens(64, 30, first=30)
    write_store(tmp_path / "s", model, [toks])
    (segment,) = glob.glob(str(tmp_path / "s" / "segments" / "*" / "*.seg"))
    with open(segment, "r+b") as f:  # the last row of the last tensor: the last block's
        f.seek(os.path.getsize(segment) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    query = toks + [1]
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB) as store:
        disk_loses(store)
        store.fetch(query)
        store.flush()
        counts = memory_counts(store)
        assert counts["memory_warm_damaged"] == 1 and counts["memory_warmed"] == 3  # the blocks before it
        restored, rest = store.fetch(query)  # the RAM part only: the disk block is slower (and damaged)
        assert len(query) - len(rest) == 3 * BS
        assert store.stats()["restored_ram_only"] == 1
        assert_same_logits(warm_logits(model, restored, rest), cold_logits(model, query))


def test_no_fill_without_a_tier_or_with_the_cost_model_off(tmp_path, model):
    toks = random_tokens(64, 40, first=40)
    write_store(tmp_path / "s", model, [toks])
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=0) as store:
        disk_loses(store)
        store.fetch(toks + [1])
        store.flush()
        assert memory_counts(store)["memory_warmed"] == 0
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=64 * MiB, cost_model=False) as store:
        disk_loses(store)
        restored, rest = store.fetch(toks + [1])  # forced: read by the caller, no fill
        store.flush()
        assert restored is not None and memory_counts(store)["memory_warmed"] == 0


def test_a_restarted_process_fills_the_tier_with_what_it_skips(tmp_path, model, tiny_model_dir):
    """Real processes: one stores and exits; the rates (a disk slower than a prefill)
    are remembered by the store; a new process skips the prefix, fills its tier in the
    background, and serves the next fetch of it from RAM, exactly."""
    from store_worker import Worker

    toks = random_tokens(80, 70, first=70)
    query = toks + [3, 2]
    common = {"model": str(tiny_model_dir), "store": str(tmp_path / "s"), "block_size": BS}
    first = Worker({**common, "steps": [["store", toks], ["flush"]]}, str(tmp_path), name="first")
    try:
        first.result(timeout=300)
    finally:
        first.reap()
    with PersistentPrefixCache(tmp_path / "s", model) as store:
        disk_loses(store)  # kept in the store's costs.json at close, for this model and device kind
    steps = [["fetch", query], ["flush"], ["stats"], ["fetch", query], ["stats"]]
    second = Worker({**common, "memory_bytes": 64 * MiB, "steps": steps}, str(tmp_path), name="second")
    try:
        out = second.result(timeout=300)["steps"]
    finally:
        second.reap()
    assert out[0] == {"matched": 0, "exact": True}  # skipped: computed by the caller
    assert out[2]["skipped_slower"] == 1 and out[2]["memory_warmed"] == 5
    assert out[3] == {"matched": len(toks), "exact": True}
    assert out[4]["memory_hits_disk"] == 5 and out[4]["restored_blocks_disk"] == 0


def test_a_fill_on_the_gpu_route_reads_into_device_memory_and_copies_nothing():
    # On a CUDA GPU a fill reads into an arena of device memory made on the caller's thread;
    # its blocks are then views of it (host memory copied over later cost 1.1-3 x the
    # prefill on the H200). The same code runs here on the CPU: views, and exact bits.
    import numpy as np

    from persistent_prefix_cache.device.buffers import Arena
    from persistent_prefix_cache.device.target import host_target

    arena = Arena(1 << 14)
    target = host_target(arena)
    got = target.allocate([("k", (1, 2, 40, 8), "BF16"), ("s", (3, 5), "F32"), ("big", (1 << 14,), "F32")])
    items = [target.wrap(got["k"], "BF16"), target.wrap(got["k"], "BF16")[:, :, 5:30, :], target.wrap(got["s"], "F32"),
             target.wrap(got["big"], "F32")]  # fmt: skip
    rng = np.random.default_rng(3)
    for name, x in got.items():
        x[...] = rng.integers(0, np.iinfo(x.dtype).max, size=x.shape, dtype=x.dtype)
    assert [arena.view(x.bits, x.dtype) is not None for x in items] == [True, True, True, False]  # "big" did not fit
    bits = {2: mx.uint16, 4: mx.uint32}
    made = [x.to_mx() for x in items]
    mx.eval(made)
    for x, y in zip(items, made):
        assert y.dtype == x.dtype and tuple(y.shape) == x.shape
        assert np.array_equal(np.array(y.view(bits[x.itemsize])), x.bits)
    for x in got.values():  # the arena's bytes change under the views: they are views, not copies
        x[...] ^= 1
    seen = [np.array(y.view(bits[x.itemsize])) for x, y in zip(items, made)]
    assert [np.array_equal(a, x.bits) for a, x in zip(seen, items)] == [True, True, True, False]

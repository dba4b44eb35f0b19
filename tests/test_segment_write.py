"""The segment writer (`disk.segment_writer`): data first, hashed once as it goes,
written in batches (from a second thread for large segments), the header last at offset
0. Whatever the batching, threading or short writes, the file is the same v5 segment:
safetensors opens it, every block checksum and the whole-segment digest verify, a fresh
handle restores the exact KV. A write that fails in the second thread fails the store
(counted), leaving no file behind. A synchronous store writes from the caller's cache
and keeps its own copy in the RAM tier, only once the index holds the blocks.

Real stores of the tiny model, real files; the batch size and the threshold of the
second thread are set small so tiny segments take every path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import BLOCK, assert_restores_kv, prefill, random_tokens
from test_segment_format import _check_opens_everywhere, _fill, _index, _segments

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.disk import segment_writer
from persistent_prefix_cache.disk.segment import SegmentFiles


def _prompts() -> list[list[int]]:
    base = random_tokens(3 * BLOCK, seed=811, first=3)
    return [base + random_tokens(2 * BLOCK + 7, seed=812, first=4), base + random_tokens(5, seed=813, first=5)]


def _check_store(path, model, prompts, caches) -> None:
    """Every segment opens everywhere and its digest verifies; a fresh handle restores
    each prompt's KV exactly."""
    assert _check_opens_everywhere(path) >= 4
    files = SegmentFiles(str(path), readonly=True)
    nodes, _, digests = _index(path)
    assert digests and all(files.digest_of(s) == d for s, d in digests.items())
    assert all(files.verify(n) is None for n in nodes.values())
    with PersistentPrefixCache(path, model, block_size=BLOCK, memory_bytes=0, cost_model=False) as store:
        for tokens, cache in zip(prompts, caches):
            assert_restores_kv(store, tokens, cache)


@pytest.mark.parametrize("threaded", [False, True])
def test_segments_written_in_small_batches_are_valid_and_restore(tmp_path, model, monkeypatch, threaded):
    monkeypatch.setattr(segment_writer, "BATCH_BYTES", 3000)  # many batches, ends mid-row
    monkeypatch.setattr(segment_writer, "THREADED_BYTES", 0 if threaded else 1 << 60)
    prompts = _prompts()
    caches = _fill(tmp_path / "s", model, prompts, sync_writes=True)
    _check_store(tmp_path / "s", model, prompts, caches)


def test_short_writes_are_finished(tmp_path, model, monkeypatch):
    real = segment_writer.pwritev
    calls = []

    def at_most_1000_bytes(fd, buffers, offset):  # the kernel may write less than asked
        calls.append(offset)
        views, left = [], 1000
        for b in buffers:
            v = memoryview(b).cast("B")[:left]
            views.append(v)
            left -= v.nbytes
            if not left:
                break
        return real(fd, views, offset)

    monkeypatch.setattr(segment_writer, "pwritev", at_most_1000_bytes)
    monkeypatch.setattr(segment_writer, "THREADED_BYTES", 0)
    prompts = _prompts()
    caches = _fill(tmp_path / "s", model, prompts, sync_writes=True)
    assert len(calls) > 10
    _check_store(tmp_path / "s", model, prompts, caches)


def test_segment_header_comes_first_and_data_follows(tmp_path, model):
    prompts = _prompts()
    _fill(tmp_path / "s", model, prompts, sync_writes=True)
    for path in _segments(tmp_path / "s"):
        raw = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        assert 8 + n + max(ends) == len(raw)  # nothing after the data, no gap before it
        assert n % 8 == 0


_FAILING_WRITER = r"""
import resource, signal, sys
sys.path.insert(0, sys.argv[2])
from helpers import BLOCK, assert_restores_kv, prefill, random_tokens
from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.disk import segment_writer
from persistent_prefix_cache.tiny_model import load_tiny_model

model = load_tiny_model(sys.argv[3])
segment_writer.THREADED_BYTES = 0  # the data goes out from the second thread
tokens = random_tokens(6 * BLOCK, seed=821, first=3)
_, cache = prefill(model, tokens)
with PersistentPrefixCache(sys.argv[1], model, block_size=BLOCK, sync_writes=True) as store:
    store.flush()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
    store.store(tokens, cache)
    print(store.stats()["write_errors"])
"""


@pytest.mark.slow
def test_a_failed_write_in_the_second_thread_fails_the_store_and_leaves_nothing(tmp_path, tiny_model_dir):
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _FAILING_WRITER, str(tmp_path / "s"), tests, str(tiny_model_dir)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1"  # counted as one write error
    assert _segments(tmp_path / "s") == []
    assert os.listdir(tmp_path / "s" / "tmp") == []
    nodes, _, digests = _index(tmp_path / "s")
    assert nodes == {} and digests == {}


def test_block_writes_queued_behind_a_busy_writer_share_one_commit(tmp_path, model, separate_segments):
    """Stores queued while the writer is busy are committed together, in order: a
    prompt extending the one before it (its first new block's parent is in the
    segment written just before) is stored whole, and everything restores."""
    base = random_tokens(2 * BLOCK, seed=831, first=3)
    prompts = [base, base + random_tokens(2 * BLOCK, seed=832), random_tokens(3 * BLOCK + 4, seed=833, first=4)]
    caches = [prefill(model, p)[1] for p in prompts]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK, memory_bytes=0) as store:
        store.flush()
        gate = threading.Event()
        store.hold_writer(gate)  # the writer is busy until the gate opens
        before = store.stats()
        for tokens, cache in zip(prompts, caches):
            store.store(tokens, cache)
        gate.set()
        store.flush()
        after = store.stats()
        assert after["write_errors"] == 0
    # three segments, one index transaction
    assert after["group_commits"] - before["group_commits"] == 1
    assert after["group_commit_writes"] - before["group_commit_writes"] == 3
    assert len(_segments(tmp_path / "s")) == 3
    _check_store(tmp_path / "s", model, prompts, caches)


def test_a_data_job_between_queued_stores_splits_the_group_commit(tmp_path, model):
    """No block write is committed ahead of a data job queued before it: stores queued
    on either side of one commit in two groups, in order."""
    base = random_tokens(2 * BLOCK, seed=841, first=3)
    prompts = [base, base + random_tokens(2 * BLOCK, seed=842), base + random_tokens(3 * BLOCK, seed=843)]
    caches = [prefill(model, p)[1] for p in prompts]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK, memory_bytes=0) as store:
        store.flush()
        gate, job = threading.Event(), threading.Event()
        try:
            store.hold_writer(gate)
            before = store.stats()["group_commits"]
            store.store(prompts[0], caches[0])
            at_job = store.hold_writer(job)  # the data job between
            store.store(prompts[1], caches[1])
            store.store(prompts[2], caches[2])
            gate.set()
            assert at_job.wait(timeout=120)
            ran = store.stats()["group_commits"] - before
        finally:
            gate.set()
            job.set()
        store.flush()
        commits = store.stats()["group_commits"] - before
    assert ran == 1  # the first store was committed before the job, the others after
    assert commits == 2
    _check_store(tmp_path / "s", model, prompts, caches)


def test_a_synchronous_store_writes_the_callers_cache_and_keeps_its_own_copy(tmp_path, model):
    """A synchronous store writes from the caller's buffers (no copy first) while it
    makes the RAM tier's copy: what the tier holds survives the caller's cache being
    overwritten, extended in place or trimmed, and both tiers restore the exact KV."""
    prompts = _prompts()
    caches = [prefill(model, p)[1] for p in prompts]
    kept = [[(mx.array(c.keys), mx.array(c.values)) for c in cache] for cache in caches]
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK, sync_writes=True, cost_model=False) as store:
        for tokens, cache in zip(prompts, caches):
            assert store.store(tokens, cache) > 0
        assert store.stats()["blocks_in_memory"] == store.stats()["blocks"] > 0
        theirs = [np.asarray(memoryview(x)) for cache in caches for c in cache for x in (c.keys, c.values)]
        for _, tensors in store.ram_tier.items():
            for x in (x for part in tensors.values() for x in part.values()):
                ours = np.asarray(memoryview(x))
                assert not any(np.shares_memory(ours, buf) for buf in theirs)
        for cache in caches:  # the caller reuses its buffers: nothing the tier holds may change
            for c in cache:
                c.keys[...] = 7.0
                c.values[...] = -7.0
                mx.eval(c.keys, c.values)
        for tokens, want in zip(prompts, kept):
            restored, rest = store.fetch(tokens)
            n = len(tokens) - len(rest)
            assert restored is not None and n >= len(tokens) - BLOCK
            for got, (k, v) in zip(restored, want):
                assert mx.array_equal(got.keys[..., :n, :], k[..., :n, :])
                assert mx.array_equal(got.values[..., :n, :], v[..., :n, :])
        assert store.stats()["memory_hits_store"] > 0
    originals = [[type(c)() for c in cache] for cache in caches]
    for fresh, want in zip(originals, kept):
        for c, (k, v) in zip(fresh, want):
            c.update_and_fetch(k, v)
    _check_store(tmp_path / "s", model, prompts, originals)


def test_a_synchronous_store_that_fails_leaves_nothing_in_the_ram_tier(tmp_path, model, monkeypatch):
    """The blocks of a synchronous store join the RAM tier once the index holds them: a
    write that fails (counted) leaves neither a file nor a block in memory, so a later
    store writes them again."""
    tokens = _prompts()[0]
    _, cache = prefill(model, tokens)
    with PersistentPrefixCache(tmp_path / "s", model, block_size=BLOCK, sync_writes=True) as store:
        store.flush()
        real = SegmentFiles.write

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(SegmentFiles, "write", disk_full)
        assert store.store(tokens, cache) > 0
        stats = store.stats()
        assert stats["write_errors"] == 1 and stats["blocks_in_memory"] == 0 and stats["blocks"] == 0
        monkeypatch.setattr(SegmentFiles, "write", real)
        assert store.store(tokens, cache) > 0  # nothing claimed them: written now
        assert store.stats()["blocks"] == store.stats()["blocks_in_memory"] > 0
    _check_store(tmp_path / "s", model, [tokens], [cache])


def test_a_synchronous_store_of_quantized_kv_restores_it_exactly(tmp_path, model):
    """4-bit KV (three fields per keys and values) through the synchronous path: the RAM
    tier and the disk both give back the caller's quantized tensors bit for bit."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    tokens = random_tokens(3 * BLOCK + 5, seed=851, first=3)
    _, cache = prefill(model, tokens)
    maybe_quantize_kv_cache(cache, 0, 32, 4)
    kw = dict(block_size=BLOCK, kv_bits=4, kv_group_size=32, cost_model=False)
    n = 3 * BLOCK
    with PersistentPrefixCache(tmp_path / "s", model, sync_writes=True, **kw) as store:
        assert store.store(tokens, cache) == 4
        ram, _ = store.fetch(tokens[:n] + [1])
        assert store.stats()["memory_hits_store"] > 0
    with PersistentPrefixCache(tmp_path / "s", model, memory_bytes=0, **kw) as store:
        disk, _ = store.fetch(tokens[:n] + [1])
    for restored in (ram, disk):
        for got, want in zip(restored, cache):
            for g, w in zip(got.keys + got.values, want.keys + want.values):
                assert mx.array_equal(g[..., :n, :], w[..., :n, :])


def test_the_callers_cache_grows_in_place_after_a_synchronous_store(tmp_path, model):
    """The writer's views of the caller's buffers are gone once `store()` returns: the
    caller's next decode step writes in place (MLX copies a buffer something else
    holds), as after an asynchronous store, which copies first."""
    from helpers import feed

    def pointer(x) -> int:
        return np.asarray(memoryview(x)).__array_interface__["data"][0]

    tokens = random_tokens(3 * BLOCK + 5, seed=861, first=3)
    for sync in (True, False):
        _, cache = prefill(model, tokens)
        assert cache[0].keys.shape[2] > cache[0].offset  # room to grow
        with PersistentPrefixCache(tmp_path / f"s{sync}", model, block_size=BLOCK, sync_writes=sync) as store:
            assert store.store(tokens, cache) > 0
            before = [pointer(c.keys) for c in cache]
            feed(model, cache, [7])
            assert [pointer(c.keys) for c in cache] == before


def _reference_digests(blocks, root, names) -> tuple[list[int], list[int]]:
    """Each block's checksum and each field's digest as the format defines them (one hash
    update per row piece), computed here without the writer."""
    import xxhash

    from persistent_prefix_cache.disk.digest_tags import block_tag, field_tag, run_tag

    checksums = []
    for node, tensors in blocks:
        h = xxhash.xxh3_64()
        h.update(block_tag(node))
        for name in names:
            lid, _, fld = name.rpartition(".")
            bits, dtype = tensors[lid][fld]
            b, heads, _, width = bits.shape
            h.update(field_tag(name, dtype, b, heads, width))
            for row in np.ascontiguousarray(bits).reshape(b * heads, -1).view(np.uint8):
                h.update(row)
        checksums.append(h.intdigest())
    fields = []
    for name in names:
        lid, _, fld = name.rpartition(".")
        whole = np.concatenate([np.ascontiguousarray(t[lid][fld][0]) for _, t in blocks], axis=2)
        b, heads, tokens, width = whole.shape
        h = xxhash.xxh3_64()
        h.update(run_tag(name, "bfloat16", b, heads, width, blocks[0][0].position, tokens))
        for row in whole.reshape(b * heads, -1).view(np.uint8):
            h.update(row)
        fields.append(h.intdigest())
    return checksums, fields


@pytest.mark.parametrize("join_below", [0, 1 << 30])
@pytest.mark.parametrize("lying", ["one copy", "a wider copy", "a copy per block"])
def test_digests_do_not_depend_on_how_the_rows_lie_in_memory(monkeypatch, join_below, lying):
    # The writer hashes a field's rows as one chunk where they follow each other, and a
    # block's pieces of the rows joined by one copy where they are short (`JOIN_PIECES_BYTES`):
    # the checksums must be the format's, whichever way the bits lie and either way.
    import xxhash

    from persistent_prefix_cache.blocks import Node
    from persistent_prefix_cache.disk.digest_tags import segment_tag

    monkeypatch.setattr(segment_writer, "JOIN_PIECES_BYTES", join_below)
    rng = np.random.default_rng(5)
    root, n_blocks, bs, names = bytes(range(16)), 3, 4, ["0.k", "0.v", "1.k", "1.v"]
    wide = rng.integers(0, 1 << 16, size=(len(names), 1, 2, n_blocks * bs + 5, 8), dtype=np.uint16)
    if lying == "a wider copy":
        source = wide[:, :, :, 2 : 2 + n_blocks * bs, :]  # rows strided: the copy holds more positions
    else:
        source = np.ascontiguousarray(wide[:, :, :, : n_blocks * bs, :])
    blocks, parent = [], root
    for i in range(n_blocks):
        tensors: dict = {}
        for k, name in enumerate(names):
            lid, _, fld = name.rpartition(".")
            piece = source[k, :, :, i * bs : (i + 1) * bs, :]
            if lying == "a copy per block":
                piece = np.ascontiguousarray(piece)
            tensors.setdefault(lid, {})[fld] = (piece, "bfloat16")
        key = bytes([i + 1]) * 16
        tokens = np.arange(i * bs, (i + 1) * bs, dtype=np.int32).tobytes()
        node = Node(key=key, parent=parent, position=i * bs, tokens=tokens, flags=0, size=0, checksum=0)
        blocks.append((node, tensors))
        parent = key
    plan = segment_writer.plan_segment(b"s" * 16, blocks, root, b"model", bs)
    written: list[bytes] = []
    checksums, _, digest = plan.stream(lambda chunk: written.append(bytes(memoryview(chunk).cast("B"))))
    want_checksums, want_fields = _reference_digests(blocks, root, names)
    assert checksums == want_checksums
    # The data in file order: each field's rows, whole, one after another (head-major).
    data = b"".join(written)
    expect = b"".join(
        np.ascontiguousarray(source[k]).reshape(2, -1).view(np.uint8).tobytes() for k in range(len(names))
    )
    assert data == expect
    # The whole-segment digest binds the checksums, then the fields' digests.
    whole = xxhash.xxh3_64()
    whole.update(segment_tag(b"s" * 16, root, want_checksums))
    for d in want_fields:
        whole.update(d.to_bytes(8, "little"))
    assert digest == whole.intdigest()

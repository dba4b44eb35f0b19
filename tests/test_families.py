"""Every mlx-lm cache family, stored in one process and restored in another.

For a tiny random-weight model of each family (see families.py), one subprocess
prefills a 150-token prompt block-aligned (``prefill``) and a fresh subprocess
restores a set of queries. The restored cache plus the remaining tokens must give
next-token logits *bit-identical* to the in-memory cache that was stored (prefilled
in the same block-aligned chunks), and close to a one-shot cold prefill.

Why a tolerance against the one-shot prefill: mlx-lm's own arithmetic differs between
a split and a one-shot prefill for some families (mamba2 and falcon_h1 scan SSMs in
fixed chunks; gemma3_text and deepseek_v32 take a different code path for a single
token), by ~1e-6 here. That is the model's numerics, not the store's: the exact check
against the chunked in-memory cache is the one that tests the store.
"""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import family_worker
from families import RUNNABLE, build, family_params
from persistent_prefix_cache import fingerprint_model
from persistent_prefix_cache.layers import all_sliced

HERE = os.path.dirname(__file__)
COLD_TOLERANCE = 1e-4
# Families whose every layer can be rebuilt inside a block (no recurrent state).
TRIMMABLE = {"llama", "gemma3_text", "deepseek_v32", "llama4"}


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    """Run the store process, then the fetch process; return each family's results."""
    workdir = str(tmp_path_factory.mktemp("families"))
    worker = os.path.join(HERE, "family_worker.py")
    for mode in ("store", "fetch"):
        proc = subprocess.run([sys.executable, worker, mode, workdir], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: dict(np.load(os.path.join(workdir, f"{name}.npz"))) for name in RUNNABLE}


def chunked_reference(model, tokens, restored_len, remaining):
    """Logits of an in-memory cache prefilled like ``prefill`` does (block-aligned
    chunks up to the stored prompt's last token, which it feeds alone; then up to
    `restored_len`), then fed `remaining`."""
    cache = make_prompt_cache(model)
    last = len(family_worker.prompt()) - 1  # the stored prompt's last token: a forward of its own
    pos = 0
    while pos < restored_len:
        end = min((pos // family_worker.BLOCK + 1) * family_worker.BLOCK, restored_len)
        if pos < last < end:
            end = last
        model(mx.array(tokens[pos:end])[None], cache=cache)
        pos = end
    return model(mx.array(remaining)[None], cache=cache)[0, -1]


@pytest.mark.parametrize("family", family_params())
def test_restored_logits_match(family, restored):
    results = restored[family]
    model = build(family)
    # Same weights in both processes, or the comparison below would mean nothing.
    assert str(results["fingerprint"]) == fingerprint_model(model)
    stats = json.loads(str(results["stats"]))
    assert stats["corrupt"] == 0
    checked = 0
    for qname, q in family_worker.queries().items():
        n = int(results[f"{qname}.restored"])
        assert n > 0, f"{family}/{qname}: expected a hit"
        assert n < len(q)
        got = mx.array(results[f"{qname}.logits"])
        want = chunked_reference(model, q, n, q[n:])
        assert mx.array_equal(got, want).item(), f"{family}/{qname}: restored at {n}"
        cold = model(mx.array(q)[None], cache=make_prompt_cache(model))[0, -1]
        assert mx.abs(got - cold).max().item() < COLD_TOLERANCE
        checked += 1
    assert checked == len(family_worker.queries())


@pytest.mark.parametrize("family", family_params())
def test_restore_points(family, restored):
    """Where a family can resume: every block boundary (prefill stores one per block),
    one token before the end (the whole prompt for a longer one where every layer is
    sliced: prefill stores it whole), and inside a block only where no layer is recurrent."""
    results = restored[family]
    p = family_worker.prompt()
    block = family_worker.BLOCK
    for boundary in range(block, len(p), block):
        assert int(results[f"boundary_{boundary}.restored"]) == boundary
    assert int(results["same.restored"]) == len(p) - 1
    whole = all_sliced(make_prompt_cache(build(family)))
    assert int(results["longer.restored"]) == (len(p) if whole else len(p) - 1)
    mid = int(results["diverge_mid_block.restored"])
    prefix = int(results["prefix.restored"])
    if family in TRIMMABLE:
        assert (mid, prefix) == (70, 56)
    else:  # recurrent state: back to the last block boundary with a snapshot
        assert (mid, prefix) == (64, 48)


@pytest.mark.parametrize("family", family_params(["gemma3_text", "llama4", "qwen3_next", "falcon_h1"]))
@pytest.mark.parametrize("chunks", [[101], [30, 30, 41]], ids=["one-shot", "chunked"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_store_after_generation(family, chunks, sync, tmp_path):
    """`store()` of a cache that has generated past its window: windows that dropped old
    tokens and recurrent state are kept as a snapshot at the end, which restores to
    continue exactly like the original cache; where nothing can be rebuilt (the window
    lost those tokens, no snapshot) the store answers a miss, never wrong KV. A
    synchronous store (written from the caller's buffers) stores the same."""
    from persistent_prefix_cache import PersistentPrefixCache

    model = build(family)
    tokens = np.random.default_rng(1).integers(0, 256, sum(chunks)).tolist()
    cache = make_prompt_cache(model)
    pos = 0
    for n in chunks:
        logits = model(mx.array(tokens[pos : pos + n])[None], cache=cache)[0, -1]
        pos += n
    for _ in range(20):  # greedy decoding, one token at a time (in-place rotation)
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array(tokens[-1:])[None], cache=cache)[0, -1]
    tokens.append(int(mx.argmax(logits)))  # not fed yet: the cache covers tokens[:-1]

    with PersistentPrefixCache(tmp_path, model, block_size=16, sync_writes=sync) as store:
        store.store(tokens[:-1], cache)
    with PersistentPrefixCache(tmp_path, model, memory_bytes=0) as store:
        restored, remaining = store.fetch(tokens + [5, 6])
        assert len(tokens) + 2 - len(remaining) == len(tokens) - 1
        got = model(mx.array(remaining)[None], cache=restored)[0, -1]
        want = model(mx.array(remaining)[None], cache=cache)[0, -1]
        assert mx.array_equal(got, want).item()
        # Early positions: the window no longer held them, so nothing to restore there.
        early, _ = store.fetch(tokens[:40] + [1])
        assert early is None
        assert store.stats()["corrupt"] == 0


def test_unsupported_cache_class_is_refused_at_store(tmp_path):
    """A model whose cache mlx-lm cannot rebuild from state (deepseek_v41's LayerCache;
    mlx-lm 0.31 has no deepseek_v41: its BatchKVCache, which we do not store either)
    opens, always misses, and refuses store() with a message naming the class."""
    from persistent_prefix_cache import PersistentPrefixCache, UnsupportedCacheError

    try:
        from mlx_lm.models.deepseek_v41 import LayerCache

        def make_layer():
            return LayerCache(8)
    except ImportError:  # mlx-lm 0.31
        from mlx_lm.models.cache import BatchKVCache as LayerCache

        def make_layer():
            return LayerCache([0])

    model = build("llama")
    model.make_cache = lambda: [make_layer() for _ in model.layers]
    with PersistentPrefixCache(tmp_path, model) as store:
        assert store.fetch([1, 2, 3]) == (None, [1, 2, 3])
        with pytest.raises(UnsupportedCacheError, match=LayerCache.__name__):
            store.store([1, 2, 3], model.make_cache())
        assert store.stats()["blocks"] == 0

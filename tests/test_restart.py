"""A store survives a real process restart and a restored prefix continues exactly.

Process A loads the model from its folder, prefills prompts, stores them and exits.
Process B, a fresh interpreter, opens the same store, fetches queries, feeds what is
left and saves the next-token logits. This process compares them with a cold prefill
of the whole query, bit for bit (float32 split prefill of llama is bitwise identical
to a one-shot prefill on this machine: README, "Supported cache classes").
"""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    BLOCK,
    assert_same_logits,
    assert_tree_consistent,
    cold_logits,
    different_tokens,
    feed,
    random_tokens,
    run_python_json,
)
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

# Every test here reads what real process restarts (module fixtures) left behind.
pytestmark = pytest.mark.slow

# -- the plain (float32 KVCache) store --------------------------------------------

STORE_SNIPPET = """
    import json, os, sys
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from persistent_prefix_cache import PersistentPrefixCache

    spec = json.load(open(sys.argv[1]))
    model, _tokenizer = load(spec["model"])  # the real loader, tokenizer included
    new = []
    with PersistentPrefixCache(
        spec["store"], model, model_path=spec["model"], block_size=spec["block_size"]
    ) as store:
        for prompt in spec["prompts"].values():
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array(prompt)[None], cache=cache))
            new.append(store.store(prompt, cache))
        store.flush()
        stats = store.stats()
    print(json.dumps({"pid": os.getpid(), "new": new, "stats": stats}))
"""

FETCH_SNIPPET = """
    import json, os, sys
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    import persistent_prefix_cache.fingerprint as fp
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    # Count weight hashes: the fingerprint process A remembered should be reused.
    hashes = []
    real = fp.fingerprint_model
    fp.fingerprint_model = lambda m: hashes.append(1) or real(m)

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    out = {}
    with PersistentPrefixCache(spec["store"], model, model_path=spec["model"]) as store:
        for name, query in spec["queries"].items():
            cache, remaining = store.fetch(query)
            hit = cache is not None
            kinds = sorted({type(c).__name__ for c in cache}) if hit else []
            if cache is None:
                cache = make_prompt_cache(model)
            logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
            np.save(os.path.join(spec["out"], name + ".npy"), np.array(logits))
            out[name] = {
                "hit": hit,
                "matched": len(query) - len(remaining),
                "remaining_is_list": isinstance(remaining, list),
                "kinds": kinds,
            }
        stats = store.stats()
    print(json.dumps({
        "pid": os.getpid(), "queries": out, "stats": stats, "hashes": len(hashes),
        "block_size": store.block_size,
    }))
"""

P_BOUNDARY = random_tokens(4 * BLOCK, seed=1, first=1)  # ends on a block boundary
P_INSIDE = random_tokens(4 * BLOCK + 11, seed=2, first=2)  # ends inside a block
P_SHORT = random_tokens(10, seed=3, first=3)  # shorter than one block
P_LONG = random_tokens(6 * BLOCK, seed=4, first=4)  # served to shorter queries

PROMPTS = {
    "boundary": P_BOUNDARY,
    "inside": P_INSIDE,
    "short": P_SHORT,
    "long": P_LONG,
}
EXPECTED_NEW_BLOCKS = [4, 5, 1, 6]

# name -> (query, tokens the store must restore)
QUERIES = {
    # A full hit is cut back by one token (the model needs one to give logits), so
    # the last block is trimmed by one.
    "boundary_exact": (P_BOUNDARY, 4 * BLOCK - 1),
    "boundary_extended": (P_BOUNDARY + different_tokens(7, 0), 4 * BLOCK),
    "inside_exact": (P_INSIDE, len(P_INSIDE) - 1),
    "inside_extended": (P_INSIDE + different_tokens(9, 0), len(P_INSIDE)),
    "short_exact": (P_SHORT, len(P_SHORT) - 1),
    "short_extended": (P_SHORT + different_tokens(5, 0), len(P_SHORT)),
    # Strict prefixes of a longer stored prompt: served by trimming it.
    "prefix_mid_block": (P_LONG[:40], 39),
    "prefix_on_boundary": (P_LONG[:48], 47),
    # Diverging from the stored prompt: the shared part is restored, even mid-block.
    "diverge_mid_block": (P_LONG[:40] + different_tokens(6, P_LONG[40]), 40),
    "diverge_on_boundary": (P_LONG[:32] + different_tokens(6, P_LONG[32]), 32),
    "unrelated": (random_tokens(20, seed=5, first=5), 0),
}


@pytest.fixture(scope="module")
def restart(tiny_model_dir, tmp_path_factory):
    """Run process A (store) then process B (fetch); return both reports."""
    work = tmp_path_factory.mktemp("restart")
    spec = {
        "model": str(tiny_model_dir),
        "store": str(work / "store"),
        "block_size": BLOCK,
        "prompts": PROMPTS,
        "queries": {name: q for name, (q, _) in QUERIES.items()},
        "out": str(work),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    a = run_python_json(STORE_SNIPPET, str(work / "spec.json"))
    b = run_python_json(FETCH_SNIPPET, str(work / "spec.json"))
    return {"a": a, "b": b, "work": work, "store": work / "store"}


def test_processes_were_distinct_and_store_filled(restart):
    a, b = restart["a"], restart["b"]
    assert len({a["pid"], b["pid"], os.getpid()}) == 3
    assert a["new"] == EXPECTED_NEW_BLOCKS
    assert a["stats"]["blocks"] == sum(EXPECTED_NEW_BLOCKS)
    assert a["stats"]["write_errors"] == 0
    # B opened without block_size and must have picked up the store's own.
    assert b["block_size"] == BLOCK
    nodes = assert_tree_consistent(restart["store"])
    assert len(nodes) == sum(EXPECTED_NEW_BLOCKS)


def test_restarted_process_reused_the_remembered_fingerprint(restart):
    # A hashed the weights once and remembered them by file signature; B, a new
    # process on unchanged files, must not hash again.
    assert restart["b"]["hashes"] == 0


def test_restarted_process_counted_every_query(restart):
    stats = restart["b"]["stats"]
    hits = sum(1 for _, m in QUERIES.values() if m)
    assert stats["queries"] == len(QUERIES)
    assert (stats["hits"], stats["misses"]) == (hits, len(QUERIES) - hits)
    assert stats["tokens_saved"] == sum(m for _, m in QUERIES.values())
    assert stats["corrupt"] == 0


@pytest.mark.parametrize("name", list(QUERIES))
def test_restored_prefix_continues_exactly(restart, model, name):
    query, expected = QUERIES[name]
    got = restart["b"]["queries"][name]
    assert got["matched"] == expected
    assert got["hit"] == (expected > 0)
    assert got["remaining_is_list"]
    if got["hit"]:
        assert got["kinds"] == ["KVCache"]
    logits = mx.array(np.load(restart["work"] / f"{name}.npy"))
    assert_same_logits(logits, cold_logits(model, query))


# -- a 4-bit KV store (QuantizedKVCache) -------------------------------------------

KV_BITS, KV_GROUP = 4, 32  # group 32 = head_dim of the tiny model

Q_STORE_SNIPPET = """
    import copy, json, os, sys
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    prompt = spec["prompt"]
    # What mlx-lm's generate does with kv_bits: prefill, then quantize the KVCache.
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    maybe_quantize_kv_cache(cache, 0, spec["group"], spec["bits"])
    with PersistentPrefixCache(
        spec["store"], model, block_size=spec["block_size"],
        kv_bits=spec["bits"], kv_group_size=spec["group"],
    ) as store:
        new = store.store(prompt, cache)
    # The reference: the very cache that was stored, trimmed to what B restores,
    # continued in memory.
    for name, (query, matched) in spec["queries"].items():
        mine = copy.deepcopy(cache)
        trim_prompt_cache(mine, len(prompt) - matched)
        logits = model(mx.array(query[matched:])[None], cache=mine)[0, -1]
        np.save(os.path.join(spec["out"], "mem_" + name + ".npy"), np.array(logits))
    print(json.dumps({"new": new, "kinds": sorted({type(c).__name__ for c in cache})}))
"""

Q_FETCH_SNIPPET = """
    import json, os, sys
    import mlx.core as mx
    import numpy as np
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    out = {}
    with PersistentPrefixCache(
        spec["store"], model, kv_bits=spec["bits"], kv_group_size=spec["group"]
    ) as store:
        for name, (query, _) in spec["queries"].items():
            cache, remaining = store.fetch(query)
            layers = [[type(c).__name__, c.bits, c.group_size, c.offset] for c in cache]
            logits = model(mx.array(remaining)[None], cache=cache)[0, -1]
            np.save(os.path.join(spec["out"], "disk_" + name + ".npy"), np.array(logits))
            out[name] = {"matched": len(query) - len(remaining), "layers": layers}
    print(json.dumps(out))
"""

Q_PROMPT = random_tokens(3 * BLOCK + 8, seed=6, first=6)
Q_QUERIES = {
    "exact": (Q_PROMPT, len(Q_PROMPT) - 1),
    "extended": (Q_PROMPT + different_tokens(5, 0), len(Q_PROMPT)),
    "prefix_mid_block": (Q_PROMPT[:27], 26),
    "diverge_mid_block": (Q_PROMPT[:21] + different_tokens(4, Q_PROMPT[21]), 21),
}


@pytest.fixture(scope="module")
def quantized_restart(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("restart_q")
    spec = {
        "model": str(tiny_model_dir),
        "store": str(work / "store"),
        "block_size": BLOCK,
        "bits": KV_BITS,
        "group": KV_GROUP,
        "prompt": Q_PROMPT,
        "queries": Q_QUERIES,
        "out": str(work),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    a = run_python_json(Q_STORE_SNIPPET, str(work / "spec.json"))
    b = run_python_json(Q_FETCH_SNIPPET, str(work / "spec.json"))
    return {"a": a, "b": b, "work": work}


def test_quantized_store_holds_quantized_layers(quantized_restart):
    assert quantized_restart["a"]["kinds"] == ["QuantizedKVCache"]
    assert quantized_restart["a"]["new"] == 4


@pytest.mark.parametrize("name", list(Q_QUERIES))
def test_quantized_restore_continues_exactly(quantized_restart, model, name):
    """4-bit KV restored in a new process == the in-memory quantized cache, exactly.

    No tolerance is needed: mlx-lm quantizes each token's vector on its own, so the
    stored slices are the in-memory bits. The cold reference must quantize at the
    same split point as the warm run: a prefill over unquantized KV then quantized
    (mlx-lm's ``maybe_quantize_kv_cache``) is not the same arithmetic as attending
    to quantized KV, so comparing against a one-shot prefill of the whole query
    would measure quantization error, not the store.
    """
    query, matched = Q_QUERIES[name]
    got = quantized_restart["b"][name]
    assert got["matched"] == matched
    assert got["layers"] == [["QuantizedKVCache", KV_BITS, KV_GROUP, matched]] * 2

    work = quantized_restart["work"]
    disk = mx.array(np.load(work / f"disk_{name}.npy"))
    memory = mx.array(np.load(work / f"mem_{name}.npy"))
    assert_same_logits(disk, memory)

    # And a cold run in this process, quantized the way mlx-lm's generate does it.
    cache = make_prompt_cache(model)
    feed(model, cache, query[:matched])
    maybe_quantize_kv_cache(cache, 0, KV_GROUP, KV_BITS)
    assert_same_logits(disk, feed(model, cache, query[matched:]))

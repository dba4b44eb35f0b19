"""`layers/mlx_lm_versions.py` against the installed mlx-lm (CI runs this on 0.32 and,
through ``make test-mlx-lm-0.31``, on 0.31.3): every claim the module makes about the
installed version is checked on mlx-lm's real classes and models, so a version that
behaves otherwise fails here rather than in a restore.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import build
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from persistent_prefix_cache.layers import mlx_lm_versions as versions

TOKENS = np.random.default_rng(3).integers(0, 256, 60).tolist()


def _prefilled(layer, n: int = 37):
    """`layer` fed `n` random keys and values (two heads of width 32) in two pieces."""
    x = mx.array(np.random.default_rng(n).standard_normal((1, 2, n, 32)).astype(np.float32))
    layer.update_and_fetch(x[:, :, :20], x[:, :, :20])
    layer.update_and_fetch(x[:, :, 20:], x[:, :, 20:] * 2)
    return layer


def _held(layer):
    n = layer.offset if not isinstance(layer, ChunkedKVCache) else layer.offset - layer.start_position
    if isinstance(layer, QuantizedKVCache):
        return [np.array(t[..., :n, :]) for t in (*layer.keys, *layer.values)]
    return [np.array(layer.keys[..., :n, :]), np.array(layer.values[..., :n, :])]


LAYERS = {
    "KVCache": lambda: KVCache(),
    "QuantizedKVCache": lambda: QuantizedKVCache(group_size=32, bits=4),
    "RotatingKVCache": lambda: RotatingKVCache(max_size=64, keep=4),
}


def test_the_state_protocol_is_the_one_the_module_names():
    """0.31: ``from_state(state, meta_state)``; 0.32: ``from_state(state)``."""
    layer = _prefilled(KVCache())
    if versions.SPLIT_META_STATE:
        assert len(layer.state) == 2 and layer.meta_state == ""
        with pytest.raises(TypeError):
            KVCache.from_state(layer.state)
    else:
        assert len(layer.state) == 3 and not hasattr(layer, "meta_state")


@pytest.mark.parametrize("name", list(LAYERS))
def test_make_layer_and_layer_from_state_rebuild_what_the_layer_holds(name):
    layer = _prefilled(LAYERS[name]())
    meta = layer.meta_state if versions.SPLIT_META_STATE else None
    again = versions.layer_from_state(type(layer), layer.state, meta)
    assert again.offset == layer.offset
    assert all(np.array_equal(a, b) for a, b in zip(_held(again), _held(layer)))
    if isinstance(layer, QuantizedKVCache):
        made = versions.make_layer(
            QuantizedKVCache, (layer.keys, layer.values), offset=layer.offset, group_size=32, bits=4
        )
    elif isinstance(layer, RotatingKVCache):
        made = versions.make_layer(
            RotatingKVCache, (layer.keys, layer.values), offset=layer.offset, keep=4, max_size=64, idx=layer._idx
        )
    else:  # a buffer longer than the offset: 0.31's setter alone would take its length
        assert layer.keys.shape[2] > layer.offset
        made = versions.make_layer(KVCache, (layer.keys, layer.values), offset=layer.offset)
    assert made.offset == layer.offset
    assert all(np.array_equal(a, b) for a, b in zip(_held(made), _held(layer)))
    # Both continue alike.
    x = mx.ones((1, 2, 3, 32))
    got, want = made.update_and_fetch(x, x), layer.update_and_fetch(x, x)
    got, want = [x for _, x in tree_flatten(got)], [x for _, x in tree_flatten(want)]
    assert len(got) == len(want) >= 2
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got, want))


def test_arrays_state_reads_both_layouts():
    a, b = mx.ones((1, 3, 4)), mx.zeros((1, 2, 4, 4))
    assert versions.arrays_state([a, b]) == [a, b]  # 0.31
    assert versions.arrays_state(([a, b], None, None)) == [a, b]  # 0.32
    assert versions.arrays_state("not a state") is None
    layer = ArraysCache(2)
    layer.cache = [a, b]
    assert versions.arrays_state(layer.state) == [a, b]  # the installed one's


def test_chunked_piecewise_prefill_fails_exactly_where_the_module_says():
    model = build("llama4")  # attention chunk 40
    cache = make_prompt_cache(model)
    assert any(isinstance(c, ChunkedKVCache) for c in cache)
    try:
        for start in range(0, 60, 16):
            model(mx.array(TOKENS[start : start + 16])[None], cache=cache)
        failed = False
    except ValueError:  # mlx-lm 0.31's own broadcast error
        failed = True
    assert failed is not versions.CHUNKED_PIECEWISE_PREFILL


def test_deepseek_v32_indexer_values_and_the_layout_variant_agree():
    model = build("deepseek_v32")
    cache = make_prompt_cache(model)
    model(mx.array(TOKENS[:20])[None], cache=cache)
    widths = {c.caches[1].values.shape[-1] for c in cache}
    assert (widths == {0}) is versions.INDEXER_VALUES_EMPTY


def test_the_two_lines_never_share_stored_kv(tmp_path):
    """The root key holds the mlx-lm line (0.31's stores are new: 0.32's keep their keys)."""
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.keys import root_key

    model = build("llama")
    with PersistentPrefixCache(tmp_path, model) as store:
        plain = root_key(store.fingerprint, "", store.this_model()["layout"])
        assert (store.this_model()["root"] == plain.hex()) is (versions.MLX_LM >= (0, 32, 0))
        assert versions.layout_variant() == ("" if versions.MLX_LM >= (0, 32, 0) else "+mlx-lm-0.31")
        with_line = root_key(store.fingerprint, "", store.this_model()["layout"] + versions.layout_variant())
        assert store.this_model()["root"] == with_line.hex()  # the handle's root holds the line


def test_load_options_are_what_the_installed_load_takes():
    import inspect

    from mlx_lm import load

    params = inspect.signature(load).parameters
    for trust in (False, True):
        options = versions.load_options(trust)
        assert set(options) <= set(params)
        assert (options["tokenizer_config"] or {}).get("trust_remote_code", False) is trust


# Defaults of `ppc generate` that differ from mlx_lm generate's on purpose.
OWN_DEFAULTS = {
    "prompt",  # required: a store needs a prompt, not mlx-lm's "hello"
    "quantized_kv_start",  # None: see cli/generate.py
    "prefill_step_size",  # None: block-aligned steps of the store's block size (0.32 only)
}


def test_ppc_generate_takes_every_option_and_default_of_the_installed_mlx_lm_generate():
    from mlx_lm.generate import setup_arg_parser

    from persistent_prefix_cache.cli.generate import build_parser

    theirs = {a.dest: a.default for a in setup_arg_parser()._actions}
    ours = {a.dest: a.default for a in build_parser()._actions}
    assert set(theirs) <= set(ours)
    differ = {d for d in theirs if theirs[d] != ours[d]}
    assert differ <= OWN_DEFAULTS, {d: (theirs[d], ours[d]) for d in differ - OWN_DEFAULTS}


STORE_AND_FETCH = """
import json, sys
from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.prefill import prefill
from persistent_prefix_cache.tiny_model import load_tiny_model
from mlx_lm import __version__
mode, store_dir, model_dir = sys.argv[1:]
model = load_tiny_model(model_dir)
prompt = list(range(3, 70))
with PersistentPrefixCache(store_dir, model, block_size=16) as store:
    if mode == "store":
        prefill(model, prompt, store)
    cache, rest = store.fetch(prompt + [5])
print(json.dumps({"version": __version__, "restored": len(prompt) + 1 - len(rest) if cache is not None else 0}))
"""


def _other_line_python():
    """The interpreter of the other mlx-lm line's venv of this checkout, where built."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    other = root / (".venv" if versions.MLX_LM < (0, 32, 0) else ".venv-031") / "bin" / "python"
    return str(other) if os.access(other, os.X_OK) else None


def test_a_store_written_on_the_other_line_is_not_restored_here(tmp_path, tiny_model_dir):
    """Both lines on one store, each in its own venv (CI builds both: `make test`, then
    `make test-mlx-lm-0.31`): each restores its own prefixes, never the other's."""
    import json
    import subprocess
    import sys

    other = _other_line_python()
    if other is None:
        pytest.skip("the other mlx-lm line's venv is not built here")

    def run(python, mode):
        proc = subprocess.run(
            [python, "-c", STORE_AND_FETCH, mode, str(tmp_path / "s"), str(tiny_model_dir)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    theirs = run(other, "store")
    # 67: the whole prompt (prefill stores a sliced cache whole; the fetch is of a longer prompt).
    assert theirs["restored"] == 67 and versions._parse(theirs["version"])[:2] != versions.MLX_LM[:2]
    assert run(sys.executable, "fetch")["restored"] == 0  # the other line's KV: never restored here
    assert run(sys.executable, "store")["restored"] == 67  # our own, beside it
    assert run(other, "fetch")["restored"] == 67  # and theirs is still theirs

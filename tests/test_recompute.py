"""`layers.recompute.check_cache`: a cache is checked against the model by computing spans
of it again from its own prefix, on every cache family of the test zoo.

Both sides of the tolerance are measured here (run with ``-s`` to print them): the right
prompt and model, computed in one pass where the check computes in spans, in float32 and
rounded to bfloat16/float16 where the check computes in that dtype (another order of the
same arithmetic, as another backend would), and quantized KV; against another prompt (one
token changed in a checked span, or all of them) and another model of the same shape.
docs/mlx-lm-files.md quotes the figures.
"""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from families import build, family_params
from persistent_prefix_cache.layers import leaves, template_cache
from persistent_prefix_cache.layers.recompute import TOLERANCE, check_cache, tolerance_for

N, BLOCK = 120, 16  # wraps the zoo's windows (24) and chunks (40) several times


def _prefill(model, tokens, kv_bits=None):
    """The cache mlx_lm.cache_prompt makes: all but the last token in one pass (KV
    quantized after it, as mlx-lm does), then the last."""
    cache = template_cache(model)
    model(mx.array(tokens[:-1])[None], cache=cache)
    if kv_bits:
        cache = [c.to_quantized(group_size=32, bits=kv_bits) if type(c).__name__ == "KVCache" else c for c in cache]
    model(mx.array(tokens[-1:])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _cast(model, dtype):
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def _rounded(cache, dtype):
    """A float32 cache with every tensor rounded to `dtype` (what a run in that dtype holds)."""
    out = copy.deepcopy(cache)
    for _, layer in leaves(out):
        if hasattr(layer, "cache"):
            layer.cache = [None if x is None else x.astype(dtype) for x in layer.cache]
        else:
            layer.keys, layer.values = layer.keys.astype(dtype), layer.values.astype(dtype)
    return out


def _prompts():
    rng = random.Random(0)
    tokens = [rng.randrange(1, 256) for _ in range(N)]
    last = tokens[:]
    last[N - 3] = (last[N - 3] + 1) % 256
    first = [(tokens[0] + 1) % 256] + tokens[1:]
    other = [rng.randrange(1, 256) for _ in range(N)]
    return tokens, {"a token of the last span": last, "the first token": first, "another prompt": other}


def _margin(name, right: dict, wrong: dict, tolerance: float) -> None:
    print(f"\n{name}: right " + ", ".join(f"{k} {v:.2g}" for k, v in right.items()))
    print(f"{name}: wrong " + ", ".join(f"{k} {v:.2g}" for k, v in wrong.items()) + f" (tolerance {tolerance:g})")
    assert max(right.values()) < tolerance, right
    assert min(wrong.values()) > 2 * tolerance, wrong


@pytest.mark.parametrize("family", family_params())
def test_the_right_cache_passes_and_a_wrong_one_fails(family):
    model, twin = build(family, seed=0), build(family, seed=1)
    tokens, others = _prompts()
    good = _prefill(model, tokens)
    checked = check_cache(model, tokens, good, block_size=BLOCK)
    assert checked.passed and checked.error < 1e-5, checked
    recurrent = any(hasattr(layer, "cache") for _, layer in leaves(good))
    windowed = any(type(layer).__name__ in ("RotatingKVCache", "ChunkedKVCache") for _, layer in leaves(good))
    assert checked.full == (recurrent or windowed)  # nothing else can be cut back to an earlier block
    assert checked.spans[-1][1] == N and (checked.full or len(checked.spans) == 4)
    wrong = {"another model": check_cache(model, tokens, _prefill(twin, tokens), block_size=BLOCK).error}
    for what, ids in others.items():
        if what == "the first token" and family == "mamba2":
            continue  # its state after 120 tokens has forgotten the first (measured: 8e-8): not "wrong KV"
        wrong[what] = check_cache(model, tokens, _prefill(model, ids), block_size=BLOCK).error
    _margin(family, {"float32": checked.error}, wrong, TOLERANCE["float32"])


@pytest.mark.slow
@pytest.mark.parametrize("family", family_params())
def test_another_order_of_16_bit_arithmetic_stays_within_the_tolerance(family):
    """The file in float32 rounded to 16 bits, the check computing in 16 bits: the largest
    difference another backend's order of the same arithmetic would make."""
    tokens, others = _prompts()
    exact = _prefill(build(family, seed=0), tokens)
    for dtype in (mx.bfloat16, mx.float16):
        model = _cast(build(family, seed=0), dtype)
        file = _rounded(exact, dtype)
        assert tolerance_for(file) == TOLERANCE[str(dtype).rpartition(".")[2]]
        right = {str(dtype): check_cache(model, tokens, file, block_size=BLOCK).error}
        twin = _cast(build(family, seed=1), dtype)
        wrong = {"another model": check_cache(model, tokens, _prefill(twin, tokens), block_size=BLOCK).error}
        wrong["a token of the last span"] = check_cache(
            model, tokens, _prefill(model, others["a token of the last span"]), block_size=BLOCK
        ).error
        if family == "mamba2":  # the state forgets: one token 3 back moves it by ~0.1, under a 16-bit tolerance
            wrong.pop("a token of the last span")
        _margin(f"{family} {dtype}", right, wrong, tolerance_for(file))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_kv_within_its_rounding(bits):
    """KV quantized after the first pass (as mlx-lm does): spans after the first are computed
    again on the quantized prefix, the original saw it unquantized: that rounding, measured."""
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    ))  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    tokens, others = _prompts()
    file = _prefill(model, tokens, kv_bits=bits)
    tolerance = tolerance_for(file)
    assert tolerance == TOLERANCE["quantized" if bits >= 4 else "quantized below 4 bits"]
    right = {f"{bits}-bit": check_cache(model, tokens, file, block_size=BLOCK).error}
    wrong = {what: check_cache(model, tokens, _prefill(model, ids, kv_bits=bits), block_size=BLOCK).error
             for what, ids in others.items()}  # fmt: skip
    print(f"\nllama {bits}-bit KV: right {right}, wrong {wrong} (tolerance {tolerance:g})")
    assert max(right.values()) < tolerance < min(wrong.values())
    if bits >= 4:
        _margin(f"llama {bits}-bit KV", right, wrong, tolerance)


def test_a_cache_is_not_changed_by_its_check():
    model = build("llama", seed=0)
    tokens, _ = _prompts()
    cache = _prefill(model, tokens)
    before = [mx.array(layer.keys[..., :N, :]) for layer in cache]
    check_cache(model, tokens, cache, block_size=BLOCK)
    assert all(layer.offset == N for layer in cache)
    assert all(mx.array_equal(b, layer.keys[..., :N, :]).item() for b, layer in zip(before, cache))

"""The block vocabulary (`persistent_prefix_cache.blocks`): every tensor a real mlx-lm cache is
cut into is a declared field of the kind the store treats it as, dtypes map both ways, the
record survives its encoding, and the module loads without mlx or numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from persistent_prefix_cache.blocks import (
    DTYPES,
    FIELDS,
    Kind,
    Node,
    dtype_info,
    field_of,
    is_sliced,
    mx_dtype,
    sliced_spec,
)
from persistent_prefix_cache.layers.layout import cut_block
from persistent_prefix_cache.migrations.formats import dtypes as frozen_dtypes

from helpers import run_python_json

N, BS = 40, 16  # tokens held, tokens per block: blocks [0,16), [16,32), [32,40)


def _kv(n: int, dim: int = 32, seed: int = 0) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((1, 2, n, dim)).astype(np.float32)) for _ in range(2))


def _caches() -> list:
    """One filled layer of every cache class `layers/` stores; windows past their size."""
    kv = KVCache()
    kv.update_and_fetch(*_kv(N))
    quant = QuantizedKVCache(group_size=32, bits=8)
    quant.update_and_fetch(*_kv(N))
    rotating = RotatingKVCache(max_size=16, keep=4)
    k, v = _kv(N)
    for i in range(N):  # token by token, as decoding does: the window drops old tokens
        rotating.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
    chunked = ChunkedKVCache(chunk_size=16)
    chunked.update_and_fetch(*_kv(N))
    arrays = ArraysCache(size=2)
    arrays[0] = mx.ones((1, 3, 5))
    arrays[1] = mx.zeros((1, 4, 4, 2), dtype=mx.bfloat16)
    return [kv, quant, rotating, chunked, arrays]


def test_every_tensor_a_cache_is_cut_into_is_a_declared_field_of_its_kind():
    caches = _caches()
    seen = {Kind.SLICED: set(), Kind.SNAPSHOT: set()}
    for start in range(0, N, BS):
        end = min(start + BS, N)
        for lid, view in cut_block(caches, start, end, end == N).items():
            for fld, x in view.tensors.items():
                declared = field_of(fld)
                assert declared is not None, f"leaf {lid} holds undeclared field {fld!r}"
                sliced = is_sliced(f"{lid}.{fld}", x.shape, end - start)
                # A field is stored sliced exactly when it is a declared sliced field whose
                # token axis holds the block's tokens: a layer's pieces are, its snapshots not.
                assert sliced == (declared.kind is Kind.SLICED and x.shape[declared.token_axis] == end - start)
                assert sliced or view.has_snapshot, f"{lid}.{fld}: neither a piece nor a snapshot"
                seen[Kind.SLICED if sliced else Kind.SNAPSHOT].add(fld)
    assert seen[Kind.SLICED] == {"k", "v", "k0", "k1", "k2", "v0", "v1", "v2"}
    assert seen[Kind.SNAPSHOT] == {"snap_k", "snap_v", "s0", "s1"}


def test_field_rules():
    assert field_of("3.1.k") is FIELDS["k"] and field_of("s12") is FIELDS["s"]
    assert field_of("x") is None and field_of("s") is None and field_of("k7") is None
    assert is_sliced("0.k", (1, 2, 16, 8), 16)
    assert not is_sliced("0.k", (1, 2, 12, 8), 16)  # a window's keys that do not hold the block
    assert not is_sliced("0.snap_k", (1, 2, 16, 8), 16)
    assert not is_sliced("0.k", (2, 16, 8), 16)  # not the declared rank
    assert sliced_spec("0.v", "F16", (1, 8, 64, 128)) == ["F16", 1, 8, 128]  # the token axis is free


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_dtypes_map_both_ways_and_agree_with_the_frozen_table(name):
    dt = mx_dtype(name)
    assert dtype_info(dt) == dtype_info(name) == frozen_dtypes.dtype_info(name)
    assert mx.zeros((3,), dtype=dt).itemsize == dtype_info(name)[1]
    if name != "BF16":  # numpy has no bfloat16
        assert dtype_info(np.zeros(1, dtype=mx.zeros(1, dtype=dt).__array__().dtype).dtype) == dtype_info(name)


def test_a_dtype_the_formats_do_not_store_is_refused():
    with pytest.raises(ValueError, match="cannot be stored"):
        dtype_info(np.dtype("complex64"))
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_info("F8")


def test_the_record_survives_its_encoding():
    node = Node(b"k" * 16, b"p" * 16, 64, np.arange(16, dtype="<i4").tobytes(), 3, 1234, 99, 2, 7,
                {"snap": ["1"]}, b"s" * 16)  # fmt: skip
    assert Node.unpack(node.key, node.pack()) == node
    with pytest.raises(ValueError):
        Node.unpack(node.key, node.pack()[:-1])


def test_the_vocabulary_loads_without_mlx_or_numpy():
    loaded = run_python_json(
        "import json, sys; import persistent_prefix_cache.blocks as b; b.dtype_info('BF16');"
        "print(json.dumps(sorted(m for m in ('mlx.core', 'numpy') if m in sys.modules)))"
    )
    assert loaded == []

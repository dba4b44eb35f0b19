"""Unit tests of the block codec's strict parsing and of the chained block keys.

`mx.load` and `safetensors` accept trailing bytes and overlapping offsets (measured
here with mlx 0.32 and safetensors 0.8), so the codec must refuse them itself; keys must bind a block to its whole history.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from persistent_prefix_cache import InvalidArgumentError
from persistent_prefix_cache.migrations.formats.block_files_v2 import (
    BlockDecodeError,
    checksum,
    decode,
    encode,
)
from persistent_prefix_cache.keys import (
    as_token_array,
    block_key,
    chain_keys,
    common_prefix,
    root_key,
)

# -- codec --------------------------------------------------------------------------


def _encoded(tensors, metadata=None) -> bytes:
    header, buffers = encode(tensors, metadata or {"format": "test"})
    data = header + b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    assert checksum(data) == xxhash.xxh3_64_intdigest(data)
    return data


def _raw(header: dict, body: bytes) -> bytes:
    """A safetensors file laid out by hand, to state exactly what is wrong with it."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body


SAMPLE = {
    "0.k": mx.arange(24, dtype=mx.float32).reshape(1, 2, 3, 4),
    "0.v": mx.arange(6, dtype=mx.int32).reshape(2, 3),
    "1.b": mx.array([1.5, -2.25], dtype=mx.bfloat16),
    "1.q": mx.array([[7, 8]], dtype=mx.uint32),
}


def test_round_trip_keeps_names_dtypes_shapes_bytes_and_metadata():
    tensors, metadata = decode(_encoded(SAMPLE, {"key": "ab", "position": "16"}))
    assert metadata == {"key": "ab", "position": "16"}
    assert set(tensors) == set(SAMPLE)
    for name, want in SAMPLE.items():
        got = tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()


def test_encoded_file_is_valid_safetensors_for_mlx():
    # mlx's own reader agrees with our writer (the layout is standard safetensors).
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(_encoded(SAMPLE))
        f.flush()
        loaded = mx.load(f.name)
    for name, want in SAMPLE.items():
        assert mx.array_equal(loaded[name], want).item()


def test_trailing_bytes_are_refused():
    with pytest.raises(BlockDecodeError, match="body holds"):
        decode(_encoded(SAMPLE) + b"\0")


def test_missing_tail_is_refused():
    with pytest.raises(BlockDecodeError):
        decode(_encoded(SAMPLE)[:-1])


def test_overlapping_tensors_are_refused():
    body = np.arange(4, dtype="<f4").tobytes()
    header = {
        "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]},
    }
    with pytest.raises(BlockDecodeError, match="overlap"):
        decode(_raw(header, body))


def test_gap_between_tensors_is_refused():
    body = np.arange(4, dtype="<f4").tobytes()
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }
    with pytest.raises(BlockDecodeError, match="gap"):
        decode(_raw(header, body))


def test_hand_made_valid_file_is_accepted():
    # The control for the malformed cases above: the same layout, done right.
    body = np.arange(4, dtype="<f4").tobytes()
    header = {
        "__metadata__": {"k": "v"},
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]},
    }
    tensors, metadata = decode(_raw(header, body))
    assert metadata == {"k": "v"}
    assert tensors["b"].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "header_bytes",
    [b"{not json", b"\xff\xfe{}", b"[1, 2]", b'"text"'],
    ids=["broken", "not_utf8", "list", "string"],
)
def test_header_that_is_not_a_json_object_is_refused(header_bytes):
    with pytest.raises(BlockDecodeError):
        decode(len(header_bytes).to_bytes(8, "little") + header_bytes)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]},
        {"dtype": "complex", "shape": [1], "data_offsets": [0, 4]},
        {"shape": [1], "data_offsets": [0, 4]},
        {"dtype": "F32", "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1]},
        {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 4]},
        "not a dict",
    ],
    ids=[
        "fp8",
        "unknown",
        "no_dtype",
        "no_shape",
        "no_offsets",
        "bad_shape",
        "not_dict",
    ],
)
def test_bad_tensor_entries_are_refused(entry):
    with pytest.raises(BlockDecodeError):
        decode(_raw({"t": entry}, b"\0" * 4))


@pytest.mark.parametrize(
    "shape, offsets",
    [([2], [0, 4]), ([1, 2], [0, 4]), ([-1], [0, 4]), ([0], [0, 4])],
)
def test_shape_that_does_not_match_its_bytes_is_refused(shape, offsets):
    entry = {"dtype": "F32", "shape": shape, "data_offsets": offsets}
    with pytest.raises(BlockDecodeError, match="shape"):
        decode(_raw({"t": entry}, b"\0" * 4))


@pytest.mark.parametrize("length", [2**63, 2**40, 16 * 1024 * 1024 + 1, 100])
def test_absurd_header_length_is_refused(length):
    # Bigger than the file, or bigger than any header we write: never allocated.
    data = length.to_bytes(8, "little") + b"{}" + b"\0" * 20
    with pytest.raises(BlockDecodeError, match="header length"):
        decode(data)


@pytest.mark.parametrize("data", [b"", b"\0" * 7])
def test_file_shorter_than_the_length_field_is_refused(data):
    with pytest.raises(BlockDecodeError):
        decode(data)


def test_checksum_sees_a_flipped_tensor_byte_the_parser_cannot():
    data = bytearray(_encoded(SAMPLE))
    good = checksum(data)
    data[-1] ^= 0x10
    decode(bytes(data))  # structurally still valid: only the checksum can tell
    assert checksum(data) != good


# -- keys ----------------------------------------------------------------------------

ROOT = root_key("fingerprint", "", "KVCache|KVCache")


def _b(tokens) -> bytes:
    return np.array(tokens, dtype="<i4").tobytes()


def test_chain_keys_are_deterministic_and_cover_a_partial_tail():
    tokens = as_token_array(list(range(10)))
    keys = chain_keys(ROOT, tokens, 4)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert all(len(k) == 16 for k in keys)
    assert keys == chain_keys(ROOT, as_token_array(list(range(10))), 4)
    assert keys[0] == block_key(ROOT, _b([0, 1, 2, 3]))
    assert keys[2] == block_key(keys[1], _b([8, 9]))  # the partial last block


def test_same_block_at_another_position_has_another_key():
    block = [5, 6, 7, 8]
    at_start = chain_keys(ROOT, as_token_array(block + [1, 2, 3, 4]), 4)[0]
    second = chain_keys(ROOT, as_token_array([1, 2, 3, 4] + block), 4)[1]
    assert at_start != second


def test_same_block_after_another_history_has_another_key():
    block = [5, 6, 7, 8]
    a = chain_keys(ROOT, as_token_array([1, 2, 3, 4] + block), 4)
    b = chain_keys(ROOT, as_token_array([1, 2, 3, 9] + block), 4)
    assert a[1] != b[1]
    # ... while an equal history gives equal keys all the way.
    c = chain_keys(ROOT, as_token_array([1, 2, 3, 4] + block + [0]), 4)
    assert a == c[:2]


def test_block_size_changes_the_keys():
    tokens = as_token_array(list(range(8)))
    assert chain_keys(ROOT, tokens, 4)[-1] != chain_keys(ROOT, tokens, 8)[-1]


@pytest.mark.parametrize(
    "other",
    [
        ("fingerprint2", "", "KVCache|KVCache"),
        ("fingerprint", "tenant", "KVCache|KVCache"),
        ("fingerprint", "", "QuantizedKVCache(group_size=64,bits=4)|KVCache"),
        # Framed parts: moving bytes between fields must not collide.
        ("fingerprin", "t", "KVCache|KVCache"),
        ("fingerprint", "KVCache|KVCache", ""),
    ],
)
def test_root_key_binds_fingerprint_namespace_and_layout(other):
    assert root_key(*other) != ROOT
    assert root_key("fingerprint", "", "KVCache|KVCache") == ROOT


def test_token_bytes_are_int32_little_endian():
    # A token is hashed as 4 bytes: 256 and [0, 1] must not encode alike.
    assert as_token_array([256]).tobytes() == b"\x00\x01\x00\x00"
    assert block_key(ROOT, _b([256])) != block_key(ROOT, _b([0, 1]))


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        np.array([1, 2, 3], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.uint16),
        mx.array([1, 2, 3]),
        mx.array([1, 2, 3], dtype=mx.uint32),
    ],
    ids=["list", "tuple", "range", "np_int64", "np_uint16", "mx_int32", "mx_uint32"],
)
def test_as_token_array_accepts_1d_integer_sequences(tokens):
    arr = as_token_array(tokens)
    assert arr.dtype == np.dtype("<i4") and arr.ndim == 1
    assert arr.tolist() == [1, 2, 3]


def test_as_token_array_copies():
    src = np.array([1, 2, 3], dtype="<i4")
    arr = as_token_array(src)
    src[0] = 9
    assert arr.tolist() == [1, 2, 3]


def test_as_token_array_empty_is_empty_int32():
    for empty in ([], (), np.zeros(0, dtype=np.int64)):
        arr = as_token_array(empty)
        assert arr.dtype == np.dtype("<i4") and arr.shape == (0,)


@pytest.mark.parametrize(
    "tokens",
    [
        [1.0, 2.0],
        [1, 2.5],
        ["1", "2"],
        [True, False],
        np.array([True]),
        [-(2**31) - 1],
        [2**31],
        [-1 - 2**59],
        [2**70],
        [[1, 2], [3, 4]],
        [[1], [2, 3]],
        np.zeros((2, 2), dtype=np.int32),
        mx.zeros((1, 3), dtype=mx.int32),
        mx.array([1.0, 2.0]),
        5,
        None,
        [None],
    ],
    ids=[
        "floats",
        "mixed",
        "strings",
        "bools",
        "np_bool",
        "too_small",
        "too_big",
        "vlm_image_id",
        "wider_than_int64",
        "2d",
        "ragged",
        "np_2d",
        "mx_2d",
        "mx_float",
        "scalar",
        "none",
        "list_of_none",
    ],
)
def test_as_token_array_refuses_non_token_input(tokens):
    with pytest.raises(InvalidArgumentError):
        as_token_array(tokens)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix(np.array([5]), np.array([6])) == 0
    assert common_prefix([], [1]) == 0

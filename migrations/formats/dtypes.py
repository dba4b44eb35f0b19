"""safetensors dtype names as the v1-v2 block files and the v3 segments stored them (frozen)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

# safetensors dtype name <-> mlx dtype, and the numpy dtype whose bytes match.
DTYPES = {
    "F32": (mx.float32, np.dtype("<f4")),
    "F16": (mx.float16, np.dtype("<f2")),
    "BF16": (mx.bfloat16, np.dtype("<u2")),  # numpy has no bfloat16: view the bits
    "F64": (mx.float64, np.dtype("<f8")),
    "U32": (mx.uint32, np.dtype("<u4")),
    "I32": (mx.int32, np.dtype("<i4")),
    "U8": (mx.uint8, np.dtype("u1")),
    "I8": (mx.int8, np.dtype("i1")),
    "U16": (mx.uint16, np.dtype("<u2")),
    "I16": (mx.int16, np.dtype("<i2")),
    "I64": (mx.int64, np.dtype("<i8")),
    "U64": (mx.uint64, np.dtype("<u8")),
    "BOOL": (mx.bool_, np.dtype("?")),
}
_NAME_OF = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}
_BY_NUMPY = {np.dtype(v[1]).str: k for k, v in DTYPES.items() if k != "BF16"}
MAX_HEADER = 16 * 1024 * 1024


def dtype_info(dtype: Any) -> tuple[str, int]:
    """(safetensors name, item size) of an mlx or numpy dtype, or of such a name.

    Raises:
        ValueError: For a dtype the formats do not store.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return dtype, DTYPES[dtype][1].itemsize
    name = _NAME_OF.get(dtype)
    if name is None:
        try:
            name = _BY_NUMPY[np.dtype(dtype).str]
        except (TypeError, KeyError):
            raise ValueError(f"dtype {dtype} cannot be stored") from None
    return name, DTYPES[name][1].itemsize

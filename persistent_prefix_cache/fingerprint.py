"""The model fingerprint: a digest of everything that changes a model's KV.

It covers the model class, its config and the *content* of every parameter (a
fine-tune has the same names and shapes as its base), which also covers dtype and
weight quantization. The cache layout (and so KV quantization) and the namespace
are added by the root key (`keys.root_key`).

Hashing weights costs a pass over them (one xxh3 stream, ~10 GB/s on one core; on a
CUDA GPU it hashes copies made on the device, touched by threads ahead of the hash, so
the weights' own pages stay on the device).
When the caller names the folder the model was loaded from, the result is remembered
in the store under the folder's files' (path, size, mtime, inode), so a second open of
unchanged files hashes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten


def _config_of(model: Any) -> Any:
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    if isinstance(args, dict):
        return args
    return getattr(model, "config", None)


def fingerprint_model(model: Any, *, prefetch: bool | None = None) -> str:
    """Digest a loaded mlx-lm model: class, config and the bytes of every parameter.

    Args:
        model: An mlx ``nn.Module``.
        prefetch: Hash copies made on the default device, their pages touched by a
            few threads ahead of the hash (the value is the same). None: only where
            the default device is a GPU. There arrays live in managed memory: the
            host reading a weight moves its pages to the host, one thread at a time
            slowly, and the next prefill moves them back (on an H200, 8B model: the
            hash 8.8 s and the next prefill 1.8 s instead of 0.22 s; with copies,
            4.4-5.0 s and no slower prefill).

    Returns:
        A hex string (xxh3-128).
    """
    h = xxhash.xxh3_128()
    cls = type(model)
    h.update(f"{cls.__module__}.{cls.__qualname__}\0".encode())
    h.update(json.dumps(_config_of(model), sort_keys=True, default=str).encode() + b"\0")
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    mx.eval([p for _, p in params])
    if prefetch is None:
        prefetch = mx.default_device() == mx.gpu
    for name, value, view in _ahead(params) if prefetch else _in_place(params):
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)}\0".encode())
        h.update(view)
    return h.hexdigest()


_PAGE = 4096
_PREFETCHERS = 8
_AHEAD_BYTES = 1 << 30  # device memory the copies in flight may take


def _bytes_of(value: mx.array) -> memoryview:
    # The evaluated buffer itself (no MLX op): this also works in a process forked
    # after MLX ran, where MLX can no longer evaluate anything.
    view = memoryview(value)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _in_place(params):
    for name, value in params:
        yield name, value, _bytes_of(value)


def _copy(value: mx.array) -> mx.array:
    # A bitwise copy made by the device (adding zero to the bytes as unsigned ints).
    copy = value.view(mx.uint8) + 0 if value.dtype != mx.bool_ else mx.array(value)
    mx.eval(copy)
    return copy


def _touch(copy: mx.array) -> memoryview:
    view = _bytes_of(copy)
    if len(view):  # one byte per page moves the page; numpy's strided sum drops the GIL
        np.frombuffer(view, dtype=np.uint8)[::_PAGE].sum()
    return view


def _ahead(params):
    """The parameters' bytes as device copies, touched on a few threads ahead of the
    hash; at most `_AHEAD_BYTES` of copies (and at least one) in flight."""
    pool = ThreadPoolExecutor(min(_PREFETCHERS, os.cpu_count() or 1), thread_name_prefix="ppc-prefetch")
    pending: deque[tuple[Future, int]] = deque()
    in_flight, nxt = 0, 0
    try:
        for name, value in params:
            while nxt < len(params) and (not pending or in_flight + params[nxt][1].nbytes <= _AHEAD_BYTES):
                copy = _copy(params[nxt][1])
                pending.append((pool.submit(_touch, copy), copy.nbytes))
                in_flight += copy.nbytes
                nxt += 1
            future, size = pending.popleft()
            yield name, value, future.result()
            in_flight -= size
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def weight_files_signature(model_path: str) -> bytes:
    """A digest of the (path, size, mtime, inode) of a model folder's files.

    Args:
        model_path: The folder ``mlx_lm.load`` read the model from.

    Returns:
        16 bytes; it changes whenever a weight or config file is replaced or edited.
    """
    h = xxhash.xxh3_128()
    root = os.path.realpath(model_path)
    for name in sorted(os.listdir(root)):
        if not (name.endswith(".safetensors") or name.endswith(".json")):
            continue
        st = os.stat(os.path.join(root, name))
        h.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}\0".encode())
    return h.digest()


def cached_fingerprint(
    model: Any,
    model_path: str | None,
    lookup: Callable[[bytes], str | None],
    remember: Callable[[bytes, str], None],
) -> str:
    """`fingerprint_model`, remembered by the files of `model_path` when given.

    Args:
        model: The loaded model.
        model_path: The folder it was loaded from, or None (always hash).
        lookup: Returns the fingerprint remembered for a files signature, or None.
        remember: Stores a fingerprint for a files signature.
    """
    if model_path is None:
        return fingerprint_model(model)
    signature = weight_files_signature(model_path)
    known = lookup(signature)
    if known:
        return known
    fp = fingerprint_model(model)
    remember(signature, fp)
    return fp

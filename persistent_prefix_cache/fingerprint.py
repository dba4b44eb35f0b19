"""The model fingerprint: a digest of everything that changes a model's KV.

It covers the model class, its config and the *content* of every parameter (a
fine-tune has the same names and shapes as its base), which also covers dtype and
weight quantization. The cache layout (and so KV quantization) and the namespace
are added by the root key (`keys.root_key`).

Hashing weights costs a pass over them (one xxh3 stream, ~10 GB/s on one core; on a
CUDA GPU the pages must first move to the host, which threads do ahead of the hash).
When the caller names the folder the model was loaded from, the result is remembered
in the store under the folder's files' (path, size, mtime, inode), so a second open of
unchanged files hashes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
        prefetch: Touch the weights' pages on a few threads ahead of the hash (the
            value is the same either way). None: only where the default device is a
            GPU, whose arrays live in managed memory: there the hash's cost is pages
            moving to the host, which one thread does slowly and several do at once.

    Returns:
        A hex string (xxh3-128).
    """
    h = xxhash.xxh3_128()
    cls = type(model)
    h.update(f"{cls.__module__}.{cls.__qualname__}\0".encode())
    h.update(json.dumps(_config_of(model), sort_keys=True, default=str).encode() + b"\0")
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    mx.eval([p for _, p in params])
    # Read the evaluated buffers directly (no MLX op): this also works in a process
    # forked after MLX ran, where MLX itself can no longer evaluate anything.
    views = [_bytes_of(value) for _, value in params]
    if prefetch is None:
        prefetch = mx.default_device() == mx.gpu
    touched = _prefetch(views) if prefetch else None
    try:
        for k, (name, value) in enumerate(params):
            if touched is not None:
                touched[k].result()
            h.update(f"{name}:{value.dtype}:{tuple(value.shape)}\0".encode())
            h.update(views[k])
    finally:
        if touched is not None:
            for f in touched:
                f.cancel()
    return h.hexdigest()


_PAGE = 4096
_PREFETCHERS = 8


def _bytes_of(value: mx.array) -> memoryview:
    view = memoryview(value)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _touch(view: memoryview) -> None:
    # One byte per page moves the page; numpy's strided sum runs without the GIL.
    if len(view):
        np.frombuffer(view, dtype=np.uint8)[::_PAGE].sum()


def _prefetch(views: list[memoryview]) -> list[Future]:
    """Start touching every buffer's pages, in hashing order, on a few threads."""
    pool = ThreadPoolExecutor(min(_PREFETCHERS, os.cpu_count() or 1), thread_name_prefix="ppc-prefetch")
    try:
        return [pool.submit(_touch, v) for v in views]
    finally:
        pool.shutdown(wait=False)  # the threads end once the queue is done


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

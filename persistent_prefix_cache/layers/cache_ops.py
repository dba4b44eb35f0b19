"""Operations on whole mlx-lm cache lists that the compat layers and the CLI need."""

from __future__ import annotations

import copy
import re
from typing import Any, Sequence

from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from ..errors import PrefixCacheError, UnsupportedCacheError
from .adapters import BlockSource, adapter_for, leaves, rebuild_cache
from .layout import cut_block
from .mlx_lm_versions import arrays_state, layer_from_state, make_layer, new_arrays_cache


def all_sliced(cache: Sequence[Any]) -> bool:
    """Whether every leaf is sliced along the sequence (``KVCache``, ``QuantizedKVCache``):
    such a cache resumes at any block boundary, whatever the prefill chunking."""
    return all(type(layer) in (KVCache, QuantizedKVCache) for _, layer in leaves(cache))


def frozen(cache: Sequence[Any]) -> list:
    """The cache as it stands now, as new layers of views of its arrays up to its offset
    (no copy): a forward queued after this writes its keys into `cache`'s arrays in place
    (mlx-lm's step), never into these. Every leaf sliced (`all_sliced`)."""
    layers = {}
    for lid, layer in leaves(cache):
        n = layer.offset
        if type(layer) is QuantizedKVCache:
            parts: tuple[Any, Any] = (layer.keys, layer.values)  # (packed, scales, biases) each
            keys, values = (tuple(x[..., :n, :] for x in part) for part in parts)
            layers[lid] = make_layer(
                QuantizedKVCache, (keys, values), offset=n, group_size=layer.group_size, bits=layer.bits
            )
        else:
            layers[lid] = make_layer(KVCache, (layer.keys[..., :n, :], layer.values[..., :n, :]), offset=n)
    return rebuild_cache(cache, layers)


def kv_quantization(signature: str) -> tuple[int, int] | None:
    """``(bits, group_size)`` of the quantized KV in a layout signature, or None."""
    m = re.search(r"QuantizedKVCache\(group_size=(\d+),bits=(\d+)\)", signature)
    return (int(m.group(2)), int(m.group(1))) if m else None


def can_trim(cache: Any) -> bool:
    """Whether every layer of a cache list can be trimmed (mlx-lm's ``is_trimmable``).

    Every layer must agree: trimming the attention layers of a hybrid model while its
    recurrent layers keep the longer state gives a cache that matches no prompt.
    """
    return (
        isinstance(cache, (list, tuple))
        and len(cache) > 0
        and all(callable(getattr(c, "is_trimmable", None)) and c.is_trimmable() for c in cache)
    )


def trim(cache: Sequence[Any], n: int) -> None:
    """Trim the last `n` positions of every layer, in place (see `can_trim`)."""
    for layer in cache:
        layer.trim(n)


def offset_trimmable(layer: Any) -> bool:
    """Whether ``layer.trim`` only moves an offset (so a shallow copy trims safely)."""
    return type(layer) in (KVCache, QuantizedKVCache)


def copy_prefix(cache: Sequence[Any], keep: int, total: int) -> list:
    """New layers holding the first `keep` of the `total` positions of `cache`.

    Only those positions are copied, and `cache` itself is never modified. Objects
    the adapters do not know are deep-copied whole, then trimmed.
    """
    try:
        views = cut_block(cache, 0, keep, keep == total)
        rebuilt = {}
        for lid, layer in leaves(cache):
            adapter = adapter_for(layer, lid)
            if not adapter.can_rebuild(layer, [views[lid]], keep):
                raise UnsupportedCacheError(f"layer {lid} cannot be rebuilt at {keep}")
            rebuilt[lid] = adapter.rebuild(layer, BlockSource([views[lid]]), keep)
        return rebuild_cache(cache, rebuilt)
    except PrefixCacheError:
        out = copy.deepcopy(list(cache))
        for layer in out if keep < total else ():
            layer.trim(total - keep)
        return out


def empty_like(layer: Any) -> Any:
    """An empty layer with the parameters the adapters rebuild `layer` with."""
    kind = type(layer)
    if kind is CacheList:
        return CacheList(*(empty_like(c) for c in layer.caches))
    if kind is QuantizedKVCache:
        return QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
    if kind is RotatingKVCache:
        return RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
    if kind is ChunkedKVCache:
        return ChunkedKVCache(layer.chunk_size)
    if kind is ArraysCache:
        return ArraysCache(len(layer.cache))
    return kind()


def layer_from_seed(entry: dict) -> Any:
    """An mlx-lm layer from vllm-mlx's per-layer dict (``state``, ``class_name``, ...),
    or None if it does not describe one."""
    state: Any = entry.get("state")  # vllm-mlx's record, anything: probed under the try below
    ref = entry.get("class_ref")
    name = entry.get("class_name") or getattr(ref, "__name__", "")
    try:
        if ref is KVCache or (ref is None and name == "KVCache"):
            keys, values = state[0], state[1]
            if keys.ndim == 3 and values.ndim == 3:
                # [heads, seq, dim] (vllm-mlx's "Qwen3.5-style" states): held with a
                # batch axis of 1, dropped again by `without_batch_axis`.
                keys, values = keys[None], values[None]
            if keys.ndim != 4 or values.ndim != 4:
                return None  # only [batch, heads, seq, dim] is what mlx-lm's KVCache holds
            # mlx-lm 0.32's state is (keys, values, offset); 0.31's (keys, values) cut to it.
            offset = int(state[2]) if len(state) > 2 else keys.shape[2]
            return make_layer(KVCache, (keys, values), offset=offset)
        if ref is ArraysCache or (ref is None and name == "ArraysCache"):
            arrays = arrays_state(state)
            return None if arrays is None else new_arrays_cache(arrays)
        return layer_from_state(ref, state, entry.get("meta_state")) if ref is not None else None
    except (TypeError, ValueError, IndexError, AttributeError):
        return None


def seed_without_batch_axis(entry: Any) -> bool:
    """Whether a vllm-mlx per-layer dict holds ``KVCache`` state without a batch axis
    (``[heads, seq, dim]``); `layer_from_seed` adds one, `without_batch_axis` drops it."""
    if not isinstance(entry, dict):
        return False
    ref, name = entry.get("class_ref"), entry.get("class_name")
    state: Any = entry.get("state")  # vllm-mlx's record, anything: probed under the try below
    if not (ref is KVCache or (ref is None and name == "KVCache")):
        return False
    try:
        return state[0].ndim == 3 and state[1].ndim == 3
    except (TypeError, IndexError, AttributeError):
        return False


def without_batch_axis(layer: Any) -> Any:
    """A ``KVCache`` rebuilt from a `seed_without_batch_axis` layer, its tensors back in
    their ``[heads, seq, dim]`` shape (the shape the caller stored)."""
    return make_layer(KVCache, (layer.keys[0], layer.values[0]), offset=layer.offset)

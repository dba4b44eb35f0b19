"""Per-cache-class adapters: one mlx-lm cache layer <-> the tensors of one block.

An adapter knows, for one cache class, how to describe a layer's layout (the part of
the root key that keeps incompatible layouts apart), how many token positions a layer
covers, how to cut the tensors of token range ``[start, end)`` out of it, and how to
rebuild a fresh layer from the tensors of consecutive blocks.

mlx-lm's own protocol (``state`` / ``from_state``) is the contract: a rebuilt layer is
made with ``from_state`` and must continue exactly like the layer it was stored from.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .errors import InvalidArgumentError, UnsupportedCacheError

Tensors = dict[str, mx.array]


def _seq_slice(x: mx.array, start: int, end: int) -> mx.array:
    # KV tensors are [batch, heads, seq, dim]; copy so the block owns its memory and
    # does not pin the (step-padded) buffer of the caller's cache.
    return mx.contiguous(x[..., start:end, :])


def _join(parts: Sequence[mx.array], length: int) -> mx.array:
    x = parts[0] if len(parts) == 1 else mx.concatenate(list(parts), axis=2)
    return x if x.shape[2] == length else x[..., :length, :]


class KVAdapter:
    """`KVCache`: keys and values sliced along the sequence axis."""

    cache_class = KVCache
    names = ("k", "v")

    def signature(self, layer: KVCache) -> str:
        return "KVCache"

    def length(self, layer: KVCache) -> int:
        return int(layer.offset)

    def slice(self, layer: KVCache, start: int, end: int) -> Tensors:
        return {"k": _seq_slice(layer.keys, start, end), "v": _seq_slice(layer.values, start, end)}

    def assemble(self, signature: str, parts: Sequence[Tensors], length: int) -> KVCache:
        keys = _join([p["k"] for p in parts], length)
        values = _join([p["v"] for p in parts], length)
        return KVCache.from_state((keys, values, length))

    def empty(self, signature: str) -> KVCache:
        return KVCache()


class QuantizedKVAdapter:
    """`QuantizedKVCache`: each of (packed, scales, biases) sliced along the sequence axis.

    mlx-lm quantizes each token's vector on its own (groups run along the head
    dimension), so a sequence slice of the quantized tensors is exact.
    """

    cache_class = QuantizedKVCache
    names = ("k0", "k1", "k2", "v0", "v1", "v2")

    def signature(self, layer: QuantizedKVCache) -> str:
        return f"QuantizedKVCache(group_size={layer.group_size},bits={layer.bits})"

    def length(self, layer: QuantizedKVCache) -> int:
        return int(layer.offset)

    def slice(self, layer: QuantizedKVCache, start: int, end: int) -> Tensors:
        out = {}
        for prefix, triple in (("k", layer.keys), ("v", layer.values)):
            for i, x in enumerate(triple):
                out[f"{prefix}{i}"] = _seq_slice(x, start, end)
        return out

    def assemble(
        self, signature: str, parts: Sequence[Tensors], length: int
    ) -> QuantizedKVCache:
        group_size, bits = _quant_params(signature)
        keys = tuple(_join([p[f"k{i}"] for p in parts], length) for i in range(3))
        values = tuple(_join([p[f"v{i}"] for p in parts], length) for i in range(3))
        return QuantizedKVCache.from_state((keys, values, length, group_size, bits))

    def empty(self, signature: str) -> QuantizedKVCache:
        group_size, bits = _quant_params(signature)
        return QuantizedKVCache(group_size=group_size, bits=bits)


def _quant_params(signature: str) -> tuple[int, int]:
    inner = signature[signature.index("(") + 1 : -1]
    fields = dict(item.split("=") for item in inner.split(","))
    return int(fields["group_size"]), int(fields["bits"])


_ADAPTERS = {a.cache_class: a for a in (KVAdapter(), QuantizedKVAdapter())}
_BY_PREFIX = {"KVCache": KVAdapter(), "QuantizedKVCache": QuantizedKVAdapter()}


def adapter_for(layer: Any, index: int = 0):
    """The adapter for one cache layer.

    Raises:
        UnsupportedCacheError: If this version cannot store the layer's class.
    """
    adapter = _ADAPTERS.get(type(layer))
    if adapter is None:
        raise UnsupportedCacheError(
            f"layer {index}: cache class {type(layer).__name__} is not supported yet "
            f"(supported: {', '.join(sorted(c.__name__ for c in _ADAPTERS))})"
        )
    return adapter


def adapter_for_signature(signature: str):
    """The adapter that rebuilds layers of the given signature."""
    return _BY_PREFIX[signature.split("(", 1)[0]]


def layer_signatures(cache: Sequence[Any]) -> list[str]:
    """Per-layer signatures of a cache list.

    Raises:
        UnsupportedCacheError: If a layer's class is not supported.
    """
    return [adapter_for(layer, i).signature(layer) for i, layer in enumerate(cache)]


def layout_signature(signatures: Sequence[str]) -> str:
    """One string naming a whole cache layout (part of every root key)."""
    return "|".join(signatures)


def template_signatures(
    model: Any, *, kv_bits: int | None = None, kv_group_size: int = 64
) -> list[str]:
    """The layout a store expects for `model`: what `make_prompt_cache` builds,
    with `KVCache` layers quantized when `kv_bits` is set (as mlx-lm's ``kv_bits``).
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [
            QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
            for c in cache
        ]
    return layer_signatures(cache)


def cache_length(cache: Sequence[Any]) -> int:
    """Token positions covered by a cache list, checking every layer agrees.

    Raises:
        InvalidArgumentError: If the layers cover different lengths.
    """
    lengths = {adapter_for(c, i).length(c) for i, c in enumerate(cache)}
    if len(lengths) != 1:
        raise InvalidArgumentError(f"cache layers cover different lengths: {sorted(lengths)}")
    return lengths.pop()

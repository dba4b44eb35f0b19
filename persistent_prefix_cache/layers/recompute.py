"""Checking a cache against the model that should have made it: some of its blocks are
computed again from the cache's own prefix and compared (``ppc import-mlx``, ``ppc import --model``).

A cache that claims to be model M's KV of tokens T is checked span by span: the cache is
cut back to the span's start (its own rows, nothing recomputed), the model runs the
span's tokens of T on it, and what the model wrote for those positions is compared with
what the cache holds there. Another prompt's tokens in a checked span, another model's
weights or a transplanted tensor change those rows completely (relative error near 1);
the same arithmetic in another order, dtype or backend changes them in the last bits
(`TOLERANCE` lies between the two, measured in docs/mlx-lm-files.md).

Which spans: the prompt's last `block_size` tokens (from further back, in steps of a
block, where a layer of the cache cannot be cut back there), the first block (from an
empty cache), and evenly spaced blocks between, `spans` in all. Layers that cannot be cut back to an earlier position (recurrent
state, a sliding window that has dropped its oldest tokens, a chunk that moved on) leave
only position 0: then the last span is the whole prompt, a full recompute, whose final
state (recurrent state and windows included) is compared whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, cast

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache

from .adapters import STATE, BlockSource, BlockView, adapter_for, leaves, rebuild_cache
from .cache_ops import empty_like
from .mlx_lm_versions import CHUNKED_PIECEWISE_PREFILL

# The largest relative difference accepted, by the precision of the KV checked. On the
# test zoo (tests/test_recompute.py; docs/mlx-lm-files.md) the right prompt and model
# computed in another order stayed at <= 1.5e-6 in float32, <= 0.28 in 16 bits, <= 0.17
# with 4-bit KV (0.79 with 2-bit); another prompt's span or another model at >= 1.2.
TOLERANCE = {"float32": 0.05, "float16": 0.5, "bfloat16": 0.5, "quantized": 0.5, "quantized below 4 bits": 1.0}
DEFAULT_SPANS = 4
STEP = 512  # tokens per forward pass of a long recompute (mlx-lm's prefill runs in steps too)


@dataclass
class CacheCheck:
    """What `check_cache` compared and found.

    Attributes:
        spans: The token ranges ``(start, end)`` computed again, in order.
        full: Whether the last span is the whole prompt because no later position can
            be cut back to (recurrent state, a window that dropped tokens).
        error: The largest relative difference found (0 for an exact match; see `TOLERANCE`).
        where: Where it was found (``"layer 3, positions 64..128"``).
        tolerance: The bound `passed` compares `error` with.
        uncompared: Leaves the last span could not compare (none for a cache of a
            layout this module knows).
    """

    spans: list[tuple[int, int]] = field(default_factory=list)
    full: bool = False
    error: float = 0.0
    where: str = ""
    tolerance: float = 0.0
    uncompared: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether every compared value agrees within the tolerance."""
        return bool(self.spans) and not self.uncompared and self.error <= self.tolerance

    def describe(self) -> str:
        """The check in a few words, for a command's output."""
        n = sum(e - s for s, e in self.spans)
        how = "a full recompute" if self.full else f"{len(self.spans)} span(s), {n:,} tokens recomputed"
        return f"{how}, largest relative difference {self.error:.2g} (tolerance {self.tolerance:g})"


def tolerance_for(cache: Sequence[Any]) -> float:
    """The `TOLERANCE` of the least precise leaf of `cache`."""
    kinds = set()
    for _, layer in leaves(cache):
        if isinstance(layer, QuantizedKVCache):
            kinds.add("quantized" if layer.bits >= 4 else "quantized below 4 bits")
        else:
            arrays = [x for x in layer.cache if x is not None] if isinstance(layer, ArraysCache) else [layer.keys]
            kinds.update(str(x.dtype).rpartition(".")[2] for x in arrays if x is not None)
    return max((TOLERANCE.get(k, TOLERANCE["float16"]) for k in kinds), default=TOLERANCE["float32"])


def _held(layer: Any) -> tuple[dict[str, mx.array], int]:
    """A sequence leaf's tensors in temporal order (quantized KV dequantized) and the
    position of their first row."""
    buf, first = adapter_for(layer).held(layer)
    if isinstance(layer, QuantizedKVCache):
        out = {}
        for kind in ("k", "v"):  # k0 k1 k2, v0 v1 v2: (packed, scales, biases) of keys, then values
            w, s, b = (buf[f"{kind}{i}"] for i in range(3))
            out[kind] = mx.dequantize(w, s, b, group_size=layer.group_size, bits=layer.bits)
        return out, first
    return buf, first


def _at(cache: Sequence[Any], position: int) -> list | None:
    """New layers holding `cache` as it was at `position`, from its own rows; None if a
    leaf cannot be cut back there (see the module's docstring). At 0, quantized layers
    start unquantized: mlx-lm quantizes KV after a prefill step, not within it."""
    if position == 0:
        return [KVCache() if type(layer) is QuantizedKVCache else empty_like(layer) for layer in cache]
    rebuilt = {}
    for lid, layer in leaves(cache):
        adapter = adapter_for(layer, lid)
        if adapter.kind == STATE or (isinstance(layer, ChunkedKVCache) and not CHUNKED_PIECEWISE_PREFILL):
            return None
        ranges = [(lo, hi) for lo, hi in adapter.needed(layer, position) if lo < hi]
        buf, first = adapter.held(layer)
        lo = min((r[0] for r in ranges), default=position)
        if lo < first or position > layer.offset:
            return None
        view = BlockView(
            lo, position, {f: mx.contiguous(x[..., lo - first : position - first, :]) for f, x in buf.items()}
        )
        rebuilt[lid] = adapter.rebuild(layer, BlockSource([view]), position)
    return rebuild_cache(cache, rebuilt)


def _quantized_like(layer: Any, like: Any) -> Any:
    if type(like) is QuantizedKVCache and type(layer) is KVCache:
        return layer.to_quantized(group_size=like.group_size, bits=like.bits)
    return layer


def _rows(x: mx.array) -> mx.array:
    """`x` in float32 as rows of its last axis."""
    x = x.astype(mx.float32)
    return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)


def _difference(got: mx.array, want: mx.array) -> float:
    """The largest distance between corresponding rows over the mean length of `want`'s
    rows: ~1.4 for unrelated vectors of one scale, ~1e-3 for bfloat16 rounding."""
    if got.shape != want.shape:
        return float("inf")
    a, b = _rows(got), _rows(want)
    if a.size == 0:
        return 0.0
    gap = mx.sqrt(mx.sum((a - b) ** 2, axis=-1))
    norm = mx.mean(mx.sqrt(mx.sum(b**2, axis=-1)))
    # float32 scalars: mlx's stubs type `item()` as any Python number.
    worst, scale = cast(float, mx.max(gap).item()), cast(float, norm.item())
    if worst != worst or scale != scale:  # NaN in either: nothing agrees
        return float("inf")
    if worst == 0.0:
        return 0.0
    return worst / scale if scale > 0 else float("inf")


def _compare(mine: Sequence[Any], theirs: Sequence[Any], start: int, end: int, last: bool) -> tuple[float, str, list]:
    """(largest difference, where, leaves not compared) between the recomputed cache and
    the given one over positions [start, end); recurrent state only when `last`."""
    worst, where = 0.0, ""
    missed: list[str] = []
    for (lid, a), (_, b) in zip(leaves(mine), leaves(theirs)):
        if isinstance(b, ArraysCache):
            state: Sequence[mx.array | None] = b.cache  # (mlx-lm's __init__ fills it with None: read as list[None])
            pairs = list(zip(a.cache, state)) if last else []
            if any((x is None) != (y is None) for x, y in pairs):
                return float("inf"), f"layer {lid}, its state", missed
            diffs = [_difference(x, y) for x, y in pairs if y is not None]
            label = f"layer {lid}, its state after position {end}"
        else:
            (ma, fa), (mb, fb) = _held(a), _held(b)
            lo, hi = max(start, fa, fb), min(end, a.offset, b.offset)
            diffs = (
                [_difference(ma[f][..., lo - fa : hi - fa, :], mb[f][..., lo - fb : hi - fb, :]) for f in mb]
                if lo < hi
                else []
            )
            label = f"layer {lid}, positions {lo}..{hi}"
        if not diffs:
            missed.append(lid)
            continue
        d = max(diffs)
        if d > worst or not where:
            worst, where = d, label
    return worst, where, missed


def _starts(last: int, block_size: int, count: int) -> list[int]:
    """`count` block boundaries before `last`, evenly spaced from the first."""
    boundaries = list(range(0, last, block_size))
    if count >= len(boundaries):
        return boundaries
    return [boundaries[i] for i in sorted({i * len(boundaries) // count for i in range(count)})]


def check_cache(
    model: Any,
    tokens: Sequence[int],
    cache: Sequence[Any],
    *,
    block_size: int,
    spans: int = DEFAULT_SPANS,
    tolerance: float | None = None,
) -> CacheCheck:
    """Check that `cache` is `model`'s KV of `tokens` by computing some of it again.

    Args:
        model: The mlx-lm model.
        tokens: The prompt the cache claims to hold (every one of its positions).
        cache: The cache (not modified).
        block_size: Tokens per checked span.
        spans: How many spans to check (at least 1; the last is always among them;
            as many as the prompt has blocks checks every block).
        tolerance: The largest relative difference accepted (default: `tolerance_for` the cache).

    Returns:
        A `CacheCheck` (see `CacheCheck.passed`).
    """
    n = len(tokens)
    result = CacheCheck(tolerance=tolerance_for(cache) if tolerance is None else tolerance)
    if n == 0:
        return result
    recurrent = any(isinstance(layer, ArraysCache) for _, layer in leaves(cache))  # never cut back: no search
    candidates = () if recurrent else range(n - block_size, 0, -block_size)
    last = next((s for s in candidates if _at(cache, s) is not None), 0)
    result.full = last == 0 and n > block_size
    starts = _starts(last, block_size, max(1, spans) - 1)
    chosen = [(s, min(s + block_size, last)) for s in starts] + [(last, n)]
    for start, end in chosen:
        mine = _at(cache, start)
        if mine is None:
            continue  # a window or chunk that does not reach back to this block
        step = STEP if CHUNKED_PIECEWISE_PREFILL else end - start  # mlx-lm 0.31: a chunked layer in one call
        for lo in range(start, end, step):
            model(mx.array(list(tokens[lo : min(lo + step, end)]))[None], cache=mine)
            mx.eval([c.state for c in mine])
        if start == 0:  # quantized as mlx-lm does after its first step (`_at`)
            mine = [_quantized_like(a, b) for a, b in zip(mine, cache)]
        error, where, missed = _compare(mine, cache, start, end, end == n)
        result.spans.append((start, end))
        if end == n:
            result.uncompared = missed
        if error > result.error or not result.where:
            result.error, result.where = error, where
    return result

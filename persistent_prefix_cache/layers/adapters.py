"""mlx-lm's cache classes: the only module that names them or relies on their ``state``.

Per-cache-class adapters turn one mlx-lm cache layer into the tensors of one block and
back; `Layout` applies them to a whole cache (every leaf of a model's layout), so the
store, the read path and the compat layers never look inside a cache layer.

Every mlx-lm cache layer is one of three kinds:

- ``seq``: state sliced along the sequence axis (``KVCache``, ``QuantizedKVCache``):
  rebuildable at any position from the slices of the blocks before it.
- ``window``: a sequence window (``RotatingKVCache``, ``ChunkedKVCache``): rebuildable
  at position P from the slices of the tokens its window holds at P, or from a
  *snapshot* of that window stored at P. A layer that has already dropped old tokens
  yields no slices for them.
- ``state``: recurrent state (``ArraysCache``): rebuildable only from a snapshot taken
  at exactly that position.

``CacheList`` layers are flattened into their children, each a *leaf* with an id such
as ``"3"`` or ``"3.1"``. mlx-lm's protocol (``state`` / ``from_state``) is the
contract: a rebuilt layer must continue exactly like a cold prefill of the same tokens;
layers are built through `mlx_lm_versions.make_layer` (0.31 and 0.32 differ there).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..blocks import KEYS, KV_FIELDS, QUANTIZED_KV_FIELDS, VALUES, Tensors, state_index, state_snapshot, window_snapshot
from ..errors import InvalidArgumentError, UnsupportedCacheError
from .mlx_lm_versions import make_layer

SEQ, WINDOW, STATE = "seq", "window", "state"


@dataclass
class BlockView:
    """What one block holds for one leaf: its token range and tensors (may be empty)."""

    start: int
    end: int
    tensors: Tensors | None = None
    has_slice: bool = True
    has_snapshot: bool = False

    def tensor(self, name: str) -> mx.array:
        """Tensor `name` of the block.

        Raises:
            KeyError: If the block holds no tensor `name` (or none at all: a record's flags only).
        """
        return (self.tensors or {})[name]


def _copy(x: mx.array, start: int, end: int) -> mx.array:
    # KV tensors are [batch, heads, seq, dim]; copy so the block owns its memory and
    # does not pin the (step-padded) buffer of the caller's cache.
    return mx.contiguous(x[..., start:end, :])


class BlockSource:
    """One leaf's tensors in consecutive blocks, joined on demand (the RAM-tier path).

    Every array it hands out is a new object: mlx-lm updates caches in place (after a
    trim), which must never write into the arrays the RAM tier holds.
    """

    def __init__(self, views: Sequence[BlockView]):
        self.views = views

    @property
    def last(self) -> BlockView:
        return self.views[-1]

    def range(self, name: str, lo: int, hi: int) -> mx.array:
        """Positions [lo, hi) of tensor `name`."""
        parts = []
        for b in self.views:
            a, z = max(lo, b.start), min(hi, b.end)
            if a < z:
                parts.append(b.tensor(name)[..., a - b.start : z - b.start, :])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def snapshot(self, name: str) -> mx.array:
        """Tensor `name` of the last block's snapshot."""
        return self.last.tensor(name)[...]

    def buffer(self, name: str, position: int) -> mx.array:
        """Positions [0, position) of `name` (here: exactly that long)."""
        return self.range(name, 0, position)

    def has(self, name: str) -> bool:
        """Whether the blocks hold tensor `name`."""
        return any(b.tensors and name in b.tensors for b in self.views)


class JoinedSource:
    """One leaf's tensors over a path of blocks already joined per field (the disk
    read path's buffers; see `disk.read_path`), with the `BlockSource` interface.

    Args:
        last: The last block's view (its tensors: the snapshot fields).
        runs: Per field, ``(start, end, array)``: joined arrays and the positions they hold.
    """

    def __init__(self, last: BlockView, runs: dict[str, list[tuple[int, int, mx.array]]]):
        self.last = last
        self.runs = runs

    def range(self, name: str, lo: int, hi: int) -> mx.array:
        """Positions [lo, hi) of tensor `name`."""
        for start, end, arr in self.runs.get(name, ()):
            if start <= lo and hi <= end:
                return arr[..., lo - start : hi - start, :]
        raise KeyError(f"{name}: positions {lo}..{hi} were not read")

    def buffer(self, name: str, position: int) -> mx.array:
        """Positions [0, position) of `name` at the start of a buffer that may be longer
        (room to grow in place); the caller takes ownership."""
        for start, end, arr in self.runs.get(name, ()):
            if start == 0 and position <= end:
                return arr
        raise KeyError(f"{name}: positions 0..{position} were not read")

    def snapshot(self, name: str) -> mx.array:
        """Tensor `name` of the last block's snapshot."""
        return self.last.tensor(name)[...]

    def has(self, name: str) -> bool:
        """Whether tensor `name` was read."""
        return name in self.runs


def _field(source: Any, name: str, position: int, like: mx.array) -> mx.array:
    """`source.buffer(name, position)`, or an empty ``[batch, heads, n, 0]`` tensor where the
    field was not stored for having width 0 (``float32``: what mlx-lm 0.31's indexer passes)."""
    if source.has(name):
        return source.buffer(name, position)
    return mx.zeros((*like.shape[:3], 0), dtype=mx.float32)


class ViewPath(list):
    """Consecutive `BlockView`s of one leaf, with a running count of blocks lacking a
    slice, so that `covered` costs O(log n) however long the prompt (a 32k-token store
    checks every block boundary)."""

    def __init__(self, views: Iterable[BlockView] = ()):
        super().__init__()
        self._missing = [0]  # _missing[i]: blocks without a slice among the first i
        for v in views:
            self.append(v)

    def append(self, view: BlockView) -> None:
        super().append(view)
        self._missing.append(self._missing[-1] + (not view.has_slice))

    def covered(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether every block overlapping each [lo, hi) holds a slice."""
        for lo, hi in ranges:
            if lo >= hi:
                continue
            if not self or self[0].start > lo or self[-1].end < hi:
                return False
            if not self._missing[-1]:  # every block holds its slice (a store's common case)
                continue
            # The common ranges (from the path's start to, or into, its last block: a store
            # checks every new block's end) need no search.
            first, last = 0, len(self)
            if lo > self[0].start:
                first = bisect.bisect_right(self, lo, key=lambda v: v.end)  # first with end > lo
            if hi <= self[-1].start:
                last = bisect.bisect_left(self, hi, key=lambda v: v.start)  # first with start >= hi
            if self._missing[last] - self._missing[first]:
                return False
        return True


def _covered(blocks: Sequence[BlockView], ranges: Sequence[tuple[int, int]]) -> bool:
    return (blocks if isinstance(blocks, ViewPath) else ViewPath(blocks)).covered(ranges)


class _SeqAdapter:
    """Shared logic of ``seq`` and ``window`` leaves (both store sequence slices)."""

    kind = SEQ
    fields: tuple[str, ...] = KV_FIELDS

    def length(self, layer) -> int | None:
        return int(layer.offset)

    def needed(self, template, position: int) -> list[tuple[int, int]]:
        """Token ranges whose slices rebuild the leaf at `position`."""
        return [(0, position)]

    def held(self, layer) -> tuple[dict[str, mx.array], int]:
        """The layer's tensors in temporal order and the position of their first row."""
        n = layer.offset
        # A field of width 0 holds no bytes (mlx-lm 0.31's deepseek_v32 indexer caches such
        # values): it is not stored, and `KVAdapter.rebuild` gives it back empty (`_field`).
        held = {KEYS: layer.keys[..., :n, :], VALUES: layer.values[..., :n, :]}
        return {f: x for f, x in held.items() if x.shape[-1] > 0}, 0

    def pieces(self, layer, start: int, end: int, last: bool) -> tuple[Tensors, bool, bool]:
        """Tensors this block keeps for the leaf: (tensors, has_slice, has_snapshot)."""
        buf, first = self.held(layer)
        if start < first:  # the layer no longer holds these tokens
            return {}, False, False
        return {f: _copy(x, start - first, end - first) for f, x in buf.items()}, True, False

    def can_rebuild(self, template, blocks: Sequence[BlockView], position: int) -> bool:
        """Whether `blocks` (the path up to `position`) rebuild the leaf there."""
        return _covered(blocks, self.needed(template, position))

    def rebuild(self, template, source: BlockSource, position: int):
        """A fresh layer at `position` from `source` (where `can_rebuild` said yes)."""
        raise NotImplementedError


class KVAdapter(_SeqAdapter):
    """``KVCache``: keys and values sliced along the sequence axis."""

    def signature(self, layer: KVCache) -> str:
        return "KVCache"

    def rebuild(self, template, source, position):
        # `buffer` may be longer than `position`: mlx-lm then writes the next tokens in
        # place (KVCache only ever reads [:offset]).
        keys = source.buffer(KEYS, position)
        return make_layer(KVCache, (keys, _field(source, VALUES, position, keys)), offset=position)


class QuantizedKVAdapter(_SeqAdapter):
    """``QuantizedKVCache``: (packed, scales, biases) each sliced along the sequence axis.

    mlx-lm quantizes each token's vector on its own (groups run along the head
    dimension), so a sequence slice of the quantized tensors is exact.
    """

    fields = QUANTIZED_KV_FIELDS  # (packed, scales, biases) of the keys, then of the values

    def signature(self, layer: QuantizedKVCache) -> str:
        return f"QuantizedKVCache(group_size={layer.group_size},bits={layer.bits})"

    def held(self, layer):
        n = layer.offset
        pairs = ((self.fields[:3], layer.keys), (self.fields[3:], layer.values))
        return {f: x[..., :n, :] for names, triple in pairs for f, x in zip(names, triple)}, 0

    def rebuild(self, template, source, position):
        keys = tuple(source.buffer(f, position) for f in self.fields[:3])
        values = tuple(source.buffer(f, position) for f in self.fields[3:])
        return make_layer(
            QuantizedKVCache, (keys, values), offset=position, group_size=template.group_size, bits=template.bits
        )


class _WindowAdapter(_SeqAdapter):
    """Window leaves: slices where the layer still holds them, plus a snapshot of the
    window at the end of a store once the layer has dropped old tokens (the blocks
    that held them may lack slices, so the end would not be resumable otherwise).
    """

    kind = WINDOW

    def pieces(self, layer, start, end, last):
        tensors, has_slice, _ = super().pieces(layer, start, end, last)
        if last and self.held(layer)[1] > 0:
            snap = self.snapshot(layer)
            if snap is not None:
                return {**tensors, **snap}, has_slice, True
        return tensors, has_slice, False

    def snapshot(self, layer) -> Tensors | None:
        """The window the leaf is rebuilt with at its current offset, if it holds it."""
        buf, first = self.held(layer)
        ranges = [(lo, hi) for lo, hi in self.needed(layer, layer.offset) if lo < hi]
        if not ranges or ranges[0][0] < first:
            return None
        return {
            window_snapshot(f): mx.contiguous(
                mx.concatenate([x[..., lo - first : hi - first, :] for lo, hi in ranges], axis=2)
            )
            for f, x in buf.items()
        }

    def can_rebuild(self, template, blocks, position):
        last = blocks[-1] if blocks else None
        if last is not None and last.end == position and last.has_snapshot:
            return True
        return super().can_rebuild(template, blocks, position)

    def window(self, template, source, position) -> tuple[mx.array, mx.array]:
        """Keys and values of the window at `position`, in temporal order."""
        last = source.last
        if last.end == position and last.has_snapshot:
            return source.snapshot(window_snapshot(KEYS)), source.snapshot(window_snapshot(VALUES))
        ranges = [(lo, hi) for lo, hi in self.needed(template, position) if lo < hi]

        def joined(f: str) -> mx.array:
            if len(ranges) > 1:
                return mx.concatenate([source.range(f, lo, hi) for lo, hi in ranges], axis=2)
            return source.range(f, *ranges[0])

        return joined(KEYS), joined(VALUES)


class RotatingAdapter(_WindowAdapter):
    """``RotatingKVCache``: the first `keep` tokens plus the last ``max_size - keep``.

    Rebuilt at P it holds what a cold cache uses on its next update: all P tokens
    while P fits the window, else the kept head and the newest tail in temporal order
    (never tokens outside its window: vllm-mlx #678).
    """

    def signature(self, layer: RotatingKVCache) -> str:
        return f"RotatingKVCache(max_size={layer.max_size},keep={layer.keep})"

    def needed(self, template, position):
        if position <= template.max_size:
            return [(0, position)]
        keep = template.keep
        return [(0, keep), (position - (template.max_size - keep), position)]

    def held(self, layer):
        keys = layer._temporal_order(layer.keys)
        values = layer._temporal_order(layer.values)
        n = keys.shape[2]
        if n >= layer.offset:
            return {KEYS: keys[..., : layer.offset, :], VALUES: values[..., : layer.offset, :]}, 0
        # Old tokens were dropped: the kept head sits apart from the tail, so only
        # the tail counts as contiguous positions.
        keep = layer.keep
        return {KEYS: keys[..., keep:, :], VALUES: values[..., keep:, :]}, layer.offset - (n - keep)

    def snapshot(self, layer):
        if layer.offset <= layer.max_size or layer.keep == 0:
            return super().snapshot(layer)
        keys = layer._temporal_order(layer.keys)
        values = layer._temporal_order(layer.values)
        tail = layer.max_size - layer.keep
        if keys.shape[2] - layer.keep < tail:
            return None
        return {
            window_snapshot(f): mx.contiguous(
                mx.concatenate([x[..., : layer.keep, :], x[..., x.shape[2] - tail :, :]], axis=2)
            )
            for f, x in ((KEYS, keys), (VALUES, values))
        }

    def rebuild(self, template, source, position):
        keys, values = self.window(template, source, position)
        return make_layer(
            RotatingKVCache, (keys, values), offset=position, keep=template.keep, max_size=template.max_size,
            idx=keys.shape[2],
        )  # fmt: skip


class ChunkedAdapter(_WindowAdapter):
    """``ChunkedKVCache`` (llama4): the last `chunk_size` tokens.

    Before every forward pass llama4 trims each chunked layer to its last
    `chunk_size` tokens, so whatever the history, at P the layer is used with
    ``[max(0, P - chunk_size), P)``: that is what it is rebuilt with.
    """

    def signature(self, layer: ChunkedKVCache) -> str:
        return f"ChunkedKVCache(chunk_size={layer.chunk_size})"

    def needed(self, template, position):
        return [(max(0, position - template.chunk_size), position)]

    def held(self, layer):
        n = layer.offset - layer.start_position
        return {KEYS: layer.keys[..., :n, :], VALUES: layer.values[..., :n, :]}, layer.start_position

    def rebuild(self, template, source, position):
        keys, values = self.window(template, source, position)
        start = position - keys.shape[2]
        return make_layer(ChunkedKVCache, (keys, values), offset=position, chunk_size=template.chunk_size, start=start)


class ArraysAdapter:
    """``ArraysCache`` (Mamba, GatedDeltaNet): recurrent state, snapshots only."""

    kind = STATE

    def signature(self, layer: ArraysCache) -> str:
        return f"ArraysCache(size={len(layer.cache)})"

    def length(self, layer) -> int | None:
        return None  # recurrent state does not record how many tokens it has seen

    def needed(self, template, position):
        return []

    def pieces(self, layer: ArraysCache, start, end, last):
        if layer.left_padding is not None or layer.lengths is not None:
            raise UnsupportedCacheError("a batched ArraysCache (left padding or lengths) cannot be stored")
        if not last:
            return {}, False, False
        state: Sequence[mx.array | None] = layer.cache  # (mlx-lm's __init__ fills it with None: read as list[None])
        snap = {state_snapshot(i): mx.contiguous(x) for i, x in enumerate(state) if x is not None}
        return snap, False, True

    def can_rebuild(self, template, blocks, position):
        return bool(blocks) and blocks[-1].end == position and blocks[-1].has_snapshot

    def rebuild(self, template, source, position):
        layer = ArraysCache(len(template.cache))
        for name in source.last.tensors:
            layer.cache[state_index(name)] = source.snapshot(name)
        return layer


_ADAPTERS = {
    KVCache: KVAdapter(),
    QuantizedKVCache: QuantizedKVAdapter(),
    RotatingKVCache: RotatingAdapter(),
    ChunkedKVCache: ChunkedAdapter(),
    ArraysCache: ArraysAdapter(),
}


def adapter_for(layer: Any, where: str = "0"):
    """The adapter for one leaf layer.

    Raises:
        UnsupportedCacheError: If this version cannot store the layer's class.
    """
    adapter = _ADAPTERS.get(type(layer))
    if adapter is None:
        raise UnsupportedCacheError(
            f"layer {where}: cache class {type(layer).__name__} is not supported "
            f"(supported: {', '.join(sorted(c.__name__ for c in _ADAPTERS))}, CacheList)"
        )
    return adapter


def grown_rows(tokens: int) -> int:
    """Rows a sequence layer's buffers hold once mlx-lm's own prefill has computed `tokens`
    tokens (its steps of 2048 grow a ``KVCache`` by multiples of ``KVCache.step``): the
    room a restored cache is given to compute the rest of its prompt in place. On CUDA,
    MLX builds a cuDNN attention graph per buffer length, once per thread: a length an
    uncached prefill also makes costs no build that prefill would not (H100: 50-60 ms on
    the first one-token forward after a restore, docs/performance.md)."""
    step = KVCache.step
    return -(-tokens // step) * step


def leaves(cache: Sequence[Any]) -> list[tuple[str, Any]]:
    """Flatten a cache list into (leaf id, leaf layer), descending into ``CacheList``."""
    out: list[tuple[str, Any]] = []
    for i, layer in enumerate(cache):
        if isinstance(layer, CacheList):
            out.extend((f"{i}.{j}", child) for j, child in enumerate(layer.caches))
        else:
            out.append((str(i), layer))
    return out


def signature_of(cache: Sequence[Any]) -> str:
    """One string naming a whole cache layout (part of every root key).

    Raises:
        UnsupportedCacheError: If a layer's class is not supported.
    """
    parts = []
    for i, layer in enumerate(cache):
        if isinstance(layer, CacheList):
            inner = ",".join(adapter_for(c, f"{i}.{j}").signature(c) for j, c in enumerate(layer.caches))
            parts.append(f"CacheList[{inner}]")
        else:
            parts.append(adapter_for(layer, str(i)).signature(layer))
    return "|".join(parts)


def template_cache(model: Any, *, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """An empty cache of the layout a store holds for `model`: what
    `make_prompt_cache` builds, with `KVCache` layers quantized when `kv_bits` is set
    (as mlx-lm's ``kv_bits`` does).
    """
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c for c in cache]
    return cache


def cache_length(cache: Sequence[Any]) -> int | None:
    """Token positions covered by a cache list (None if no layer records it).

    Raises:
        InvalidArgumentError: If the layers cover different lengths.
    """
    lengths = {adapter_for(c, i).length(c) for i, c in leaves(cache)} - {None}
    if len(lengths) > 1:
        raise InvalidArgumentError(f"cache layers cover different lengths: {sorted(lengths)}")
    return lengths.pop() if lengths else None


def rebuild_cache(template: Sequence[Any], leaf_layers: dict[str, Any]) -> list:
    """Reassemble top-level layers (``CacheList`` included) from rebuilt leaves."""
    out = []
    for i, layer in enumerate(template):
        if isinstance(layer, CacheList):
            out.append(CacheList(*(leaf_layers[f"{i}.{j}"] for j in range(len(layer.caches)))))
        else:
            out.append(leaf_layers[str(i)])
    return out


def model_cache(model: Any, *, max_kv_size: int | None = None) -> list:
    """`make_prompt_cache` of a model (or of anything with a ``make_cache`` method);
    with `max_kv_size`, mlx-lm's ``RotatingKVCache`` layers of that size (as
    ``mlx_lm.generate --max-kv-size`` builds them)."""
    return make_prompt_cache(model, max_kv_size=max_kv_size)

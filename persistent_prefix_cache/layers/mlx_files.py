"""mlx-lm's prompt-cache files (``mlx_lm.cache_prompt``, ``save_prompt_cache``), read in both layouts.

A prompt-cache file is a safetensors file: the layers' ``state`` tensors under
``<layer>.<path>`` and, in its metadata, the class of every layer and the user's
metadata (``model``, ``tokenizer_config``). It holds no tokens. Two layouts exist, and
neither mlx-lm reads the other's:

- ``0.31`` (mlx-lm 0.31.x and before): metadata ``[meta_state per layer, metadata,
  classes]`` flattened (``0.<i>…`` the layers' ``meta_state`` strings, ``1.<key>`` the
  user's metadata, ``2.<i>`` the class names); KV tensors hold exactly ``offset`` rows,
  other numbers (offset, group size, window…) are strings in ``meta_state``.
- ``0.32`` (mlx-lm 0.32): metadata ``[metadata, classes, scalars]`` (``0.<key>``,
  ``1.<i>``, then ``2.0`` = ``""`` and ``2.<k>.0``/``2.<k>.1``: which tensors stand for a
  Python scalar, string or None); ``state`` carries every number as a 0-d tensor, and a
  ``KVCache``'s tensors are its whole buffer (rows past ``offset`` unused).

mlx-lm 0.32 opening a 0.31 file fails with "too many values to unpack" (it reads the
class names as its scalars list); 0.31 opening a 0.32 file fails with ``KeyError: ''``
(it reads the scalars list as class names). `read_prompt_cache` reads both into cache
objects of the installed mlx-lm, set attribute by attribute (the attributes are the same
in both versions, their ``state``/``from_state`` are not), checking every layer;
`write_prompt_cache` writes the installed mlx-lm's own layout (its `save_prompt_cache`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Sequence, cast

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from ..errors import PromptCacheFileError
from ..files import replace_beside
from ..untrusted import dotted_depth, load_json
from .adapters import leaves

LAYOUT_031, LAYOUT_032 = "0.31", "0.32"
# Bounds on a file's safetensors header: mlx-lm writes a few entries per layer, names a few
# parts deep (``2.<k>.0``, ``<layer>.<child>.<i>``); a header past these is not mlx-lm's.
MAX_HEADER = 16 * 1024 * 1024
MAX_NAME_DEPTH = 8
SUPPORTED = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache", "ArraysCache", "CacheList")


@dataclass
class PromptCacheFile:
    """What a prompt-cache file holds.

    Attributes:
        layout: ``"0.31"`` or ``"0.32"`` (see the module's docstring).
        cache: The layers, as cache objects of the installed mlx-lm.
        metadata: The user's metadata (``model``, ``tokenizer_config`` from cache_prompt).
        classes: The class name of every top-level layer, as the file names them.
    """

    layout: str
    cache: list
    metadata: dict[str, str] = field(default_factory=dict)
    classes: list[str] = field(default_factory=list)


def _bad(path: str, why: str) -> PromptCacheFileError:
    return PromptCacheFileError(f"{path}: {why}")


def _split(path: str, meta: dict[str, str]) -> tuple[str, dict, list[str], Any]:
    """(layout, user metadata, classes, per-layer extra) from the flattened metadata."""
    tree = tree_unflatten(list(meta.items())) if meta else None
    if not isinstance(tree, list) or len(tree) != 3:
        raise _bad(path, "not an mlx-lm prompt-cache file (its metadata is not mlx-lm's [.., .., ..] list)")
    first, second, third = tree
    # 0.32's scalars list always starts with "" (save_prompt_cache keeps it non-empty).
    if isinstance(first, dict) and isinstance(second, list) and isinstance(third, list) and third[:1] == [""]:
        user, classes, layout, extra = first, second, LAYOUT_032, third[1:]
    elif isinstance(first, list) and isinstance(second, dict) and isinstance(third, list):
        user, classes, layout, extra = second, third, LAYOUT_031, first
    else:
        raise _bad(path, "a prompt-cache layout this version cannot read (neither mlx-lm 0.31's nor 0.32's)")
    if not classes or not all(isinstance(c, str) and c for c in classes):
        raise _bad(path, "its metadata names no cache classes")
    return layout, user, classes, extra


def _int(x: Any, path: str, what: str) -> int:
    try:
        if isinstance(x, mx.array):
            x = x.item()
        value = int(x)
    except (TypeError, ValueError):
        raise _bad(path, f"{what} is not an integer: {x!r}") from None
    if value < 0:
        raise _bad(path, f"{what} is negative: {value}")
    return value


def _tensor(x: Any, path: str, what: str, ndim: int | None = 4) -> mx.array:
    if not isinstance(x, mx.array) or (ndim is not None and x.ndim != ndim):
        shape = getattr(x, "shape", type(x).__name__)
        raise _bad(path, f"{what} is not a {ndim}-D tensor ({shape})")
    return x


def _items(state: Any, n: int, path: str, what: str) -> list:
    if not isinstance(state, (list, tuple)) or len(state) < n:
        raise _bad(path, f"{what}: its state has not the {n} parts this class has")
    return list(state)


def _kv(keys: Any, values: Any, rows: int, path: str, where: str) -> tuple[mx.array, mx.array]:
    keys = _tensor(keys, path, f"layer {where} keys")
    values = _tensor(values, path, f"layer {where} values")
    if keys.shape[:3] != values.shape[:3] or keys.shape[2] < rows:
        raise _bad(path, f"layer {where}: keys {keys.shape} and values {values.shape} do not hold {rows} rows")
    return keys, values


def _new(cls):
    # Attributes set one by one: their names are the same in mlx-lm 0.31 and 0.32, while
    # `from_state` takes (state, meta_state) in one and (state) in the other.
    obj = cls.__new__(cls)
    if cls is ArraysCache:
        obj.left_padding, obj.lengths = None, None
    return obj


def _layer(name: str, state: Any, meta: Any, layout: str, path: str, where: str):
    """One cache object of class `name` from its file state (and 0.31's meta_state strings)."""
    old = layout == LAYOUT_031
    if name not in SUPPORTED:
        known = name in vars(mlx_cache)
        raise _bad(path, f"layer {where} is a {name}, which {'ppc cannot store' if known else 'mlx-lm does not know'} "
                   f"(supported: {', '.join(SUPPORTED)})")  # fmt: skip
    if name == "CacheList":
        if old:
            names, metas = _items(meta, 2, path, f"layer {where}")[:2]
            children = list(zip(names, _items(state, len(names), path, f"layer {where}"), metas))
        else:
            children = [(c, s, None) for s, c in (_items(p, 2, path, f"layer {where}") for p in state)]
        obj = _new(CacheList)
        obj.caches = tuple(_layer(c, s, m, layout, path, f"{where}.{j}") for j, (c, s, m) in enumerate(children))
        return obj
    if name == "ArraysCache":
        arrays = state if old else _items(state, 3, path, f"layer {where}")[0]
        if not old and any(x is not None for x in _items(state, 3, path, f"layer {where}")[1:]):
            raise _bad(path, f"layer {where}: a batched ArraysCache (left padding or lengths) cannot be stored")
        obj = _new(ArraysCache)
        obj.cache = [None if x is None else _tensor(x, path, f"layer {where} state", None) for x in arrays]
        return obj
    if name == "QuantizedKVCache":
        parts = _items(state, 2, path, f"layer {where}")
        triples = [_items(t, 3, path, f"layer {where} keys/values") for t in parts[:2]]
        numbers = _items(meta, 3, path, f"layer {where} meta_state") if old else _items(state, 5, path, where)[2:5]
        names = ("offset", "group size", "bits")
        offset, group_size, bits = (_int(x, path, f"layer {where} {n}") for x, n in zip(numbers, names))
        for t in triples:
            for x in t:
                _tensor(x, path, f"layer {where} keys/values")
                if x.shape[2] < offset:
                    raise _bad(path, f"layer {where}: {x.shape} holds fewer than its {offset} rows")
        obj = _new(QuantizedKVCache)
        obj.keys, obj.values = (tuple(t[:3]) for t in triples)
        obj.offset, obj.group_size, obj.bits = offset, group_size, bits
        return obj
    parts = _items(state, 2, path, f"layer {where}")
    # 0.32 keeps the offset third in the state (0.31 and the rotating layer: see below).
    offset = _int(parts[2], path, f"layer {where} offset") if not old and name != "RotatingKVCache" else 0
    if name == "KVCache":
        keys, values = _kv(parts[0], parts[1], offset, path, where)
        obj = _new(KVCache)
        obj.keys, obj.values, obj.offset = keys, values, (keys.shape[2] if old else offset)
        return obj
    if name == "ChunkedKVCache":
        numbers = _items(meta, 2, path, f"layer {where} meta_state") if old else _items(state, 5, path, where)[3:5]
        chunk_size, start = (_int(x, path, f"layer {where} chunk") for x in numbers)
        if old and start > 0:
            # 0.31 saves keys[:offset] of a buffer that starts at `start`: the layer's length is lost.
            raise _bad(path, f"layer {where}: mlx-lm 0.31 did not record this ChunkedKVCache's length "
                       "(its chunk had moved on): it cannot be read exactly")  # fmt: skip
        keys, values = _kv(parts[0], parts[1], 0 if old else offset - start, path, where)
        obj = _new(ChunkedKVCache)
        obj.keys, obj.values, obj.chunk_size, obj.start_position = keys, values, chunk_size, start
        obj.offset = keys.shape[2] if old else offset
        return obj
    keys, values = _kv(parts[0], parts[1], 0, path, where)
    # RotatingKVCache: (keep, max_size, offset, _idx) in 0.31's meta_state; state[2:6] in 0.32 as
    # (offset, keep, max_size, _idx).
    if old:
        keep, max_size, offset, idx = (_int(x, path, f"layer {where} meta_state") for x in _items(meta, 4, path, where))
    else:
        offset, keep, max_size, idx = (
            _int(x, path, f"layer {where} state") for x in _items(state, 6, path, where)[2:6]
        )
    if keep > max_size or idx > keys.shape[2] or keys.shape[2] > max(max_size, offset):
        raise _bad(path, f"layer {where}: a RotatingKVCache whose window (keep {keep}, max_size {max_size}, "
                   f"index {idx}, {keys.shape[2]} rows) is inconsistent")  # fmt: skip
    obj = _new(RotatingKVCache)
    obj.keys, obj.values, obj.offset, obj.keep, obj.max_size, obj._idx = keys, values, offset, keep, max_size, idx
    return obj


def _check_header(path: str) -> None:
    """Bound the safetensors header before a parser builds it: its length, JSON nesting and
    the depth of every dotted name (`tree_unflatten` recurses once per part)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            size = os.fstat(f.fileno()).st_size
            if n < 2 or 8 + n > size:
                raise _bad(path, "not a readable safetensors file (truncated or another format)")
            if n > MAX_HEADER:
                raise _bad(path, f"its header is {n:,} bytes, more than the {MAX_HEADER:,} an mlx-lm file may have")
            header = load_json(f.read(n), what="its header", max_bytes=MAX_HEADER, max_depth=4)
    except OSError as exc:
        raise _bad(path, f"cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        if isinstance(exc, PromptCacheFileError):
            raise
        raise _bad(path, f"not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise _bad(path, "not a readable safetensors file (its header is not a JSON object)")
    meta = header.get("__metadata__") or {}
    try:
        dotted_depth(header, what="its header", max_depth=MAX_NAME_DEPTH)
        dotted_depth(meta if isinstance(meta, dict) else (), what="its metadata", max_depth=MAX_NAME_DEPTH)
    except ValueError as exc:
        raise _bad(path, f"not an mlx-lm prompt-cache file: {exc}") from None


def read_prompt_cache(path: str) -> PromptCacheFile:
    """Read a prompt-cache file written by mlx-lm 0.31 or 0.32 (see the module's docstring).

    Args:
        path: The file (any name: it is read as safetensors whatever its extension).

    Returns:
        The `PromptCacheFile`, its layers cache objects of the installed mlx-lm.

    Raises:
        PromptCacheFileError: If the file is missing, not a safetensors file, truncated,
            not a prompt-cache file (a header larger or nested deeper than mlx-lm writes
            included), of a layout this version cannot read, or holds a layer class that
            cannot be stored (one line saying which).
    """
    if not os.path.isfile(path):
        raise _bad(path, "no such file")
    _check_header(path)
    try:
        # (The tensors by name, then the metadata. Scalars and strings replace some tensors below.)
        loaded = mx.load(path, format="safetensors", return_metadata=True)
        arrays, meta = cast(tuple[dict[str, Any], dict[str, str]], loaded)
        mx.eval(list(arrays.values()))  # a short read surfaces here, not later in a restore
    except Exception as exc:  # mlx raises RuntimeError/ValueError for every malformed file
        first = (str(exc).strip().splitlines() or [""])[0]
        raise _bad(path, f"not a readable safetensors file (truncated or another format): {first}") from None
    layout, user, classes, extra = _split(path, meta)
    if layout == LAYOUT_032:
        for entry in extra:
            pos, kind = _items(entry, 2, path, "a scalars entry")[:2]
            if pos not in arrays:
                raise _bad(path, f"its scalars list names a tensor {pos!r} the file lacks")
            x = arrays[pos]
            if kind == "scalar":
                arrays[pos] = x.item()
            elif kind == "string":
                arrays[pos] = "".join(chr(i) for i in x.tolist())
            elif kind == "none":
                arrays[pos] = None
            else:
                raise _bad(path, f"unknown scalar kind {kind!r} (a newer mlx-lm's file?)")
    tree = tree_unflatten(list(arrays.items())) if arrays else []
    states = tree if isinstance(tree, list) else []
    if len(states) != len(classes):
        raise _bad(path, f"it names {len(classes)} layers but holds the state of {len(states)}")
    metas = extra if layout == LAYOUT_031 else [None] * len(classes)
    if not isinstance(metas, list) or len(metas) != len(classes):
        raise _bad(path, "its meta_state list does not match its layers")
    cache = [_layer(c, s, m, layout, path, str(i)) for i, (c, s, m) in enumerate(zip(classes, states, metas))]
    return PromptCacheFile(layout, cache, {k: v for k, v in user.items() if isinstance(v, str)}, list(classes))


def _state(layer: ArraysCache) -> list[mx.array]:
    held: Sequence[mx.array | None] = layer.cache  # (mlx-lm's __init__ fills it with None: read as list[None])
    return [x for x in held if x is not None]


def _arrays(layer: Any) -> list[mx.array]:
    if isinstance(layer, ArraysCache):
        return _state(layer)
    keys, values = layer.keys, layer.values
    return [*keys, *values] if isinstance(keys, (tuple, list)) else [keys, values]


def leaf_tensors(cache: list) -> dict[str, list[mx.array]]:
    """Every leaf's meaningful tensors by leaf id: KV rows ``[:offset]`` (a rotating window's in
    temporal order, a chunked layer's last chunk), recurrent state whole. What two caches of
    the same tokens must agree on bitwise."""
    out: dict[str, list[mx.array]] = {}
    for where, layer in leaves(cache):
        if isinstance(layer, ArraysCache):
            out[where] = _state(layer)
            continue
        if isinstance(layer, RotatingKVCache):  # a wrapped window compares in temporal order
            rows = min(layer.offset, layer.keys.shape[2])
            out[where] = [layer._temporal_order(x)[..., :rows, :] for x in (layer.keys, layer.values)]
            continue
        if isinstance(layer, ChunkedKVCache):  # llama4 trims to the last chunk before each pass: that is what counts
            rows = layer.offset - layer.start_position
            out[where] = [x[..., max(0, rows - layer.chunk_size) : rows, :] for x in _arrays(layer)]
            continue
        out[where] = [x[..., : layer.offset, :] for x in _arrays(layer)]
    return out


def shapes_and_dtypes(cache: list) -> dict[str, list[str | tuple[tuple[int, ...], str]]]:
    """Per leaf: the class and, per tensor, (shape without the sequence axis, dtype): what
    a model fixes of its cache whatever the prompt's length."""
    out: dict[str, list[str | tuple[tuple[int, ...], str]]] = {}
    for where, layer in leaves(cache):
        arrays = _arrays(layer)
        seq = not isinstance(layer, ArraysCache)
        out[where] = [
            type(layer).__name__,
            *(((*x.shape[:2], *x.shape[3:]) if seq else tuple(x.shape), str(x.dtype)) for x in arrays),
        ]
    return out


def _compact(layer: Any) -> Any:
    """A shallow copy of `layer` whose KV holds only the rows it uses: a restored buffer's
    rows past the offset were never written (the read path does not zero-fill them), and
    a file should hold nothing but the cache."""
    if isinstance(layer, CacheList):
        out = _new(CacheList)
        out.caches = tuple(_compact(c) for c in layer.caches)
        return out
    if isinstance(layer, ArraysCache) or layer.keys is None:
        return layer
    rows = layer.offset - (layer.start_position if isinstance(layer, ChunkedKVCache) else 0)
    arrays = layer.keys if isinstance(layer.keys, (tuple, list)) else [layer.keys]
    if isinstance(layer, RotatingKVCache) and layer.offset >= arrays[0].shape[2]:
        return layer  # a full (or wrapped) window uses every row
    if arrays[0].shape[2] <= rows:
        return layer
    out = _new(type(layer))
    out.__dict__.update(layer.__dict__)
    if isinstance(layer.keys, (tuple, list)):
        out.keys = tuple(x[..., :rows, :] for x in layer.keys)
        out.values = tuple(x[..., :rows, :] for x in layer.values)
    else:
        out.keys, out.values = layer.keys[..., :rows, :], layer.values[..., :rows, :]
    return out


def write_prompt_cache(path: str, cache: list, metadata: dict[str, str]) -> int:
    """Write `cache` as the installed mlx-lm's `save_prompt_cache` does, crash-safely.

    The file appears whole or not at all: it is written beside `path` under a temporary
    name, synced, then renamed. KV buffers are cut to the rows in use (mlx-lm grows them
    again on the next token).

    Args:
        path: The file to write (it should end in ``.safetensors``: mlx-lm's loader
            picks the format by the extension).
        cache: The layers.
        metadata: The user's metadata (mlx_lm.generate reads ``model`` and ``tokenizer_config``).

    Returns:
        The file's size in bytes.
    """
    from mlx_lm.models.cache import save_prompt_cache

    layers = [_compact(layer) for layer in cache]

    # Beside `path`, created exclusively under a random name (its folder may be shared),
    # written through that descriptor (mlx writes to a file object as to a path).
    def write(f: BinaryIO) -> None:
        save_prompt_cache(f, layers, metadata)  # type: ignore[arg-type]  # mlx-lm names a path; a file works too

    replace_beside(path, write, mode=0o600)  # it holds the prompt
    return os.path.getsize(path)

"""What differs between the mlx-lm versions we support (0.31.3 and later 0.31.x, 0.32.x):
the one place that knows, asked by every caller that meets a difference.

The differences we meet (docs/versions.md lists them all, with where each is handled):

- **Cache layer state.** 0.32 folds every scalar into ``state`` (``KVCache.state`` is
  ``(keys, values, offset)``, ``RotatingKVCache.state`` ends in ``_idx``…) and
  ``from_state(state)`` takes it alone. 0.31 splits it: ``state`` holds the arrays only
  (``KVCache.state`` is ``(keys, values)`` cut to the offset), the scalars are strings in
  ``meta_state``, and ``from_state(state, meta_state)`` takes both. Its ``KVCache`` and
  ``ChunkedKVCache`` state setters take the offset from the keys' length, so a layer
  whose buffer runs past its offset cannot be expressed there: `make_layer` sets the
  offset after. ``ArraysCache.state`` is ``(cache, left_padding, lengths)`` in 0.32 and the
  bare list in 0.31; ``CacheList.state`` carries its children's class names in 0.32 and
  ``meta_state`` does in 0.31.
- **ChunkedKVCache prefilled in pieces** (llama4): 0.31 trims the front by the length of
  its step-padded buffer rather than of what it holds, so a second ``update_and_fetch``
  fails in mlx-lm itself once the buffer is longer than ``chunk_size`` (fixed in 0.32).
  We do not work around it: `CHUNKED_PIECEWISE_PREFILL` says whether it works.
- **deepseek_v32's indexer cache** (and glm_moe_dsa's, built on it): 0.31 caches values of
  width 0 beside its keys, 0.32 caches the keys again as values. Same classes, same
  layout signature, different tensors: restored across the two, either would fail in the
  model (a width-0 field is not stored at all: `adapters.KVAdapter`).
- **Model code** changed in most model files; the fingerprint does not cover it.
  `layout_variant` puts the line into the root key: 0.31 and 0.32 never share stored KV.
- **``mlx_lm.load``**: 0.32 takes ``trust_remote_code`` (a config's ``model_file``, custom
  model code, is refused without it); 0.31 has no such argument and runs that code
  unasked, as its own ``mlx_lm generate`` does. `load_options` gives what the installed one takes.
- **``mlx_lm generate``'s options**: the same flags, but ``--xtc-threshold`` defaults to
  0.0 in 0.31 and 0.1 in 0.32 (`generate_default`: ``ppc generate`` samples as the
  installed one does); 0.32 adds ``--image`` and ``--prefill-step-size``, which ``ppc
  generate`` has in both (refused, and its own block-aligned step).
- **Prompt-cache files** (``save_prompt_cache`` / ``load_prompt_cache``): 0.32's metadata
  is ``[metadata, classes, scalars]``, 0.31's ``[meta_states, metadata, classes]``; each
  reads only its own (the file import/export of ``ppc import-mlx`` owns those layouts).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm import __version__ as MLX_LM_VERSION
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

if TYPE_CHECKING:
    from mlx_lm.models.cache import _BaseCache  # every cache layer class's base (the same in both lines)


def _parse(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())  # "0rc1" -> 0
        out.append(int(digits or 0))
    return tuple(out)


#: The installed mlx-lm, as a comparable tuple (``(0, 32, 2)``).
MLX_LM = _parse(MLX_LM_VERSION)

#: The range the package declares (pyproject.toml's pin): a version outside it was never tested.
SUPPORTED_RANGE = ((0, 31, 3), (0, 33, 0))

#: 0.31's protocol: ``state`` arrays plus ``meta_state`` strings, ``from_state(state, meta_state)``.
#: Told by the classes themselves, not by the version string.
SPLIT_META_STATE = "meta_state" in dir(KVCache)

#: Whether ``mlx_lm.load`` takes ``trust_remote_code`` (0.32: custom model code needs it).
LOAD_ASKS_TRUST_REMOTE_CODE = "trust_remote_code" in inspect.signature(mlx_lm_load).parameters

#: Whether a ``ChunkedKVCache`` may be prefilled in more than one call (see above).
CHUNKED_PIECEWISE_PREFILL = MLX_LM >= (0, 32, 0)

#: Whether deepseek_v32's indexer caches values of width 0 (0.31) rather than its keys again.
INDEXER_VALUES_EMPTY = MLX_LM < (0, 32, 0)


def load_options(trust_remote_code: bool) -> dict[str, Any]:
    """Keyword arguments of ``mlx_lm.load`` for ``--trust-remote-code``, as the installed
    mlx-lm's own CLI passes them (the tokenizer's in both; the model code's where it asks)."""
    options: dict[str, Any] = {"tokenizer_config": {"trust_remote_code": True} if trust_remote_code else None}
    if LOAD_ASKS_TRUST_REMOTE_CODE:
        options["trust_remote_code"] = trust_remote_code
    return options


def generate_default(dest: str, fallback: Any) -> Any:
    """The installed ``mlx_lm generate``'s default for option `dest` (`fallback` where it
    has no such option)."""
    from mlx_lm.generate import setup_arg_parser

    for action in setup_arg_parser()._actions:
        if action.dest == dest:
            return action.default
    return fallback


def layout_variant() -> str:
    """What the root key adds to the layout signature on the installed mlx-lm: "" on 0.32,
    ``"+mlx-lm-0.31"`` on 0.31, so the two lines never share stored KV.

    The fingerprint covers a model's class, config and weights, not mlx-lm's model code,
    and that code changed between the lines (95 of the 119 model files 0.31.3 ships differ
    in 0.32.2; deepseek_v32's indexer even caches other tensors in the same classes). No
    store was written under 0.31 before (the pin was ``>=0.32``), so 0.32's keys are kept.
    Within a line, patch releases are taken to compute the same KV.
    """
    return "" if MLX_LM >= (0, 32, 0) else "+mlx-lm-0.31"


def make_layer(cls: type, arrays: tuple, **scalars: Any) -> Any:
    """A cache layer of mlx-lm class `cls` from its tensors and scalars, on either protocol.

    Args:
        cls: ``KVCache``, ``QuantizedKVCache``, ``RotatingKVCache`` or ``ChunkedKVCache``.
        arrays: ``(keys, values)`` (each a tuple of three for ``QuantizedKVCache``). The
            buffers may run past ``offset`` (``KVCache`` then writes the next tokens in place).
        scalars: ``offset`` for all; ``group_size``, ``bits`` (quantized); ``keep``,
            ``max_size``, ``idx`` (rotating); ``chunk_size``, ``start`` (chunked).

    Returns:
        The layer, as that class's ``from_state`` builds it.

    Raises:
        TypeError: If `cls` is none of those classes.
    """
    keys, values = arrays
    offset = int(scalars["offset"])
    # mypy reads the installed mlx-lm: on 0.32 the 0.31 branches' two-argument calls are ignored.
    if cls is KVCache:
        if not SPLIT_META_STATE:
            return KVCache.from_state((keys, values, offset))
        layer = KVCache.from_state((keys, values), "")  # type: ignore[call-arg]  # 0.31's two-argument form
        layer.offset = offset  # 0.31's setter took keys.shape[2]
        return layer
    if cls is QuantizedKVCache:
        group_size, bits = int(scalars["group_size"]), int(scalars["bits"])
        if not SPLIT_META_STATE:
            return QuantizedKVCache.from_state((keys, values, offset, group_size, bits))
        meta = tuple(map(str, (offset, group_size, bits)))
        return QuantizedKVCache.from_state((keys, values), meta)  # type: ignore[call-arg]  # 0.31's two-argument form
    if cls is RotatingKVCache:
        keep, max_size, idx = int(scalars["keep"]), int(scalars["max_size"]), int(scalars["idx"])
        if not SPLIT_META_STATE:
            return RotatingKVCache.from_state((keys, values, offset, keep, max_size, idx))
        meta = tuple(map(str, (keep, max_size, offset, idx)))
        return RotatingKVCache.from_state((keys, values), meta)  # type: ignore[call-arg]  # 0.31's two-argument form
    if cls is ChunkedKVCache:
        chunk_size, start = int(scalars["chunk_size"]), int(scalars["start"])
        if not SPLIT_META_STATE:
            return ChunkedKVCache.from_state((keys, values, offset, chunk_size, start))
        meta = tuple(map(str, (chunk_size, start)))
        layer = ChunkedKVCache.from_state((keys, values), meta)  # type: ignore[call-arg]  # 0.31's two-argument form
        layer.offset = offset  # 0.31's setter took keys.shape[2]
        return layer
    raise TypeError(f"make_layer builds no {getattr(cls, '__name__', cls)!r}")


def arrays_state(state: Any) -> list | None:
    """The recurrent arrays of an ``ArraysCache`` state of either version (None if it is not one).

    0.32's state is ``(cache, left_padding, lengths)``; 0.31's the bare ``cache`` list.
    """
    if isinstance(state, (list, tuple)) and len(state) == 3 and isinstance(state[0], list):
        return list(state[0])
    if isinstance(state, (list, tuple)) and all(x is None or isinstance(x, mx.array) for x in state):
        return list(state)
    return None


def layer_from_state(cls: type[_BaseCache], state: Any, meta_state: Any = None) -> Any:
    """``cls.from_state`` with what a caller recorded (vllm-mlx keeps ``state`` and
    ``meta_state`` side by side): 0.31 takes both, 0.32 the state alone.

    Raises:
        TypeError, ValueError: Where the class rejects the state (as mlx-lm raises them).
    """
    if SPLIT_META_STATE:
        meta = "" if meta_state is None else meta_state
        return cls.from_state(state, meta)  # type: ignore[call-arg]  # 0.31's two-argument form
    return cls.from_state(state)


def new_arrays_cache(arrays: list) -> ArraysCache:
    """An ``ArraysCache`` holding `arrays` (the constructor and attributes are the same in both)."""
    layer = ArraysCache(len(arrays))
    layer.cache = list(arrays)
    return layer

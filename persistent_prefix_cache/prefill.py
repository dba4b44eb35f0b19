"""Prefill that restores what the store holds, runs the rest at the model's speed, and
stores it.

The forward passes are mlx-lm's own: steps of ``prefill_step_size`` tokens (2,048, as
``mlx_lm.generate``), the cache evaluated and MLX's buffer cache cleared after each, the
last token fed alone for the logits. Where blocks are cut is the store's business, not
the forwards': a model whose layers are all sliced along the sequence (``KVCache``,
``QuantizedKVCache``) is resumable at every block boundary whatever the forwards were,
so its prompt is stored once, as one segment: whole, after the last forward, or on a GPU
all but its last token, while the device runs that forward
(`device.target.forwards_run_beside`). A model with recurrent
or sliding-window layers (``ArraysCache``, ``RotatingKVCache``, ``ChunkedKVCache``) is
resumable only where a forward ended and a snapshot was stored: it stores after every
forward, and its forwards are the shortest runs of whole blocks whose per-call cost
stays within `costs.SNAPSHOT_OVERHEAD` of their tokens'
(`PersistentPrefixCache.resumable_step`): every block on a CPU, where a call costs
little, 2,048 tokens on a GPU that spends ~10 ms per call. Until the store knows the
model's costs on this device kind, the forwards grow from one block, doubling, and the
store learns them from the first two (of different sizes).

A restore also prices the prefill where the store cannot yet (`store.calibrate` for the
prompt: at most a quarter of what recomputing the restored tokens would cost, at most
once per handle, remembered for every store of the model on the machine).
Else a prompt prefilled once per process would never be: a process's first forward
compiles kernels and is not taught, the last token alone prices no token, and a resumed
prompt's one-token forward teaches the first forward's cost; the store would then restore
whatever a restore costs (a resume of 4k tokens took 1.5-1.7 x a recompute on an H100
host reading ~3 GB/s).
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any, Callable

import mlx.core as mx

from .core import costs
from .core.calibration import MIN_STAKE
from .core.costs import PREFILL_STEP
from .device.target import beside_stream, forwards_run_beside, room_for
from .errors import InvalidArgumentError
from .keys import as_token_array
from .layers import all_sliced, frozen, leaves

log = logging.getLogger("persistent_prefix_cache")


def prefill(
    model: Any,
    tokens: Any,
    store: Any,
    *,
    prefill_step_size: int | None = None,
    blocks_per_chunk: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list, mx.array]:
    """Prefill `tokens`, restoring what the store has and storing the rest.

    Args:
        model: The mlx-lm model the store was opened with.
        tokens: The prompt (at least one token).
        store: The `PersistentPrefixCache` (or an object with its `fetch`, `store`,
            `make_cache`, `block_size`, `observe_prefill` and `resumable_step`, and
            `calibrate` where it has one).
        prefill_step_size: Most tokens per forward pass (mlx-lm's option of that name).
            Default: 2,048 for a model whose layers are all sliced along the sequence;
            for one with recurrent or sliding-window layers, which can resume only where
            a forward ended, the store's `resumable_step` (whole blocks; at most 2,048;
            one block, then doubling, until the store knows the model's costs).
        blocks_per_chunk: The same in blocks (``prefill_step_size = blocks_per_chunk *
            block_size``), as earlier versions took it.
        progress: Called with (tokens processed, total) after each forward pass.

    Returns:
        ``(cache, logits)``: the cache covering all of `tokens`, and the logits for
        the token after them (shape ``[1, vocab]``), ready for generation.

    Raises:
        InvalidArgumentError: If `tokens` is empty or not a sequence of ints, or a step
            is not a positive int.
        StoreClosedError: If the store is closed.
    """
    toks = as_token_array(tokens)
    if len(toks) == 0:
        raise InvalidArgumentError("prefill needs at least one token")
    for name, value in (("prefill_step_size", prefill_step_size), ("blocks_per_chunk", blocks_per_chunk)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if prefill_step_size is not None and blocks_per_chunk is not None:
        raise InvalidArgumentError("give prefill_step_size or blocks_per_chunk, not both")
    ids = toks.tolist()
    cache, remaining = store.fetch(ids)
    if cache is None:
        cache = store.make_cache()
    pos = len(ids) - len(remaining)
    if pos >= MIN_STAKE:  # restored enough to be worth measuring for (fewer: only lookups would run)
        _price_prefill(model, ids, store)
    bs = store.block_size
    # Stored once at the end (every block boundary resumable), or after every forward.
    every_forward = not all_sliced(cache)
    if blocks_per_chunk is not None:
        prefill_step_size = blocks_per_chunk * bs
    fixed = prefill_step_size
    if fixed is None and not every_forward:
        fixed = PREFILL_STEP
    if fixed is not None and every_forward:  # forwards end on block boundaries: snapshots resume there
        fixed = max(bs, fixed // bs * bs)
    probe = bs  # the next forward while the costs are unknown: one block, then doubling
    restored = pos > 0  # the first forward on a restored cache costs more (mlx-lm grows it by a copy)
    stop = len(ids) - 1  # the last token is fed below, for the logits
    stored = pos
    while pos < stop:
        step = fixed or store.resumable_step()
        if step is None:
            step, probe = probe, min(2 * probe, PREFILL_STEP)
        end = min(pos + step, stop)
        if every_forward and end < stop:
            end = max(end // bs * bs, pos + 1)
        started = costs.clock()
        model(mx.array(ids[pos:end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        # For the cost model (kept in the store per model and device kind).
        store.observe_prefill(end - pos, costs.clock() - started, start=pos, restored=restored)
        restored = False
        if every_forward:
            store.store(ids[:end], cache)
            stored = end
        pos = end
        mx.clear_cache()  # as mlx-lm's prefill: the step's temporaries go back
        if progress is not None:
            progress(pos, len(ids))
    if every_forward and stored < stop:  # its snapshot is the cache as it is now
        store.store(ids[:stop], cache)
        stored = stop
    # The whole prompt, with the last forward: a sliced cache trims, so a fetch of the same
    # prompt takes all but its last token and one that extends it takes every token. Where
    # a device runs the forwards beside this thread, all but the last token instead (an
    # extension computes one token more), while the device runs the last forward: the
    # store's copies go on a stream of their own and read the cache as it was before that
    # forward (`frozen`), so neither waits for the other. The forward is timed with the
    # store's work on this thread, the shorter of the two (~2 ms against ~5 ms for 256
    # tokens of an 8B llama on an H100). While the store holds the cache as it was, that
    # forward writes a copy of the KV instead of into it, beside the store's own copy: only
    # where the device has room for two more (on this project's CPU, that path's peak was
    # 1.8 x the KV above the other's: docs/performance.md).
    whole = not every_forward and stored < len(ids)
    beside = whole and forwards_run_beside() and room_for(2 * sum(layer.nbytes for _, layer in leaves(cache)))
    before = frozen(cache) if beside and stored < stop else None
    started = costs.clock()
    logits = model(mx.array(ids[pos:])[None], cache=cache)[:, -1, :]
    if before is not None:
        mx.async_eval(logits)
        with mx.stream(beside_stream()):
            store.store(ids[:stop], before)
    mx.eval(logits)
    store.observe_prefill(len(ids) - pos, costs.clock() - started, start=pos, restored=restored)
    if whole and not beside:
        store.store(ids, cache)  # after the forward: no device beside this thread to overlap
    if progress is not None:
        progress(len(ids), len(ids))
    return cache, logits


def _price_prefill(model: Any, ids: list[int], store: Any) -> None:
    """Have `store` measure the model's prefill if it does not know it (see the module's
    docstring); a model the measurement cannot drive leaves it unknown, with a warning."""
    calibrate = getattr(store, "calibrate", None)
    if calibrate is None:
        return
    try:
        calibrate(model, prompt=ids, only_if_unknown=True)
    except Exception as exc:  # the caller's prefill goes on: the store then restores blind
        log.warning("could not measure the model's prefill for the cost model: %s", exc)


class _CallableModule(types.ModuleType):
    """This module, callable as `prefill`: importing ``persistent_prefix_cache.prefill``
    binds the package's attribute ``prefill`` to the module (Python does, after the
    lazy ``from persistent_prefix_cache import prefill`` had bound the function), so a
    program that imported both ways would otherwise get a module where the README
    promises the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list, mx.array]:
        return prefill(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

"""Block-aligned prefill that stores as it goes.

`store()` after a normal generation only sees the final state, so a model with
recurrent layers (``ArraysCache``) becomes resumable only at that one position.
`prefill` runs the prompt in chunks that end on block boundaries and stores after each
chunk, so such prompts become resumable at every block boundary, and also one token
before the end, which is where an identical later prompt resumes (the model needs at
least one token to produce logits).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import mlx.core as mx

from .keys import as_token_array
from .store import PersistentPrefixCache


def prefill(
    model: Any,
    tokens: Any,
    store: PersistentPrefixCache,
    *,
    blocks_per_chunk: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list, mx.array]:
    """Prefill `tokens`, restoring what the store has and storing the rest.

    Args:
        model: The mlx-lm model the store was opened with.
        tokens: The prompt (at least one token).
        store: The store.
        blocks_per_chunk: Blocks per forward pass; a chunk boundary is where a model with
            recurrent layers becomes resumable (1: every block).
        progress: Called with (tokens processed, total) after each chunk.

    Returns:
        ``(cache, logits)``: the cache covering all of `tokens`, and the logits for
        the token after them (shape ``[1, vocab]``), ready for generation.

    Raises:
        InvalidArgumentError: If `tokens` is empty or not a sequence of ints.
    """
    from .errors import InvalidArgumentError

    toks = as_token_array(tokens)
    if len(toks) == 0:
        raise InvalidArgumentError("prefill needs at least one token")
    if not isinstance(blocks_per_chunk, int) or isinstance(blocks_per_chunk, bool) or blocks_per_chunk < 1:
        raise InvalidArgumentError(f"blocks_per_chunk must be an int >= 1, got {blocks_per_chunk!r}")
    ids = toks.tolist()
    cache, remaining = store.fetch(ids)
    if cache is None:
        cache = store.make_cache()
    pos = len(ids) - len(remaining)
    restored = pos > 0  # the first forward on a restored cache costs more (mlx-lm grows it by a copy)
    chunk = store.block_size * blocks_per_chunk
    stop = len(ids) - 1  # the last token is fed below, for the logits
    while pos < stop:
        end = min((pos // chunk + 1) * chunk, stop)
        started = time.perf_counter()
        model(mx.array(ids[pos:end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        # For the cost model (kept in the store per model and device kind).
        store.observe_prefill(end - pos, time.perf_counter() - started, start=pos, restored=restored)
        restored = False
        store.store(ids[:end], cache)
        pos = end
        if progress is not None:
            progress(pos, len(ids))
    started = time.perf_counter()
    logits = model(mx.array(ids[pos:])[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    store.observe_prefill(len(ids) - pos, time.perf_counter() - started, start=pos, restored=restored)
    if progress is not None:
        progress(len(ids), len(ids))
    return cache, logits

"""Calibration: timing a model's prefill on purpose, for the cost model (`costs.Costs`).

A store learns the prefill from the forwards its callers run (`prefill()`, ``ppc
generate``, ``ppc serve``'s prompts); `calibrate` runs forwards of its own where no
caller has taught it yet (``ppc serve`` at its first request, `PersistentPrefixCache.calibrate`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

MAX_CALIBRATION_TOKENS = 4096  # the longest prompt `calibrate` grows to
_clock = time.perf_counter  # what `calibrate` times with (tests set a clock of their own)


def calibrate(costs: Any, model: Any, make_cache: Callable[[], list], tokens: int) -> None:
    """Time `model`'s prefill into `costs` (a `costs.Costs`): forwards of ``n // 8`` and of `n` tokens on
    fresh caches (per token and per call apart), then ``n // 4``, ``n // 2`` and
    ``n // 4`` more on the second cache (attention's growth with the position).

    `n` starts at `tokens` and doubles (up to `MAX_CALIBRATION_TOKENS`) while the forward
    of `n` tokens takes less than 1.5 x that of ``n // 8``: there a forward is bound by
    its call, not its tokens (an 8B model on an H200 takes ~12 ms for 32 and for 256
    tokens alike), and a fit from such timings alone put 256 tokens at 22 ms, or at
    0.3 ms. Each set of forwards runs once untimed first: a process's first forward of a
    shape compiles MLX's kernels (a 64-token continuation took 99 ms the first time and
    17 ms after on the H200). Runs on the calling thread (it owns MLX's stream).

    Raises:
        InvalidArgumentError: If `tokens` is not an int >= 2.
    """
    import mlx.core as mx

    from .errors import InvalidArgumentError

    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
        raise InvalidArgumentError(f"tokens must be an int >= 2, got {tokens!r}")
    ids = [(7 * i + 1) % 251 for i in range(2 * max(tokens, MAX_CALIBRATION_TOKENS))]

    def run(calls: list[tuple[int, int, int]], observed_from: int = 0) -> list[float]:
        """The calls ``(cache, start, end)`` once untimed, then timed (and observed from
        the `observed_from`-th on)."""
        for timed in (False, True):
            caches, seconds = [make_cache(), make_cache()], []
            for k, (which, start, end) in enumerate(calls):
                started = _clock()
                mx.eval(model(mx.array([ids[start:end]]), cache=caches[which]))
                seconds.append(_clock() - started)
                if timed and k >= observed_from:
                    costs.observe_prefill(end - start, seconds[-1], start=start)
        return seconds

    n = tokens
    while True:
        short, long = run([(0, 0, max(1, n // 8)), (1, 0, n)])
        if n >= MAX_CALIBRATION_TOKENS or long >= 1.5 * short:
            break
        n = min(2 * n, MAX_CALIBRATION_TOKENS)
    # Three more calls on a cache the long forward filled (timed already), at growing positions.
    calls = [(1, 0, n)]
    for end in (n + n // 4, n + 3 * n // 4, 2 * n):
        if end > calls[-1][2]:
            calls.append((1, calls[-1][2], end))
    if len(calls) > 1:
        run(calls, observed_from=1)

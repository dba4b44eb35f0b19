"""Calibration: timing a model's prefill on purpose, for the cost model (`costs.Costs`).

A store learns the prefill from the forwards its callers run (`prefill()`, ``ppc
generate``, ``ppc serve``'s prompts, the compat layers' prompts); `calibrate` runs
forwards of its own where no caller has taught it yet (the compat layers, ``ppc
serve``'s among them, at the first read that finds a stored prefix worth it;
`PersistentPrefixCache.calibrate`). Around it, a handle's `cost_model.CostModel.calibrate`:
a rate this machine measured before for the model (`machine_costs`) is taken instead of
measuring, a measurement is kept there for every store, and the first one of a process
is said once (logging, INFO, with its duration: `first_measured`).
"""

from __future__ import annotations

from typing import Any, Callable

from . import costs as _costs
from .costs import Costs, first_forward_here

MAX_CALIBRATION_TOKENS = 4096  # the longest prompt `calibrate` grows to
# Measuring for a fetch (`stake`): at most about this share of the predicted prefill of
# the prefix it decides about, and no forward at all where its first set would cost more.
SHARE = 0.25
MIN_TOKENS = 32  # the shortest first timed forward worth fitting (its eighth: 4 tokens)
FIRST_SET = 2.25  # tokens a set of forwards of n // 8 and n feeds, run twice: 2.25 n
# The fewest tokens at stake that a calibration for a fetch runs any forward for (288).
MIN_STAKE = int(MIN_TOKENS * FIRST_SET / SHARE)
# Rates (tokens/s of a 1,024- and a 32,768-token prefill) a remembered record may give:
# outside these it is not a prefill this machine measured.
MIN_RATE, MAX_RATE = 0.01, 1e9
_announced: set[str] = set()  # the records this process has measured and said so


def calibrate(costs: Any, model: Any, make_cache: Callable[[], list], tokens: int, *, stake: int | None = None) -> bool:
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

    Args:
        stake: Measure for a fetch that would restore this many tokens: `n` is at most
            what keeps the first set's tokens within `SHARE` of them (no forward at all
            below `MIN_TOKENS`), and a further set runs only while the time spent plus
            its predicted cost stays within `SHARE` of the predicted prefill of the
            `stake` tokens. None: no bound (an explicit calibration).

    Returns:
        Whether anything was measured.

    Raises:
        InvalidArgumentError: If `tokens` is not an int >= 2.
    """
    import mlx.core as mx

    from ..errors import InvalidArgumentError

    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
        raise InvalidArgumentError(f"tokens must be an int >= 2, got {tokens!r}")
    if stake is not None:
        tokens = min(tokens, int(stake * SHARE / FIRST_SET))
        if tokens < MIN_TOKENS:
            return False  # what is at stake costs less than one set of forwards
    ids = [(7 * i + 1) % 251 for i in range(2 * max(tokens, MAX_CALIBRATION_TOKENS))]
    started = _costs.clock()

    def run(calls: list[tuple[int, int, int]], observed_from: int = 0) -> list[float]:
        """The calls ``(cache, start, end)`` once untimed, then timed (and observed from
        the `observed_from`-th on)."""
        for timed in (False, True):
            caches, seconds = [make_cache(), make_cache()], []
            for k, (which, start, end) in enumerate(calls):
                begun = _costs.clock()
                mx.eval(model(mx.array([ids[start:end]]), cache=caches[which]))
                seconds.append(_costs.clock() - begun)
                if timed and k >= observed_from:
                    costs.observe_prefill(end - start, seconds[-1], start=start)
            first_forward_here()  # the untimed round compiled the kernels
        return seconds

    def affordable(calls: list[tuple[int, int, int]]) -> bool:
        """Whether running `calls` (twice) keeps within the stake's share, as predicted."""
        if stake is None:
            return True
        cost = 2 * sum(costs.prefill_seconds(start, end) or 0.0 for _, start, end in calls)
        return _costs.clock() - started + cost <= SHARE * (costs.prefill_seconds(0, stake) or 0.0)

    def first(n: int) -> list[tuple[int, int, int]]:
        return [(0, 0, max(1, n // 8)), (1, 0, n)]

    n = tokens
    while True:
        short, long = run(first(n))
        if n >= MAX_CALIBRATION_TOKENS or long >= 1.5 * short or not affordable(first(2 * n)):
            break
        n = min(2 * n, MAX_CALIBRATION_TOKENS)
    # Three more calls on a cache the long forward filled (timed already), at growing positions.
    calls = [(1, 0, n)]
    for end in (n + n // 4, n + 3 * n // 4, 2 * n):
        if end > calls[-1][2]:
            calls.append((1, calls[-1][2], end))
    if len(calls) > 1 and affordable(calls):
        run(calls, observed_from=1)
    return True


def first_measured(key: str) -> bool:
    """Whether this process has not said yet that it measured the record `key` (and
    from now on it has): the first measurement of each is logged, once."""
    first = key not in _announced
    _announced.add(key)
    return first


def plausible(record: dict) -> bool:
    """Whether a prefill record gives rates between `MIN_RATE` and `MAX_RATE` tokens/s
    at 1,024 and at 32,768 tokens (a remembered record is trusted no further)."""
    probe = Costs()
    try:
        probe.take_prefill(record)
        seconds = [(n, probe.prefill_seconds(0, n)) for n in (1024, 32768)]
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return False
    return all(s is not None and n / MAX_RATE <= s <= n / MIN_RATE for n, s in seconds)

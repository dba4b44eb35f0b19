"""Calibration: timing a model's prefill on purpose, for the cost model (`costs.Costs`).

A store learns the prefill from the forwards its callers run (`prefill()`, ``ppc
generate``, ``ppc serve``'s prompts, the compat layers' prompts); `calibrate` runs
forwards of its own where no caller has taught it yet (the compat layers, ``ppc
serve``'s among them, at the first read that finds a stored prefix worth it;
`PersistentPrefixCache.calibrate`). Around it, the facade's
`calibrate` (`CalibrationMixin`): a rate this machine measured before for the model
(`machine_costs`) is taken instead of measuring, a measurement is kept there for every
store, and the first one of a process is said once (logging, INFO, with its duration).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import machine_costs
from .costs import Costs, first_forward_here
from .keys import root_key

log = logging.getLogger("persistent_prefix_cache")

MAX_CALIBRATION_TOKENS = 4096  # the longest prompt `calibrate` grows to
# Measuring for a fetch (`stake`): at most about this share of the predicted prefill of
# the prefix it decides about, and no forward at all where its first set would cost more.
SHARE = 0.25
MIN_TOKENS = 32  # the shortest first timed forward worth fitting (its eighth: 4 tokens)
FIRST_SET = 2.25  # tokens a set of forwards of n // 8 and n feeds, run twice: 2.25 n
# Rates (tokens/s of a 1,024- and a 32,768-token prefill) a remembered record may give:
# outside these it is not a prefill this machine measured.
MIN_RATE, MAX_RATE = 0.01, 1e9
_clock = time.perf_counter  # what `calibrate` times with (tests set a clock of their own)
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

    from .errors import InvalidArgumentError

    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
        raise InvalidArgumentError(f"tokens must be an int >= 2, got {tokens!r}")
    if stake is not None:
        tokens = min(tokens, int(stake * SHARE / FIRST_SET))
        if tokens < MIN_TOKENS:
            return False  # what is at stake costs less than one set of forwards
    ids = [(7 * i + 1) % 251 for i in range(2 * max(tokens, MAX_CALIBRATION_TOKENS))]
    started = _clock()

    def run(calls: list[tuple[int, int, int]], observed_from: int = 0) -> list[float]:
        """The calls ``(cache, start, end)`` once untimed, then timed (and observed from
        the `observed_from`-th on)."""
        for timed in (False, True):
            caches, seconds = [make_cache(), make_cache()], []
            for k, (which, start, end) in enumerate(calls):
                begun = _clock()
                mx.eval(model(mx.array([ids[start:end]]), cache=caches[which]))
                seconds.append(_clock() - begun)
                if timed and k >= observed_from:
                    costs.observe_prefill(end - start, seconds[-1], start=start)
            first_forward_here()  # the untimed round compiled the kernels
        return seconds

    def affordable(calls: list[tuple[int, int, int]]) -> bool:
        """Whether running `calls` (twice) keeps within the stake's share, as predicted."""
        if stake is None:
            return True
        cost = 2 * sum(costs.prefill_seconds(start, end) or 0.0 for _, start, end in calls)
        return _clock() - started + cost <= SHARE * (costs.prefill_seconds(0, stake) or 0.0)

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


class CalibrationMixin:
    """`PersistentPrefixCache.calibrate` (the facade's private `_costs`, `_saved_costs`,
    `_fingerprint`, `_layout`, `_model_name` and `_remote`)."""

    def calibrate(
        self, model: Any, *, tokens: int = 512, only_if_unknown: bool = False, prompt: Any = None
    ) -> float | None:
        """Measure how fast `model` prefills on this machine, for the cost model (see
        `calibration.calibrate`): remembered in the store for this model and device kind,
        and for every store of it on this machine (`machine_costs`); the first measurement
        of a process is logged (INFO, with its duration). Call it on the thread that runs
        the model (MLX's streams belong to a thread).

        Args:
            model: The model the store was opened with.
            tokens: Tokens of the first timed forward (more, up to 4,096, where a forward
                of that many is bound by its call: a fast GPU).
            only_if_unknown: Measure nothing if the prefill of this model on this
                device kind is known: measured here, remembered by the store, or measured
                on this machine before (then taken from there: no forward runs).
            prompt: Measure for a fetch of this prompt: nothing unless the store holds
                a prefix of it (a miss decides nothing: the caller's prefill then teaches
                the rate), and at most about `SHARE` of that prefix's predicted prefill
                (nothing for a prefix under ``MIN_TOKENS * FIRST_SET / SHARE``: 288 tokens).

        Returns:
            Tokens/s of a 1,024-token prefill as now known (None: skipped, unknown).

        Raises:
            StoreClosedError: If the store is closed.
            InvalidArgumentError: If `tokens` < 2.
        """
        self._check_open()
        costs, saved = self._costs, self._saved_costs
        if only_if_unknown and costs.prefill_tokens_per_s is not None:
            return costs.prefill_tokens_per_s
        model_root = root_key(self._fingerprint, "", self._layout.signature + self._layout.variant).hex()
        key, name = machine_costs.record_key(model_root, saved.device), self._model_name or self._fingerprint[:16]
        if only_if_unknown:
            record = machine_costs.recall(key)
            if record is not None and plausible(record):
                costs.take_prefill(record)
                log.debug("cost model: the prefill of %s on %s as this machine measured it before", name, saved.device)
                return costs.prefill_tokens_per_s
        # What a fetch of `prompt` would restore (a remote tier may hold more than the disk).
        stake = None if prompt is None else len(prompt) if self._remote is not None else self.peek(prompt)
        began = time.perf_counter()
        if not calibrate(costs, model, self.make_cache, tokens, stake=stake):
            return costs.prefill_tokens_per_s
        seconds = time.perf_counter() - began
        saved.maybe_save(force=True)
        record = dict(costs.prefill_record(), device=saved.device, model=name[:200])
        kept = plausible(record) and machine_costs.remember(key, record)
        if key not in _announced:  # said once a process, where it happened
            _announced.add(key)
            log.info(
                "cost model: measured the prefill of %s on %s in %.2f s: %.0f tokens/s (%s)",
                name, saved.device, seconds, costs.prefill_tokens_per_s or 0.0,
                f"kept for every store of this model on this machine, in {machine_costs.folder()}" if kept
                else "kept for this store only",
            )  # fmt: skip
        return costs.prefill_tokens_per_s


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

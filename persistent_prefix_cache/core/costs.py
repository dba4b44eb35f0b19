"""The cost model: restore a prefix only where that is faster than computing it.

On Apple Silicon a prefill runs at 60-1,000 tokens/s and any restore wins by far; on a
datacenter GPU a prefill runs at tens of thousands of tokens/s and a restore from disk
can lose (docs/h200-measurements.md). The store learns on this machine, from real
work, what each side costs, and a fetch restores the prefix that saves the most time:
all of it, only the part held in RAM, a shorter prefix, or nothing.

- Prefill: seconds for tokens ``[start, end)`` = ``a·n + b·(end² − start²)/2 + c·f``
  (a per token, attention's growth with the position, and a cost per forward call: `f`
  calls of up to `PREFILL_STEP` tokens), fitted by least squares over decayed
  observations (`Fit`): every timed forward pass (`prefill()`, ``ppc generate``, ``ppc
  serve``'s prompt segments, `calibrate`). The per-call cost matters on a GPU, where a
  forward of 64 tokens is bound by its launch, not its tokens.
- Restore, per tier: a fixed cost (lookup of segment digests, plan, allocation) plus
  bytes over a rate, fitted the same way from every timed restore, and trusted from
  the second one on (`TRUSTED_WEIGHT`).
- The first forward on a restored cache: what it costs beyond a forward of the same
  tokens on a cache the model grew itself, per restored token (mlx-lm grows a restored
  cache by a copy of it; on CUDA, pages restored through host memory move then).

A continuation the remote tier holds is read only if reading it and then restoring it
is faster than prefilling its tokens (`worth_reading`). Until the prefill is known
every fetch restores (and is timed).

`Costs` is what was learned and what it decides; a handle's `cost_model.CostModel`
teaches it, asks it for every fetch and keeps it in the store's ``costs.json`` per model
root and device kind (`device.target.device_kind`: MLX's default device and its name), as a `record`
that `load` takes back. Records older than `MAX_AGE` seconds are ignored (a driver or
MLX upgrade changes the rates).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from .cost_fit import ALPHA, TRUSTED_WEIGHT, Fit

# Restores smaller than this teach the fixed cost only (the rate would be noise).
MIN_TIMED_BYTES = 1 << 20
# Tokens per forward call of a caller's prefill (mlx-lm's prefill_step_size default).
PREFILL_STEP = 2048
# A prefill that stores a snapshot at the end of every forward (recurrent or sliding-window
# layers resume only there) cuts its forwards short: by at most this share of their time.
SNAPSHOT_OVERHEAD = 0.05
# A first forward on a restored cache teaches its extra cost only up to this many tokens:
# a longer one's difference from the predicted prefill is mostly the prediction's error
# (a 2,048-token prompt 5 tokens of which were restored, predicted 20 % low by a
# calibration on a CPU, put 1.5 s on every later restore, which then skipped 512-token
# prompts it would have restored 80 x faster than their prefill).
FIRST_FORWARD_TOKENS = 256
# Saved records older than this are read without their first forward (learned as above,
# per restored token, since version 3) and without their prefill (since version 4 a
# server's requests are kept apart, `Costs.prefill_requests`; before, they may be mixed in).
RECORD_VERSION = 4
MAX_AGE = 30 * 24 * 3600.0
TIERS = ("ram", "disk", "remote")
# What a prefill's and a calibration's forwards are timed by (`prefill()`, `calibrate`): one
# clock, so a test can set its own and have every forward it counts cost what it says.
clock = time.perf_counter
# Tiers this process has restored from (and "forward" once it ran one, `first_forward_here`):
# its first restore from each pays one-off costs
# (MLX compiling kernels for the shapes met, the reader pool and pinned buffers made), a
# cost of its own (`Costs.first_restore`), never mixed into the tier's rate.
_restored_here: set[str] = set()


def first_forward_here() -> bool:
    """Whether this process has not run a forward yet (and from now on it has): its
    first compiles MLX's kernels, which no later forward pays (a restarted process's
    first request, a one-token forward after a 4k-token restore on an H200, took 0.16 s
    more than predicted and taught that as every restore's first-forward cost)."""
    return first_restore_here("forward")


def first_restore_here(tier: str) -> bool:
    """Whether this process has not restored from `tier` yet (and from now on it has)."""
    first = tier not in _restored_here
    _restored_here.add(tier)
    return first


def _prefill_features(start: int, end: int, forwards: int) -> tuple[float, float, float]:
    """Per token, attention's growth (Σ of the positions), per forward call."""
    return (end - start, (end * end - start * start) / 2, forwards)


def _prefill_time(coef: list[float], start: int, end: int) -> float:
    """Predicted seconds to prefill positions ``[start, end)`` by known coefficients."""
    x = _prefill_features(start, end, -(-(end - start) // PREFILL_STEP))
    return sum(c * f for c, f in zip(coef, x))


def _new_prefill(sums: list[float] | None = None) -> Fit:
    return Fit(_prefill_order, sums, keep_first=False, features=3)


# A forward of this many tokens is mostly its tokens on every backend measured (an 8B
# model on an H200: ~10 ms a call, 64 and 256 tokens alike, 2,048 in ~60 ms).
LARGE_FORWARD = 512


def _prefill_order(sums: list[float]) -> tuple[int, ...]:
    """Which of a prefill's features explains forwards all of one size (they cannot tell
    a call's cost from its tokens'): their tokens where those forwards were large (on
    average, `LARGE_FORWARD` tokens and more), else their calls, so that a caller's small
    forwards never teach "the model is slow" (64-token forwards of an 8B model on an H200
    are bound by their launch: read as tokens they put its prefill at ~6,000 tokens/s, a
    fifth of its speed, and restores slower than the prefill looked worth it). Small
    forwards alone then price a token at nothing, which leaves the prefill unknown
    (`Costs._prefill_coefficients`); forwards of other sizes (prefill's steps, its last
    token) tell the two apart.
    Features: (tokens, growth, forwards); sums as `Fit` keeps them."""
    per_forward = sums[0 * 3 + 2] / sums[2 * 3 + 2] if sums[2 * 3 + 2] > 0 else 0.0  # Σ n·f / Σ f²
    return (0, 2, 1) if per_forward >= LARGE_FORWARD else (2, 0, 1)


def _new_requests(sums: list[float] | None = None) -> Fit:
    # Features (tokens, growth, 1): the tokens first, then a request's own time, then growth.
    return Fit((0, 2, 1), sums)  # the tokens kept first: two requests alike must not read as all overhead


def _new_restore(sums: list[float] | None = None) -> Fit:
    return Fit((1, 0), sums)  # features (1, bytes): the rate first, then the fixed cost


@dataclass
class Choice:
    """What a fetch restores: the first `blocks` blocks of its path, `tokens` tokens."""

    blocks: int
    tokens: int
    saved_seconds: float | None  # estimated time saved against a prefill (None: unknown)
    decision: str = "restored_all"  # restored_all / restored_ram_only / restored_shorter / skipped_slower


class Costs:
    """Learned costs of one model on one device kind, and the choice they drive.

    Args:
        enabled: False restores whatever is stored (``cost_model=False``).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.prefill = _new_prefill()  # seconds ~ a·tokens + b·(end² − start²)/2 + c·forwards
        # The prefill as a server's requests show it (`observe_prefill(exact=False)`):
        # seconds ~ a·tokens + b·(e² − s²)/2 + r, `r` a request's own time (queueing,
        # sampling, the answer), which no restore saves. Where a caller's prefill is a
        # server's, its tokens cost what they cost there: mlx-lm's server prefilled 2k
        # tokens of a 3B model ~3 x slower than `calibrate`'s forwards (H100). Fitted
        # with the forwards' features, `r` read as a call's cost (~144 ms) and restores
        # of 64 tokens of 2,092 "saved a call".
        self.prefill_requests = _new_requests()
        self.restore: dict[str, Fit] = {}  # tier -> seconds ~ fixed·1 + (1/rate)·bytes
        # Seconds per restored token a first forward on a restored cache costs beyond one on
        # a grown cache: mlx-lm copies what was restored (docs/cost-model.md).
        self.first_forward_per_token: float | None = None
        # Tier -> seconds a process's first restore from it took beyond the tier's fit.
        self.first_restore: dict[str, float] = {}
        # The fastest single forward call seen: no call's fixed cost can exceed it (a
        # bound on the per-call coefficient, which noise can otherwise inflate).
        self.fastest_forward: float | None = None
        self.changed = False  # anything learned since the last save
        self.device: str | None = None  # the device kind the costs are of (`cost_model.SavedCosts`)
        self._lock = threading.Lock()

    # -- the rates, as numbers ----------------------------------------------------------

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Tokens/s of a prefill of a 1,024-token prompt (None until measured, and while
        what was measured prices no token); setting it makes the prefill linear at that rate."""
        seconds = self.prefill_seconds(0, 1024)
        return None if not seconds else 1024 / seconds

    @prefill_tokens_per_s.setter
    def prefill_tokens_per_s(self, rate: float | None) -> None:
        with self._lock:
            self._forget_prefill()
            if rate:
                self.prefill.set((1 / rate, 0.0, 0.0))

    @property
    def timed_forwards(self) -> bool:
        """Whether `prefill` was taught by timed forwards (`calibrate`, `prefill()`, a rate
        given), not only by a server's requests (`prefill_requests`)."""
        return any(self.prefill.sums)

    @property
    def measured(self) -> bool:
        """Whether the prefill was timed or set at all (forwards or a server's requests),
        priced or not (a prompt's last token alone is timed and prices nothing: it is
        `prefill_tokens_per_s`, not this, that says whether the prefill is known)."""
        return self.timed_forwards or any(self.prefill_requests.sums)

    def _forget_prefill(self) -> None:
        """Forget both prefill fits and the fastest forward (the lock held)."""
        self.prefill, self.prefill_requests, self.fastest_forward = _new_prefill(), _new_requests(), None
        self.changed = True

    @property
    def restore_bytes_per_s(self) -> dict[str, float]:
        """Bytes/s per tier (fixed costs apart); assigning a dict sets the rates and
        clears the fixed costs."""
        out = {}
        for tier, fit in list(self.restore.items()):
            coef = fit.coefficients()
            if coef and coef[1] > 0:
                out[tier] = 1 / coef[1]
        return out

    @restore_bytes_per_s.setter
    def restore_bytes_per_s(self, rates: dict[str, float]) -> None:
        self.set_restore(rates)

    def set_prefill(self, tokens_per_s: float, growth: float = 0.0, per_forward: float = 0.0) -> None:
        """Set the prefill: `tokens_per_s` at position 0, each later position costing
        `growth` seconds more per token and position (attention), and `per_forward`
        seconds per forward call of up to `PREFILL_STEP` tokens."""
        with self._lock:
            self._forget_prefill()
            self.prefill.set((1 / tokens_per_s, growth, per_forward))

    def set_restore(self, rates: dict[str, float], fixed: dict[str, float] | None = None) -> None:
        """Set the restore rates (bytes/s) and fixed costs (seconds) per tier."""
        with self._lock:
            self.restore = {}
            for tier, rate in rates.items():
                self.restore[tier] = _new_restore()
                self.restore[tier].set(((fixed or {}).get(tier, 0.0), 1 / rate))
            self.changed = True

    def restore_fixed_seconds(self, tier: str) -> float | None:
        """The fixed cost of a restore from `tier` (None until measured)."""
        fit = self.restore.get(tier)
        coef = fit.coefficients() if fit is not None else None
        return None if coef is None else coef[0]

    def prefill_seconds(self, start: int, end: int) -> float | None:
        """Predicted seconds to prefill positions ``[start, end)`` (None: unknown)."""
        coef = self._prefill_coefficients()
        return None if coef is None else _prefill_time(coef, start, end)

    def resumable_step(self, block_size: int) -> int | None:
        """The shortest forward, in whole blocks, whose per-call cost is at most
        `SNAPSHOT_OVERHEAD` of its tokens' (`PREFILL_STEP` at most): how often a prefill of
        a model with recurrent or sliding-window layers can stop and store a snapshot
        without slowing down by more than that. None until the prefill is known."""
        coef = self._prefill_coefficients()
        if coef is None:
            return None
        longest = max(block_size, PREFILL_STEP // block_size * block_size)
        if coef[0] <= 0:
            return longest
        tokens = coef[2] / (SNAPSHOT_OVERHEAD * coef[0])
        return min(longest, max(1, math.ceil(tokens / block_size)) * block_size)

    def _prefill_coefficients(self) -> list[float] | None:
        """(per token, growth, per forward call): a server's requests' per token and
        growth where it has timed any (a call's cost then from timed forwards, else 0),
        else the timed forwards'."""
        coef = self.prefill.coefficients()
        if coef is not None and self.fastest_forward is not None:
            coef[2] = min(coef[2], self.fastest_forward)
        requests = self.prefill_requests.coefficients()
        if requests is not None and requests[0] > 0:
            return [requests[0], requests[1], coef[2] if coef is not None else 0.0]
        # A fit that prices a token at nothing (per token and growth 0) has seen only forwards
        # bound by their calls (a prompt's last token alone, a caller's small chunks): it
        # cannot say what a prefill of many tokens costs, and deciding by it recomputed what
        # the RAM tier would restore 3 x faster (tests/test_costs_paths.py). The prefill is
        # unknown until a token is priced.
        return coef if coef is not None and (coef[0] > 0 or coef[1] > 0) else None

    def _restore_seconds(self, tier: str, nbytes: int) -> float | None:
        fit = self.restore.get(tier)
        coef = fit.coefficients() if fit is not None else None
        if coef is None or (coef[1] <= 0 and nbytes > 0):
            return None
        return coef[0] + coef[1] * nbytes

    # -- learning ----------------------------------------------------------------------

    def observe_prefill(
        self, tokens: int, seconds: float, *, start: int = 0, forwards: int = 1, exact: bool = True
    ) -> None:
        """Record that positions ``[start, start + tokens)`` were prefilled in `seconds`,
        by `forwards` forward calls (`exact`: the seconds are the forwards' alone; else a
        server's request, which never bounds what one call costs)."""
        if tokens > 0 and seconds > 0 and start >= 0 and forwards >= 1:
            with self._lock:
                if exact:
                    self.prefill.add(_prefill_features(start, start + tokens, forwards), seconds)
                else:  # (tokens, growth, 1): a request's own time in place of its calls
                    self.prefill_requests.add(_prefill_features(start, start + tokens, forwards)[:2] + (1.0,), seconds)
                if forwards == 1 and exact:
                    self.fastest_forward = min(seconds, self.fastest_forward or seconds)
                self.changed = True

    def observe_restore(self, tier: str, nbytes: int, seconds: float, *, first: bool = False) -> None:
        """Record that `nbytes` of KV were restored from `tier` in `seconds` (a restore
        under `MIN_TIMED_BYTES` teaches only the fixed cost).

        Args:
            first: The process's first restore from `tier`: once the tier's fit is trusted,
                it teaches only what it took beyond it (`first_restore`).
        """
        if seconds <= 0 or nbytes < 0:
            return
        with self._lock:
            fit = self.restore.setdefault(tier, _new_restore())
            coef = fit.coefficients()
            if first and coef is not None and coef[1] > 0 and fit.weight() >= TRUSTED_WEIGHT:
                extra = max(0.0, seconds - coef[0] - coef[1] * nbytes)
                old = self.first_restore.get(tier)
                self.first_restore[tier] = extra if old is None else (1 - ALPHA) * old + ALPHA * extra
                self.changed = True
                return
            if nbytes >= MIN_TIMED_BYTES:
                fit.add((1.0, nbytes), seconds)
            else:
                coef = fit.coefficients()
                if coef is not None and coef[1] > 0:  # the time beyond the bytes' share
                    fit.add((1.0, 0.0), max(0.0, seconds - coef[1] * nbytes))
            self.changed = True

    def observe_first_forward(self, tokens: int, seconds: float, *, start: int) -> None:
        """Record a forward of `tokens` tokens right after a restore of `start`
        tokens: what it took beyond a forward on a grown cache, per restored token, is
        the first forward's cost (ignored until the prefill is known, and for forwards over
        `FIRST_FORWARD_TOKENS`: there the prefill's own prediction error, not the restore,
        decides the difference)."""
        if not 0 < tokens <= FIRST_FORWARD_TOKENS:
            return
        expected = self.prefill_seconds(start, start + tokens)
        if expected is None or seconds <= 0:
            return
        if start <= 0:
            return
        extra = max(0.0, seconds - expected) / start
        with self._lock:
            old = self.first_forward_per_token
            self.first_forward_per_token = extra if old is None else (1 - ALPHA) * old + ALPHA * extra
            self.changed = True

    # -- deciding ------------------------------------------------------------------------

    def worth_reading(self, tier: str, tokens: int, nbytes: int) -> bool:
        """Whether reading `nbytes` of KV covering `tokens` tokens from `tier` (the
        remote) and then restoring them from the RAM tier is faster than a prefill of
        those tokens; True until the rates are known (and always when disabled)."""
        if not self.enabled or nbytes <= 0:
            return True
        with self._lock:
            prefill = self.prefill_seconds(0, tokens)
            read = self._restore_seconds(tier, nbytes)
            ram = self._restore_seconds("ram", nbytes)
        if prefill is None or read is None:
            return True
        return read + (ram or 0.0) < prefill

    def choose(
        self, ends: list[int], sizes: list[int], in_ram: list[bool], resumable: list[int], total: int | None = None
    ) -> Choice:
        """The prefix of a lookup's path that saves the most time.

        Restoring the first ``i + 1`` blocks costs the fixed cost of the slowest tier
        they come from, the first forward's extra for ``ends[i]`` restored tokens, and each block's bytes
        over its tier's rate. It saves what a prefill of the whole prompt costs beyond
        the prefill of what is left, ``prefill(0, total) − prefill(ends[i], total)``:
        the caller runs a forward for the rest either way, so a restore saves no
        forward call's fixed cost unless it saves a whole call (a GPU's forward is
        bound by its launches below a few hundred tokens: counting one call per
        restore made an 8B model on an H200 restore 64 tokens of 8,193, and 512-token
        prompts, at a loss).

        Args:
            ends: Tokens covered once each block of the path is restored (the last
                may be less than that block's end: the matched length).
            total: The prompt's length (the caller computes ``[ends[i], total)``);
                ``ends[-1]`` if not given.
            sizes: Bytes of each block.
            in_ram: Whether each block is in the RAM tier.
            resumable: Indexes of the blocks at whose end (``ends[i]``) every layer
                can be rebuilt: the candidate cut points (the last is the whole path).

        Returns:
            The choice; ``blocks == 0`` means restore nothing (``skipped_slower``).
        """
        whole = Choice(len(ends), ends[-1] if ends else 0, None)
        if not self.enabled or not ends:
            return whole
        with self._lock:
            prefill = self._prefill_coefficients()
            if prefill is None:
                return whole  # the prefill is not known: restore (and time the restore)
            slopes, fixed = {}, {}
            for tier in ("ram", "disk"):
                fit = self.restore.get(tier)
                coef = fit.coefficients() if fit is not None else None
                if fit is not None and coef is not None and coef[1] > 0 and fit.weight() >= TRUSTED_WEIGHT:
                    fixed[tier], slopes[tier] = coef
            first = self.first_forward_per_token or 0.0
            # A tier this process has not restored from yet costs its first time's extra.
            once = {t: self.first_restore.get(t, 0.0) if t not in _restored_here else 0.0 for t in ("ram", "disk")}
            if not all(("ram" if r else "disk") in slopes for r in in_ram):
                return whole  # a tier not timed (twice) yet: restore, and learn its rate
            best, most, cost, disk = Choice(0, 0, 0.0, "skipped_slower"), 0.0, 0.0, False
            cuts = set(resumable)
            total = max(ends[-1], total or 0)
            computed = _prefill_time(prefill, 0, total)
            for i, (size, ram) in enumerate(zip(sizes, in_ram)):
                cost += size * slopes["ram" if ram else "disk"]
                disk = disk or not ram
                if i in cuts:
                    tier = "disk" if disk else "ram"
                    spent = cost + fixed[tier] + once[tier] + first * ends[i]
                    saved = computed - _prefill_time(prefill, ends[i], total) - spent
                    if saved > most:
                        best, most = Choice(i + 1, ends[i], saved), saved
        if best.blocks == len(ends):
            best.decision = "restored_all"
        elif best.blocks:
            ram_part = next((i for i, r in enumerate(in_ram) if not r), len(in_ram))
            best.decision = "restored_ram_only" if best.blocks == ram_part else "restored_shorter"
        return best

    def figures(self) -> dict[str, Any]:
        """The costs as `PersistentPrefixCache.stats` shows them (None: not measured, or
        for the prefill's, nothing measured prices a token).

        Returns:
            prefill_tokens_per_s (of a 1,024-token prompt), prefill_growth (seconds per
            token per position: attention's share), prefill_per_forward_s,
            restore_bytes_per_s_ram, _disk and _remote, restore_fixed_s_ram, _disk and
            _remote, first_forward_s_per_token, first_restore_s_ram and _disk (what a
            process's first restore from a tier takes beyond its rate: MLX's kernel
            compiles, buffers made), cost_device (the device kind the costs are of).
        """
        coef = self._prefill_coefficients()
        out: dict[str, Any] = {"prefill_tokens_per_s": self.prefill_tokens_per_s}
        out["prefill_growth"] = None if coef is None else coef[1]
        out["prefill_per_forward_s"] = None if coef is None else coef[2]
        rates = self.restore_bytes_per_s
        for tier in TIERS:
            out[f"restore_bytes_per_s_{tier}"] = rates.get(tier)
            out[f"restore_fixed_s_{tier}"] = self.restore_fixed_seconds(tier)
        out["first_forward_s_per_token"] = self.first_forward_per_token
        for tier in ("ram", "disk"):
            out[f"first_restore_s_{tier}"] = self.first_restore.get(tier)
        out["cost_device"] = self.device
        return out

    # -- persistence ---------------------------------------------------------------------

    def record(self) -> dict:
        """What `load` takes back: the fits' sums and the first forward's cost."""
        with self._lock:
            return {
                "version": RECORD_VERSION,
                "saved": time.time(),
                "prefill": list(self.prefill.sums),
                "prefill_requests": list(self.prefill_requests.sums),
                "restore": {tier: list(fit.sums) for tier, fit in self.restore.items()},
                "first_forward_per_token": self.first_forward_per_token,
                "first_restore": dict(self.first_restore),
                "fastest_forward": self.fastest_forward,
                "timed_forwards": self.timed_forwards,
            }

    def prefill_record(self) -> dict:
        """The prefill's part of `record` (what `machine_costs` keeps for every store)."""
        with self._lock:
            return {"prefill": list(self.prefill.sums), "fastest_forward": self.fastest_forward}

    def take_prefill(self, record: dict) -> None:
        """Start the prefill from a `prefill_record` (the rest is kept; the caller checks it)."""
        prefill, fastest = [float(v) for v in record["prefill"]], record.get("fastest_forward")
        with self._lock:
            self.prefill = _new_prefill(prefill)
            self.fastest_forward = None if fastest is None else max(0.0, float(fastest))
            self.changed = True

    def load(self, record: dict) -> bool:
        """Start from a saved `record` (ignored if malformed or older than `MAX_AGE`).

        Returns:
            Whether anything was taken.
        """
        try:
            if time.time() - float(record["saved"]) > MAX_AGE:
                return False
            prefill = [float(v) for v in record["prefill"]]
            requests = record.get("prefill_requests")
            requests = None if requests is None else [float(v) for v in requests]
            restore = {str(t): [float(v) for v in s] for t, s in record.get("restore", {}).items() if t in TIERS}
            first = record.get("first_forward_per_token") if record.get("version", 1) >= RECORD_VERSION else None
            first = None if first is None else max(0.0, float(first))
            once = {str(t): max(0.0, float(v)) for t, v in (record.get("first_restore") or {}).items() if t in TIERS}
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        if record.get("version", 1) < RECORD_VERSION:
            prefill, requests = [], []  # an older prefill may mix requests in: learned again
        with self._lock:
            self.prefill = _new_prefill(prefill or None)
            self.prefill_requests = _new_requests(requests or None)
            self.restore = {tier: _new_restore(sums) for tier, sums in restore.items()}
            self.first_forward_per_token = first
            self.first_restore = once
            fastest = record.get("fastest_forward") if self.timed_forwards else None
            self.fastest_forward = None if fastest is None else max(0.0, float(fastest))
        return True

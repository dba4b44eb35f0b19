"""The cost model: restore a prefix only where that is faster than computing it.

On Apple Silicon a prefill runs at 60-1,000 tokens/s and any restore wins by far; on a
datacenter GPU a prefill runs at tens of thousands of tokens/s and a restore from disk
can lose (docs/h200-measurements.md). The store learns on this machine, from real
work, how fast each tier restores (bytes/s: timed fetches) and how fast the model
prefills (tokens/s: `prefill()`, or `PersistentPrefixCache.calibrate`), and a fetch
restores the prefix that saves the most time: all of it, only the part held in RAM,
or nothing. A continuation the remote tier holds is read only if reading it and then
restoring it is faster than prefilling its tokens (`worth_reading`). Until the rates
are known every fetch restores (and is timed).

Rates are moving averages (weight `ALPHA` for the newest figure), kept per handle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

ALPHA = 0.3
# Restores smaller than this are not timed: fixed costs would swamp their rate.
MIN_TIMED_BYTES = 1 << 20


@dataclass
class Choice:
    """What a fetch restores: the first `blocks` blocks of its path, `tokens` tokens."""

    blocks: int
    tokens: int
    saved_seconds: float | None  # estimated time saved against a prefill (None: unknown)


class Costs:
    """Learned rates of one store handle and the choice they drive.

    Args:
        enabled: False restores whatever is stored (``cost_model=False``).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.prefill_tokens_per_s: float | None = None
        self.restore_bytes_per_s: dict[str, float] = {}  # "ram" / "disk" -> bytes/s
        self._lock = threading.Lock()

    @staticmethod
    def _blend(old: float | None, new: float) -> float:
        return new if old is None else (1 - ALPHA) * old + ALPHA * new

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Record that `tokens` tokens were prefilled in `seconds`."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, tokens / seconds)

    def observe_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        """Record that `nbytes` of KV were restored from `tier` in `seconds`."""
        if nbytes >= MIN_TIMED_BYTES and seconds > 0:
            with self._lock:
                self.restore_bytes_per_s[tier] = self._blend(self.restore_bytes_per_s.get(tier), nbytes / seconds)

    def worth_reading(self, tier: str, tokens: int, nbytes: int) -> bool:
        """Whether reading `nbytes` of KV covering `tokens` tokens from `tier` (the
        remote) and then restoring them from the RAM tier is faster than a prefill of
        those tokens; True until the rates are known (and always when disabled)."""
        with self._lock:
            prefill, rates = self.prefill_tokens_per_s, dict(self.restore_bytes_per_s)
        if not self.enabled or prefill is None or not rates.get(tier) or nbytes <= 0:
            return True
        cost = nbytes / rates[tier] + (nbytes / rates["ram"] if rates.get("ram") else 0.0)
        return cost < tokens / prefill

    def choose(self, ends: list[int], sizes: list[int], in_ram: list[bool], resumable: list[int]) -> Choice:
        """The prefix of a lookup's path that saves the most time.

        Args:
            ends: Tokens covered once each block of the path is restored (the last
                may be less than that block's end: the matched length).
            sizes: Bytes of each block.
            in_ram: Whether each block is in the RAM tier.
            resumable: Indexes of the blocks at whose end (``ends[i]``) every layer
                can be rebuilt: the candidate cut points (the last is the whole path).

        Returns:
            The choice; ``blocks == 0`` means restore nothing.
        """
        whole = Choice(len(ends), ends[-1] if ends else 0, None)
        with self._lock:
            prefill, rates = self.prefill_tokens_per_s, dict(self.restore_bytes_per_s)
        if not self.enabled or not ends or prefill is None:
            return whole
        if not all(rates.get("ram" if r else "disk") for r in in_ram):
            return whole  # a tier not timed yet: restore, and learn its rate
        best = Choice(0, 0, 0.0)
        cost = 0.0
        cuts = set(resumable)
        for i, (size, ram) in enumerate(zip(sizes, in_ram)):
            cost += size / rates["ram" if ram else "disk"]
            if i in cuts:
                saved = ends[i] / prefill - cost
                if saved > best.saved_seconds:
                    best = Choice(i + 1, ends[i], saved)
        return best

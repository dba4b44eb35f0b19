"""`KeyFilter`: a bounded memory of block keys, two generations of a Bloom filter.

A block key is an xxh3-128 digest, so its bits are uniform already: a key's bit
positions are slices of the key itself, with no hashing. A generation takes a fixed
number of keys, then the older one is dropped: the filter remembers the last one to two
generations of keys in a fixed number of bytes, and a key never added is taken for an
added one with a small chance (a false yes, never a false no within its window).

Two users: `disk.removed` (block keys evicted lately, for the miss reasons) and
`admission` (block keys seen but not written, for the admission rule).
"""

from __future__ import annotations

import threading
from typing import Iterable

HASHES = 4  # bit positions per key: 32-bit slices of its 128 bits


class KeyFilter:
    """The last `generation` to ``2 * generation`` keys added, in ``2 * bits / 8`` bytes.

    Args:
        bits: Bits per generation, a power of two up to 2**32.
        generation: Keys a generation takes before the older one is dropped.

    With ``bits = 16 * generation`` (and `HASHES` = 4) a key never added is held for an
    added one with a chance of at most ~0.24 % per generation (~0.5 % for both, once full).
    """

    def __init__(self, *, bits: int, generation: int):
        if bits <= 0 or bits & (bits - 1) or bits > 1 << 32:
            raise ValueError(f"bits must be a power of two up to 2**32, got {bits}")
        self.bits, self.generation = bits, generation
        self._mask = bits - 1
        self._lock = threading.Lock()
        self._current = bytearray(bits // 8)
        self._previous: bytearray | None = None
        self._count = 0

    @property
    def nbytes(self) -> int:
        """Bytes the filter holds once both generations exist."""
        return 2 * (self.bits // 8)

    def add(self, keys: Iterable[bytes]) -> None:
        """Remember `keys` (16 bytes or more each)."""
        with self._lock:
            for key in keys:
                if self._count == self.generation:
                    self._previous, self._current, self._count = self._current, bytearray(self.bits // 8), 0
                bits = self._current
                for i in self._positions(key):
                    bits[i >> 3] |= 1 << (i & 7)
                self._count += 1

    def holds(self, key: bytes) -> bool:
        """Whether `key` was added within the window (rarely a false yes)."""
        positions = self._positions(key)
        with self._lock:
            return any(
                bits is not None and all(bits[i >> 3] >> (i & 7) & 1 for i in positions)
                for bits in (self._current, self._previous)
            )

    def _positions(self, key: bytes) -> list[int]:
        value = int.from_bytes(key[:16], "little")
        return [(value >> (32 * j)) & self._mask for j in range(HASHES)]

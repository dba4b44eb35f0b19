"""The block keys this process removed from a store lately, so that a fetch that misses
there can say why (`miss_reasons`): evicted under the disk budget, or dropped as damaged.

`Removed` is one per store directory per process (`removed_for`: every `Index` of that
store in this process shares it, so an eviction made by one handle's writer is seen by
another handle's fetches), and it lives as long as an `Index` holds it.

- **Evicted keys** go into a `key_filter.KeyFilter` (two generations of a Bloom filter),
  `EVICTED_BITS` bits each (128 KiB). A generation takes `GENERATION` keys, then the
  older one is dropped: the last 65,536 to 131,072 evicted keys are remembered, 256 KiB
  in all, and a key never evicted is taken for an evicted one with a chance of at most
  ~0.24 % per generation (~0.5 % for both, once full).
- **Dropped keys** (a block found damaged, dropped with what follows it) are rare: the
  last `DROPPED` of them are kept exactly.

Nothing here is written to disk: evictions by another process (another server, ``ppc gc``)
and those before this process opened the store are not known, and such a miss reads as
never stored.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Iterable

from ..key_filter import KeyFilter

EVICTED_BITS = 1 << 20  # bits per generation of the filter: 128 KiB
GENERATION = 1 << 16  # keys per generation
DROPPED = 4096  # damaged keys remembered exactly


class Removed:
    """Recently evicted and dropped block keys of one store (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.evicted_keys = KeyFilter(bits=EVICTED_BITS, generation=GENERATION)
        self._dropped: OrderedDict[bytes, None] = OrderedDict()

    def evicted(self, keys: Iterable[bytes]) -> None:
        """Remember keys removed by an eviction (a committed one)."""
        self.evicted_keys.add(keys)

    def dropped(self, key: bytes) -> None:
        """Remember a key dropped because its block was found damaged."""
        with self._lock:
            self._dropped[key] = None
            self._dropped.move_to_end(key)
            while len(self._dropped) > DROPPED:
                self._dropped.popitem(last=False)

    def was_evicted(self, key: bytes) -> bool:
        """Whether `key` was evicted lately (a Bloom filter: rarely a false yes)."""
        return self.evicted_keys.holds(key)

    def was_dropped(self, key: bytes) -> bool:
        """Whether `key` was dropped as damaged lately."""
        with self._lock:
            return key in self._dropped


_BY_STORE: weakref.WeakValueDictionary[str, Removed] = weakref.WeakValueDictionary()
_REGISTRY = threading.Lock()


def removed_for(path: str) -> Removed:
    """The `Removed` of the store whose index folder is `path` in this process (made on
    first use; the caller keeps it alive by holding it)."""
    with _REGISTRY:
        memory = _BY_STORE.get(path)
        if memory is None:
            memory = _BY_STORE[path] = Removed()
        return memory

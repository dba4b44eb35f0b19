"""A store's restores go before its writer: the writer pauses while a restore reads.

A server stores each request's prompt on its writer thread while the next request
restores; both work the same disk, page cache, memory bus and cores (and, on a GPU, the
copy engine). Measured on this project's 2-core VM (`tools/profile_restore.py`, a 3B-shaped
KV): a restore of 2k–4k tokens took 2.5–5 × as long while another prompt was being
written as with the writer idle. A restore is short and the caller waits for it; a write
is background work nobody waits for. So a restore marks itself `reading`, and the writer
`wait`s at its safe points (before a segment, between its batches, before each fsync)
while any restore reads, holding no lock a restore could need.

A wait is bounded (`MAX_WAIT_SECONDS` a time): back-to-back restores slow the writer
down, never stop it. A thread that is itself restoring never waits (it would wait for
itself).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

# The longest the writer waits at one safe point: a 16k-token restore of an 8B model
# takes ~0.3 s on an H200, seconds on a CPU.
MAX_WAIT_SECONDS = 5.0


class ReadsFirst:
    """Who is restoring now, for a writer that gives way to them (see the module)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._readers: dict[int, int] = {}  # thread id -> nesting depth
        self.waits = 0  # times a writer found a restore under way and waited (tests read it)
        self.waiting = 0  # writers waiting now

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Mark the calling thread as restoring for the duration of the block."""
        me = threading.get_ident()
        with self._changed:
            self._readers[me] = self._readers.get(me, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                depth = self._readers.pop(me) - 1
                if depth:
                    self._readers[me] = depth
                else:
                    self._changed.notify_all()

    def wait(self, limit: float = MAX_WAIT_SECONDS) -> None:
        """Return once no other thread is restoring, or after `limit` seconds."""
        me = threading.get_ident()
        with self._changed:
            if not self._readers or me in self._readers:
                return
            self.waits += 1
            self.waiting += 1
            try:
                self._changed.wait_for(lambda: not self._readers, timeout=limit)
            finally:
                self.waiting -= 1

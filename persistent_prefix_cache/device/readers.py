"""The reader threads: a pool shared by every restore of the process, and the one way a
restore's reads, checksums and copies are shared between it and the caller's thread."""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

# Reader threads: reads and checksums of a path's (segment, field) pieces, and copies
# of RAM-tier blocks, run in parallel (all drop the GIL); a pool of 4 on small machines,
# up to 8 where cores allow (module settings: a benchmark may set both). A restore's
# reads are shared by READ_THREADS threads, the caller's among them: one per core (at
# most 8), each taking the next (segment, field) as it finishes one (`share`); on a single
# core the caller reads alone. Quiet 2-core VM, 128 MiB float16, page cache warm
# (`tools/bench.py`): 36.4 ms on the caller's thread alone, 24-25 ms with the pool taking
# one job per hand-over (4 threads), 21-22 ms so (raw read: 20.5 ms; the reads and
# checksums themselves ~16 ms, at a bare 2-thread loop's ~15.5 ms). A thread that
# neighbours slow down takes fewer jobs, where the pool's rounds waited for it.
# Reads staged to a CUDA GPU (`device.cuda.Stager`: each piece also hashed and handed
# to the copy engine by a driver call) take up to 12: a 16k-token restore of an 8B llama
# on a 16-core H100 host read in 85-102 ms with 12 threads, 118-142 ms with 8 and
# 100-145 ms with 16 (`tools/first_restore.py ... after+t12+phases`, one run;
# docs/performance.md, seventeenth day). Elsewhere 8 stay: more were not measured there.
_CPUS = os.cpu_count() or 1
READERS = max(4, min(12, _CPUS))  # threads of the pool (set before the first restore)
READ_THREADS = 1 if _CPUS <= 1 else min(8, _CPUS)  # threads sharing a restore's reads, the caller's included
STAGED_READ_THREADS = 1 if _CPUS <= 1 else min(12, _CPUS)  # the same, where the reads are staged to a CUDA GPU
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def reader_pool() -> ThreadPoolExecutor:
    """The reader threads shared by every restore of this process (made on first use).

    Returns:
        The pool's executor (`READERS` threads named ``ppc-reader``).
    """
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READERS, thread_name_prefix="ppc-reader")
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool
    _pool = None  # its threads do not exist in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def share(fn: Callable, items: list, *, alone: bool = False, threads: int | None = None) -> list:
    """`fn` over `items`: on the reader threads and this one, or here alone.

    Each thread takes the next item as it finishes one: one hand-over per thread, not
    one per item (a restore of 128 MiB has 32 jobs of ~0.5 ms; on a 2-core VM the
    pool's hand-over of each cost ~1.5 ms in all), and a thread a neighbour slows down
    takes fewer items. This thread works too, instead of waiting.

    Args:
        fn: Called once per item, on any of the threads.
        items: What to call it on.
        alone: Call it on this thread only (a host target's read: a background fill,
            which leaves the reader pool to callers).
        threads: How many threads share them, this one included (default `READ_THREADS`).

    Returns:
        ``fn``'s results, in the order of `items`.
    """
    n = len(items)
    threads = READ_THREADS if threads is None else threads
    if n <= 1 or threads <= 1 or alone:
        return [fn(x) for x in items]
    out: list = [None] * n
    taken = itertools.count()  # its next() is atomic: each item goes to one thread

    def work() -> None:
        for i in iter(taken.__next__, None):
            if i >= n:
                return
            out[i] = fn(items[i])

    helpers = [reader_pool().submit(work) for _ in range(min(threads, n) - 1)]
    try:
        work()
    finally:
        wait(helpers)  # they write into the caller's buffers: never leave before them
    for f in helpers:
        f.result()  # a helper's failure is this call's
    return out

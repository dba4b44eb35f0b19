"""The writer thread: one daemon thread running submitted jobs in order.

Not a ``ThreadPoolExecutor``: its pools are shut down by ``concurrent.futures``'
exit hook before ``atexit`` handlers run, while our exit hook still has to finish
pending writes. A daemon thread lives until interpreter finalization, after them.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class Worker:
    """Runs jobs one at a time, in submission order, on a daemon thread.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its result or exception lands in the returned future."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Finish the queued jobs, then end the thread."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

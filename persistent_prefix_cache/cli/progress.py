"""The progress line of a long ``ppc`` run, and how such a run ends early.

`Progress` draws one line on stderr (on a terminal only): prompts, tokens, the rate of
computed tokens and the time left. `sigterm_raises` makes SIGTERM end a run the way Ctrl-C
does (`Terminated`, raised in the main thread like `KeyboardInterrupt`), so ``kill``
gets the same ending: the line terminated, what was kept said once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import Iterator


class Terminated(BaseException):
    """SIGTERM arrived (raised by `sigterm_raises`'s handler). A `BaseException`, as
    `KeyboardInterrupt` is, so no ``except Exception`` on the way swallows it."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread; the handler before
    is put back on the way out (off the main thread, where Python cannot set one,
    nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def eta(left: int, rate: float) -> str:
    """Time to cover `left` tokens at `rate` tokens per second, as ``m:ss`` or
    ``h:mm:ss``; ``-`` while no rate is known.

    The rate is of computed tokens only: a resumed run restores its first prompts in no
    time, and counting them as speed would promise the rest as fast.
    """
    if rate <= 0:
        return "-"
    seconds = max(0, round(left / rate))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


# Computed tokens before the line shows a time left: a restored prompt computes only its
# last token or so, too few to tell a rate by.
MIN_RATE_TOKENS = 256


class Progress:
    """A one-line progress display on stderr, redrawn in place on a terminal.

    Off a terminal (a log file, CI) it stays silent: the summary says it all, and a
    file full of carriage returns helps nobody.

    Args:
        total_prompts: Prompts to process.
        total_tokens: Tokens in all prompts.
        enabled: False to draw nothing.
    """

    WIDTH = 24

    def __init__(self, total_prompts: int, total_tokens: int, *, enabled: bool = True):
        self.total_prompts = total_prompts
        self.total_tokens = total_tokens
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()
        self.prompts_done = 0
        self.tokens_before = 0  # tokens of the prompts already finished
        self.computed = 0  # tokens actually run through the model
        self.restoring = 0.0  # seconds spent restoring, left out of the rate
        self._last = 0.0
        self._width = 0

    def update(
        self, done_in_prompt: int, computed: int, *, restoring: float | None = None, force: bool = False
    ) -> None:
        """Redraw with `done_in_prompt` tokens of the current prompt covered, `computed`
        tokens prefilled so far in total, and `restoring` seconds spent restoring so far
        (the rate is of computing: tokens computed over the time not spent restoring)."""
        self.computed = computed
        if restoring is not None:
            self.restoring = restoring
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        done = self.tokens_before + done_in_prompt
        frac = done / self.total_tokens if self.total_tokens else 1.0
        filled = int(frac * self.WIDTH)
        rate = self.computed / max(now - self.start - self.restoring, 1e-9)
        left = eta(self.total_tokens - done, rate) if self.computed >= MIN_RATE_TOKENS else "-"
        line = (
            f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] "
            f"{self.prompts_done}/{self.total_prompts} prompts  "
            f"{done:,}/{self.total_tokens:,} tokens  {rate:,.0f} tok/s  "
            f"ETA {left}"
        )
        self._width = max(self._width, len(line))
        sys.stderr.write(line.ljust(self._width))
        sys.stderr.flush()

    def prompt_done(self, n_tokens: int) -> None:
        """Count one finished prompt of `n_tokens` tokens."""
        self.prompts_done += 1
        self.tokens_before += n_tokens
        self.update(0, self.computed, force=True)

    def close(self) -> None:
        """End the progress line."""
        if self.enabled and self._width:
            sys.stderr.write("\n")
            sys.stderr.flush()

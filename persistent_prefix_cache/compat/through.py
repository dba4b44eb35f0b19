"""Read-through and write-through to a store, shared by every compat layer.

A compat layer keeps caches in memory the way the API it imitates does, and asks the
store only for what memory does not cover (``fetch(tokens, longer_than=...)``: nothing
is loaded unless the store holds more). A store is an optimisation there: its errors
become one warning per cause, never a failed request.

The link also feeds the store's cost model what it can observe: a write of a prefix of
the prompt last read (a server saving the cache at the end of a prompt segment, before
any token is generated) took the prefill of the tokens since that read, within a
request's own time (merging the cache into its batch, sampling): taught as a request
(``exact=False``: `costs.Costs.prefill_requests`), after a read that restored something
too (the prompts of a server share a template's first blocks: skipping those, a server
learned nothing). A write that holds generated tokens also holds their decoding, and
teaches nothing. Where the model is known and the store does not know its prefill on
this device kind, a read takes the rate this machine measured before for the model, if
there is one; else the first read that finds a stored prefix measures it, on the reading
thread (the one that runs the model, as MLX wants), by forwards costing at most about a
quarter of that prefix's prefill (`PersistentPrefixCache.calibrate` with ``prompt=``). A
read that finds nothing runs no forward: the prefill the caller then runs teaches the rate.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..core.costs import PREFILL_STEP
from ..errors import InvalidArgumentError, PrefixCacheError
from ..layers import cache_length
from ..store import PersistentPrefixCache

log = logging.getLogger("persistent_prefix_cache")

# Tokens of the first-use calibration at most (a short prompt's is shorter): long enough
# for a rate, short enough that the one request that pays it (once per model and machine)
# barely notices.
CALIBRATION_TOKENS = 256


def covered(cache: Any) -> int | None:
    """Positions a list of mlx-lm cache layers holds; None if not known (other objects)."""
    if not isinstance(cache, (list, tuple)) or not cache:
        return None
    try:
        return cache_length(cache)
    except PrefixCacheError:
        return None


class WarnOnce:
    """Say each cause of trouble once: a server would repeat it on every request.

    Args:
        say: Called with the message the first time a cause is seen.
    """

    def __init__(self, say: Callable[[str], None]):
        self._say = say
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(self, cause: Hashable, message: str) -> None:
        """Report `message` unless `cause` was reported before."""
        with self._lock:
            if cause in self._seen:
                return
            self._seen.add(cause)
        self._say(message)


class StoreLink:
    """One store behind an in-memory cache: read-through, write-through, ownership.

    Args:
        store: A `PersistentPrefixCache`, a store directory (opened for `model` with
            default options and closed by `close`), or None (memory only).
        model: The model, to open a store from a directory.
        warn: Reports a failure once per cause (see `WarnOnce`).
        errors: The exceptions that turn into a warning (others propagate).

    Raises:
        InvalidArgumentError: If `store` is of the wrong type.
    """

    def __init__(
        self,
        store: Any,
        model: Any = None,
        *,
        warn: Callable[[Hashable, str], None],
        errors: tuple[type[BaseException], ...] = (PrefixCacheError,),
    ):
        self.owns_store = isinstance(store, (str, os.PathLike))
        if self.owns_store:
            store = PersistentPrefixCache(store, model)
        elif store is not None and not isinstance(store, PersistentPrefixCache):
            raise InvalidArgumentError(f"store must be a PersistentPrefixCache or a path, got {type(store).__name__}")
        self.store: PersistentPrefixCache | None = store
        self.model = model
        self._warn = warn
        self._errors = errors
        # (when, the prompt, positions the cache held)
        self._last_read: tuple[float, Any, int] | None = None
        self._calibrated = model is None

    def calibrate(self, model: Any = None, prompt: Any = None) -> None:
        """Measure the model's prefill for the cost model if the store does not know it
        on this device kind (`PersistentPrefixCache.calibrate`), for a read of `prompt`
        if given (until the rate is known, every such read asks again); a failure is a
        warning."""
        model = model if model is not None else self.model
        self._calibrated = True
        if self.store is None or model is None:
            return
        try:
            rate = self.store.calibrate(model, tokens=CALIBRATION_TOKENS, only_if_unknown=True, prompt=prompt)
        except Exception as exc:  # a model the calibration cannot drive: the store restores blind
            self._warn(("calibrate", type(exc)), f"could not measure the model's prefill: {exc}")
            return
        self._calibrated = rate is not None or prompt is None

    def read(self, tokens: Any, have: int = 0) -> tuple[list | None, Any]:
        """The store's hit for `tokens` if it restores more than `have` tokens.

        Returns:
            ``(cache, rest)`` as `PersistentPrefixCache.fetch` returns them, or
            ``(None, tokens)`` when the store holds no more than `have` (or failed).
        """
        if self.store is None:
            return None, tokens
        if not self._calibrated:
            self.calibrate(prompt=tokens)
        try:
            cache, rest = self.store.fetch(tokens, longer_than=have)
        except self._errors as exc:
            self._warn(("read", type(exc)), f"could not read the store: {exc}")
            return None, tokens
        held = len(tokens) - len(rest) if cache is not None else have
        self._last_read = (time.perf_counter(), tokens, held)
        return cache, rest

    def write(self, tokens: Any, cache: Sequence[Any], *, admit: str = "always") -> bool:
        """Store `cache` for `tokens` under the admission rule `admit` (see
        `PersistentPrefixCache.store`); False (after one warning per cause) if it failed."""
        if self.store is None or self.store.readonly:  # read-only: nothing written, nothing to warn
            return False
        try:  # a closed store raises in either: a warning like any failure
            self._observe(tokens)
            self.store.store(tokens, cache, admit=admit)
        except self._errors as exc:
            self._warn(("write", type(exc)), f"cache kept in memory only, not written to the store: {exc}")
            return False
        return True

    def _observe(self, tokens: Any) -> None:
        """Teach the cost model the prefill since the last read, if `tokens` are a
        longer prefix of that read's prompt (see the module's docstring)."""
        last, self._last_read = self._last_read, None
        if last is None or self.store is None:
            return
        when, prompt, held = last
        now, written = time.perf_counter(), len(tokens)
        try:  # another request's prompt (a server interleaves them) teaches nothing
            same = held < written <= len(prompt) and np.array_equal(
                np.asarray(tokens[held:written]), np.asarray(prompt[held:written])
            )
        except (TypeError, ValueError):
            same = False
        if same:
            calls = -(-(written - held) // PREFILL_STEP)  # the server's forward calls (its default step)
            # A request's time (queueing, sampling, the answer), not its forwards' alone.
            self.store.observe_prefill(written - held, now - when, start=held, forwards=calls, exact=False)
            self._last_read = (now, prompt, written)  # the next segment starts here

    def close(self) -> None:
        """Close the store if this link opened it (from a path); idempotent."""
        if self.store is not None and self.owns_store:
            self.store.close()


def warn_once_per_object() -> Callable[[Hashable, str], None]:
    """One `RuntimeWarning` per compat object, whatever the cause (a server would
    otherwise repeat it on every request)."""
    once = WarnOnce(lambda message: warnings.warn(message, RuntimeWarning, stacklevel=6))
    return lambda cause, message: once("store", message)


class Linked:
    """A compat object with an optional store behind it (see `StoreLink`)."""

    link: StoreLink

    @property
    def store(self):
        """The `PersistentPrefixCache` behind this object, or None."""
        return self.link.store

    def close(self) -> None:
        """Close the store if this object opened it (from a path); idempotent."""
        self.link.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

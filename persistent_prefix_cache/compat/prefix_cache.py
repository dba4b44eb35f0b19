"""The API of ``vllm_mlx.prefix_cache``, built on `PersistentPrefixCache`.

`PrefixCacheManager` keeps whole prompt caches in memory, keyed by their tokens;
`BlockAwarePrefixCache` cuts them into the blocks of a `PagedCacheManager`. Given
``store=`` (a `PersistentPrefixCache` or a store directory) both also read through to
disk when memory does not cover a query and write through on every store, so a new
process finds what an earlier one stored.

What ``remaining`` means
------------------------
Every fetch returns ``(cache, remaining)``: ``remaining`` are the tokens of the query
that the cache does *not* hold, to be fed to the model on top of it. A KV cache holds
no logits, so the first new token always comes from feeding at least one token:

- `PrefixCacheManager.fetch_cache` keeps vllm-mlx's contract: an exact hit returns the
  stored cache itself and ``[]``. That cache already holds the last prompt token: never
  feed ``tokens[-1:]`` on top of it (vllm-mlx's scheduler did, which puts the token in
  the cache twice). To generate, use `PrefixCacheManager.fetch_for_generation`: its
  ``remaining`` is never empty and its cache is the caller's own.
- `BlockAwarePrefixCache.fetch_cache` and every hit read from disk never return an
  empty ``remaining``: a full hit is cut back by one token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..keys import as_token_array
from ..layers import can_trim, copy_prefix
from .through import Linked, StoreLink, covered, warn_once_per_object

log = logging.getLogger("persistent_prefix_cache")


# -- PrefixCacheManager --------------------------------------------------------------


@dataclass
class PrefixCacheStats:
    """Counters of a `PrefixCacheManager`.

    Attributes:
        hits: Fetches that returned a cache.
        misses: Fetches that returned None.
        tokens_saved: Positions held by the caches returned.
        total_queries: Fetches.
        evictions: Entries dropped from memory to stay within ``max_entries``.
    """

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    total_queries: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits per query (0.0 before the first query)."""
        return self.hits / self.total_queries if self.total_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The counters and `hit_rate` as a dict.

        Returns:
            hits, misses, hit_rate, tokens_saved, total_queries, evictions.
        """
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "tokens_saved": self.tokens_saved,
            "total_queries": self.total_queries,
            "evictions": self.evictions,
        }


@dataclass
class CacheEntry:
    """One entry of a `PrefixCacheManager`.

    Attributes:
        prompt_cache: The object given to `PrefixCacheManager.store_cache`.
        count: How many times those tokens were stored.
    """

    prompt_cache: list[Any]
    count: int


class PrefixCacheManager(Linked):
    """Whole prompt caches in memory, keyed by their tokens, evicted least recently
    used first when there are more than `max_entries`.

    A fetch prefers, in this order: the entry equal to the query; a stored sequence
    that extends the query, trimmed to it (only if every layer is trimmable; the
    shortest such sequence, ties broken by its tokens); the longest stored prefix of the
    query. With a store, a query the memory does not cover fully is also looked up on
    disk, and the longer hit wins. Every hit makes its entry the most recently used.

    Entries are the very objects given to `store_cache` and an exact hit returns that
    object (no copy, as in vllm-mlx, whose `BatchGenerator` copies caches on insert):
    never run the model on a cache `fetch_cache` returned; `fetch_for_generation`
    returns one you may extend.

    Args:
        model: The mlx-lm model (used to open a store from a path).
        max_entries: Entries kept in memory.
        store: A `PersistentPrefixCache`, or a store directory opened for `model` with
            default options (closed by `close`); None keeps everything in memory.

    Raises:
        InvalidArgumentError: If `max_entries` < 1 or `store` is of the wrong type.
    """

    def __init__(self, model: Any, max_entries: int = 100, *, store: Any = None):
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise InvalidArgumentError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.model = model
        self.model_key = id(model)
        self.max_size = max_entries
        self.stats = PrefixCacheStats()
        # int32 token bytes -> entry, least recently used first.
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self._lock = threading.RLock()
        self.link = StoreLink(store, model, warn=warn_once_per_object())

    def fetch_cache(self, tokens: Any) -> tuple[list | None, Any]:
        """The cache of the longest usable stored prefix of `tokens` (vllm-mlx's contract).

        Args:
            tokens: The prompt (list of ints, or a 1-D numpy or mlx array).

        Returns:
            ``(cache, remaining)``. Exact hit: the stored object and ``[]`` (it already
            holds every token: see the module docstring before generating from it).
            Shorter stored prefix: the stored object and the tokens after the prefix.
            Longer stored sequence: a new cache trimmed to `tokens` and ``[]``. Disk hit:
            fresh objects and a non-empty rest. Miss: ``(None, tokens)``.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        return self._fetch(tokens, generation=False)

    def fetch_for_generation(self, tokens: Any) -> tuple[list | None, Any]:
        """Like `fetch_cache`, ready to run the model on (an addition to vllm-mlx's API).

        Args:
            tokens: The prompt (list of ints, or a 1-D numpy or mlx array).

        Returns:
            ``(cache, remaining)``: a cache the caller owns (never a stored object)
            holding at most ``len(tokens) - 1`` positions, and the tokens to feed, never
            empty for a non-empty query; ``(None, tokens)`` on a miss.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        return self._fetch(tokens, generation=True)

    def _fetch(self, tokens: Any, *, generation: bool) -> tuple[list | None, Any]:
        toks = as_token_array(tokens)
        limit = len(toks) - 1 if generation else len(toks)
        cache, keep = None, 0
        with self._lock:
            self.stats.total_queries += 1
            found = self._search(toks.tobytes(), limit) if limit > 0 else None
            if found is not None:
                key, entry, keep = found
                self._entries.move_to_end(key)
                total = len(key) // 4
                if keep == total and not generation:
                    cache = entry.prompt_cache
                else:
                    cache = copy_prefix(entry.prompt_cache, keep, total)
        if self.store is not None and keep < min(limit, len(toks) - 1):
            disk, rest = self.link.read(tokens, keep)
            if disk is not None and len(toks) - len(rest) > keep:
                cache, keep = disk, len(toks) - len(rest)
        with self._lock:
            if cache is None:
                self.stats.misses += 1
                return None, tokens
            self.stats.hits += 1
            self.stats.tokens_saved += keep
        return cache, tokens[keep:]

    def _search(self, data: bytes, limit: int) -> tuple[bytes, CacheEntry, int] | None:
        """Best entry for the first `limit` tokens of `data`: (key, entry, positions to use)."""
        want = data[: 4 * limit]
        shorter, longer = b"", None
        # A scan of byte-prefix tests: cheap for the few hundred entries this holds,
        # and it finds a shorter prefix wherever the query diverges from a longer entry.
        for key, entry in self._entries.items():
            if len(key) <= len(want):
                if len(key) > len(shorter) and want.startswith(key):
                    shorter = key
            elif key.startswith(want) and can_trim(entry.prompt_cache):
                if longer is None or (len(key), key) < (len(longer), longer):
                    longer = key
        if longer is not None and len(shorter) < len(want):
            return longer, self._entries[longer], limit
        if shorter:
            return shorter, self._entries[shorter], len(shorter) // 4
        return None

    def store_cache(self, tokens: Any, prompt_cache: list[Any]) -> None:
        """Keep `prompt_cache` for `tokens` (and write it through to the store).

        The entry is keyed by the positions the cache holds when those can be read
        (mlx-lm layers): vllm-mlx's scheduler stores the prompt plus every generated
        token while the last one was never fed, and fetching that entry then returns
        that token as ``remaining`` instead of skipping it. Storing the same tokens again
        only counts and refreshes the entry. Empty token lists are not stored.

        Args:
            tokens: The tokens the cache was computed from.
            prompt_cache: The cache (kept as is, not copied).

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        toks = as_token_array(tokens)
        n = len(toks)
        held = covered(prompt_cache)
        if held is not None:
            if held > n:
                log.warning("cache holds %d positions but %d tokens were given: not stored", held, n)
                return
            n = held
        if n == 0:
            return
        key = toks[:n].tobytes()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.count += 1
                self._entries.move_to_end(key)
            else:
                self._entries[key] = CacheEntry(prompt_cache, 1)
                while len(self._entries) > self.max_size:
                    self._entries.popitem(last=False)
                    self.stats.evictions += 1
        if self.store is not None:
            self.link.write(toks[:n], prompt_cache)

    def get_stats(self) -> dict[str, Any]:
        """The counters (see `PrefixCacheStats.to_dict`).

        Returns:
            The counters as a dict.
        """
        with self._lock:
            return self.stats.to_dict()

    def reset_stats(self) -> None:
        """Zero the counters."""
        with self._lock:
            self.stats = PrefixCacheStats()

    def clear(self) -> None:
        """Forget every entry in memory and zero the counters (the store is untouched)."""
        with self._lock:
            self._entries.clear()
            self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

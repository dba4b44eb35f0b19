"""`PersistentLRUPromptCache`: mlx-lm's `LRUPromptCache`, with a store behind it.

``mlx_lm.server`` keeps the KV caches of recent prompts in an in-memory
``LRUPromptCache`` and loses them when the process stops. This class is a drop-in
replacement: it *is* that in-memory LRU (a subclass, so every method the server calls
behaves as before), and it puts a `PersistentPrefixCache` behind it:

- ``insert_cache`` writes through: the cache goes into the in-memory LRU as before and
  its new blocks into the store (written on the store's writer thread).
- ``fetch_nearest_cache`` reads through: it asks the in-memory LRU first and, unless
  that was an exact hit, the store's index; blocks are loaded only when the store
  covers more of the prompt than memory (after a restart memory holds nothing, so the
  store answers).

The answers have mlx-lm's shape: ``(cache, rest)`` where ``cache`` covers
``len(tokens) - len(rest)`` tokens (None on a miss, with ``rest`` the whole prompt).
One difference: an answer from the store never covers the whole prompt (``rest`` keeps
at least the last token), while the in-memory LRU gives ``rest == []`` on an exact hit.
Recomputing one token gives the same output, and mlx-lm 0.32's batched path cannot
start a sequence from an empty ``rest`` (``keep_last_token=True`` treats exact
in-memory hits the same way).

**Memory: one budget, one copy.** ``max_bytes`` bounds the KV this object holds in
memory: the entries of the in-memory LRU *and* the RAM tiers of its stores together
(`nbytes` is their sum). A cache the store took (written through, every prefix of it
servable by the store, and small enough for the RAM tier) is not kept in the LRU as
well: the RAM tier holds its blocks, and a hit restores it from there into fresh
buffers (no deep copy of a kept entry; the restored cache shares nothing the
generation writes into). The LRU keeps only what the store cannot serve as well: a
cache it refused (quantized KV, image tokens, a read-only store), a cache that cannot
be trimmed (recurrent layers: the store resumes only at its snapshots), or one larger
than the tier. The LRU's entries come first: the tier of the store in use gets what
they leave, less what other stores' tiers hold: those keep their blocks but take no
more, and give back evenly what the store in use needs of its even share (blocks given
back stay on disk). Not counted: the caches of requests
in progress (the caller's) and blocks queued for the writer thread until written.

The store holds one model's KV (its layout and fingerprint are fixed when it opens),
while the server keys caches by a model key and may load several models over its life.
Give the class either one store (every key shares it: a single-model server) or a
function from model key to store, called the first time a key is seen.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable, Hashable, Sequence, Union

from mlx_lm.models.cache import LRUPromptCache

from ..core.admission import check_rule
from ..errors import InvalidArgumentError
from ..keys import TOKEN_MAX, TOKEN_MIN
from ..layers import cache_length, can_trim, offset_trimmable, trim
from ..store import PersistentPrefixCache
from ..core.tier_report import blocks_by_tier, describe_tiers
from .open_prompts import OpenPrompts
from .through import StoreLink, WarnOnce

log = logging.getLogger(__name__)

_NO_LIMIT = 1 << 63

#: A store, or a function giving the store for a model key (None: memory only).
StoreSource = Union[PersistentPrefixCache, Callable[[Hashable], Union[PersistentPrefixCache, None]]]


class PersistentLRUPromptCache(LRUPromptCache):
    """mlx-lm's in-memory prompt cache with a persistent store behind it.

    Args:
        store: A `PersistentPrefixCache` used for every model key, or a callable
            ``store(model_key) -> PersistentPrefixCache | None`` called once per new key
            (None means: keep that model's caches in memory only; the callable is asked
            again for that key next time). Stores the callable opens are closed by
            `close`; a store passed in directly is only flushed (its owner closes it).
            A callable with a ``model_for(model_key)`` method (``ppc serve``'s) also
            gives the loaded model, so the cost model can be calibrated at the first
            read that finds a stored prefix (`compat.through.StoreLink`).
        max_size: Most sequences the in-memory LRU holds (as mlx-lm's ``max_size``).
        max_bytes: Most bytes of KV held in memory: the LRU's entries and the RAM tiers
            of the stores together (see the module's docstring). Unbounded by default:
            then each store's tier keeps its own ``memory_bytes`` and the LRU only
            `max_size`.
        keep_last_token: Turn an exact in-memory hit (``rest == []``) into a hit on all
            but the last token when the cache can be trimmed. mlx-lm 0.32's server
            cannot continue from an empty ``rest`` on its batched path (its generation
            thread dies with "Sequence has an empty prompt"); ``ppc serve`` sets this.
        admit: The admission rule of the writes through (`PersistentPrefixCache.store`,
            docs/wear.md): ``"always"`` (the default) writes every insert's new blocks;
            ``"reuse"`` writes a request's blocks once they are seen again or continued
            (a chat's next turn) and leaves a one-off prompt's in memory only;
            ``"seen"`` writes only what was seen before. Under either, one request is
            one sighting: the server's checkpoints inside a request (its prompt's
            segments, the prompt but its last token) stay in memory only, and the
            insert that covers the whole prompt is the one the rule judges
            (`compat.open_prompts`).
        tenants: Whose request each call serves (``ppc serve --tenants``: a
            `compat.tenants.RequestTenants`): the in-memory LRU and the stores are then
            keyed by ``(model key, tenant name)``, so no tenant is ever answered from
            another's entry; a fetch whose tenant is unknown finds nothing, an insert
            whose tenant is unknown is not kept. None: one namespace.

    Raises:
        InvalidArgumentError: If `store` is neither a store nor callable, or `admit`
            names no rule.
    """

    def __init__(
        self,
        store: StoreSource,
        max_size: int = 10,
        max_bytes: int = _NO_LIMIT,
        *,
        keep_last_token: bool = False,
        admit: str = "always",
        tenants: Any = None,
    ):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.keep_last_token, self.tenants = keep_last_token, tenants
        self.admit = check_rule(admit)
        self._open_prompts = OpenPrompts() if self.admit != "always" else None  # one sighting per request
        self._shared_store: PersistentPrefixCache | None
        self._open_store: Callable[[Hashable], PersistentPrefixCache | None] | None
        if isinstance(store, PersistentPrefixCache):
            self._shared_store, self._open_store = store, None
        elif callable(store):
            self._shared_store, self._open_store = None, store
        else:
            raise InvalidArgumentError(
                f"store must be a PersistentPrefixCache or a callable, got {type(store).__name__}"
            )
        self._stores: dict[Hashable, PersistentPrefixCache] = {}
        self._failed: set[Hashable] = set()
        # One link per model: it remembers the last read, to time the prefill after it.
        self._links: dict[Hashable, StoreLink] = {}
        self._warn_once = WarnOnce(lambda message: log.warning("persistent prompt cache: %s", message))
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            ("store_hits", "restored_tokens", "stored_sequences", "store_skipped", "memory_peak_bytes"), 0
        )
        self._counters["memory_only_sequences"] = 0  # stored, yet kept in the LRU (see _kept)
        self._counters.update(memory_tokens=0, computed_tokens=0)  # prompt tokens from the LRU, left to compute
        self._caps: dict[int, int] = {}  # id(store) -> its own RAM-tier budget, taken at first use
        self._active: PersistentPrefixCache | None = None  # the store whose tier gets the room

    @property
    def nbytes(self) -> int:
        """Bytes of KV held in memory: the LRU's entries plus the RAM tiers of the stores."""
        return self._lru_bytes() + sum(s.limit_memory()[0] for s in self._open_stores() if not s.closed)

    def _lru_bytes(self) -> int:
        return super().nbytes  # mlx-lm's own count: the LRU's entries

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Trim the LRU to `n_sequences` entries and LRU plus RAM tier to `n_bytes`.

        mlx-lm's batched server calls this with its budget minus the active requests'
        caches; the tier gives back its share first (its blocks stay on disk).

        Args:
            n_sequences: Most entries the LRU keeps (None: no limit).
            n_bytes: Most bytes the LRU and the tier keep together (None: no limit).
        """
        if n_bytes is not None:
            self._fit(max(0, n_bytes - self._lru_bytes()))
        super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
        if n_bytes is not None:
            self._fit(max(0, n_bytes - self._lru_bytes()))
        self._note_memory()

    # -- the interface mlx_lm.server uses (the rest is inherited) -------------------

    def fetch_nearest_cache(self, model: Hashable, tokens: list[int]) -> tuple[list | None, list]:
        """The cache of the longest known prefix of `tokens`, from memory or the store.

        Args:
            model: The model key (as the server passes it).
            tokens: The prompt tokens.

        Returns:
            ``(cache, rest)``: a fresh cache the caller may extend (None on a miss) and
            the tokens it does not cover, as mlx-lm's ``LRUPromptCache`` returns them.
        """
        if self.tenants is not None:
            tenant = self.tenants.current()
            if tenant is None:  # never a guess: nothing from memory or the store
                return self._served(tokens, None, list(tokens))
            model = (model, tenant.name)
        if self._open_prompts is not None:
            self._open_prompts.fetched(model, tokens)
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if len(rest) == 0 and len(tokens) and cache is not None:
            # An exact hit in memory: nothing can cover more.
            if self.keep_last_token and can_trim(cache):
                trim(cache, 1)
                return self._served(tokens, cache, tokens[-1:])
            return self._served(tokens, cache, rest)
        if not _storable(tokens):
            return self._served(tokens, cache, rest)  # tokens a store cannot key (image placeholders)
        store = self.store_for(model)
        if store is None:
            return self._served(tokens, cache, rest)
        self._use(store)
        in_memory = len(tokens) - len(rest)
        # What the LRU keeps the store rarely covers further (then it loads nothing); what
        # the store took, the LRU does not hold: the store restores it from its RAM tier.
        before, last = store.stats(), store.last_fetch
        started = time.perf_counter()
        restored, remaining = self._link(model, store).read(tokens, in_memory)
        took = time.perf_counter() - started
        self._note_memory()  # a restore may admit disk blocks into the tier (within its budget)
        report = store.last_fetch if not store.closed else None
        why = report.reason if report is not None and report is not last else None  # None: no fetch ran
        from_store = len(tokens) - len(remaining)
        if restored is None or from_store <= in_memory:
            # One line per request the store did not help, saying why (the store's reason).
            log.info(
                "Restored none of %d prompt tokens from the persistent store %s (memory had %d; %.1f ms): %s",
                len(tokens), _named(store), in_memory, 1000 * took, why or "-",
            )  # fmt: skip
            return self._served(tokens, cache, rest)
        with self._lock:
            self._counters["store_hits"] += 1
            self._counters["restored_tokens"] += from_store
            self._counters["computed_tokens"] += len(tokens) - from_store
        # Tests and operators read this line: keep its wording stable (a short hit adds
        # "; stopped: <reason>" after it).
        log.info(
            "Restored %d of %d prompt tokens from the persistent store %s (memory had %d; served by %s; %.1f ms)%s",
            from_store,
            len(tokens),
            _named(store),
            in_memory,
            describe_tiers(blocks_by_tier(before, store.stats())),
            1000 * took,
            f"; stopped: {why}" if why else "",
        )
        return restored, tokens[from_store:]

    def _served(self, tokens: list[int], cache: list | None, rest: list[int]) -> tuple[list | None, list]:
        """Count a request's tokens the in-memory cache gave and those left to compute."""
        with self._lock:
            self._counters["memory_tokens"] += len(tokens) - len(rest) if cache is not None else 0
            self._counters["computed_tokens"] += len(rest)
        return cache, rest

    def insert_cache(
        self,
        model: Hashable,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Keep `prompt_cache` in memory (as mlx-lm does) and write its new blocks through.

        Caches the store cannot hold (another layout, e.g. KV quantized by the server
        past ``--quantized-kv-start``; image placeholder ids in `tokens`) stay in memory
        only; a warning says so once per model and reason.

        Args:
            model: The model key.
            tokens: The tokens `prompt_cache` covers.
            prompt_cache: The cache layers; the in-memory LRU keeps this object.
            cache_type: ``"assistant"``, ``"user"`` or ``"system"`` (mlx-lm's eviction
                order).
        """
        if self.tenants is not None:
            tenant = self.tenants.for_insert(prompt_cache)
            if tenant is None:  # whose it is cannot be told: kept nowhere, never under another's name
                self._skip(model, "tenant", "a cache whose tenant cannot be told is not kept")
                return
            model = (model, tenant.name)
        store = self.store_for(model) if len(tokens) else None
        if store is not None:
            self._use(store)
        self._fit()  # the tier's room back after a trim_to, before it takes this cache
        # A checkpoint inside a request is no sighting under a rule: the request's last insert is.
        inside = self._open_prompts is not None and self._open_prompts.checkpoint(model, tokens)
        # (A checkpoint is not written at all; without a store `_written` is False.)
        if (
            inside
            or not self._written(model, store, tokens, prompt_cache)
            or store is None
            or self._kept(store, tokens, prompt_cache)
        ):
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        self._fit()
        self._note_memory()

    def _written(self, model: Hashable, store: PersistentPrefixCache | None, tokens: list[int], cache: list) -> bool:
        """Write `cache` through to `store` under the admission rule; whether it was taken."""
        if store is None:
            if len(tokens):  # no store for this model (store_for gave None, or its open failed)
                with self._lock:
                    self._counters["store_skipped"] += 1
            return False
        if store.readonly:  # read-only serves hits: nothing written, nothing skipped
            return False
        if not _storable(tokens):
            self._skip(
                model,
                "tokens",
                f"prompts with token ids outside the store's int32 range [{TOKEN_MIN}, {TOKEN_MAX}] "
                "(mlx-lm's image ids) are kept in memory only",
            )
            return False
        try:
            cache = _even_lengths(cache)
            covered = cache_length(cache)
            if covered is not None and covered < len(tokens):
                # Keys may run ahead of the KV (a token sampled but not yet fed).
                tokens = tokens[:covered]
            elif covered is not None and covered > len(tokens):
                self._skip(model, "length", "a cache longer than its tokens is kept in memory only")
                return False
        except Exception as exc:  # a cache the adapters cannot measure: memory only
            self._skip(model, type(exc), f"not persisted ({exc}); kept in memory only")
            return False
        if not self._link(model, store).write(tokens, cache, admit=self.admit):
            with self._lock:
                self._counters["store_skipped"] += 1
            return False
        with self._lock:
            self._counters["stored_sequences"] += 1
        return True

    def _kept(self, store: PersistentPrefixCache, tokens: list[int], cache: list) -> bool:
        """Whether the LRU must keep a cache `store` took: unless the store serves every
        prefix of it (all but the last token found, every layer trimmable) from a RAM tier
        it fits in, a hit from the LRU is the better one."""
        try:
            size = sum(layer.nbytes for layer in cache)
            fits = size <= store.limit_memory()[1]
            kept = not (fits and can_trim(cache) and store.peek(tokens) >= len(tokens) - 1)
        except Exception:  # whatever cannot be measured stays where mlx-lm keeps it
            kept = True
        if kept:
            with self._lock:
                self._counters["memory_only_sequences"] += 1
        return kept

    # -- the persistent side ------------------------------------------------------------

    def store_for(self, model: Hashable) -> PersistentPrefixCache | None:
        """The store holding `model`'s caches, opening it on first use.

        Args:
            model: The model key.

        Returns:
            The store, or None if this model's caches stay in memory only.
        """
        if self._shared_store is not None:
            return self._usable(model, self._shared_store)
        opener = self._open_store
        assert opener is not None  # one of the two is given (__init__)
        with self._lock:
            if model in self._stores:
                return self._usable(model, self._stores[model])
            if model in self._failed:
                return None
            try:
                store = opener(model)
            except Exception as exc:
                # Opening again on every request would repeat the cost and the error.
                self._failed.add(model)
                log.warning("cannot open a store for model %r: %s; memory only", model, exc)
                return None
            if store is not None:
                self._stores[model] = store
            return store

    def _usable(self, model: Hashable, store: PersistentPrefixCache) -> PersistentPrefixCache | None:
        """`store`, unless its owner closed it: then memory only, said once (never a failed request)."""
        if not store.closed:
            return store
        self._warn_once((model, "closed"), f"the store {store.path} is closed; caches stay in memory only")
        return None

    def persistent_stats(self) -> dict[str, Any]:
        """Counters of the persistent side and each open store's `stats()`.

        Returns:
            store_hits (fetches answered by the store), restored_tokens,
            memory_tokens (prompt tokens the in-memory LRU gave), computed_tokens (prompt
            tokens left to compute), stored_sequences (inserts written through), store_skipped (inserts kept in
            memory only: the store refused them, or there was no store for the model),
            memory_only_sequences (inserts the store took that the LRU
            kept too), memory_peak_bytes (the most `nbytes` seen after any call or
            now), memory_bytes (`nbytes` now, read with the stores' stats), memory_budget (``max_bytes``; None when
            unbounded), and ``stores``: a list of ``{"model", "path", "stats", "name",
            "namespace", "fingerprint"}`` (the model key, the store, its `stats()`, and
            what the handle was opened with).
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            stores = list(self._stores.items())
        if self._shared_store is not None:
            stores = [(None, self._shared_store)]
        out["stores"] = [
            {"model": key, "path": s.path, "stats": s.stats(), "name": s.model_name, "namespace": s.namespace,
             "fingerprint": s.fingerprint}
            for key, s in stores
            if not s.closed
        ]  # fmt: skip
        # One reading of the memory held, from the stats above (a tier can grow between two
        # calls: a background fill after a restart), which the peak then counts too.
        total = self._lru_bytes() + sum(entry["stats"]["bytes_in_memory"] for entry in out["stores"])
        with self._lock:
            peak = self._counters["memory_peak_bytes"] = max(self._counters["memory_peak_bytes"], total)
        out.update(memory_bytes=total, memory_peak_bytes=peak)
        out["memory_budget"] = self.max_bytes if self.max_bytes < _NO_LIMIT else None  # None: unbounded
        return out

    def flush(self) -> None:
        """Wait until every store's pending writes are on disk."""
        for store in self._open_stores():
            store.flush()

    def close(self) -> None:
        """Flush every store; close the ones this object opened. Safe to call twice."""
        if self._shared_store is not None:
            if not self._shared_store.closed:
                self._shared_store.flush()
            return
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()

    # -- helpers ---------------------------------------------------------------------

    def _open_stores(self) -> list[PersistentPrefixCache]:
        if self._shared_store is not None:
            return [] if self._shared_store.closed else [self._shared_store]
        with self._lock:
            return [s for s in self._stores.values() if not s.closed]

    def _use(self, store: PersistentPrefixCache) -> None:
        """Make `store` the one whose RAM tier shares the budget (the model in use)."""
        if id(store) not in self._caps:
            self._caps[id(store)] = store.limit_memory()[1]  # what its owner gave it: our cap
        if self._active is not store:
            self._active = store
            self._fit()

    def _fit(self, room: int | None = None) -> None:
        """Share `room` bytes (default: what the LRU leaves of ``max_bytes``) between the
        stores' RAM tiers: the active store's tier gets what the others' holdings leave,
        at least an even share, capped by its own budget; the others keep what they hold
        (no more), cut evenly where the active one needs its share. Emptying them made a
        server whose requests alternate between tenants (a handle each) restore every
        prompt from disk. Without ``max_bytes`` (and `room`) every tier keeps its own budget."""
        bounded = self.max_bytes < _NO_LIMIT
        if room is None:
            room = max(0, self.max_bytes - self._lru_bytes()) if bounded else _NO_LIMIT
        stores = self._open_stores()
        for store in stores:
            self._caps.setdefault(id(store), store.limit_memory()[1])
        active = self._active if self._active in stores else None
        if not bounded or active is None:
            for store in stores:
                store.limit_memory(min(self._caps[id(store)], room))
            return
        others = [s for s in stores if s is not active]
        held = {id(s): s.limit_memory()[0] for s in others}
        keep = room - min(self._caps[id(active)], room // len(stores))  # what the others may keep
        while others and sum(held.values()) > keep:  # cut the largest down to the next, evenly
            over = sum(held.values()) - keep
            top = max(held.values())
            tied = [k for k, v in held.items() if v == top]
            below = max([v for v in held.values() if v < top], default=0)
            cut = min(top - below, -(-over // len(tied)))
            for k in tied:
                held[k] -= cut
        for store in others:
            store.limit_memory(min(self._caps[id(store)], held[id(store)]))
        active.limit_memory(min(self._caps[id(active)], max(0, room - sum(held.values()))))

    def _note_memory(self) -> None:
        total = self.nbytes
        with self._lock:
            self._counters["memory_peak_bytes"] = max(self._counters["memory_peak_bytes"], total)

    def _link(self, model: Hashable, store: PersistentPrefixCache) -> StoreLink:
        # Never fail a request for the store's sake: every error is a warning there.
        def warn(cause, message):
            self._warn_once((model, *cause), message)

        with self._lock:
            link = self._links.get(model)
            if link is None or link.store is not store:
                # A store source that knows the key's loaded model (`server_patch.ProviderStores`)
                # lets the link calibrate the cost model at the first read that finds a prefix.
                model_for = getattr(self._open_store, "model_for", None)
                loaded = model_for(model) if model_for is not None else None
                link = self._links[model] = StoreLink(store, loaded, warn=warn, errors=(Exception,))
            return link

    def _skip(self, model: Hashable, reason: Any, message: str) -> None:
        with self._lock:
            self._counters["store_skipped"] += 1
        self._warn_once(("insert", model, reason), message)


def _named(store: PersistentPrefixCache) -> str:
    """The store in a request's log line: its folder, and its namespace where it has one."""
    return f"{store.path}, namespace {store.namespace}" if store.namespace else store.path


def _even_lengths(cache: list[Any]) -> list[Any]:
    """`cache` itself, or a view trimmed to its shortest layer if layers differ in length.

    With speculative decoding the server's cache is the model's layers followed by the
    draft model's, and they may end a token or two apart; the common prefix is still
    a valid cache. The view shares the caller's arrays (trimming only moves offsets).
    """
    lengths = [cache_length([layer]) for layer in cache]
    known = {n for n in lengths if n is not None}
    if len(known) < 2:
        return cache
    if not all(offset_trimmable(layer) for layer in cache):
        return cache  # store() then refuses it, and it stays in memory only
    shortest = min(known)
    view = []
    for layer, n in zip(cache, lengths):
        layer = copy.copy(layer)
        layer.trim(0 if n is None else n - shortest)
        view.append(layer)
    return view


def _storable(tokens: Sequence[int]) -> bool:
    """True if a store can key `tokens`: mlx-lm 0.32's server marks image patches with
    negative ids of up to 60 bits (a hash of the image), wider than the stored int32."""
    return len(tokens) > 0 and min(tokens) >= TOKEN_MIN and max(tokens) <= TOKEN_MAX

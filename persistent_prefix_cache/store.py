"""`PersistentPrefixCache`: the store facade (`fetch`, `store`, `flush`, `close`, `stats`).

Its open checks the options and builds the handle's parts once (`opening.open_parts`,
held in a `parts.Parts`); then it delegates: a `fetch()` to `fetching.Fetcher`, a
`store()` to `storing.Storer`, what restoring and computing cost to its public cost
model (`costs`: `cost_model.CostModel`), flush, stats and close to its `Parts`.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Sequence

from .core.cost_model import CostModel
from .errors import InvalidArgumentError, ReadOnlyStoreError, StoreClosedError
from .fingerprint import forget_fingerprints
from .core.opening import OPEN_HANDLES, open_parts
from .options import Options
from .tiers import REMOTE_TIMEOUT
from .tiers.memory import MemoryView
from .core.writeback import sweep_orphans

if TYPE_CHECKING:  # the remote's client is imported only where a remote is configured
    from .core.miss_reasons import FetchReport
    from .core.remote_fill import RemoteFill


class PersistentPrefixCache:
    """A prefix (KV) cache for one mlx-lm model, kept in a store directory.

    Args:
        path: The store directory (created if missing, unless `readonly`); ``~`` and
            ``$VARS`` are expanded (`paths.expand_path`), as in `model_path`.
        model: The loaded mlx-lm model (used for its cache layout and fingerprint).

    The keyword options (fingerprint, model_path, model_name, namespace, block_size,
    memory_bytes, disk_bytes, namespace_bytes, shared_prefixes, shared_namespace, readonly,
    kv_bits, kv_group_size, sync_writes, cost_model, remote, remote_secret,
    remote_insecure, remote_ttl, remote_timeout, shared) are each
    documented once, in `options.Options`: ``help()`` shows it for ``__init__``.

    After `close()` every method but `close` raises `StoreClosedError`; what the handle
    was opened with (`path`, ..., `this_model()`) and `closed` still answer.

    Raises:
        InvalidArgumentError: On bad arguments.
        StorePathError: If `path` is a file or a folder of other files (an
            `InvalidArgumentError`); nothing is created.
        StoreNotWritableError: If the store must be created where this process cannot
            write; nothing is created. (An existing store it cannot write opens
            read-only, with a warning.)
        StoreVersionError: If a newer version of this library wrote the store.
        StoreCorruptError: If the index cannot be read safely.
        StoreBusyError: If ``ppc check --fix`` holds the store for longer than 2 s.
        ModelMismatchError: If `model` is proven not to be the model in `model_path`.
        RemoteConfigError: If the `remote` server refuses its URL's db, user or password.
        MissingDependencyError: If `remote` is given and redis-py is not installed.
    """

    def __init__(
        self, path: str | os.PathLike, model: Any, *, fingerprint: str | None = None,
        model_path: str | os.PathLike | None = None, model_name: str | None = None, namespace: str = "",
        block_size: int | None = None, memory_bytes: int | str = "auto", disk_bytes: int | str | None = "auto",
        namespace_bytes: int | None = None, shared_prefixes: Sequence[Sequence[int]] = (), shared_namespace: str = "",
        readonly: bool = False, kv_bits: int | None = None, kv_group_size: int = 64, sync_writes: bool = False,
        cost_model: bool = True, remote: str | None = None, remote_secret: str | bytes | None = None,
        remote_ttl: float | None = None, remote_timeout: float = REMOTE_TIMEOUT, remote_insecure: bool = False,
        shared: bool = False,
    ):  # fmt: skip
        self._pid, self._closed = os.getpid(), False
        options = Options(
            fingerprint=fingerprint, model_path=model_path, model_name=model_name, namespace=namespace,
            block_size=block_size, memory_bytes=memory_bytes, disk_bytes=disk_bytes, namespace_bytes=namespace_bytes,
            shared_prefixes=shared_prefixes, shared_namespace=shared_namespace, readonly=readonly,
            kv_bits=kv_bits, kv_group_size=kv_group_size, sync_writes=sync_writes, cost_model=cost_model,
            remote=remote, remote_secret=remote_secret, remote_ttl=remote_ttl, remote_timeout=remote_timeout,
            remote_insecure=remote_insecure, shared=shared,
        )  # fmt: skip
        self._parts = open_parts(path, model, options, check_open=self._check_open, peek=self.peek)
        OPEN_HANDLES.add(self)

    __init__.__doc__ = Options.__doc__  # every keyword option, documented once

    # -- reading ------------------------------------------------------------------------

    def fetch(self, tokens: Any, *, longer_than: int | None = None) -> tuple[list | None, Any]:
        """Restore the longest stored prefix of `tokens`.

        Args:
            tokens: The prompt: a list of ints, or a 1-D numpy or mlx array.
            longer_than: Load nothing unless more than this many tokens can be
                restored (a caller that already holds a cache of that many, say;
                0: unless anything can); such a call is counted as ``not_longer``
                only, not as a query, except with 0, where nothing stored is a miss.

        Returns:
            ``(cache, remaining)``: fresh mlx-lm cache objects covering the restored
            prefix (None on a miss) and the tokens still to be fed, of the same kind as
            `tokens`. For a non-empty query `remaining` is never empty: the model needs
            at least one token to produce logits, so a full hit is cut back by one.

        Raises:
            InvalidArgumentError: If `tokens` is not a 1-D sequence of ints.
        """
        self._check_open()
        return self._parts.fetcher.fetch(tokens, longer_than=longer_than)

    @property
    def last_fetch(self) -> FetchReport | None:
        """What this thread's last `fetch` on this handle did, and why it stopped there
        (a `FetchReport`; docs/library.md says what each reason means). Per thread, so
        that a server's threads each read their own; None before this thread's first fetch.

        Raises:
            StoreClosedError: If the store is closed.
        """
        self._check_open()
        return self._parts.fetcher.last()

    def peek(self, tokens: Any) -> int:
        """How many leading tokens of `tokens` a `fetch` would restore now, from the index
        alone (nothing is loaded; a segment the fetch finds damaged can make it fewer)."""
        self._check_open()
        return self._parts.fetcher.peek(tokens)

    def make_cache(self) -> list:
        """A fresh, empty cache of this store's layout (what `fetch` returns on a hit)."""
        self._check_open()
        return self._parts.layout.make_cache()

    def stored_models(self) -> list[dict]:
        """Every model that has blocks in this store, as ``{"root", "fingerprint",
        "namespace", "layout", "name"}`` (``root`` in hex; ``name`` the folder or hub id,
        None if unknown); unreadable records are left out."""
        self._check_open()
        with self._parts.index.reader() as reader:
            return reader.filled_models()

    def forget_fingerprints(self, model_path: str | os.PathLike | None = None) -> int:
        """Forget the fingerprints remembered by model folder (the next open of each
        hashes its weights again); this handle keeps its own fingerprint.

        Args:
            model_path: Only those remembered for this folder; None: every one.

        Returns:
            How many were forgotten.

        Raises:
            ReadOnlyStoreError: If the store was opened read-only.
        """
        self._check_open()
        return forget_fingerprints(self._parts.index, model_path)

    # -- writing ------------------------------------------------------------------------

    def store(self, tokens: Any, cache: Sequence[Any], *, admit: str = "always") -> int:
        """Store the KV of `tokens`; blocks already stored are not written again.

        The caller's cache is not modified. Unless the store was opened with
        ``sync_writes=True``, files are written on a background thread: call
        `flush()` to wait for them.

        Args:
            tokens: The tokens `cache` was computed from.
            cache: mlx-lm cache objects covering ``len(tokens)`` positions (or more,
                where every layer is sliced along the sequence: ``KVCache``,
                ``QuantizedKVCache``), with the layout the store was opened with.
            admit: Which new blocks are written (`admission`; docs/wear.md):
                ``"always"`` every one; ``"seen"`` only those a store of this handle saw
                before (a repeated prompt, a shared prefix); ``"reuse"`` those, and the
                whole of a prompt that continues where an earlier ``"reuse"`` store ended
                (a chat's next turn). `stats()` counts the blocks left out
                (``blocks_not_admitted``).

        Returns:
            The number of new blocks written.

        Raises:
            InvalidArgumentError: If the cache covers fewer than ``len(tokens)`` positions
                (or more, with a layer that is not sliced), or `admit` names no rule.
            LayoutMismatchError: If the cache's classes differ from the store's layout.
            UnsupportedCacheError: If a layer's class cannot be stored.
        """
        self._check_open()
        return self._parts.storer.store(tokens, cache, admit=admit)

    def flush(self) -> None:
        """Wait until every pending write and access update is committed, every
        block stored so far is published to the remote (or has failed, counted), and a
        background fill of the RAM tier is done."""
        self._check_open()
        self._parts.flush()

    def sweep_orphans(self, *, grace: float) -> int:
        """Remove segment files no index record names, older than `grace` seconds; returns how many."""
        self._check_open()
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgumentError(f"grace must be a number of seconds >= 0, got {grace!r}")
        return sweep_orphans(self._parts.index, self._parts.files, grace=grace)

    def hold_writer(self, release: threading.Event) -> threading.Event:
        """For tests and tools: hold the writer thread at its next job until `release` is
        set, the stores queued meanwhile behind it (`WriteBack.hold`); returns an event set
        once the writer stands there. Set `release` before `flush` or `close` (they wait).

        Raises:
            ReadOnlyStoreError: If the handle is read-only (it has no writer).
        """
        self._check_open()
        if self._parts.writeback is None:
            raise ReadOnlyStoreError(f"store {self._parts.path} is open read-only: it has no writer to hold")
        return self._parts.writeback.hold(release)

    # -- the handle -----------------------------------------------------------------

    def limit_memory(self, max_bytes: int | None = None) -> tuple[int, int]:
        """Set the RAM tier's budget (None: keep it), evicting least recently used blocks down
        to it now (they stay on disk); returns the tier's ``(bytes held, budget)``.
        `compat.lru_prompt_cache` keeps itself and the tier in one."""
        self._check_open()
        if max_bytes is not None:
            self._parts.memory.resize(max_bytes)
        return self._parts.memory.nbytes, self._parts.memory.max_bytes

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    def close(self) -> None:
        """Flush and release the store. Safe to call twice."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            # A copy inherited through fork(): its writer thread and LMDB environment
            # belong to the parent, and the child has already dropped the latter.
            self._closed = True
            return
        finished = self._parts.stop()
        self._closed = True  # refused from here on, while the RAM tier and the index go
        self._parts.release(close_index=finished)  # else the writer may still wait on the index's lock
        OPEN_HANDLES.discard(self)

    def stats(self) -> dict[str, Any]:
        """Counters of this handle, its costs, RAM tier and remote, and the store's totals
        over every process: docs/library.md lists them, `parts.Parts.stats` gathers them.

        Raises:
            StoreClosedError: If the store is closed (InvalidArgumentError: opened before a fork).
        """
        self._check_open()
        return self._parts.stats()

    def __enter__(self) -> "PersistentPrefixCache":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what it was opened with (read-only), and its cost model ------------------------

    @property
    def path(self) -> str:
        """The store directory (an absolute path)."""
        return self._parts.path

    @property
    def readonly(self) -> bool:
        """Whether `store()` writes nothing (asked for, or a store this process cannot write)."""
        return self._parts.readonly

    @property
    def block_size(self) -> int:
        """Tokens per block: the store's own."""
        return self._parts.block_size

    @property
    def fingerprint(self) -> str:
        """The model fingerprint this handle's blocks are keyed under."""
        return self._parts.model.fingerprint

    @property
    def model_name(self) -> str | None:
        """The model's name in the store's record (a folder or hub id; None: unknown)."""
        return self._parts.model.name

    @property
    def namespace(self) -> str:
        """The namespace that keeps this handle's blocks apart from other tenants'."""
        return self._parts.model.namespace

    def this_model(self) -> dict:
        """This handle's model as `stored_models` lists one (stored here or not yet)."""
        return self._parts.model.this_model()

    @property
    def costs(self) -> CostModel:
        """The cost model (`cost_model.CostModel`): what restoring and computing cost
        here (its `learned` costs), what teaches it, and what a fetch restores."""
        return self._parts.costs

    @property
    def remote_fill(self) -> RemoteFill | None:
        """The remote tier's part in this handle (`remote_fill.RemoteFill`; None without
        ``remote=``): its tier, the checks and writes a remote block goes through.

        Raises:
            StoreClosedError: If the store is closed.
        """
        self._check_open()
        return self._parts.remote_fill

    @property
    def ram_tier(self) -> MemoryView:
        """The RAM tier seen from outside (`tiers.memory.MemoryView`): the blocks it holds
        with their tensors, read-only, and `MemoryView.evict` to drop some (they stay on disk).

        Raises:
            StoreClosedError: If the store is closed.
        """
        self._check_open()
        return MemoryView(self._parts.memory)

    def observe_prefill(self, tokens: int, seconds: float, **where: Any) -> None:
        """Tell the cost model how long a prefill took (``start``, ``restored``,
        ``forwards``, ``exact``): see `CostModel.observe_prefill`."""
        self._parts.costs.observe_prefill(tokens, seconds, **where)

    def calibrate(
        self, model: Any, *, tokens: int = 512, only_if_unknown: bool = False, prompt: Any = None
    ) -> float | None:
        """Measure how fast `model` prefills on this machine: see `CostModel.calibrate`."""
        return self._parts.costs.calibrate(model, tokens=tokens, only_if_unknown=only_if_unknown, prompt=prompt)

    def resumable_step(self) -> int | None:
        """Tokens per forward for a prefill that stores after each: see `CostModel.resumable_step`."""
        return self._parts.costs.resumable_step()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self._parts.path} is closed")
        if os.getpid() != self._pid:
            raise InvalidArgumentError(
                f"store {self._parts.path} was opened in process {self._pid}, before a fork",
                hint="open the store again in this process",
            )

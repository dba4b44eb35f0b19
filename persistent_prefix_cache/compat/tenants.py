"""Tenants of ``ppc serve``: the namespace of a request is decided by the server, never by
the client's body.

`Tenants` is the operator's word (``ppc serve --tenants FILE``, read by
``cli/tenants_file.py``): the SHA-256 digests of the API keys each tenant holds, each
tenant's quota, the prefixes every tenant shares, and what a request without a known
key gets (401, or a default tenant). `Tenants.tenant` names a request's tenant from its
``Authorization: Bearer <key>`` header (digests compared in constant time, a key never
logged), or with ``--tenant-header NAME`` from the header a trusted proxy sets.

A request is resolved on the server's handler thread, while its cache is fetched and
inserted on the generation thread; `RequestTenants` carries the tenant across: handed
over with the request object (`hand_over`, in ``ResponseGenerator.generate``:
`tenant_responses`), taken when the generation thread takes that request off the
server's queue (`take`), the one its next fetch is for (`current`). An insert says whose
cache it is by the cache itself: on the batched path the tag `TenantBatches` puts on
every cache it hands back for a request (`TenantCache`), on the sequential path the
request in progress. A cache whose tenant cannot be told is not kept at all: never under
another tenant's name.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from queue import Queue
from typing import Any, Iterator, Mapping, Sequence

# How many requests may wait between the handler thread and the generation thread.
_PENDING = 4096


@dataclass(frozen=True)
class Tenant:
    """One tenant: its namespace in the store and its quota.

    Attributes:
        name: The tenant's name: the namespace its blocks are keyed under.
        quota: The most bytes of blocks it may hold (`PersistentPrefixCache`'s
            ``namespace_bytes``); None: no quota of its own.
    """

    name: str
    quota: int | None = None


@dataclass(frozen=True)
class SharedPrompt:
    """A prefix the operator declares shared by every tenant: stored once, hit by all.

    Exactly one of the three is set.

    Attributes:
        tokens: The token ids themselves.
        text: Text, tokenized as mlx_lm.server tokenizes a completion prompt.
        system: A system message, rendered by the model's chat template (what a chat
            request with that system message starts with).
    """

    tokens: tuple[int, ...] | None = None
    text: str | None = None
    system: str | None = None

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prefix as the server's tokenizer makes it.

        Args:
            tokenizer: The loaded model's tokenizer (mlx-lm's wrapper).
        """
        if self.tokens is not None:
            return list(self.tokens)
        if self.text is not None:
            return list(tokenizer.encode(self.text))
        messages = [{"role": "system", "content": self.system}]
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False))


class Refused(Exception):
    """A request the server serves no tenant for: answered 401 with this message."""


class Tenants:
    """Who a request is, by the operator's tenants file or a trusted proxy's header.

    Args:
        tenants: Every tenant the operator declared (none with `header` alone: then the
            header names any tenant).
        key_digests: SHA-256 digest of an API key -> the tenant's name.
        default: The tenant of a request without a known key (None: refused, 401).
        header: A header a trusted proxy sets to the tenant's name (None: the API key).
        shared: The prefixes every tenant shares.
        reserved: Names a header may not give (the shared prefixes' namespace).
    """

    def __init__(
        self,
        tenants: Sequence[Tenant],
        *,
        key_digests: Mapping[bytes, str] | None = None,
        default: str | None = None,
        header: str | None = None,
        shared: Sequence[SharedPrompt] = (),
        reserved: Sequence[str] = (),
    ):
        self.by_name = {t.name: t for t in tenants}
        self._digests = list((key_digests or {}).items())
        self.default, self.header, self.shared = default, header, tuple(shared)
        self.reserved = frozenset(reserved)

    def tenant(self, headers: Any) -> Tenant:
        """The tenant of a request with these headers.

        Args:
            headers: The request's headers (``email.message.Message``: ``get``).

        Raises:
            Refused: No tenant: a missing or unknown key (or header) and no default.
        """
        if self.header is not None:
            name = headers.get(self.header)
            if name is None:
                return self._fallback(f"no {self.header} header")
            name = name.strip()
            tenant = self.by_name.get(name)
            if tenant is None and not self.by_name and valid_name(name) and name not in self.reserved:
                return Tenant(name)  # the proxy's word alone: any well-formed name
            return tenant if tenant is not None else self._fallback(f"unknown tenant in the {self.header} header")
        auth = headers.get("Authorization") or ""
        scheme, _, key = auth.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return self._fallback("missing API key (Authorization: Bearer <key>)")
        digest = hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, name in self._digests:  # every digest compared, in constant time each
            if hmac.compare_digest(known, digest):
                found = name
        if found is None:
            return self._fallback("unknown API key")
        return self.by_name[found]

    def _fallback(self, why: str) -> Tenant:
        if self.default is None:
            raise Refused(why)
        return self.by_name.get(self.default) or Tenant(self.default)


def valid_name(name: str) -> bool:
    """A tenant name: 1-64 letters, digits, ``_``, ``.`` or ``-`` (it names a namespace)."""
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_.-") for c in name)


class TenantCache(list):
    """A cache (list of layers) the batched path hands back, with the tenant it is for."""

    tenant: Tenant | None = None


class RequestTenants:
    """Carries each request's tenant from the handler thread that resolved it to the
    generation thread that fetches and inserts its caches (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, tuple[Any, Tenant]] = OrderedDict()
        self._local = threading.local()

    @contextmanager
    def handling(self, tenant: Tenant) -> Iterator[None]:
        """On a handler thread: the request it serves now is `tenant`'s."""
        self._local.handled = tenant
        try:
            yield
        finally:
            self._local.handled = None

    def handled(self) -> Tenant | None:
        """The tenant of the request this handler thread serves (None: none resolved)."""
        return getattr(self._local, "handled", None)

    def hand_over(self, request: Any, tenant: Tenant) -> None:
        """On the handler thread: `request` (the object put on the server's queue) is `tenant`'s."""
        with self._lock:
            self._pending[id(request)] = (request, tenant)
            while len(self._pending) > _PENDING:  # requests the generation thread never took (a load failed)
                self._pending.popitem(last=False)

    def take(self, request: Any) -> None:
        """On the generation thread, as it tokenizes `request`: the next fetch is its tenant's."""
        with self._lock:
            held = self._pending.pop(id(request), None)
        self._local.current = held[1] if held is not None and held[0] is request else None

    def current(self) -> Tenant | None:
        """The tenant of the request the generation thread tokenized last (None: unknown)."""
        return getattr(self._local, "current", None)

    def for_insert(self, cache: Any) -> Tenant | None:
        """Whose `cache` an insert stores: a batched request's tag (`TenantCache`; None if
        its uid's tenant was not known), else the current request's. mlx_lm.server inserts
        an untagged cache only on its sequential path, which serves one request from its
        `take` to its insert, with no batch running (checked for 0.32's three inserts)."""
        if isinstance(cache, TenantCache):
            return cache.tenant
        return self.current()


def tenant_batches(base: type, tenants: RequestTenants) -> type:
    """A subclass of mlx-lm's ``BatchGenerator`` whose caches say whose they are.

    Args:
        base: ``mlx_lm.server.BatchGenerator``.
        tenants: The server's `RequestTenants`.

    Returns:
        The class: `TenantBatches`, bound to `tenants`.
    """

    class TenantBatches(base):  # type: ignore[misc, valid-type]
        """mlx-lm's batch generator; each request's uid remembers its tenant."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._tenant_of: dict[Any, Tenant | None] = {}

        def insert_segments(self, *args: Any, **kwargs: Any) -> Any:
            return self._noted(super().insert_segments(*args, **kwargs))

        def insert(self, *args: Any, **kwargs: Any) -> Any:
            return self._noted(super().insert(*args, **kwargs))

        def _noted(self, uids: Any) -> Any:
            for uid in uids:  # inserted right after its request was taken, tokenized and fetched
                self._tenant_of[uid] = tenants.current()
            return uids

        def extract_cache(self, uids: Any) -> Any:
            out = super().extract_cache(uids)
            return {uid: (_tagged(cache, self._tenant_of.get(uid)), *rest) for uid, (cache, *rest) in out.items()}

        def next(self) -> Any:
            prompt_responses, generation_responses = super().next()
            for r in generation_responses:
                if getattr(r, "finish_reason", None) is not None:
                    tenant = self._tenant_of.pop(r.uid, None)
                    if getattr(r, "prompt_cache", None) is not None:
                        r.prompt_cache = _tagged(r.prompt_cache, tenant)
            return prompt_responses, generation_responses

        def remove(self, uids: Any, *args: Any, **kwargs: Any) -> Any:
            for uid in uids:
                self._tenant_of.pop(uid, None)
            return super().remove(uids, *args, **kwargs)

    return TenantBatches


def tenant_responses(base: type, tenants: RequestTenants) -> type:
    """A subclass of mlx-lm's ``ResponseGenerator`` that carries each request's tenant.

    Args:
        base: ``mlx_lm.server.ResponseGenerator``.
        tenants: The server's `RequestTenants`.

    Returns:
        The class: `TenantResponses`, bound to `tenants`.
    """

    class TenantRequests(Queue):
        """The server's request queue: the generation thread takes a request's tenant with it."""

        def get(self, block: bool = True, timeout: float | None = None) -> Any:
            item = super().get(block, timeout)
            if isinstance(item, tuple) and len(item) >= 2:
                tenants.take(item[1])  # (response queue, request, generation arguments)
            return item

    class TenantResponses(base):  # type: ignore[misc, valid-type]
        """mlx-lm's response generator; its queue hands each request's tenant over."""

        @property  # type: ignore[override]
        def requests(self) -> Queue:
            return self._tenant_requests

        @requests.setter
        def requests(self, queue: Queue) -> None:
            # The server's own (empty) queue, made before its generation thread starts: ours instead.
            self._tenant_requests = TenantRequests()

        def generate(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            tenant = tenants.handled()
            if tenant is not None:
                tenants.hand_over(request, tenant)
            return super().generate(request, *args, **kwargs)

    return TenantResponses


def _tagged(cache: Any, tenant: Tenant | None) -> Any:
    if cache is None or not isinstance(cache, list):
        return cache
    tagged = TenantCache(cache)
    tagged.tenant = tenant
    return tagged

"""The connection to a Redis / Valkey server or cluster: URLs, timeouts, one pipeline per node.

URL forms (what redis-py takes, plus one for a cluster):

- ``redis://[user:password@]host:port[/db]``, ``rediss://...`` (TLS),
  ``unix:///path/to/socket[?db=0]``: one server;
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``
  for TLS): a Redis Cluster, found from any of the listed nodes.

Every socket has a connect and a read timeout and redis-py's own retries are off: a
dead, paused or slow node costs a caller at most one timeout per round trip, and then
its circuit breaker skips it for a while (doubling up to `MAX_BACKOFF`) instead of
paying the timeout on every call. In a cluster each node has its own breaker, so a
node that is down makes its slots miss while the rest serve. redis-py is imported
only when a remote is opened (the ``[remote]`` extra).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import unquote, urlsplit

from ..errors import InvalidArgumentError, MissingDependencyError
from .remote_replies import read_values

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
_SLOTS = 16384


def _redis():
    try:
        import redis
        import redis.backoff
        import redis.crc
        import redis.retry
    except ImportError:
        raise MissingDependencyError("the remote tier needs the 'redis' package (redis-py)") from None
    return redis


def redact(url: str) -> str:
    """`url` without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


@dataclass
class Target:
    """A parsed remote URL: one server (`url`) or a cluster (`nodes`)."""

    url: str
    cluster: bool
    nodes: list[tuple[str, int]] = field(default_factory=list)
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_url(url: str) -> Target:
    """Check a remote URL and say what it names.

    Raises:
        InvalidArgumentError: If it is not one of the forms above.
    """
    if not isinstance(url, str) or "://" not in url:
        raise InvalidArgumentError(
            f"remote URL {url!r} is not a URL",
            hint="use redis://host:port, rediss://..., unix:///path or redis+cluster://host:port,host:port",
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise InvalidArgumentError(
            f"remote URL {redact(url)!r}: unknown scheme {scheme!r}", hint=f"use one of {', '.join(SCHEMES)}"
        )
    rest = url.split("://", 1)[1]
    if scheme == "unix":
        if not urlsplit(url).path:
            raise InvalidArgumentError(f"remote URL {url!r} names no socket path", hint="use unix:///path/to/socket")
        return Target(url, False)
    auth, _, hosts = rest.rpartition("@")
    hosts = hosts.split("/", 1)[0].split("?", 1)[0]
    nodes = []
    for item in hosts.split(",") if hosts else []:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(
                f"remote URL {redact(url)!r}: {item!r} is not host:port", hint="write the port, e.g. redis://127.0.0.1:6379"
            )
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise InvalidArgumentError(f"remote URL {redact(url)!r} names no host", hint="e.g. redis://127.0.0.1:6379")
    cluster = scheme.endswith("+cluster")
    if not cluster and len(nodes) > 1:
        raise InvalidArgumentError(
            f"remote URL {redact(url)!r} lists several hosts", hint="for a cluster use redis+cluster://h1:p1,h2:p2"
        )
    user, _, password = auth.partition(":")
    return Target(
        url, cluster, nodes, unquote(user) or None, unquote(password) if password else None, scheme.startswith("rediss")
    )


class Breaker:
    """A circuit breaker: after a failure, calls are skipped until a back-off passes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._until = 0.0
        self._backoff = FIRST_BACKOFF

    def closed(self) -> bool:
        """Whether calls may go to the server now."""
        return time.monotonic() >= self._until

    def failed(self) -> None:
        """Record a failure: skip the server for the back-off, then double it."""
        with self._lock:
            self._until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)

    def succeeded(self) -> None:
        """Record a success: the next failure backs off from the start again."""
        with self._lock:
            self._backoff = FIRST_BACKOFF


class _Node:
    """One server: a lazily made redis-py client and its breaker."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._client = None
        self.breaker = Breaker()
        self._lock = threading.Lock()

    def client(self):
        with self._lock:
            if self._client is None:
                self._client = self._make()
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


UNAVAILABLE = type("Unavailable", (), {"__repr__": lambda self: "UNAVAILABLE"})()
# ("EXISTS", key) / ("SET", key, value, ttl_ms) / ("COUNT", key, keys):
# how many of `keys` exist, in one command (one server only: a cluster refuses keys of
# several slots in one command).
Command = tuple


class Servers:
    """The server or cluster of a remote URL, spoken to one pipeline per node.

    Args:
        url: A remote URL (see the module's docstring).
        timeout: Seconds a connect or a read may take before the call fails.
    """

    def __init__(self, url: str, *, timeout: float):
        self.target = parse_url(url)
        self.timeout = timeout
        self.redis = _redis()
        self.errors = 0  # round trips that failed (timeouts, refused connections, ...)
        self._lock = threading.Lock()
        self._nodes: dict[Any, _Node] = {}
        self._slots: list[Any] | None = None  # cluster: slot -> node address
        self._slots_breaker = Breaker()

    def _options(self) -> dict:
        r = self.redis
        return dict(
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            # One immediate retry on a broken connection (a pooled socket the server
            # closed when it restarted), none on a timeout: that would double it.
            retry=r.retry.Retry(r.backoff.NoBackoff(), 1, supported_errors=(r.ConnectionError,)),
            health_check_interval=0,
        )

    def _node(self, address: Any) -> _Node:
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                t = self.target
                if t.cluster:
                    host, port = address
                    make = lambda: self.redis.Redis(  # noqa: E731
                        host=host, port=port, username=t.username, password=t.password, ssl=t.tls, **self._options()
                    )
                else:
                    make = lambda: self.redis.Redis.from_url(t.url, **self._options())  # noqa: E731
                node = self._nodes[address] = _Node(make)
            return node

    def _slot_map(self) -> list[Any] | None:
        """The cluster's slot -> node address map (asked of any listed node)."""
        if self._slots is not None or not self._slots_breaker.closed():
            return self._slots
        for address in list(self.target.nodes) + [a for a in list(self._nodes) if a not in self.target.nodes]:
            node = self._node(tuple(address))
            if not node.breaker.closed():
                continue
            try:
                ranges = node.client().execute_command("CLUSTER SLOTS")
            except Exception:  # noqa: BLE001 - any failure of a node means: try another
                self._failed(node)
                continue
            slots: list[Any] = [None] * _SLOTS
            for lo, hi, master, *_ in ranges:
                host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                for s in range(int(lo), int(hi) + 1):
                    slots[s] = (host or address[0], int(master[1]))
            self._slots = slots
            return slots
        self._slots_breaker.failed()
        return None

    def forget_topology(self) -> None:
        """Ask the cluster for its slots again before the next call (after MOVED)."""
        self._slots = None

    def _group(self, keys: Sequence[bytes]) -> dict[Any, list[int]]:
        if not self.target.cluster:
            return {"single": list(range(len(keys)))}
        slots = self._slot_map()
        groups: dict[Any, list[int]] = {}
        if slots is None:
            return groups
        key_slot = self.redis.crc.key_slot
        for i, key in enumerate(keys):
            address = slots[key_slot(key)]
            if address is not None:
                groups.setdefault(address, []).append(i)
        return groups

    def _failed(self, node: _Node) -> None:
        node.breaker.failed()
        with self._lock:
            self.errors += 1

    def call(self, commands: Sequence[Command]) -> list[Any]:
        """Run commands (one key each) in one pipeline per node.

        Returns:
            One result per command (a SET NX of a held key gives None);
            `UNAVAILABLE` where its node is down, skipped by its breaker, or
            answered with an error (a MOVED slot, say). Values are read with
            `get_values`.
        """

        def run(client: Any, where: list[int]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for i in where:
                c = commands[i]
                if c[0] == "SET":
                    pipe.set(c[1], c[2], nx=True, px=c[3])
                elif c[0] == "COUNT":  # one server only: keys of many slots
                    pipe.exists(*c[2])
                else:
                    pipe.exists(c[1])
            return pipe.execute(raise_on_error=False)

        return self._each_node([c[1] for c in commands], run)

    def get_values(self, keys: Sequence[bytes]) -> list[Any]:
        """GET `keys`, one pipelined round trip per node, each value read straight into
        a uint8 array of its own (`remote_replies`: one copy instead of three).

        Returns:
            Like `call`: a value, None for a missing key, or `UNAVAILABLE`.
        """
        return self._each_node(keys, lambda client, where: read_values(client, [keys[i] for i in where]))

    def _each_node(self, keys: Sequence[bytes], run: Callable[[Any, list[int]], list[Any]]) -> list[Any]:
        """`run(client, indexes)` for each node's share of `keys`, results in key order;
        a node that fails is counted, backed off, and its keys are `UNAVAILABLE`."""
        out: list[Any] = [UNAVAILABLE] * len(keys)
        moved = False
        for address, where in self._group(keys).items():
            node = self._node(address)
            if not node.breaker.closed():
                continue
            try:
                results = run(node.client(), where)
            except Exception:  # noqa: BLE001 - a timeout, a refused or reset connection, ...
                self._failed(node)
                if self.target.cluster:
                    self.forget_topology()
                continue
            node.breaker.succeeded()
            for i, res in zip(where, results):
                if isinstance(res, Exception):
                    moved = moved or "MOVED" in str(res) or "ASK" in str(res)
                    continue
                out[i] = res
        if moved:
            self.forget_topology()
        return out

    def available(self) -> bool:
        """Whether any node may be asked now (False: every breaker is open)."""
        if self.target.cluster and self._slots is None and not self._slots_breaker.closed():
            return False
        with self._lock:
            nodes = list(self._nodes.values())
        return not nodes or any(n.breaker.closed() for n in nodes)

    def scan(self, pattern: bytes, count: int = 1000):
        """Every key matching `pattern`, node by node (for ``ppc pull`` of a model).

        Raises:
            OSError: If a node cannot be read.
        """
        addresses = ["single"]
        if self.target.cluster:
            slots = self._slot_map()
            if slots is None:
                raise OSError("no cluster node answers")
            addresses = sorted({a for a in slots if a is not None})
        for address in addresses:
            try:
                yield from self._node(address).client().scan_iter(match=pattern, count=count)
            except self.redis.RedisError as exc:
                raise OSError(f"cannot scan {address}: {exc}") from None

    def info(self) -> list[dict]:
        """Memory and eviction figures of every node (for ``ppc stats --remote``).

        Raises:
            OSError: If no node answers.
        """
        addresses: list[Any] = ["single"]
        if self.target.cluster:
            slots = self._slot_map()
            if slots is None:
                raise OSError("no cluster node answers")
            addresses = sorted({a for a in slots if a is not None})
        out = []
        for address in addresses:
            try:
                client = self._node(address).client()
                info = {**client.info("memory"), **client.info("stats")}
            except self.redis.RedisError as exc:
                out.append({"node": str(address), "error": str(exc)})
                continue
            out.append({
                "node": str(address) if self.target.cluster else redact(self.target.url),
                **{k: info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys")},
            })  # fmt: skip
        if all("error" in n for n in out):
            raise OSError(f"no node answers: {out[0]['error']}")
        return out

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

"""The connection to a Redis / Valkey server or cluster: timeouts, one pipeline per node.

URLs (their forms, and their checks when parsed) are `remote_urls`'s. First
contact (`Servers.contact`) tells a server that refuses the URL (a db it lacks, a wrong
password: `RemoteConfigError`) from one that cannot be reached
(`RemoteUnreachableError`); a failure is said once, plainly (`remote_urls.Voice`).

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
from typing import Any, Callable, Sequence

from ..errors import MissingDependencyError, RemoteConfigError, RemoteUnreachableError
from .remote_replies import read_values
from .remote_urls import SCHEMES, Target, Voice, describe, parse_url, reason_of, redact, shown  # noqa: F401 - re-exported

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
# ("EXISTS", key) / ("SET", key, value, ttl_ms) (NX) / ("REPLACE", key, value, ttl_ms) / ("COUNT", key, keys):
# how many of `keys` exist, in one command (one server only: a cluster refuses keys of
# several slots in one command).
Command = tuple


class Servers:
    """The server or cluster of a remote URL, spoken to one pipeline per node.

    Args:
        url: A remote URL (see the module's docstring).
        timeout: Seconds a connect or a read may take before the call fails.
        tail: What the caller does without the server, said after its first failure
            ("serving from the local store only"; empty: nothing).
    """

    def __init__(self, url: str, *, timeout: float, tail: str = ""):
        self.target = parse_url(url)
        self.timeout = timeout
        self.tail = tail
        self.shown = shown(url)
        self.redis = _redis()
        self.errors = 0  # round trips that failed (timeouts, refused connections, ...)
        self.problem: str | None = None  # the last failure, said plainly (None: none yet)
        self.refusal: str | None = None  # the server's words when it last refused a command
        self._last_failure: tuple[BaseException, Any] | None = None
        self._quiet = False  # in `contact`: its caller says what failed
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
            except Exception as exc:  # noqa: BLE001 - any failure of a node means: try another
                self._failed(node, exc, address, say=False)  # said below if no node answers
                continue
            self._answered(node, address)
            Voice.answered(self.shown)
            slots: list[Any] = [None] * _SLOTS
            for lo, hi, master, *_ in ranges:
                host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                for s in range(int(lo), int(hi) + 1):
                    slots[s] = (host or address[0], int(master[1]))
            self._slots = slots
            return slots
        self._slots_breaker.failed()
        if not self._quiet and self._last_failure is not None:
            Voice.failed(self.shown, self._no_node_error().message, self.tail)
        return None

    def _no_node_error(self) -> RemoteConfigError | RemoteUnreachableError:
        """The typed error when no node of a cluster answers (after a failure)."""
        exc, address = self._last_failure or (OSError("no node answers"), None)
        error = self._error(exc, address)
        if isinstance(error, RemoteConfigError):
            return error
        return RemoteUnreachableError(f"cannot reach any node of {self.shown}: {reason_of(exc)}")

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

    def _failed(self, node: _Node, exc: BaseException, address: Any = None, *, say: bool = True) -> None:
        """Count a failed round trip, back the node off, and say it (once, see `Voice`)."""
        node.breaker.failed()
        with self._lock:
            self.errors += 1
        try:
            refused, self.problem = describe(self.target, exc, timeout=self.timeout, node=address)
        except Exception:  # noqa: BLE001 - saying it must never fail the caller
            self.problem = f"cannot reach {self.shown}: {type(exc).__name__}"
        self._last_failure = (exc, address)
        if say and not self._quiet:
            Voice.failed(self._voice_key(address), self.problem, self.tail)

    def _voice_key(self, address: Any) -> str:
        """What `Voice` says once: the server, or one node of a cluster."""
        if not self.target.cluster or address is None:
            return self.shown
        return f"{address[0]}:{address[1]} of {self.shown}"

    def back_off(self) -> None:
        """Skip the server for a while, as after a failed call (another connection to
        it just failed: a call now would pay the same failure)."""
        if self.target.cluster:
            self._slots_breaker.failed()
        else:
            self._node("single").breaker.failed()

    def _answered(self, node: _Node, address: Any = None) -> None:
        node.breaker.succeeded()
        Voice.answered(self._voice_key(address))

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
                elif c[0] == "REPLACE":  # ppc push --replace-unauthenticated: over a value that failed its checks
                    pipe.set(c[1], c[2], px=c[3])
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
            except Exception as exc:  # noqa: BLE001 - a timeout, a refused or reset connection, ...
                self._failed(node, exc, address)
                if self.target.cluster:
                    self.forget_topology()
                continue
            self._answered(node, address)
            for i, res in zip(where, results):
                if isinstance(res, Exception):
                    text = str(res)
                    if "MOVED" in text or "ASK" in text:
                        moved = True
                    else:  # the server refused this command (full and not evicting, say)
                        self.refusal = text
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
            RemoteConfigError: If the server refuses the URL (db, user, password).
            RemoteUnreachableError: If a node cannot be read.
        """
        for address in self._addresses():
            try:
                yield from self._node(address).client().scan_iter(match=pattern, count=count)
            except self.redis.RedisError as exc:
                raise self._error(exc, address) from None

    def _addresses(self) -> list[Any]:
        """Every node to ask (one server: "single").

        Raises:
            RemoteUnreachableError: If no node of a cluster answers.
        """
        if not self.target.cluster:
            return ["single"]
        slots = self._slot_map()
        if slots is None:
            raise self._no_node_error()
        return sorted({a for a in slots if a is not None})

    def _error(self, exc: BaseException, address: Any) -> RemoteConfigError | RemoteUnreachableError:
        """The typed error for a failure of `address` (see `describe`)."""
        refused, message = describe(self.target, exc, timeout=self.timeout, node=address)
        if refused and "has no db" in message:
            message = self._databases(message)
        return RemoteConfigError(message) if refused else RemoteUnreachableError(message)

    def _databases(self, message: str) -> str:
        """`message` with how many dbs the server has (asked on db 0; as it was if the
        server does not say)."""
        try:
            pool = self._node("single").client().connection_pool
            kwargs = {k: v for k, v in pool.connection_kwargs.items() if not k.startswith(("maint_", "orig_"))}
            db0 = type(pool)(connection_class=pool.connection_class, **{**kwargs, "db": 0})
            probe = self.redis.Redis(connection_pool=db0)
            try:
                n = int(probe.config_get("databases")["databases"])
            finally:
                probe.close()
        except Exception:  # noqa: BLE001 - CONFIG may be renamed or not allowed: keep the server's words
            return message
        return f"{self.shown}: the server has {n} databases (0-{n - 1}), not db {self.target.db}"

    def contact(self) -> None:
        """Talk to the server now (a PING; a cluster: its slot map, then a PING to
        each node), so that a URL the server refuses, or a server that cannot be
        reached, is known at once.

        Raises:
            RemoteConfigError: If the server (any node) refuses the URL's db, user or
                password.
            RemoteUnreachableError: If it (every node) cannot be reached: the failure
                is counted and backed off, as a failed call's, and not logged: the
                caller says it. A cluster node that is down while others answer is
                said (once) and its slots miss.
        """
        self._quiet = True
        try:
            addresses = self._addresses()
            down = []
            for address in addresses:
                node = self._node(address)
                try:
                    node.client().ping()
                except Exception as exc:  # noqa: BLE001 - redis-py's errors, ssl's, the socket's
                    error = self._error(exc, address)
                    if isinstance(error, RemoteConfigError):
                        raise error from None
                    node.breaker.failed()
                    with self._lock:
                        self.errors += 1
                    self.problem = error.message
                    down.append((address, error))
                    continue
                self._answered(node, address)
            if down and len(down) == len(addresses):
                raise down[0][1] from None
            for address, error in down:  # a cluster's node is down: its slots miss, the rest serve
                Voice.failed(self._voice_key(address), error.message, "its slots miss")
        finally:
            self._quiet = False

    def info(self) -> list[dict]:
        """Memory and eviction figures of every node (for ``ppc stats --remote``).

        Raises:
            RemoteConfigError: If the server refuses the URL (db, user, password).
            RemoteUnreachableError: If no node answers.
        """
        addresses = self._addresses()
        out: list[dict[str, Any]] = []
        for address in addresses:
            try:
                client = self._node(address).client()
                info = {**client.info("memory"), **client.info("stats")}
            except self.redis.RedisError as exc:
                out.append({"node": str(address), "error": self._error(exc, address).message})
                continue
            out.append({
                "node": str(address) if self.target.cluster else redact(self.target.url),
                **{k: info.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys")},
            })  # fmt: skip
        if all("error" in n for n in out):
            error = out[0]["error"]
            raise (RemoteUnreachableError if error.startswith("cannot reach") else RemoteConfigError)(error)
        return out

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()


def contact(url: str, *, timeout: float) -> None:
    """Talk to the server of `url` once (see `Servers.contact`), on a connection of its own.

    Raises:
        InvalidArgumentError: On a malformed URL.
        RemoteConfigError: If the server refuses the URL's db, user or password.
        RemoteUnreachableError: If it cannot be reached.
    """
    servers = Servers(url, timeout=timeout)
    try:
        servers.contact()
    finally:
        servers.close()

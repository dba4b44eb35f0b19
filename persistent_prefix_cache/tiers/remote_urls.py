"""Remote URLs, checked when parsed, and a failing server said plainly, once.

URL forms (what redis-py takes, plus one for a cluster):

- ``redis://[user:password@]host:port[/db]``, ``rediss://...`` (TLS),
  ``unix:///path/to/socket[?db=0]``: one server;
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://``
  for TLS): a Redis Cluster, found from any of the listed nodes (a cluster has db 0 only).

A db must be a number: redis-py would take ``/abc`` as db 0 without a word. Whether
the server has it is known only when it is asked (`remote_client.Servers.contact`).

A server that cannot be reached is said once, in plain words (``cannot reach
redis://127.0.0.1:6379: connection refused; serving from the local store only``), on
the ``persistent_prefix_cache`` logger: once per server (a cluster: per node) and
process, until it answers again; never per call (`Voice`). Passwords are never shown
(`redact`).
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import InvalidArgumentError

log = logging.getLogger("persistent_prefix_cache")

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def redact(url: str) -> str:
    """`url` without its password (for messages and logs): the one after ``user:`` and
    a ``password=`` query option (redis-py takes both)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL at all: nothing in it is known to be a password
        return url
    if password is None and "password=" not in parts.query:
        return url  # as given (geturl would normalize it: unix:///s -> unix:/s)
    if password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{password}@", ":***@", 1))
    if "password=" in parts.query:
        query = "&".join("password=***" if item.startswith("password=") else item for item in parts.query.split("&"))
        parts = parts._replace(query=query)
    return parts.geturl()


def shown(url: str) -> str:
    """`url` as messages name the server: password hidden, query options left out."""
    return redact(url).split("?", 1)[0]


@dataclass
class Target:
    """A parsed remote URL: one server (`url`) or a cluster (`nodes`)."""

    url: str
    cluster: bool
    nodes: list[tuple[str, int]] = field(default_factory=list)
    username: str | None = None
    password: str | None = None
    tls: bool = False
    db: int = 0


def parse_url(url: str) -> Target:
    """Check a remote URL and say what it names.

    Raises:
        InvalidArgumentError: If it is not one of the forms above, or names a db that
            is not a number (``/abc``, ``?db=-1``), or a db other than 0 of a cluster.
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
        return Target(url, False, db=_db_of(url, path=False))
    auth, _, hosts = rest.rpartition("@")
    hosts = hosts.split("/", 1)[0].split("?", 1)[0]
    nodes = []
    for item in hosts.split(",") if hosts else []:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(
                f"remote URL {redact(url)!r}: {item!r} is not host:port",
                hint="write the port, e.g. redis://127.0.0.1:6379",
            )
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise InvalidArgumentError(f"remote URL {redact(url)!r} names no host", hint="e.g. redis://127.0.0.1:6379")
    cluster = scheme.endswith("+cluster")
    if not cluster and len(nodes) > 1:
        raise InvalidArgumentError(
            f"remote URL {redact(url)!r} lists several hosts", hint="for a cluster use redis+cluster://h1:p1,h2:p2"
        )
    db = _db_of(url, path=True)
    if cluster and db:
        raise InvalidArgumentError(
            f"remote URL {redact(url)!r} asks a cluster for db {db}: a cluster has db 0 only",
            hint="leave the db out of a redis+cluster:// URL",
        )
    user, _, password = auth.partition(":")
    return Target(
        url, cluster, nodes, unquote(user) or None, unquote(password) if password else None,
        scheme.startswith("rediss"), db,
    )  # fmt: skip


def _db_of(url: str, *, path: bool) -> int:
    """The db a URL names (``/N`` after the host, or ``?db=N``): a number >= 0.

    Raises:
        InvalidArgumentError: If either is not a number, or they differ.
    """
    parts = urlsplit(url)
    found = []
    if path and parts.path.strip("/"):
        found.append(("the path", parts.path[1:]))
    found += [("db=", value) for name, value in parse_qsl(parts.query, keep_blank_values=True) if name == "db"]
    for where, text in found:
        if not (text.isascii() and text.isdigit()):
            raise InvalidArgumentError(
                f"remote URL {redact(url)!r}: the db must be a number >= 0, not {text!r} ({where})",
                hint="e.g. redis://host:6379/0",
            )
    numbers = {int(text) for _, text in found}
    if len(numbers) > 1:
        raise InvalidArgumentError(
            f"remote URL {redact(url)!r} names two dbs ({', '.join(map(str, sorted(numbers)))})", hint="name one"
        )
    return numbers.pop() if numbers else 0


def reason_of(exc: BaseException) -> str:
    """What went wrong with a connection, in a few lower-case words ("connection
    refused", "name or service not known", "connection closed by server")."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror.lower()
    text = str(exc).strip().rstrip(".")
    if " connecting to " in text and ". " in text:  # redis-py: "Error 111 connecting to h:p. Connection refused."
        text = text.rsplit(". ", 1)[1]
    if text[1:2].islower():  # "Connection refused", not "HELLO ..."
        text = text[:1].lower() + text[1:]
    return text or type(exc).__name__


def describe(target: Target, exc: BaseException, *, timeout: float, node: Any = None) -> tuple[bool, str]:
    """A failure of a round trip, said plainly.

    Args:
        target: The URL's target.
        exc: What redis-py (or the socket) raised.
        timeout: The connect and read timeout in force.
        node: A cluster node's (host, port), where one failed.

    Returns:
        (refused, message): refused is True when the server answered but refuses what
        the URL asks (a db it lacks, a user or password it does not accept), False
        when it cannot be reached (refused, reset, timed out, no such host).
    """
    where = shown(target.url) if node is None or not target.cluster else f"{node[0]}:{node[1]} of {shown(target.url)}"
    # redis-py's classes by name: this module does not import redis-py.
    kinds = {c.__name__ for c in type(exc).__mro__}
    text = str(exc)
    if any(k.startswith("Authentication") for k in kinds) or "WRONGPASS" in text or "NOAUTH" in text:
        if target.password is None:
            return True, f"{where}: the server asks for a password, and the URL gives none"
        return True, f"{where}: the server refuses the URL's user name or password ({reason_of(exc)})"
    if "ResponseError" in kinds and "DB index" in text:
        return True, f"{where}: the server has no db {target.db} ({reason_of(exc)})"
    if "ResponseError" in kinds:
        return True, f"{where}: the server refuses the connection: {reason_of(exc)}"
    if isinstance(exc, (socket.timeout, TimeoutError)) or "TimeoutError" in kinds:
        return False, f"cannot reach {where}: no answer within {timeout:g} s"
    return False, f"cannot reach {where}: {reason_of(exc)}"


class Voice:
    """Says a server's failures once: the first failure of a URL in this process is
    logged as a warning (with what the caller does without it), later ones are not
    until the server answered again (then that is logged at info)."""

    _lock = threading.Lock()
    _down: dict[str, str] = {}  # shown URL -> the message said

    @classmethod
    def failed(cls, url: str, message: str, tail: str) -> bool:
        """Say `message` (plus "; `tail`") unless a failure of `url` was said already.

        Returns:
            Whether it was said now.
        """
        with cls._lock:
            if url in cls._down:
                return False
            cls._down[url] = message
        log.warning("%s%s", message, f"; {tail}" if tail else "")
        return True

    @classmethod
    def answered(cls, url: str) -> None:
        """`url` answered: its next failure is said again."""
        if url in cls._down:  # read without the lock: the common case is a dict miss
            with cls._lock:
                said = cls._down.pop(url, None)
            if said is not None:
                log.info("%s answers again", url)

"""Reading large GET replies straight off the socket, one copy per value.

redis-py with hiredis hands a 2 MiB value over in three copies (socket -> redis-py's
buffer -> hiredis' buffer -> a new ``bytes``), 32 KiB at a time: about half of a
remote restore's time went there. `read_values` sends the GETs through redis-py's
own connection (so AUTH, TLS, unix sockets and the database are redis-py's) and then
reads the replies itself: each bulk reply is received by ``recv_into`` directly
into a buffer of its own, in as few system calls as the socket allows.

Only bulk replies (a value, or nil) and error replies are expected (RESP3 pushes
and attributes before a reply are skipped); anything else is a protocol error. A
connection whose replies were not all read is closed, never reused.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_LINE_READ = 4096  # what one read takes when a reply's first line is not yet here


class ProtocolError(OSError):
    """The server's reply is not what a GET answers."""


class ReplyError(Exception):
    """An error reply (``-MOVED ...``, ``-NOAUTH ...``) to one GET."""


def _length(line: bytes) -> int:
    """The length or count in a reply's first line (``$5``, ``*2``...)."""
    try:
        return int(line[1:])
    except ValueError:
        raise ProtocolError(f"bad length in {line[:32]!r}") from None


class _Replies:
    """RESP replies from one socket; bytes read past a reply's first line are kept."""

    def __init__(self, sock: Any):
        self.sock = sock
        self.carry = bytearray()

    def _more(self) -> None:
        chunk = self.sock.recv(_LINE_READ)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.carry += chunk

    def _line(self) -> bytes:
        while True:
            end = self.carry.find(b"\r\n")
            if end >= 0:
                line = bytes(self.carry[:end])
                del self.carry[: end + 2]
                return line
            if len(self.carry) > 1 << 16:
                raise ProtocolError("reply line too long")
            self._more()

    def _exactly(self, view: memoryview) -> None:
        have = min(len(view), len(self.carry))
        view[:have] = self.carry[:have]
        del self.carry[:have]
        while have < len(view):
            got = self.sock.recv_into(view[have:])
            if not got:
                raise ConnectionError("the server closed the connection")
            have += got

    def _skip(self, line: bytes) -> None:
        """Read past one RESP3 value that starts with `line` (a push or an attribute)."""
        kind = line[:1]
        if kind and kind in b"$!=":
            n = _length(line)
            if n >= 0:
                self._exactly(memoryview(bytearray(n + 2)))
        elif kind and kind in b"*>~%|":
            for _ in range(max(0, _length(line)) * (2 if kind in b"%|" else 1)):
                self._skip(self._line())
        elif not kind or kind not in b"+-:_#,(":
            raise ProtocolError(f"unexpected reply {line[:32]!r}")

    def bulk(self) -> np.ndarray | None | ReplyError:
        """The next reply: a value (uint8 array), None (nil) or a `ReplyError`.

        RESP3 push messages (redis-py 8 turns maintenance notifications on) and
        attributes that come before it are read and dropped.
        """
        line = self._line()
        while line[:1] in (b">", b"|"):
            self._skip(line)
            line = self._line()
        kind = line[:1]
        if kind == b"$":
            n = _length(line)
            if n < 0:
                return None
            value = np.empty(n + 2, dtype=np.uint8)  # the value and its CRLF, one read
            self._exactly(value.data)
            if bytes(value[n:]) != b"\r\n":
                raise ProtocolError("bulk reply not terminated")
            return value[:n]
        if kind == b"_":  # RESP3 null
            return None
        if kind == b"-":
            return ReplyError(line[1:].decode(errors="replace"))
        if kind == b"!":  # RESP3 blob error: its text follows, counted
            text = bytearray(max(0, _length(line)) + 2)
            self._exactly(memoryview(text))
            return ReplyError(bytes(text[:-2]).decode(errors="replace"))
        raise ProtocolError(f"unexpected reply {line[:32]!r} to GET")


def read_values(client: Any, keys: Sequence[bytes]) -> list[np.ndarray | None | ReplyError]:
    """GET `keys` in one pipelined round trip, each value read into its own buffer.

    Args:
        client: A redis-py ``Redis`` client (its pool lends the connection).
        keys: The keys.

    Returns:
        One entry per key: the value's bytes as a uint8 array, None where the key
        is missing, or a `ReplyError`.

    Raises:
        OSError: (timeouts, resets, `ProtocolError`) and redis-py's connection
            errors; the connection is then closed, not returned to the pool dirty.
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    done = False
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise ConnectionError("redis-py's connection has no socket to read")
        replies = _Replies(sock)
        out = [replies.bulk() for _ in keys]
        done = not replies.carry  # a clean connection: every byte read belonged to a reply
        return out
    finally:
        if not done:
            conn.disconnect()
        pool.release(conn)

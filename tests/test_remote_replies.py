"""The GET reply reader (`tiers/remote_replies.py`) on byte streams it may meet: RESP2
and RESP3 replies, pushes and attributes between them, and malformed ones."""

from __future__ import annotations

import pytest

from persistent_prefix_cache.tiers.remote_replies import ProtocolError, ReplyError, _Replies


class Trickle:
    """A socket that hands out `data` a few bytes per call (replies split anywhere)."""

    def __init__(self, data: bytes, step: int = 3):
        self.data, self.step = bytearray(data), step

    def recv(self, n: int) -> bytes:
        out = bytes(self.data[: min(n, self.step)])
        del self.data[: len(out)]
        return out

    def recv_into(self, view, n: int = 0) -> int:
        k = min(len(view), len(self.data), self.step)
        view[:k] = self.data[:k]
        del self.data[:k]
        return k


def test_values_nils_errors_and_pushes_between_them():
    stream = (
        b"|1\r\n+ttl\r\n:1\r\n"  # an attribute before a reply
        b">3\r\n$-1\r\n%1\r\n+k\r\n*0\r\n_\r\n"  # a push message (nested, with a null)
        b"$3\r\nabc\r\n" b"!5\r\nERR x\r\n" b"$0\r\n\r\n" b"_\r\n" b"$-1\r\n" b"-WRONGTYPE no\r\n"
        b"$4\r\na\r\nb\r\n"  # CRLF inside a value is data
    )  # fmt: skip
    r = _Replies(Trickle(stream))
    got = [r.bulk() for _ in range(7)]
    assert bytes(got[0]) == b"abc" and bytes(got[2]) == b"" and bytes(got[6]) == b"a\r\nb"
    assert got[3] is None and got[4] is None
    assert isinstance(got[1], ReplyError) and str(got[1]) == "ERR x"
    assert isinstance(got[5], ReplyError) and "WRONGTYPE" in str(got[5])
    assert not r.carry  # nothing read beyond the last reply


@pytest.mark.parametrize(
    "stream", [b"\r\n", b"*1\r\n$1\r\nx\r\n", b"$zz\r\n", b">1\r\n~x\r\n", b"$3\r\nabcde", b"+OK\r\n"]
)
def test_what_a_get_never_gets_is_a_protocol_error(stream):
    with pytest.raises((ProtocolError, ConnectionError)):
        _Replies(Trickle(stream)).bulk()

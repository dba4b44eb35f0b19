"""The remote (fleet) tier: blocks shared by every host through a Redis / Valkey server.

Reading (`RemoteTier.read_chain`, on the caller's thread): the keys of the query's
blocks after what the local store holds are probed in one pipelined round trip
(EXISTS), then the blocks present are read in pipelined batches of about `BATCH_BYTES` and
each is checked (`remote_wire.decode`: key, parent, position, tokens, checksum, MAC);
the first block missing or failing a check ends the chain there.

Publishing (`RemoteTier.publish`, never blocking): blocks go into a queue bounded in
bytes; a full queue drops them (counted). A publisher thread writes them with
``SET NX`` (the first writer wins; a value is one SET, so never half-written), with
an optional TTL. `flush` waits until every block queued so far is published or has
failed and been counted.

Opening (`RemoteTier.contact`): a handle talks to the server once when it is made, so
that a URL the server refuses (a db it lacks, a wrong password) raises there and a
server that cannot be reached is said at once, in plain words (then the handle serves
from its local store, and from the server as soon as it answers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ..disk.faults import hook, pause_point
from ..blocks import Node
from ..errors import InvalidArgumentError, RemoteUnreachableError
from ..keys import block_key
from . import remote_wire as wire
from .remote_client import UNAVAILABLE, Servers, Voice, redact

log = logging.getLogger("persistent_prefix_cache")

# Bytes per pipelined read (as many blocks as fit, at least one, at most 64): on
# loopback 1-2 MiB per round trip read fastest for blocks of 16 KiB to 2 MiB (the
# bench's sweep); larger pipelines make the server buffer every reply before the
# socket takes it, and run slower.
BATCH_BYTES = 2 << 20
MAX_BATCH_BLOCKS = 64
PUBLISH_BATCH = 16
PUBLISH_TIMEOUT = 2.0
# What a handle does when the server cannot be reached (said after the failure, once).
LOCAL_ONLY = "serving from the local store only"


def _partials(parent: bytes, at: int, data: bytes, step: int, beyond: int) -> list[tuple]:
    """Candidate partial blocks at position `at`, longest first: every length shorter
    than a block that the query holds there and that ends past `beyond`."""
    rest = data[4 * at : 4 * at + step - 4]
    return [
        (block_key(parent, rest[: 4 * i]), parent, at, rest[: 4 * i])
        for i in range(len(rest) // 4, max(0, beyond - at), -1)
    ]


def _tensor_bytes(tensors: dict) -> int:
    total = 0
    for part in tensors.values():
        for x in part.values():
            total += (x[0] if isinstance(x, tuple) else x).nbytes
    return total


class RemoteTier:
    """One handle's view of the shared block tier.

    Args:
        url: The server or cluster (see `remote_client`).
        root: The model's root key (every server key is namespaced by it).
        secret: MAC every value written and require a valid MAC on every value read.
        ttl: Seconds a published block lives on the server (None: until evicted).
        timeout: Seconds one round trip may take (connect or read) before it fails.
        queue_bytes: Bound of the publish queue's tensor bytes.
        counters: Where to count (a `counters.Counters` with `REMOTE_COUNTERS`).
        tail: What the caller does without the server, said once after its first
            failure (see `remote_urls.Voice`).
        contact: Talk to the server now (`contact`), so that a URL it refuses raises
            here and a server that cannot be reached is said at once.

    Raises:
        InvalidArgumentError: On a malformed URL or option.
        RemoteConfigError: If the server refuses the URL's db, user or password.
        MissingDependencyError: If redis-py is not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        root: bytes,
        secret: str | bytes | None,
        ttl: float | None,
        timeout: float,
        queue_bytes: int,
        counters: Any,
        tail: str = LOCAL_ONLY,
        contact: bool = True,
    ):
        self.url = redact(url)
        self.servers = Servers(url, timeout=timeout, tail=tail)
        # Publishing has connections of its own, with a longer timeout: no caller waits
        # on it, and a batch of large values may take longer than a fetch may wait.
        self.bulk = Servers(url, timeout=max(timeout, PUBLISH_TIMEOUT), tail=tail)
        self.root = root
        self.mac = wire.mac_key(secret) if secret else None
        self.kid = wire.key_id(self.mac) if self.mac else None  # this secret's key space (`remote_wire`)
        self.ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self.queue_bytes = queue_bytes
        self.counters = counters
        self._outcome = threading.local()  # how this thread's last `read_chain` went
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._value_bytes = 0  # length of the last value read (sizes the read batches)
        self._check_pool: ThreadPoolExecutor | None = None
        self._check_pid = 0
        self._said_unauthenticated = False
        self._said_unchecked_macs = False
        self.warn_unauthenticated = True  # False: the caller says it (ppc pull, with a count)
        if contact:
            try:
                self.contact()
            except BaseException:
                self.servers.close()
                self.bulk.close()
                raise

    def contact(self) -> bool:
        """Talk to the server now (on the publisher's connections, whose timeout is
        longer: one slow answer at open should not read as a dead server).

        Returns:
            Whether it answered; if not, that is said once (a warning naming the server
            and the reason, then the tail), counted in ``remote_errors``, and fetches
            skip the server for a while.

        Raises:
            RemoteConfigError: If the server refuses the URL's db, user or password.
        """
        try:
            self.bulk.contact()
        except RemoteUnreachableError as exc:
            self.counters.add(remote_errors=1)
            Voice.failed(self.bulk.shown, exc.message, self.bulk.tail)
            self.servers.back_off()
            return False
        return True

    def key(self, key: bytes) -> bytes:
        """The server key of one of this model's blocks (in this secret's key space)."""
        return wire.server_key(self.root, key, self.kid)

    # -- reading ------------------------------------------------------------------------

    def read_chain(
        self, parent: bytes, position: int, data: bytes, block_size: int, *, beyond: int = 0,
        worth: Callable[[list[tuple]], bool] | None = None,
    ) -> list[wire.RemoteBlock]:  # fmt: skip
        """The verified blocks the server holds after `parent`, for the query `data`.

        Args:
            parent: The key of the last block held locally (or the root key).
            position: Where the server's blocks start (a multiple of `block_size`).
            data: The whole query as int32 bytes.
            block_size: Tokens per full block.
            beyond: Tokens the local store already serves: a partial block that
                ends there or before is not worth reading.
            worth: Asked with the blocks the server holds (``(key, parent, position,
                tokens)`` each) before any is read: False reads none.

        Returns:
            Consecutive blocks from `position` on (possibly none): full blocks of the
            query, then possibly a partial one it contains.
        """
        if not self.servers.available():
            self.counters.add(remote_skipped=1)
            self._outcome.last = "unreachable"
            return []
        errors = self.servers.errors
        chain = self.probe(parent, position, data, block_size, beyond=beyond)
        if chain and worth is not None and not worth(chain):
            self._outcome.last = "slower"
            return []
        blocks = self._read(chain)
        failed = self.servers.errors - errors
        if failed > 0:
            self.counters.add(remote_errors=failed)
        if blocks:
            self.counters.add(remote_hits=1, remote_blocks=len(blocks), remote_bytes_read=sum(b.nbytes for b in blocks))
        else:
            self.counters.add(remote_misses=1)
        self._outcome.last = "read" if blocks else "unreachable" if failed > 0 else "none"
        return blocks

    def take_last_read(self) -> str | None:
        """How this thread's last `read_chain` went, forgotten once taken (a fetch takes
        its own): ``"read"`` (blocks came), ``"none"`` (the server holds no
        continuation), ``"slower"`` (left there: the cost model), ``"unreachable"``
        (skipped while the server backs off, or a round trip failed); None if none
        since the last take."""
        last, self._outcome.last = getattr(self._outcome, "last", None), None
        return last

    def probe(self, parent: bytes, position: int, data: bytes, block_size: int, *, beyond: int = 0) -> list[tuple]:
        """Which blocks of the query's continuation the server holds.

        One server: one round trip when it holds the whole chain or none of it (a
        multi-key EXISTS counts the full blocks, another the partial candidates), a
        few more when the chain breaks early. A cluster: EXISTS per key, pipelined
        per node (a cluster refuses multi-key commands across slots).

        Returns:
            ``(key, parent, position, tokens)`` of the consecutive blocks held: full
            blocks, then at most one partial block (the longest held).
        """
        step = 4 * block_size
        full = []  # (key, parent, position, tokens)
        p, pos = parent, position
        while 4 * pos + step <= len(data):
            toks = data[4 * pos : 4 * pos + step]
            k = block_key(p, toks)
            full.append((k, p, pos, toks))
            p, pos = k, pos + block_size
        # A prompt stored shorter than the query ends with a partial block: probe every
        # length at the query's last block boundary in the same round trip.
        tail = _partials(p, pos, data, step, beyond)
        if self.servers.target.cluster:
            return self._probe_each(full, tail, parent, position, data, step, beyond)
        fk = [self.key(c[0]) for c in full]
        n_full, n_tail = self._counts([fk, [self.key(c[0]) for c in tail]])
        if n_full is UNAVAILABLE:
            return []
        n = n_full
        if n_full < len(full):
            n, tail, n_tail = self._first_missing(full, fk, n_full, parent, position, data, step, beyond)
        if n is UNAVAILABLE:
            return []
        if n_tail is UNAVAILABLE or not n_tail:
            return full[:n]
        found = self.servers.call([("EXISTS", self.key(c[0])) for c in tail])
        return full[:n] + [c for c, e in zip(tail, found) if e == 1][:1]

    def _counts(self, groups: list[list[bytes]]) -> list:
        """How many keys of each group exist (0 for an empty group), one round trip."""
        asked = [g for g in groups if g]
        got = iter(self.servers.call([("COUNT", g[0], g) for g in asked]) if asked else [])
        return [next(got) if g else 0 for g in groups]

    def _first_missing(self, full, fk, held, parent, position, data, step, beyond):
        """(blocks before the first missing one, the partial candidates there, how many
        of those exist), knowing that `held` of the full blocks exist."""

        def tail_at(n):
            last, at = (full[n - 1][0], full[n - 1][2] + step // 4) if n else (parent, position)
            return _partials(last, at, data, step, beyond)

        # Mostly the server holds a prefix of the chain: then its first `held` keys exist.
        tail = tail_at(held)
        prefix, n_tail = self._counts([fk[:held], [self.key(c[0]) for c in tail]])
        if prefix is UNAVAILABLE or prefix == held:
            return prefix if prefix is UNAVAILABLE else held, tail, n_tail
        lo, hi = 0, held - 1  # a hole: the longest fully held prefix, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            got = self._counts([fk[:mid]])[0]
            if got is UNAVAILABLE:
                return UNAVAILABLE, [], 0
            lo, hi = (mid, hi) if got == mid else (lo, mid - 1)
        tail = tail_at(lo)
        return lo, tail, self._counts([[self.key(c[0]) for c in tail]])[0]

    def _probe_each(self, full, tail, parent, position, data, step, beyond) -> list[tuple]:
        found = self.servers.call([("EXISTS", self.key(c[0])) for c in full + tail]) if full or tail else []
        n = next((i for i, e in enumerate(found[: len(full)]) if e != 1), len(full))
        if n == len(full):
            return full + [c for c, e in zip(tail, found[len(full) :]) if e == 1][:1]
        if not self.servers.available():
            return full[:n]
        last, at = (full[n - 1][0], full[n - 1][2] + step // 4) if n else (parent, position)
        tail = _partials(last, at, data, step, beyond)
        found = self.servers.call([("EXISTS", self.key(c[0])) for c in tail]) if tail else []
        return full[:n] + [c for c, e in zip(tail, found) if e == 1][:1]

    @property
    def value_bytes(self) -> int:
        """Length of the last value read (0 before any): what a block costs to read, which
        sizes the read batches and what the cost model weighs a read by. A caller that
        knows it before any read (a figure measured elsewhere) may set it."""
        return self._value_bytes

    @value_bytes.setter
    def value_bytes(self, size: int) -> None:
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError(f"value_bytes must be an int >= 0, got {size!r}")
        self._value_bytes = size

    def batch_blocks(self) -> int:
        """Blocks per pipelined read: `BATCH_BYTES` worth, by the last value read (one
        until a value was seen)."""
        if not self._value_bytes:
            return 1
        return max(1, min(MAX_BATCH_BLOCKS, BATCH_BYTES // self._value_bytes))

    def _read(self, chain: list[tuple[bytes, bytes, int, bytes]]) -> list[wire.RemoteBlock]:
        """Read and verify the blocks of `chain` in order, up to the first one missing
        or failing a check. Each batch is verified on a thread of its own while the
        next one is received."""
        checks = []
        lo = 0
        while lo < len(chain):
            batch = chain[lo : lo + self.batch_blocks()]
            lo += len(batch)
            values = self.servers.get_values([self.key(k) for k, *_ in batch])
            present = []
            for want, value in zip(batch, values):
                if value is None or value is UNAVAILABLE:
                    break  # evicted meanwhile, or its node is down
                self._value_bytes = len(value)
                present.append((want, value))
            checks.append((len(batch), self._checker().submit(self._decode, present)))
            if len(present) < len(batch):
                break
        blocks: list[wire.RemoteBlock] = []
        for asked, check in checks:
            got, bad = check.result()
            blocks += got
            if bad is not None:
                self._rejected(*bad)
            if len(got) < asked:
                break
        return blocks

    def _rejected(self, key: bytes, exc: wire.BadValue) -> None:
        """Count a value that failed a check; say it (a failed MAC once per handle: a
        wrong secret fails every block, and each is a miss, not news)."""
        self.counters.add(**{f"remote_{exc.reason}": 1})
        if exc.reason != "unauthenticated":
            log.warning("remote block %s rejected: %s", key.hex(), exc)
        elif self.warn_unauthenticated and not self._said_unauthenticated:
            self._said_unauthenticated = True
            log.warning(
                "blocks from %s under this secret's key id fail authentication (%s): they were written with another "
                "secret (forged, or damaged), not by a host holding this one. They are read as misses (counted: "
                "remote_unauthenticated); `ppc push --replace-unauthenticated` replaces those a store holds",
                self.url, exc,
            )  # fmt: skip

    def note_unchecked(self, value: Any) -> None:
        """Say once that values carry a MAC this handle cannot check (it has no secret)."""
        if self.mac is None and not self._said_unchecked_macs and wire.carries_mac(value):
            self._said_unchecked_macs = True
            log.warning(
                "blocks from %s carry a MAC this host cannot check (it has no remote secret: remote_insecure): they "
                "are used unauthenticated; give the fleet's secret ($PPC_REMOTE_SECRET, remote_secret=) to check them",
                self.url,
            )  # fmt: skip

    def _decode(self, values: list[tuple[tuple, Any]]) -> tuple[list[wire.RemoteBlock], tuple | None]:
        """The leading `values` that decode as the blocks wanted, and (key, error) of
        the first that does not (None if all do)."""
        out = []
        for (k, p, pos, toks), value in values:
            self.note_unchecked(value)
            try:
                out.append(wire.decode(value, self.key(k), key=k, parent=p, position=pos, tokens=toks, mac=self.mac))
            except wire.BadValue as exc:
                return out, (k, exc)
        return out, None

    def _checker(self) -> ThreadPoolExecutor:
        with self._cond:
            # A forked child has the pool but not its thread: make a new one there.
            if self._check_pool is None or self._check_pid != os.getpid():
                self._check_pool = ThreadPoolExecutor(1, thread_name_prefix="ppc-remote-check")
                self._check_pid = os.getpid()
            return self._check_pool

    # -- publishing -------------------------------------------------------------------

    def publish(self, blocks: Sequence[tuple[Node, dict]]) -> None:
        """Queue blocks for the server; never blocks (a full queue drops and counts).

        Args:
            blocks: ``(node, tensors by leaf)``; tensors evaluated (or bits), and not
                changed afterwards.
        """
        dropped = 0
        with self._cond:
            if self._stopping:
                return
            for node, tensors in blocks:
                size = _tensor_bytes(tensors)
                if self._queued_bytes + size > self.queue_bytes:
                    dropped += 1
                    continue
                self._queue.append((node, tensors, size))
                self._queued_bytes += size
            if self._thread is None and self._queue:
                self._thread = threading.Thread(target=self._run, name="ppc-publisher", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped:
            self.counters.add(remote_dropped=dropped)

    @property
    def pending(self) -> int:
        """Blocks queued or being published."""
        with self._cond:
            return len(self._queue) + self._in_flight

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(PUBLISH_BATCH, len(self._queue)))]
                self._in_flight = len(batch)
            try:
                self.put([(node, tensors) for node, tensors, _ in batch])
            except Exception:  # noqa: BLE001 - never let the thread die: count and go on
                log.exception("publishing to %s failed", self.url)
                self.counters.add(remote_publish_failed=len(batch))
            with self._cond:
                self._in_flight = 0
                self._queued_bytes -= sum(size for *_, size in batch)
                self._cond.notify_all()

    def put(self, blocks: Sequence[tuple[Node, dict]], *, replace: bool = False) -> tuple[int, int]:
        """Write blocks now (``SET NX``), on the calling thread.

        Args:
            blocks: ``(node, tensors)`` per block.
            replace: Write over what the server holds (``SET``): for values that failed
                their checks (``ppc push --replace-unauthenticated``).

        Returns:
            (blocks written, blocks the server already held); the rest failed and
            were counted.
        """
        if not self.bulk.available():
            self.counters.add(remote_publish_failed=len(blocks))
            return 0, 0
        errors = self.bulk.errors
        values = [(self.key(node.key), wire.encode(self.key(node.key), node, t, self.mac)) for node, t in blocks]
        commands = [("REPLACE" if replace else "SET", k, v, self.ttl_ms) for k, v in values]
        if hook("pause_at") == "remote_publish" and len(commands) > 1:
            # Crash tests: stop (to be killed) with the first block published, the rest not.
            results = self.bulk.call(commands[:1])
            pause_point("remote_publish")
            results += self.bulk.call(commands[1:])
        else:
            results = self.bulk.call(commands)
        written = [len(v) for (_, v), r in zip(values, results) if r is True]
        already = sum(1 for r in results if r is None)
        failed = len(results) - len(written) - already
        self.counters.add(
            remote_published=len(written), remote_bytes_published=sum(written), remote_already=already,
            remote_publish_failed=failed, remote_errors=self.bulk.errors - errors,
        )  # fmt: skip
        return len(written), already

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block queued so far is published or has failed (counted).

        Returns:
            False if `timeout` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Publish what is queued, then close the connections."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._check_pool is not None:
            self._check_pool.shutdown()
        self.servers.close()
        self.bulk.close()

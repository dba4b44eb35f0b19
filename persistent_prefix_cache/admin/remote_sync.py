"""Whole stores to and from the remote tier: ``ppc push`` and ``ppc pull`` of a model.

`push_store` publishes every block of a local store (a precomputed one, say), parents
first, asking the server which it holds already (one EXISTS round trip per batch) so a
re-run sends only what is missing; values are written with ``SET NX`` like the
publisher's. `pull_model` reads every block the server holds for one model (SCAN of
its key prefix), verifies each as a fetch does (its key follows from its parent and
tokens, checksum, MAC, layout) and writes the ones the local store lacks through the
store's own write path, parents first; a block whose parent is missing is skipped.
Both are safe to re-run and to interrupt. Both need the server: they talk to it first
and raise `RemoteUnreachableError` (or `RemoteConfigError` for a db it lacks, a wrong
password) before doing anything else.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from ..blocks import Node
from ..core.counters import Counters
from ..disk.faults import hold_point
from ..disk.index import Index
from ..disk.segment import SegmentFiles
from ..errors import InvalidArgumentError, PrefixCacheError, RemoteUnreachableError
from ..tiers import REMOTE_COUNTERS
from ..tiers import remote_wire as wire
from ..tiers.remote import RemoteTier
from ..tiers.remote_client import UNAVAILABLE, contact, redact

BATCH = 16
BULK_TIMEOUT = 10.0  # seconds per round trip for bulk transfers (no caller waits on them)
Progress = Callable[[int, int], None]


def reach(url: str, tail: str, timeout: float = BULK_TIMEOUT) -> None:
    """Talk to the server before a transfer that cannot go on without it.

    Args:
        url: The remote URL.
        tail: What it means for the transfer ("nothing was pushed"), said after why.
        timeout: Seconds the connect and the answer may take.

    Raises:
        RemoteConfigError: If the server refuses the URL's db, user or password.
        RemoteUnreachableError: If it cannot be reached.
    """
    try:
        contact(url, timeout=timeout)
    except RemoteUnreachableError as exc:
        raise RemoteUnreachableError(f"{exc.message}; {tail}") from None


def _roots_of(nodes: dict[bytes, Node], roots: set[bytes]) -> dict[bytes, bytes]:
    """Block key -> its chain's root key (blocks whose chain is broken are left out)."""
    out: dict[bytes, bytes] = {}
    for key in nodes:
        trail, k = [], key
        while k not in out and k not in roots and k in nodes:
            trail.append(k)
            k = nodes[k].parent
        root = out.get(k, k if k in roots else None)
        if root is not None:
            out.update(dict.fromkeys(trail, root))
    return out


def push_store(
    path: str, url: str, *, secret: str | bytes | None, ttl: float | None, progress: Progress | None = None,
    replace_unauthenticated: bool = False,
) -> dict[str, int]:  # fmt: skip
    """Publish every block of the store at `path` to the remote at `url`.

    Args:
        replace_unauthenticated: Read the values the server already holds for these
            blocks (in this secret's key space) and write over those that fail their
            checks (a MAC another secret made, a forged or damaged value): first-writer-wins
            never replaces them otherwise.

    Returns:
        blocks, pushed, already (held by the server), replaced (held, failing their
        checks, written over), damaged (failed their checksum here, not sent), failed
        (the server did not take them); with failures, also why: the server's words
        (a refusal, or why it could not be reached).

    Raises:
        InvalidArgumentError: If there is no store at `path`, or on a malformed URL.
        RemoteConfigError: If the server refuses the URL's db, user or password.
        RemoteUnreachableError: If the server cannot be reached (nothing was sent).
    """
    if not os.path.isdir(os.path.join(path, "index")):
        raise InvalidArgumentError(f"no store at {path}")
    reach(url, "nothing was pushed")
    index = Index(os.path.join(path, "index"), readonly=True)
    files = SegmentFiles(path, readonly=True)
    counters = Counters(*REMOTE_COUNTERS)
    out: dict[str, Any] = dict.fromkeys(("blocks", "pushed", "already", "replaced", "damaged", "failed"), 0)
    tiers: dict[bytes, RemoteTier] = {}
    try:
        with index.reader() as reader:
            nodes = {n.key: n for n in reader.iter_nodes()}
            roots = set(reader.models())
        root_of = _roots_of(nodes, roots)
        todo = sorted((n for n in nodes.values() if n.key in root_of), key=lambda n: (n.position, n.key))
        out["blocks"] = len(todo)
        for lo in range(0, len(todo), BATCH):
            batch = todo[lo : lo + BATCH]
            for root in {root_of[n.key] for n in batch}:
                if root not in tiers:
                    tiers[root] = RemoteTier(
                        url, root=root, secret=secret, ttl=ttl, timeout=BULK_TIMEOUT, queue_bytes=0, counters=counters,
                        tail="the blocks it does not take are counted as failed", contact=False,
                    )  # fmt: skip
            first = tiers[root_of[batch[0].key]]
            held = first.bulk.call([("EXISTS", tiers[root_of[n.key]].key(n.key)) for n in batch])
            out["already"] += sum(1 for h in held if h == 1)
            out["failed"] += sum(1 for h in held if h is UNAVAILABLE)
            missing = [n for n, h in zip(batch, held) if h == 0]
            if replace_unauthenticated:
                held_here = [n for n, h in zip(batch, held) if h == 1]
                bad = [n for n in held_here if not _holds_good(tiers[root_of[n.key]], n)]
                for root in {root_of[n.key] for n in bad}:
                    blocks = [
                        (n, b) for n in bad if root_of[n.key] == root and (b := files.block_tensors(n)) is not None
                    ]
                    written, _ = tiers[root].put(blocks, replace=True) if blocks else (0, 0)
                    out["replaced"] += written
                    out["already"] -= written
            for root in {root_of[n.key] for n in missing}:
                blocks = []
                for node in (n for n in missing if root_of[n.key] == root):
                    bits = files.block_tensors(node)
                    if bits is None:
                        out["damaged"] += 1
                    else:
                        blocks.append((node, bits))
                if blocks:
                    written, already = tiers[root].put(blocks)
                    out["pushed"] += written
                    out["already"] += already
                    out["failed"] += len(blocks) - written - already
            if progress is not None:
                progress(min(lo + BATCH, len(todo)), len(todo))
        if out["failed"]:
            said = [f"the server says: {t.bulk.refusal.rstrip('.')}" if t.bulk.refusal else t.bulk.problem
                    for t in tiers.values()]  # fmt: skip
            out["why"] = next((why for why in said if why), None)
    finally:
        for tier in tiers.values():
            tier.close()
        index.close()
    return out


def _holds_good(tier: RemoteTier, node: Node) -> bool:
    """Whether the server's value of `node` passes every check of a read (True where it
    cannot be read: only a value seen to fail is replaced)."""
    skey = tier.key(node.key)
    value = tier.bulk.get_values([skey])[0]
    if value is None or value is UNAVAILABLE:
        return True
    try:
        wire.decode(value, skey, key=node.key, parent=node.parent, position=node.position, tokens=node.tokens,
                    mac=tier.mac)  # fmt: skip
    except wire.BadValue:
        return False
    return True


def remote_key_spaces(store: Any) -> dict[str | None, list[bytes]]:
    """`key_spaces` of `store`'s remote tier (opened with ``remote=``)."""
    return key_spaces(store.remote_fill.remote)


def count_unauthenticated(store: Any) -> None:
    """Make `store`'s remote tier count values that fail authentication without a warning
    per value (``ppc pull`` says it once, with the count)."""
    store.remote_fill.remote.warn_unauthenticated = False


def key_spaces(tier: RemoteTier) -> dict[str | None, list[bytes]]:
    """The server keys of `tier`'s model by key space: the key id of the secret that
    wrote them (None: written without a secret; see `remote_wire`).

    Raises:
        RemoteUnreachableError: If the server cannot be scanned.
    """
    out: dict[str | None, list[bytes]] = {}
    for skey in set(tier.bulk.scan(wire.key_pattern(tier.root))):
        try:
            kid, _ = wire.split_key(skey)
        except ValueError:
            continue  # not a key of this scheme (another tool's, under our prefix)
        out.setdefault(kid, []).append(skey)
    return out


def pull_model(store: Any, progress: Progress | None = None) -> dict[str, int]:
    """Fill `store` (opened with ``remote=``) with every block the server holds for
    its model, namespace and layout, in its secret's key space.

    Returns:
        found (on the server, in this secret's key space), other_secrets (blocks of the
        model in other key spaces: written with another secret, or without one), pulled
        (committed locally by this pull), present (there already), rejected (failed a
        check, counted as the store's remote_corrupt or remote_unauthenticated), unread
        (found, but the server did not answer for them: counted in remote_errors),
        waiting (read, but a block before them was unread: not stored), orphans
        (their parent is neither here nor there), replaced (pulled
        blocks that took the place of others or were replaced: a prompt's partial last
        block gives way to a longer one, eviction under a disk budget), so that the
        store grew by pulled - replaced blocks.

    Raises:
        InvalidArgumentError: If the store has no remote, or is read-only.
        RemoteConfigError: If the server refuses the URL's db, user or password.
        RemoteUnreachableError: If the server cannot be scanned.
    """
    fill = store.remote_fill  # the handle's remote tier, what it fits and writes blocks through
    if fill is None or store.readonly:
        raise InvalidArgumentError("pull needs a writable store opened with remote=URL")
    tier = fill.remote
    spaces = key_spaces(tier)
    keys = sorted(spaces.pop(tier.kid, []))
    names = ("found", "other_secrets", "pulled", "present", "rejected", "unread", "waiting", "orphans", "replaced")
    out = dict.fromkeys(names, 0)
    out["other_secrets"] = sum(len(v) for v in spaces.values())
    before = store.stats()
    errors = tier.bulk.errors
    out["found"] = len(keys)
    blocks: list[wire.RemoteBlock] = []
    unread: set[bytes] = set()
    for lo in range(0, len(keys), BATCH):
        batch = keys[lo : lo + BATCH]
        for skey, value in zip(batch, tier.bulk.get_values(batch)):
            if value is UNAVAILABLE:  # the server stopped answering (or skips, backing off)
                unread.add(wire.split_key(skey)[1])
                continue
            block = _verified(tier, fill, tier.root, skey, value)
            if block is None:
                out["rejected"] += value is not None
                continue
            blocks.append(block)
        if progress is not None:
            progress(min(lo + BATCH, len(keys)), len(keys))
        if lo == 0:
            hold_point("pull_batch")  # tests: the server is stopped here
    out["unread"] = len(unread)
    tier.counters.add(remote_errors=tier.bulk.errors - errors)
    local = fill.held(b.node.key for b in blocks)
    known = local | {tier.root}
    runs: dict[bytes, list] = {}  # key of a run's last block -> the run
    order = []
    for block in sorted(blocks, key=lambda b: (b.node.position, b.node.key)):
        node = block.node
        if node.key in local:
            out["present"] += 1
            continue
        if node.parent not in known:
            if node.parent in unread:  # a block before it was not read: it waits for the next pull
                unread.add(node.key)
                out["waiting"] += 1
            else:
                out["orphans"] += 1
            continue
        known.add(node.key)
        run = runs.pop(node.parent, None)
        if run is None:
            run = []
            order.append(run)
        run.append(block)
        runs[node.key] = run
    for run in order:  # parents first: the writer thread commits in submission order
        fill.write(run)
    store.flush()
    after = store.stats()
    # What was committed, not what was handed over (another process may store a block first).
    out["pulled"] = after["blocks_written"] - before["blocks_written"]
    out["replaced"] = max(0, out["pulled"] - (after["blocks"] - before["blocks"]))
    return out


# What a value that does not parse raises before `wire.decode` can say why.
_MALFORMED = (ValueError, KeyError, TypeError, IndexError, json.JSONDecodeError)


def checked_value(skey: bytes, value: Any, root: bytes, mac: bytes | None) -> wire.RemoteBlock:
    """A value read under `skey` (a key of `root`'s blocks), checked as every read checks
    it: the block it claims to be, its checksum and, with `mac`, its MAC.

    Raises:
        wire.BadValue: If a check fails (``reason``: corrupt or unauthenticated).
        ValueError, KeyError, TypeError, IndexError: If it does not even parse.
    """
    key = wire.split_key(skey)[1]
    head = wire.header_of(value)
    parent, position, tokens = bytes.fromhex(head["parent"]), int(head["pos"]), wire.tokens_of(value)
    if position == 0 and parent != root:
        raise wire.BadValue("corrupt", "a first block whose parent is not the root")
    return wire.decode(value, skey, key=key, parent=parent, position=position, tokens=tokens, mac=mac)


def _verified(tier: RemoteTier, fill: Any, root: bytes, skey: bytes, value: Any) -> wire.RemoteBlock | None:
    if value is None or value is UNAVAILABLE:
        return None
    tier.note_unchecked(value)
    try:
        block = checked_value(skey, value, root, tier.mac)
    except wire.BadValue as exc:
        tier.counters.add(**{f"remote_{exc.reason}": 1})
        return None
    except _MALFORMED:
        tier.counters.add(remote_corrupt=1)
        return None
    return block if fill.fits(block) else None


def remote_summary(
    url: str, roots: list[bytes], secret: str | bytes | None = None, *, verify: bool = False
) -> dict[str, Any]:
    """What the server holds for a store's models, and its memory figures.

    Args:
        url: The remote URL.
        roots: The models' root keys.
        secret: The remote secret (None: a fleet without one), whose key space is this host's.
        verify: Read every value in this host's key space and check it as a read does
            (its MAC, with a secret; its checksum), so that `blocks` counts only those
            that pass (it reads every byte of them: a bulk transfer).

    Returns:
        reachable, secret (this host's key id, or None), blocks (keys of these models'
        roots in this host's key space; with `verify`, the values there that pass their
        checks, and failed: those that do not), other_secrets (in other key spaces:
        written with another secret, or without one, which this host cannot
        authenticate) and nodes (used_memory, maxmemory, maxmemory_policy, evicted_keys
        per node), or reachable False and the error.
    """
    from ..tiers.remote_client import Servers

    kid = wire.key_id(wire.mac_key(secret)) if secret else None
    servers = Servers(url, timeout=BULK_TIMEOUT)
    ours: list[tuple[bytes, bytes]] = []  # (root, server key) in this host's key space
    try:
        nodes = servers.info()
        spaces: dict[str | None, int] = {}
        for root in roots:
            for skey in servers.scan(wire.key_pattern(root)):
                try:
                    space = wire.split_key(skey)[0]
                except ValueError:
                    continue
                spaces[space] = spaces.get(space, 0) + 1
                if space == kid:
                    ours.append((root, skey))
        checked = _check_values(url, servers, ours, wire.mac_key(secret) if secret else None) if verify else None
    except PrefixCacheError as exc:  # cannot reach it, or it refuses the URL: said plainly
        return {"reachable": False, "error": exc.message}
    finally:
        servers.close()
    out = {"reachable": True, "secret": kid, "blocks": spaces.pop(kid, 0), "other_secrets": sum(spaces.values()),
           "nodes": nodes}  # fmt: skip
    if checked is not None:
        out.update(checked)
    return out


def _check_values(url: str, servers: Any, keys: list[tuple[bytes, bytes]], mac: bytes | None) -> dict[str, int]:
    """blocks (values that pass every check of a read), failed (those that do not) and
    gone (keys that expired or were evicted since the scan) of `keys`.

    Raises:
        RemoteUnreachableError: If the server stops answering meanwhile.
    """
    out = dict.fromkeys(("blocks", "failed", "gone"), 0)
    for lo in range(0, len(keys), BATCH):
        batch = keys[lo : lo + BATCH]
        for (root, skey), value in zip(batch, servers.get_values([k for _, k in batch])):
            if value is UNAVAILABLE:
                raise RemoteUnreachableError(f"{redact(url)} stopped answering while its values were read")
            if value is None:
                out["gone"] += 1
                continue
            try:
                checked_value(skey, value, root, mac)
            except (wire.BadValue, *_MALFORMED):
                out["failed"] += 1
            else:
                out["blocks"] += 1
    return out

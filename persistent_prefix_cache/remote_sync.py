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

from .disk.index import Index
from .blocks import Node
from .disk.segment import SegmentFiles
from .errors import InvalidArgumentError, PrefixCacheError, RemoteUnreachableError
from .tiers import remote_wire as wire
from .tiers.remote import REMOTE_COUNTERS, RemoteTier
from .tiers.remote_client import UNAVAILABLE, contact
from .counters import Counters

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
    path: str, url: str, *, secret: str | bytes | None, ttl: float | None, progress: Progress | None = None
) -> dict[str, int]:
    """Publish every block of the store at `path` to the remote at `url`.

    Returns:
        blocks, pushed, already (held by the server), damaged (failed their checksum
        here, not sent), failed (the server did not take them); with failures, also
        why: the server's words (a refusal, or why it could not be reached).

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
    out = dict.fromkeys(("blocks", "pushed", "already", "damaged", "failed"), 0)
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
            for root in {root_of[n.key] for n in missing}:
                blocks = []
                for node in (n for n in missing if root_of[n.key] == root):
                    bits = _read_block(files, node)
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


def _read_block(files: SegmentFiles, node: Node) -> dict | None:
    seg = files.open(node.segment)
    if seg is None:
        return None
    try:
        return seg.block_tensors(node)
    finally:
        seg.close()


def count_unauthenticated(store: Any) -> None:
    """Make `store`'s remote tier count values that fail authentication without a warning
    per value (``ppc pull`` says it once, with the count)."""
    store._remote.warn_unauthenticated = False  # the facade's collaborator: this module is its part


def pull_model(store: Any, progress: Progress | None = None) -> dict[str, int]:
    """Fill `store` (opened with ``remote=``) with every block the server holds for
    its model, namespace and layout.

    Returns:
        found (on the server), pulled (committed locally by this pull), present (there
        already), rejected (failed a check, counted as the store's remote_corrupt or
        remote_unauthenticated), orphans (their parent is neither here nor there),
        replaced (pulled blocks that took the place of others or were replaced: a
        prompt's partial last block gives way to a longer one, eviction under a disk
        budget), so that the store grew by pulled - replaced blocks.

    Raises:
        InvalidArgumentError: If the store has no remote, or is read-only.
        RemoteConfigError: If the server refuses the URL's db, user or password.
        RemoteUnreachableError: If the server cannot be scanned.
    """
    # The facade's collaborators (private to it; this module is its part that pulls).
    tier, fill, writeback = store._remote, store._remote_fill, store._writeback
    if tier is None or writeback is None:
        raise InvalidArgumentError("pull needs a writable store opened with remote=URL")
    keys = sorted(set(tier.bulk.scan(wire.key_pattern(store._root))))
    out = dict.fromkeys(("found", "pulled", "present", "rejected", "orphans", "replaced"), 0)
    before = store.stats()
    out["found"] = len(keys)
    blocks: list[wire.RemoteBlock] = []
    for lo in range(0, len(keys), BATCH):
        batch = keys[lo : lo + BATCH]
        for skey, value in zip(batch, tier.bulk.get_values(batch)):
            block = _verified(tier, fill, store._root, skey, value)
            if block is None:
                out["rejected"] += value is not None and value is not UNAVAILABLE
                continue
            blocks.append(block)
        if progress is not None:
            progress(min(lo + BATCH, len(keys)), len(keys))
    with store._index.reader() as reader:
        local = {b.node.key for b in blocks if reader.get(b.node.key) is not None}
        known = local | {store._root}
    runs: dict[bytes, list] = {}  # key of a run's last block -> the run
    order = []
    for block in sorted(blocks, key=lambda b: (b.node.position, b.node.key)):
        node = block.node
        if node.key in local:
            out["present"] += 1
            continue
        if node.parent not in known:
            out["orphans"] += 1
            continue
        known.add(node.key)
        run = runs.pop(node.parent, None)
        if run is None:
            run = []
            order.append(run)
        run.append((node, block.bits))
        runs[node.key] = run
    for run in order:  # parents first: the writer thread commits in submission order
        writeback.submit(writeback.write_blocks, run)
    store.flush()
    after = store.stats()
    # What was committed, not what was handed over (another process may store a block first).
    out["pulled"] = after["blocks_written"] - before["blocks_written"]
    out["replaced"] = max(0, out["pulled"] - (after["blocks"] - before["blocks"]))
    return out


def _verified(tier: RemoteTier, fill: Any, root: bytes, skey: bytes, value: Any) -> wire.RemoteBlock | None:
    if value is None or value is UNAVAILABLE:
        return None
    try:
        key = bytes.fromhex(skey.rsplit(b":", 1)[1].decode())
        head = wire.header_of(value)
        parent, position, tokens = bytes.fromhex(head["parent"]), int(head["pos"]), wire.tokens_of(value)
        if position == 0 and parent != root:
            raise wire.BadValue("corrupt", "a first block whose parent is not the root")
        block = wire.decode(value, skey, key=key, parent=parent, position=position, tokens=tokens, mac=tier.mac)
    except wire.BadValue as exc:
        tier.counters.add(**{f"remote_{exc.reason}": 1})
        return None
    except (ValueError, KeyError, TypeError, IndexError, json.JSONDecodeError):
        tier.counters.add(remote_corrupt=1)
        return None
    return block if fill.fits(block) else None


def remote_summary(url: str, roots: list[bytes]) -> dict[str, Any]:
    """What the server holds for a store's models, and its memory figures.

    Returns:
        reachable, blocks (keys of these models' roots) and nodes (used_memory,
        maxmemory, maxmemory_policy, evicted_keys per node), or reachable False
        and the error.
    """
    from .tiers.remote_client import Servers

    servers = Servers(url, timeout=BULK_TIMEOUT)
    try:
        nodes = servers.info()
        blocks = sum(1 for root in roots for _ in servers.scan(wire.key_pattern(root)))
    except PrefixCacheError as exc:  # cannot reach it, or it refuses the URL: said plainly
        return {"reachable": False, "error": exc.message}
    finally:
        servers.close()
    return {"reachable": True, "blocks": blocks, "nodes": nodes}

"""Which namespace owns a block, and what each accounted namespace holds (its quota's base).

A store's disk budget is store-wide: `index_tables.Writer.evict` takes the least
recently used leaves of every model and namespace. A tenant's quota (``ppc serve
--tenants``, `PersistentPrefixCache`'s ``namespace_bytes``) needs more: what one root
key (one model in one namespace) holds, and its own least-recently-used order, so that a
tenant that floods the store evicts only its own blocks. Three tables keep that, only
for roots that are *accounted* (a handle with a quota opened them); a store without
quotas writes none of them:

- owners ``\\x0a``: block key -> the root key that owns it (16 bytes)
- owned ``\\x0b``: root key -> blocks, bytes (2 x u64 LE); present: the root is accounted
- owned lru ``\\x0c``: root key + last access (u64 BE, ns) + block key -> empty

They are kept in the transaction that inserts, touches or removes a block
(`index_tables.Writer` calls `Owners`), so they are exactly as crash-safe as the blocks
themselves. A block's owner follows from its parent: a block under an accounted root, or
under a block that root owns, is that root's; a block that continues a shared prefix
into a tenant's chain names its tenant's root in its record (``extra["link"]``, see
`keys.TenantRoot`), so the shared prefix's own blocks are charged to nobody's quota.
An older library that writes the store keeps none of the tables up to date: `adopt`,
run when a handle with a quota opens, recounts a root from its blocks (lazily rebuilt,
no migration: the tables are an addition older versions ignore).
"""

from __future__ import annotations

import struct
from typing import Any, Iterator

from ..blocks import Node

OWNERS, OWNED, OWNED_LRU = b"\x0a", b"\x0b", b"\x0c"
_USE = struct.Struct("<QQ")


def _lru_key(root: bytes, access: int, key: bytes) -> bytes:
    return OWNED_LRU + root + access.to_bytes(8, "big") + key  # big-endian sorts by time


class Owners:
    """The owner tables inside one transaction (the `Writer`'s, or a reader's).

    Args:
        txn: The LMDB transaction.
    """

    def __init__(self, txn: Any):
        self.txn = txn

    def owner(self, key: bytes) -> bytes | None:
        """The root that owns the block `key` (None: no accounted root does)."""
        raw = self.txn.get(OWNERS + key)
        return bytes(raw) if raw is not None else None

    def use(self, root: bytes) -> tuple[int, int] | None:
        """``(blocks, bytes)`` the accounted `root` owns; None if it is not accounted."""
        raw = self.txn.get(OWNED + root)
        return _USE.unpack(raw) if raw is not None else None

    def accounted(self) -> dict[bytes, tuple[int, int]]:
        """Every accounted root with ``(blocks, bytes)``."""
        out = {}
        with self.txn.cursor() as cur:
            if cur.set_range(OWNED):
                for key, value in cur:
                    if not key.startswith(OWNED):
                        break
                    out[bytes(key[1:])] = _USE.unpack(value)
        return out

    # -- kept by the Writer, in the transaction that changes a block ---------------------

    def owner_of_new(self, node: Node, parent: Node | None) -> bytes | None:
        """Who owns `node`, about to be inserted under `parent` (None: a root)."""
        link = node.link
        if link is not None:
            return link if self.use(link) is not None else None
        if parent is not None:
            return self.owner(node.parent)
        return node.parent if self.use(node.parent) is not None else None

    def added(self, node: Node, owner: bytes) -> None:
        """Charge a block inserted now to `owner`."""
        self.txn.put(OWNERS + node.key, owner)
        self.txn.put(_lru_key(owner, node.last_access, node.key), b"")
        self._add(owner, 1, node.size)

    def removed(self, node: Node) -> None:
        """Take a block being removed off its owner's account (if any)."""
        owner = self.owner(node.key)
        if owner is None:
            return
        self.txn.delete(OWNERS + node.key)
        self.txn.delete(_lru_key(owner, node.last_access, node.key))
        self._add(owner, -1, -node.size)

    def touched(self, node: Node, now: int) -> None:
        """Move a block to the recent end of its owner's order (before `node` records `now`)."""
        owner = self.owner(node.key)
        if owner is not None:
            self.txn.delete(_lru_key(owner, node.last_access, node.key))
            self.txn.put(_lru_key(owner, now, node.key), b"")

    def _add(self, root: bytes, blocks: int, nbytes: int) -> None:
        current = self.use(root)
        if current is None:
            return
        self.txn.put(OWNED + root, _USE.pack(max(0, current[0] + blocks), max(0, current[1] + nbytes)))

    def lru(self, root: bytes) -> Iterator[tuple[int, bytes]]:
        """(last access, key) of `root`'s blocks, oldest first, re-seeking after every
        step so that removals made meanwhile in this transaction never disturb the walk."""
        prefix = OWNED_LRU + root
        start = prefix
        while True:
            with self.txn.cursor() as cur:
                if not cur.set_range(start):
                    return
                key = bytes(cur.key())
            if not key.startswith(prefix):
                return
            rest = key[len(prefix) :]
            yield int.from_bytes(rest[:8], "big"), rest[8:]
            start = key + b"\x00"

    def forget(self) -> None:
        """Drop every owner table (a repair rewrote the blocks: `adopt` counts again)."""
        for prefix in (OWNERS, OWNED, OWNED_LRU):
            with self.txn.cursor() as cur:
                keys = []
                if cur.set_range(prefix):
                    for key, _ in cur:
                        if not key.startswith(prefix):
                            break
                        keys.append(bytes(key))
            for key in keys:
                self.txn.delete(key)

    def adopt(self, root: bytes, nodes: Iterator[Node], linked: Iterator[Node]) -> tuple[int, int]:
        """Account `root` from its blocks as they are: `nodes` (its subtree) and `linked`
        (blocks charged to it before: those that continue a shared prefix among them).
        Entries of blocks that are gone are dropped; the totals are recounted.

        Returns:
            ``(blocks, bytes)`` it owns.
        """
        stale = [(access, key) for access, key in self.lru(root)]
        for access, key in stale:
            self.txn.delete(_lru_key(root, access, key))
            if self.owner(key) == root:
                self.txn.delete(OWNERS + key)
        self.txn.put(OWNED + root, _USE.pack(0, 0))
        for node in (*nodes, *linked):
            if self.owner(node.key) is None:
                self.added(node, root)
        return self.use(root) or (0, 0)

    def owned_keys(self, root: bytes) -> list[bytes]:
        """The keys of every block charged to `root` (its order's entries)."""
        return [key for _, key in self.lru(root)]

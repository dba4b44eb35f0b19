"""The trie walk: which stored blocks hold a prompt's longest usable prefix.

Blocks are looked up in the RAM tier first (it holds blocks stored a moment ago,
before the writer thread has committed them) and then in the index. Every record's
parent, position and tokens are compared with the query, so a key collision is a miss.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..disk.index import Index, Reader
from ..blocks import HEAD_AT, TOKENS_AT, Node, raw_head
from ..keys import best_continuation, block_key, chain_start, link_key
from ..tiers.memory import MemoryTier


class Trie:
    """The stored blocks of one model (one root key), as the RAM tier and index hold them.

    Args:
        index: The store's index.
        memory: The RAM tier.
        root: The root key of the model, namespace and layout (a `keys.TenantRoot`: a
            prompt that starts with a shared prefix is walked from the shared root, and
            on through the tenant's `keys.link_key` after it).
        block_size: Tokens per full block.
    """

    def __init__(self, index: Index, memory: MemoryTier, root: bytes, block_size: int):
        self.index = index
        self.memory = memory
        self.root = root
        self.block_size = block_size

    def _node(self, reader: Reader, key: bytes) -> Node | None:
        return self.memory.node(key) or reader.get(key)

    def _children(self, reader: Reader, parent: bytes) -> list[Node]:
        found = {n.key: n for n in reader.children(parent)}
        for n in self.memory.children(parent):
            found.setdefault(n.key, n)
        return list(found.values())

    def stored_prefix(self, keys: list[bytes], data: bytes) -> list[Node] | None:
        """The stored blocks a prompt starts with (what `store()` need not write again).

        Args:
            keys: The chain of the prompt's block keys.
            data: The prompt's tokens as int32 bytes.

        Returns:
            The nodes, or None if a stored record under one of the keys holds other
            tokens (a key collision: nothing after it may be stored).
        """
        step = 4 * self.block_size
        path: list[Node] = []
        with self.index.reader() as reader:
            parent, _ = chain_start(self.root, data, self.block_size)
            for i, key in enumerate(keys):
                node = self._node(reader, key)
                if node is None:
                    break
                if node.parent != parent or node.tokens != data[i * step : (i + 1) * step]:
                    return None
                path.append(node)
                parent = key
        return path

    def longest(self, toks: np.ndarray, *, decode: bool = True) -> tuple[list[Node], int]:
        """The nodes to restore for `toks` and how many tokens of them to use.

        At most ``len(toks) - 1`` tokens are used (the model needs one to produce
        logits), and only up to a point where every layer can be rebuilt.

        Args:
            toks: The query as int32 tokens.
            decode: False (for counting only) leaves records undecoded where the
                cut-back does not look at them; the path is then not for use.
        """
        walk = self.walk(toks, decode=decode)
        return walk.path, walk.matched

    def walk(self, toks: np.ndarray, *, decode: bool = True) -> Walk:
        """`longest` with where the walk stopped, for a fetch that says why (`Walk`)."""
        n = len(toks)
        if n == 0:
            return Walk([], 0, 0, None)
        data = toks.tobytes()
        step = 4 * self.block_size
        path = _LazyPath()
        root = self.root
        # `parent` is what a record names, `hashed` what its key is hashed from: the two
        # differ only after a shared prefix's last block (`keys.TenantRoot`).
        parent, shared = chain_start(root, data, self.block_size)
        hashed, pos, junction = parent, 0, shared * self.block_size if shared else -1
        missing = None
        with self.index.reader() as reader:
            # Full blocks: their keys follow from the tokens, no scan needed; records
            # are checked as stored bytes and decoded only when used.
            # The loop is the lookup's cost (one record per block): names are bound
            # once, and a record is matched as two byte slices.
            bs, get = self.block_size, reader.get_raw
            in_memory = self.memory.node if len(self.memory) else None
            while n - pos >= bs:
                block = data[4 * pos : 4 * pos + step]
                key = block_key(hashed, block)
                node = in_memory(key) if in_memory is not None else None
                if node is not None:
                    if node.parent != parent or node.tokens != block or node.position != pos:
                        break
                    path.append(node)
                else:
                    raw = get(key)
                    if raw is None:
                        missing = key  # in neither tier: why is for `miss_reasons` to tell
                        break
                    if raw[HEAD_AT] != raw_head(parent, pos, bs) or raw[TOKENS_AT : TOKENS_AT + step] != block:
                        break
                    path.append((key, raw))
                parent, pos = key, pos + bs
                hashed = key if pos != junction else link_key(key, root)
            # Then the stored child sharing the longest prefix with what is left
            # (a partial block, or a longer block that will be trimmed).
            children = [
                (child.tokens, child.key, child)
                for child in self._children(reader, parent)
                if child.parent == parent
                and child.position == pos
                and block_key(hashed, child.tokens) == child.key  # key follows from tokens (another tenant's: no)
            ]
        best = best_continuation(toks[pos : pos + self.block_size], children, partial_ok=lambda c: c.trimmable)
        matched = pos
        if best is not None:
            path.append(best[0])
            matched = pos + best[1]
        reached = min(matched, n - 1)
        kept, matched = back_off(path, reached)
        return Walk([kept[i] for i in range(len(kept))] if decode else kept, matched, reached, missing)


class Walk(NamedTuple):
    """A lookup (`Trie.walk`): what to restore, and where the walk stopped.

    Attributes:
        path: The nodes to restore; `matched` the tokens of them to use.
        reached: The tokens the stored blocks matched before the back-off to a point
            where every layer can be rebuilt (at most ``len - 1``).
        missing: The key of the first full block of the query that neither the RAM tier
            nor the index holds, where the walk stopped there (else None).
    """

    path: list[Node]
    matched: int
    reached: int
    missing: bytes | None


def back_off(path: list[Node], matched: int) -> tuple[list[Node], int]:
    """Back off to the longest point at most `matched` where every layer can be rebuilt.

    Pops from `path` (the caller's list) in place.
    """
    while path:
        last = path[-1]
        matched = min(matched, last.end)
        if matched == last.end and last.resumable:
            return path, matched
        if matched > last.position and last.trimmable:
            return path, matched
        path.pop()
    return [], 0


class _LazyPath(list):
    """A lookup's path: `Node`s, or ``(key, packed record)`` pairs decoded on access."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        if isinstance(i, slice):
            return _LazyPath(item)
        if isinstance(item, tuple):
            item = Node.unpack(*item)
            super().__setitem__(i, item)
        return item

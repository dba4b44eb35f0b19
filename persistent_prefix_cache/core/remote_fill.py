"""The remote tier in a fetch: the blocks the local store lacks, read into the RAM tier.

`RemoteFill.fill` runs before a fetch's lookup when a remote is configured: it finds
where the local store's chain for the query ends (`Trie.stored_prefix`), asks the
remote for the blocks after that (`tiers.remote.RemoteTier.read_chain`: probed, read,
verified), checks their tensors against the model's layout, and puts them in the RAM
tier, so that the fetch's ordinary lookup and restore find them there. They are also
handed to the writer thread, which writes and commits them like any new block, so
the next fetch is local.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import numpy as np

from ..blocks import is_sliced, sliced_spec
from .costs import Costs
from ..device.buffers import HostBits
from ..device.target import Target
from ..keys import chain_keys
from ..layers import Layout
from .lookup import Trie
from ..tiers.memory import MemoryTier
from ..tiers.remote import RemoteTier
from ..tiers.remote_wire import RemoteBlock
from .writeback import WriteBack


class RemoteFill:
    """Fills the RAM tier (and, behind it, the local store) from the remote tier.

    A handle's is public (`PersistentPrefixCache.remote_fill`): its tier (`remote`) and
    what a block from the server goes through (`fits`, `held`, `write`), which ``ppc pull``
    uses; the store's parts it is given stay its own.

    Args:
        remote: The remote tier.
        trie, memory, layout, writeback, costs: The store's (`writeback` None for a
            read-only store: remote blocks then live in the RAM tier only).
        root: The model's root key; `block_size` the store's.
        target: The handle's restore target (a GPU's tier holds MLX arrays).
    """

    def __init__(
        self,
        remote: RemoteTier,
        *,
        trie: Trie,
        memory: MemoryTier,
        layout: Layout,
        writeback: WriteBack | None,
        costs: Costs,
        root: bytes,
        block_size: int,
        target: Target,
    ):
        self.remote, self._trie, self._memory, self._layout = remote, trie, memory, layout
        self._writeback, self._costs, self._root, self._block_size = writeback, costs, root, block_size
        self._target = target

    def fill(self, toks: np.ndarray, matched: int = 0) -> list[RemoteBlock] | None:
        """Bring the remote's continuation of the local chain for `toks` into the RAM tier.

        Args:
            toks: The query.
            matched: Tokens the local store serves already.

        Returns:
            None if no block came from the remote; else the blocks still to write into
            the local store (`write`: after the caller's restore, so that the writer
            thread does not compete with it), empty if they are written already.
        """
        keys = chain_keys(self._root, toks, self._block_size)
        data = toks.tobytes()
        held = self._trie.stored_prefix(keys, data)
        if held is None or len(held) == len(keys):
            return None  # a key collision, or the local store holds the whole query
        full = sum(1 for node in held if node.n_tokens == self._block_size)
        parent = keys[full - 1] if full else self._root
        started = time.perf_counter()
        blocks = self._fit(
            self.remote.read_chain(
                parent, full * self._block_size, data, self._block_size, beyond=matched, worth=self._worth
            )
        )
        if not blocks:
            return None
        now = time.time_ns()
        total = sum(block.node.size for block in blocks)
        # The RAM tier holds the blocks' bits as read (one copy less), unless a GPU
        # joins them with MLX operations.
        as_mx = self._target.join_on_device
        for block in blocks:
            block.node.last_access = now
            tensors: dict[str, dict[str, Any]] = {lid: {} for lid in self._layout.kinds}  # MLX arrays or HostBits
            for lid, part in block.bits.items():
                for fld, (bits, dtype) in part.items():
                    tensors[lid][fld] = HostBits(bits, dtype).to_mx() if as_mx else HostBits(bits, dtype)
            self._memory.put(block.node, tensors, source="remote")
        self._costs.observe_restore("remote", total, time.perf_counter() - started)
        if self._writeback is not None and total > self._memory.max_bytes:
            self.write(blocks).result()  # the RAM tier cannot hold them all: the fetch reads them from disk
            return []
        return blocks

    def _worth(self, chain: list[tuple]) -> bool:
        """Whether the server's continuation is faster to read and restore than to
        prefill (the cost model; True until it knows): if not, it is left there and
        it is counted (``remote_slower``, and its tokens in ``tokens_skipped``)."""
        tokens = sum(len(toks) // 4 for *_, toks in chain)
        if self._costs.worth_reading("remote", tokens, self.remote.value_bytes * len(chain)):
            return True
        self.remote.counters.add(remote_slower=1, tokens_skipped=tokens)
        return False

    def write(self, blocks: list[RemoteBlock]) -> Any:
        """Hand remote blocks to the writer thread (a no-op for a read-only store).

        Returns:
            The write's future (None for a read-only store).
        """
        if self._writeback is None or not blocks:
            return None
        return self._writeback.write([(b.node, b.bits) for b in blocks])

    def held(self, keys: Iterable[bytes]) -> set[bytes]:
        """Which of `keys` the local store's index holds (the RAM tier aside): what
        ``ppc pull`` need not write.

        Args:
            keys: Block keys.

        Returns:
            Those of them with a record in the index.
        """
        with self._trie.index.reader() as reader:
            return {key for key in keys if reader.get(key) is not None}

    def fits(self, block: RemoteBlock) -> bool:
        """Whether one block's tensors fit the model's layout (see `_fit`)."""
        return bool(self._fit([block]))

    def _fit(self, blocks: list[RemoteBlock]) -> list[RemoteBlock]:
        """The leading blocks whose tensors fit the model's layout: known leaves, and
        every sliced field with the dtype and shape the layout holds (or, before the
        store has recorded them, the same as the first block's)."""
        expect: dict[str, list] = dict(self._layout.fields or {})
        known = set(self._layout.kinds)
        for i, block in enumerate(blocks):
            for lid, part in block.bits.items():
                if lid not in known:
                    return self._unfit(blocks, i)
                for fld, (bits, dtype) in part.items():
                    name = f"{lid}.{fld}"
                    if not is_sliced(name, bits.shape, block.node.n_tokens):
                        continue
                    spec = sliced_spec(name, dtype, bits.shape)
                    if expect.setdefault(name, spec) != spec:
                        return self._unfit(blocks, i)
        return blocks

    def _unfit(self, blocks: list[RemoteBlock], i: int) -> list[RemoteBlock]:
        self.remote.counters.add(remote_corrupt=1)
        return blocks[:i]

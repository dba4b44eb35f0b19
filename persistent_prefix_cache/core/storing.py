"""A handle's store, top to bottom: `Storer` (`PersistentPrefixCache.store`).

1. The checks: the tokens, the cache's layout against the store's, the positions it covers.
2. The chain of block keys (`keys.chain_keys`) and the first block not yet stored
   (`lookup.Trie.stored_prefix`); the blocks already stored are touched (recency). The
   admission rule (`admission.Admission`, ``store(..., admit=)``) says how many of the
   new blocks are written; those it leaves out are only counted.
3. The new blocks cut out of the cache (`layers.Layout.new_blocks`, evaluated on the
   caller's thread, as MLX wants), put in the RAM tier where they fit.
4. The write: handed to the writer thread (`writeback.WriteBack.write`: every block
   write joins its group commit), which writes the files and then commits their index
   records; with a remote, the blocks are published once committed. A synchronous store
   (no remote) hands the writer views of the caller's cache and makes the RAM tier's
   copy meanwhile (`writeback.WriteBack.write_from_caller`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .admission import Admission, check_rule
from .counters import Counters
from ..blocks import CutFrom
from ..device.target import Target
from ..errors import InvalidArgumentError, LayoutMismatchError, StoreCorruptError
from ..keys import as_token_array, chain_keys
from ..layers import Layout, all_sliced, cache_length, signature_of
from .lookup import Trie
from ..tiers.memory import MemoryTier, tensors_nbytes
from .writeback import WriteBack

if TYPE_CHECKING:  # the remote's client is imported only where a remote is configured
    from ..tiers.remote import RemoteTier

log = logging.getLogger("persistent_prefix_cache")


class Storer:
    """The stores of one handle (see the module's docstring).

    Args:
        layout, trie, memory, counters: The handle's.
        root: The model's root key; `block_size` the store's.
        target: The handle's restore target (where a GPU's new KV is copied to the host).
        writeback: The writer thread (None: a read-only handle writes nothing).
        remote: The remote tier, published to after each commit (None: no remote).
        sync_writes: `store` returns once its blocks are committed.
        index_damaged: Counts a read that met a damaged index page (and says it once).
        admission: The handle's admission rule (`store(..., admit=)`; the fetches' miss
            reasons ask it too).
        pause: Where the writer gives way to restores (`SegmentFiles.reads_first`'s
            `wait`): also between the pieces of a GPU's copy of new KV to the host.
    """

    def __init__(
        self,
        *,
        layout: Layout,
        trie: Trie,
        memory: MemoryTier,
        counters: Counters,
        root: bytes,
        block_size: int,
        target: Target,
        writeback: WriteBack | None,
        remote: RemoteTier | None,
        sync_writes: bool,
        index_damaged: Callable[[StoreCorruptError], None],
        admission: Admission,
        pause: Callable[[], None] | None = None,
    ):
        self._layout, self._trie, self._memory, self._counters = layout, trie, memory, counters
        self._root, self._block_size, self._target = root, block_size, target
        self._writeback, self._remote, self._sync_writes = writeback, remote, sync_writes
        self._index_damaged = index_damaged
        self._admission = admission
        self._route = target.writer_route(pause)

    def store(self, tokens: Any, cache: Sequence[Any], *, admit: str = "always") -> int:
        """`PersistentPrefixCache.store` past the handle's check.

        Returns:
            The number of new blocks.
        """
        check_rule(admit)
        toks = as_token_array(tokens)
        layout = self._layout
        if layout.unsupported is not None:
            raise layout.unsupported
        if not isinstance(cache, (list, tuple)):
            raise InvalidArgumentError(f"cache must be a list of cache layers, got {type(cache).__name__}")
        signature = signature_of(cache)
        if signature != layout.signature:
            raise LayoutMismatchError(f"cache layout {signature!r} does not match the store's {layout.signature!r}")
        covered = cache_length(cache)
        # A sliced cache may hold more (what was computed after `tokens`): their blocks are cut from it.
        if covered is not None and covered != len(toks) and not (covered > len(toks) and all_sliced(cache)):
            raise InvalidArgumentError(f"cache covers {covered} positions but {len(toks)} tokens were given")
        if self._writeback is None:  # read-only, asked for (or said once at open): nothing to warn about
            return 0
        if len(toks) == 0:
            return 0
        keys = chain_keys(self._root, toks, self._block_size)
        data = toks.tobytes()
        try:
            path = self._trie.stored_prefix(keys, data)
        except StoreCorruptError as exc:  # the caller's work goes on; nothing is written
            self._index_damaged(exc)
            self._counters.add(write_errors=1)
            return 0
        if path is None:
            log.warning("block key collision; not storing the rest of this prompt")
            return 0
        self._writeback.note(touch=keys[: len(path)])
        upto = self._admission.admitted(keys, len(toks), len(path), admit, whole_only=not all_sliced(cache))
        if upto < len(keys):  # a sliced cache cuts its blocks from the first `upto` alone
            self._counters.add(
                blocks_not_admitted=len(keys) - upto, tokens_not_admitted=len(toks) - upto * self._block_size
            )
            keys, data = keys[:upto], data[: 4 * upto * self._block_size]
        if upto == len(path):  # nothing new (a restored prompt stored again): nothing to cut
            return 0
        return self._write(cache, keys, data, path)

    def _write(self, cache: Sequence[Any], keys: list[bytes], data: bytes, path: list) -> int:
        """Cut the blocks after `path` out of `cache` and hand them to the writer thread."""
        layout, writeback = self._layout, self._writeback
        assert writeback is not None  # a read-only handle's store() returned before
        # A synchronous store (no remote, which publishes after the return) writes from
        # the caller's cache while the caller waits: no copy before the disk starts. Not
        # on a CUDA GPU: the host reading the caller's cache would move its pages into
        # managed memory and over to the host, and the next forward would fault them back.
        direct = self._sync_writes and self._remote is None and not self._target.device
        new = layout.new_blocks(
            cache, keys, data, path, root=self._root, block_size=self._block_size, direct=direct,
            host=self._route,
        )  # fmt: skip
        taught = None
        for node, tensors, _, _ in new:
            names = tensors.names if isinstance(tensors, CutFrom) else CutFrom.names_of(tensors)
            if names != taught:  # blocks with the fields of the one before teach nothing new
                layout.learn_fields(tensors)  # the dtypes and shapes a read must find
                taught = names
        if direct and new:
            writeback.write_from_caller(new, lambda: layout.evaluate(new))
            return len(new)
        # A block of an all-sliced cache holds its tokens' share of every field: blocks of
        # one length weigh the same (summing each block's arrays was a 16k-token store's
        # biggest Python cost on a CPU).
        sized: dict[int, int] | None = {} if all_sliced(cache) else None
        sizes = []
        for node, tensors, _, _ in new:
            size = sized.get(node.n_tokens) if sized is not None else None
            if size is None:
                size = tensors_nbytes(tensors)
                if sized is not None:
                    sized[node.n_tokens] = size
            sizes.append(size)
            # A restore may find the block in the RAM tier before the writer's record
            # sets its size: its bytes are counted and taught to the cost model from it.
            node.size = size
        if any(self._memory.fits(size) for size in sizes):
            layout.evaluate(new)
            for (node, tensors, _, origin), size in zip(new, sizes):
                self._memory.put(node, tensors, origin, size=size)
        if new:
            # Published after the commit that holds them, on the writer thread: `flush` finds them queued.
            then = self._remote.publish if self._remote is not None else None
            future = writeback.write([(node, bits) for node, _, bits, _ in new], then=then)
            if self._sync_writes:
                future.result()
        return len(new)

"""Why a fetch stopped where it did: the report it leaves (`FetchReport`) and the checks
that tell the reasons apart (`MissReasons`; the writer knows which block keys are still
queued: `WriteBack.in_flight`).

A fetch that restores all but the last token of its prompt is complete (reason None).
Any other, a miss or a hit on part of the prompt, stopped for one reason of
`counters.MISS_REASONS`, told apart as follows; the first that applies wins, from the
last step of the fetch back to the lookup:

==================== ===============================================================
reason               detected when
==================== ===============================================================
unsupported          the model has a layer the store cannot hold (`Layout.unsupported`)
damaged              this fetch met a damaged block (checksum, missing file, tensors
                     that do not fit the layout) or index page; or the block where
                     the lookup stopped was dropped as damaged lately in this process
slower               the cost model cut the prefix (``restored_ram_only``,
                     ``restored_shorter``, ``skipped_slower``), or left the remote's
                     continuation on the server (``remote_slower``)
not_resumable        the stored blocks match further, but the lookup backed off to a
                     point where every layer can be rebuilt (a recurrent or sliding-
                     window layer has no snapshot at the point reached)
write_pending        the block where the lookup stopped is one this handle stored,
                     still queued for the writer thread (not in the RAM tier: it is
                     off, or the block did not fit)
remote_unreachable   the local store fell short and the remote tier was asked in vain:
                     a round trip failed, or the server was skipped while backing off
evicted              the block where the lookup stopped was evicted under the disk
                     budget by this process lately (`disk.removed`: a Bloom filter of
                     the last 64-128 Ki evicted keys, 256 KiB a store)
not_admitted         the block where the lookup stopped was left out by this handle's
                     admission rule (``store(..., admit=)``: `admission.Admission`
                     remembers the keys it left out, 1 MiB a handle)
other_model          nothing matched, and the prompt's first full block is stored under
                     another model, namespace or cache layout of this store
never_stored         none of the above: the prompt goes on where nothing was stored
==================== ===============================================================

What it costs: on a complete fetch nothing but the report; on any other, in-memory set
and filter checks (microseconds), and only for a fetch that matched nothing, one read
transaction of the index: its models table (one entry per model, namespace and layout)
and one record per other root, at most `OTHER_ROOTS`.

What cannot be told: an eviction or drop by another process (another server, ``ppc gc``)
or before this process opened the store reads as never stored; so does a prompt shorter
than one block (its key is not known until a stored one is found); a write queued by
another handle or process is never stored until it commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..disk.index import Index
from ..keys import block_key
from .lookup import Walk
from .writeback import WriteBack

# Other models' roots a fetch that matched nothing looks its first block up under.
OTHER_ROOTS = 16

# Remote outcomes (`RemoteTier.take_last_read`) that decide a reason.
_REMOTE_REASONS = {"unreachable": "remote_unreachable", "slower": "slower"}


@dataclass(frozen=True)
class FetchReport:
    """What one `fetch` did and why it stopped there (`PersistentPrefixCache.last_fetch`).

    Attributes:
        tokens: The prompt's length.
        restored: Tokens restored (0 on a miss, or when ``longer_than`` loaded nothing).
        found: Tokens the store holds usably for the prompt (the longest prefix where
            every layer can be rebuilt), before the cost model's cut and damage.
        reason: Why it stopped at `restored` (`counters.MISS_REASONS`; the module says
            how each is told), None when it restored all but the last token.
        tier: The deepest tier a hit read: ``"remote"``, ``"disk"`` or ``"ram"``; None
            when nothing was restored.
    """

    tokens: int
    restored: int
    found: int
    reason: str | None
    tier: str | None


class MissReasons:
    """Tells why a lookup stopped where it did (see the module).

    Args:
        index: The store's index (its `removed` keys, and the other models' roots).
        root: The handle's model root key; `block_size` the store's.
        writeback: The handle's writer (None: read-only).
        left_out: Whether the handle's admission rule left a block key out
            (`admission.Admission.left_out`; None: never asked).
    """

    def __init__(
        self,
        index: Index,
        root: bytes,
        block_size: int,
        writeback: WriteBack | None,
        left_out: Callable[[bytes], bool] | None = None,
    ):
        self._index, self._root, self._block_size = index, root, block_size
        self._in_flight = writeback.in_flight if writeback is not None else None
        self._left_out = left_out

    def dropped(self, key: bytes) -> None:
        """Remember that the block `key` was dropped as damaged."""
        self._index.removed.dropped(key)

    def why(self, toks: np.ndarray, walk: Walk, remote: str | None) -> str:
        """Why the lookup `walk` of `toks` stopped where it did.

        Args:
            toks: The query.
            walk: The lookup (after the remote's fill, if any).
            remote: How the remote tier's read went (`RemoteTier.take_last_read`;
                None: not asked).
        """
        if walk.reached > walk.matched:
            return "not_resumable"
        key = walk.missing
        if key is not None:
            if self._in_flight is not None and self._in_flight(key):
                return "write_pending"
            if self._index.removed.was_dropped(key):
                return "damaged"
        if remote in _REMOTE_REASONS:
            return _REMOTE_REASONS[remote]
        if key is not None and self._index.removed.was_evicted(key):
            return "evicted"
        if key is not None and self._left_out is not None and self._left_out(key):
            return "not_admitted"
        if walk.reached == 0 and self._elsewhere(toks):
            return "other_model"
        return "never_stored"

    def _elsewhere(self, toks: np.ndarray) -> bool:
        """Whether the prompt's first full block is stored under another root."""
        if len(toks) < self._block_size:
            return False
        first = toks[: self._block_size].tobytes()
        with self._index.reader() as reader:
            roots = [root for root in reader.models() if root != self._root][:OTHER_ROOTS]
            return any(reader.get_raw(block_key(root, first)) is not None for root in roots)

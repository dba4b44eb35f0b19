"""Opening a store for a handle: its options checked, where a store may be, its files
and index, its budgets, the handle's parts built once (`open_parts`: each given what it
needs, held in a `parts.Parts`), taking back a store that a failed open made for nothing, and closing the handles
still open at exit."""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from .admission import Admission
from ..blocks import DEFAULT_BLOCK_SIZE
from .cost_model import CostModel
from .costs import Costs
from .counters import HANDLE_COUNTERS, Counters
from ..disk.index import Index
from ..device.target import device_memory, device_target
from ..disk.segment import SegmentFiles
from ..disk.store_dir import check_location, create_root, missing_folders, undo_creation
from ..errors import InvalidArgumentError, StoreNotWritableError
from .fetching import Fetcher
from ..layers import Layout
from ..layers.mlx_lm_versions import layout_variant
from .lookup import Trie
from .miss_reasons import MissReasons
from .model_record import ModelRecord
from ..options import Options, existing_but_not_writable
from .parts import Parts
from ..paths import expand_path
from .storing import Storer
from ..tiers import REMOTE_COUNTERS, REMOTE_QUEUE_BYTES
from ..tiers.memory import MemoryTier
from .warm import Warmer
from .writeback import WriteBack


# The handles open in this process (`store.PersistentPrefixCache` adds and discards itself).
OPEN_HANDLES: "weakref.WeakSet[Any]" = weakref.WeakSet()


@atexit.register
def _close_open_handles() -> None:
    # Pending writes are durable work the caller already paid for: finish them.
    for handle in list(OPEN_HANDLES):
        handle.close()


@dataclass
class OpenedDirectory:
    """A store directory opened for a handle.

    Attributes:
        readonly: Whether the handle serves hits only (asked for, or not writable).
        files: The segment files.
        index: The index (the caller closes it).
        made_folder: None if the store existed; else whether its folder was made here.
        parents: Folders above it this open made (``mkdir -p``), deepest first.
    """

    readonly: bool
    files: SegmentFiles
    index: Index
    made_folder: bool | None
    parents: tuple[str, ...] = ()


def open_directory(path: str, *, readonly: bool, shared: bool, block_size: int | None) -> OpenedDirectory:
    """Open (or create) the store at `path`; nothing is left behind if this raises.

    Args:
        path: The store directory (absolute, expanded).
        readonly: Serve hits only; a store this process cannot write is opened so too,
            with one warning.
        shared: Make a new store group-shared.
        block_size: The block size asked for (None: the store's, or the default).

    Raises:
        InvalidArgumentError: If the store uses another `block_size`, or `path` is no
            place for a store (`StorePathError`).
        StoreNotWritableError, StoreCorruptError, StoreBusyError: As the store's state says.
    """
    # A file, a folder of other files, a place this process cannot write: a typed
    # error before anything is created.
    exists = check_location(path, readonly=readonly)
    if not readonly and existing_but_not_writable(path):
        # Serve what is there (a store shipped on a read-only volume, say).
        message = f"store {path} is not writable by this process: serving its hits only"
        hint = "to say so and silence this, open it read-only; to store, give write permission"
        warnings.warn(str(StoreNotWritableError(message, hint=hint)))
        readonly = True
    parents = () if exists else tuple(missing_folders(path)[1:])
    made_folder = None if exists else create_root(path, shared=shared)  # 0700 (2770 if shared)
    try:
        files = SegmentFiles(path, readonly=readonly)
        index = Index(os.path.join(path, "index"), readonly=readonly, block_size=block_size or DEFAULT_BLOCK_SIZE)
        if block_size is not None and block_size != index.block_size:
            index.close()
            raise InvalidArgumentError(
                f"store {path} uses block_size={index.block_size}, not {block_size}",
                hint="omit block_size, or use another store directory",
            )
    except BaseException:
        if made_folder is not None:
            undo_creation(path, made_folder=made_folder, parents=parents)
        raise
    return OpenedDirectory(readonly, files, index, made_folder, parents)


def disk_budget(path: str, disk_bytes: int | str | None, held: int) -> int | None:
    """The byte budget of a store's blocks: `disk_bytes` as given, or for ``"auto"`` what
    the store holds plus half the space free on its file system now (a store never takes
    more than half of what was free when it was opened; each open looks again).

    Args:
        path: The store directory.
        disk_bytes: An int, None (unbounded) or ``"auto"``.
        held: The bytes of the blocks the store holds.
    """
    if not isinstance(disk_bytes, str):  # the one str `options.check_options` lets through: "auto"
        return disk_bytes
    st = os.statvfs(path)
    return held + st.f_bavail * st.f_frsize // 2


MIN_MEMORY_BYTES = 512 << 20  # the RAM tier's "auto" budget is never below this


def memory_tier(model: Any, memory_bytes: int | str) -> MemoryTier:
    """A handle's RAM tier: its budget `memory_bytes` as given, or for ``"auto"`` what is
    left of the process's share, 1/8 of what the device's memory holds beside the model's
    weights, after the other open handles' "auto" tiers (and at least `MIN_MEMORY_BYTES`):
    the hot prompts of the model served, sized by its device. An H200 (141 GB) serving an
    8B model in bf16 (16 GB) keeps ~15 GB, seven 16k-token prompts of 2 GiB (a fixed 512
    MiB held none, and churned); a 16 GB Mac with a 4-bit 8B model ~1.4 GB. Shared, since
    each handle taking 1/8 made seven handles of one process run an H100 out of memory. A
    closed handle's tier holds nothing and gives its share back (`Parts.release`).

    Args:
        model: The model (its parameters' bytes are counted).
        memory_bytes: An int, or ``"auto"``.
    """
    if not isinstance(memory_bytes, str):  # the one str `options.check_options` lets through: "auto"
        return MemoryTier(memory_bytes)
    share = max(MIN_MEMORY_BYTES, (device_memory() - weight_bytes(model)) // 8)
    with _auto_lock:
        if _auto_tiers.pid != os.getpid():  # a fork's copies of the parent's tiers are not this process's
            _auto_tiers.pid, _auto_tiers.tiers = os.getpid(), weakref.WeakSet()
        held = sum(t.max_bytes for t in _auto_tiers.tiers)
        tier = MemoryTier(max(MIN_MEMORY_BYTES, share - held))
        _auto_tiers.tiers.add(tier)
    return tier


class _AutoTiers:
    """The "auto" RAM tiers of this process's handles (weakly: a handle dropped unclosed
    gives its share back when collected)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.tiers: weakref.WeakSet[MemoryTier] = weakref.WeakSet()


_auto_tiers = _AutoTiers()
_auto_lock = threading.Lock()


def weight_bytes(model: Any) -> int:
    """Bytes of a model's parameters (0 for an object that has none)."""
    from ..weights_hash import named_parameters

    try:
        return sum(int(v.nbytes) for _, v in named_parameters(model))
    except (AttributeError, TypeError):
        return 0


def give_back(path: str, opened: OpenedDirectory) -> None:
    """After a later step of a handle's open failed: close the index, and take back a
    store this open made (a wrong model, a refused remote URL: the caller's mistake
    leaves nothing behind)."""
    opened.index.close()
    if opened.made_folder is not None:
        undo_creation(path, made_folder=opened.made_folder, parents=opened.parents)


def open_parts(
    path: str | os.PathLike, model: Any, options: Options, *, check_open: Callable[[], None], peek: Callable[[Any], int]
) -> Parts:
    """Check a handle's options, open its store and build its parts, each given what it
    needs; nothing is left behind if this raises.

    Args:
        path, model, options: What `PersistentPrefixCache` was given (its docstring says
            what each is, and what it raises).
        check_open, peek: The handle's (its cost model's `calibrate` needs them).
    """
    path = os.path.abspath(expand_path(path, what="path"))
    o = options.checked()
    # Open anyway if a layer cannot be stored (fetch misses), so that a server can run
    # uncached; store() raises.
    layout = Layout.of_model(model, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size, variant=layout_variant())
    opened = open_directory(path, readonly=o.readonly, shared=o.shared, block_size=o.block_size)
    readonly, files, index = opened.readonly, opened.files, opened.index
    writeback = warmer = None
    try:
        record = ModelRecord.open(
            index, model, layout, fingerprint=o.fingerprint, model_path=o.model_path, name=o.model_name,
            namespace=o.namespace, shared_prefixes=o.shared_prefixes, shared_namespace=o.shared_namespace,
        )  # fmt: skip
        root, block_size = record.root, index.block_size
        memory = memory_tier(model, o.memory_bytes)
        # Where restored bytes live (MLX's device: CPU, unified memory, a CUDA GPU's),
        # decided once for the handle, whichever thread calls it.
        target = device_target()
        trie = Trie(index, memory, root, block_size)
        counters = Counters(*HANDLE_COUNTERS, *REMOTE_COUNTERS)
        learned = Costs(enabled=o.cost_model)
        if not readonly:
            writeback = WriteBack(
                index, files, memory, counters, root=root, describe=record.describe, describe_shared=record.describe_shared,
                disk_bytes=disk_budget(path, o.disk_bytes, index.totals()[0]), quota=o.namespace_bytes,
            )  # fmt: skip
            if o.namespace_bytes is not None:  # count what the namespace holds now (an older writer kept no count)
                index.write(lambda w: w.adopt_root(root))
        remote = remote_fill = None
        if o.remote is not None:
            from .remote_fill import RemoteFill  # the remote's client: imported only where used
            from ..tiers.remote import RemoteTier

            remote = RemoteTier(
                o.remote, root=root, secret=o.remote_secret, ttl=o.remote_ttl, timeout=o.remote_timeout,
                queue_bytes=REMOTE_QUEUE_BYTES, counters=counters,
            )  # fmt: skip
            remote_fill = RemoteFill(
                remote, trie=trie, memory=memory, layout=layout, writeback=writeback, costs=learned, root=root,
                block_size=block_size, target=target,
            )  # fmt: skip
        # Its thread runs from here on (the tier learns what the cost model skips).
        warmer = Warmer(layout, memory, files, index.segment_digests, target)
        costs = CostModel(
            learned, folder=path, readonly=readonly, model=record, block_size=block_size, memory=memory,
            warmer=warmer, counters=counters, writeback=writeback, check_open=check_open, peek=peek,
            make_cache=layout.make_cache, remote=remote is not None,
        )  # fmt: skip
        admission = Admission(root, block_size)  # its rule in stores, its memory in the miss reasons
        fetcher = Fetcher(
            layout=layout, trie=trie, memory=memory, files=files, index=index, target=target, counters=counters,
            costs=costs, writeback=writeback, remote_fill=remote_fill,
            reasons=MissReasons(index, root, block_size, writeback, admission.left_out),
        )  # fmt: skip
        storer = Storer(
            layout=layout, trie=trie, memory=memory, counters=counters, root=root, block_size=block_size,
            target=target, writeback=writeback, remote=remote, sync_writes=o.sync_writes,
            index_damaged=fetcher.index_damaged, admission=admission, pause=files.reads_first.wait,
        )  # fmt: skip
    except BaseException:
        for thread in (warmer, writeback):  # their threads end before the index is given back
            if thread is not None:
                thread.stop()
        give_back(path, opened)
        raise
    return Parts(
        path,
        readonly,
        block_size,
        layout,
        record,
        index,
        files,
        memory,
        counters,
        writeback,
        remote,
        remote_fill,
        warmer,
        costs,
        fetcher,
        storer,
    )

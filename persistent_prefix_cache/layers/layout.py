"""A model's cache layout as a whole: cutting caches into blocks and rebuilding them."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping, Set
from typing import Any, Callable, Sequence, cast

import mlx.core as mx
import numpy as np

from ..blocks import FIELDS, RESUMABLE, TRIMMABLE, CutFrom, Kind, Node, Tensors, dtype_info, mx_uint, sliced_spec
from ..device.buffers import WriterRoute, stacked_copy
from ..errors import UnsupportedCacheError
from ..keys import chain_start
from .adapters import (
    SEQ,
    STATE,
    BlockView,
    ViewPath,
    adapter_for,
    leaves,
    rebuild_cache,
    signature_of,
    template_cache,
)

log = logging.getLogger("persistent_prefix_cache")


def cut_block(
    cache: Sequence[Any], start: int, end: int, last: bool, *, skip: Set[str] = frozenset()
) -> dict[str, BlockView]:
    """What a block keeps of every leaf of `cache` for positions ``[start, end)``.

    The one place caches are cut into blocks (the store and the compat layers use it).
    Tensors are lazy copies: evaluate them before the caller's cache changes.

    Args:
        cache: The cache layers.
        start: First position of the block.
        end: One past its last position.
        last: Whether the block ends what `cache` holds (window and recurrent leaves
            then keep a snapshot).
        skip: Leaf ids to leave out.

    Returns:
        Leaf id -> `BlockView` (tensors, has_slice, has_snapshot).
    """
    return {
        lid: BlockView(start, end, *adapter_for(layer, lid).pieces(layer, start, end, last))
        for lid, layer in leaves(cache)
        if lid not in skip
    }


class Layout:
    """A model's cache layout: its leaves and how they rebuild from stored blocks.

    Blocks are described to it by duck-typed nodes (``position``, ``end`` and the
    ``extra`` dict the store records: leaf ids under ``"noslice"`` and ``"snap"``).

    Args:
        template: An empty cache of the layout (see `template_cache`).
        fresh: Makes another empty cache like `template` (``template_cache`` of the
            model); None: `make_cache` deep-copies the template.

    Attributes:
        signature: The layout's signature string (part of every root key).
        variant: What else the root key holds of the layout (`mlx_lm_versions.layout_variant`).
        leaves: ``(leaf id, empty template leaf, adapter)`` for every leaf.
        unsupported: The `UnsupportedCacheError` if a class cannot be stored (the
            layout then has no leaves).
    """

    def __init__(self, template: list, variant: str = "", fresh: Callable[[], list] | None = None):
        self.template = template
        self._fresh = fresh
        # Part of the root key beside the signature: the mlx-lm line, whose model code
        # changes the KV (`mlx_lm_versions.layout_variant`), so lines keep their stores apart.
        self.variant = variant
        self.unsupported: UnsupportedCacheError | None = None
        try:
            self.signature = signature_of(template)
            self.leaves = [(lid, t, adapter_for(t, lid)) for lid, t in leaves(template)]
        except UnsupportedCacheError as exc:
            self.signature = "unsupported:" + "|".join(type(c).__name__ for c in template)
            self.leaves = []
            self.unsupported = exc
        self.kinds = {lid: adapter.kind for lid, _, adapter in self.leaves}
        # "<leaf>.<field>" -> [dtype, batch, heads, width] of the sliced KV tensors, once
        # known (from the store's model record, or from the first cache stored).
        self.fields: dict[str, list] | None = None
        # The `CutFrom.names` of blocks `learn_fields` has seen: a block with the same leaves
        # and fields teaches nothing more (asking 64 fields again cost every store ~0.3 ms).
        self._taught: set[tuple] = set()
        # The flags of a uniform store's blocks (`new_blocks`): every leaf a sequence, every
        # block from position 0 holding its slice, so every position rebuilds; the same for
        # every such store, worked out once (asking 32 leaves at 3 positions: ~0.1 ms a store).
        self._uniform_flags: int | None = None

    @classmethod
    def of_model(
        cls, model: Any, *, kv_bits: int | None = None, kv_group_size: int = 64, variant: str = ""
    ) -> "Layout":
        """The layout a store holds for `model` (`template_cache`, with KV quantized as
        `kv_bits` says), whose `make_cache` makes each empty cache the way the template was."""

        def fresh() -> list:
            return template_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)

        return cls(fresh(), variant=variant, fresh=fresh)

    def learn_fields(self, tensors: Mapping[str, Tensors]) -> bool:
        """Record the dtypes and shapes of a block's sliced tensors as the layout's.

        Returns:
            Whether a field was not known before.
        """
        names = tensors.names if isinstance(tensors, CutFrom) else CutFrom.names_of(tensors)
        if names in self._taught and self.fields is not None:  # (fields set anew by an open: ask again)
            return False
        # A block cut from one copy per field: the copies hold its dtypes and the shapes
        # that matter (all but the tokens' axis), with no view made to ask them.
        source = tensors.copies if isinstance(tensors, CutFrom) else tensors
        fields = self.fields if self.fields is not None else {}
        before = len(fields)
        specs: dict[tuple, list | None] = {}  # (field, dtype, shape) -> its spec: fields of one kind alike
        for lid, part in source.items():
            for fld, x in part.items():
                name = f"{lid}.{fld}"
                if name in fields:  # known (the first block of a store taught it)
                    continue
                spec_key = (fld, x.dtype, x.ndim, tuple(x.shape))
                if spec_key not in specs:
                    declared = FIELDS.get(fld)
                    sliced = declared is not None and declared.kind is Kind.SLICED and x.ndim == declared.ndim
                    specs[spec_key] = sliced_spec(fld, dtype_info(x.dtype)[0], x.shape) if sliced else None
                spec = specs[spec_key]
                if spec is not None:
                    fields[name] = list(spec)
        self.fields = fields or self.fields
        self._taught.add(names)
        return len(fields) > before

    def make_cache(self) -> list:
        """A fresh, empty cache of this layout (made as the template was where that is
        known: a deep copy of 32 empty layers cost ~0.7 ms of a 256-token prefill on an H100)."""
        return self._fresh() if self._fresh is not None else copy.deepcopy(self.template)

    def cut(
        self, cache: Sequence[Any], start: int, end: int, last: bool, pieces: dict | None = None
    ) -> tuple[dict[str, Tensors], dict, dict[str, BlockView]]:
        """`cut_block`, with what the store records about the block.

        Args:
            pieces: Leaf id -> the block's tensors, already cut (sequence leaves, views
                of one copy per field: see `new_blocks`).

        Returns:
            (tensors by leaf, the node's ``extra`` record, views by leaf).
        """
        pieces = pieces or {}
        cut = cut_block(cache, start, end, last, skip=set(pieces)) if len(pieces) < len(self.leaves) else {}
        views = {}
        for lid, _, _ in self.leaves:
            if lid in pieces:
                views[lid] = BlockView(start, end, pieces[lid], True, False)
            else:
                views[lid] = cut[lid]
        noslice = [lid for lid, v in views.items() if not v.has_slice and self.kinds[lid] != STATE]
        snap = [lid for lid, v in views.items() if v.has_snapshot]
        extra = {k: v for k, v in (("noslice", noslice), ("snap", snap)) if v}
        return {lid: cast(Tensors, v.tensors) for lid, v in views.items()}, extra, views  # a cut holds tensors

    @staticmethod
    def view(node: Any, lid: str, tensors: Tensors | None = None) -> BlockView:
        """What a stored block holds for leaf `lid`, from its record."""
        return BlockView(
            node.position,
            node.end,
            tensors,
            lid not in node.extra.get("noslice", ()),
            lid in node.extra.get("snap", ()),
        )

    def flags(self, views: Mapping[str, Sequence[BlockView]], start: int, end: int) -> int:
        """RESUMABLE if every leaf can be rebuilt at `end` from the path's views;
        TRIMMABLE if also at every position inside the block."""
        flags = 0
        if all(a.can_rebuild(t, views[lid], end) for lid, t, a in self.leaves):
            flags |= RESUMABLE
        inside = [p for p in (start + 1, end - 1) if start < p < end]
        if all(a.kind != STATE for _, _, a in self.leaves) and all(
            a.can_rebuild(t, views[lid], p) for lid, t, a in self.leaves for p in inside
        ):
            flags |= TRIMMABLE
        return flags

    def first_needed(self, path: Sequence[Any], position: int) -> int:
        """Index of the first block of `path` any leaf needs to be rebuilt at `position`."""
        first = len(path) - 1
        last = path[-1]
        for lid, template, adapter in self.leaves:
            ranges = [(lo, hi) for lo, hi in adapter.needed(template, position) if lo < hi]
            if not ranges or (last.end == position and lid in last.extra.get("snap", ())):
                continue  # rebuilt from the last block's snapshot
            lo = min(r[0] for r in ranges)
            first = min(first, next(i for i, n in enumerate(path) if n.end > lo))
        return first

    def rebuild(self, sources: dict[str, Any], position: int) -> list | None:
        """Fresh cache layers at `position` from a source of block tensors per leaf.

        Returns:
            The cache, or None if the tensors do not fit the layout (a miss).
        """
        try:
            rebuilt = {lid: adapter.rebuild(template, sources[lid], position) for lid, template, adapter in self.leaves}
        except (KeyError, ValueError, IndexError) as exc:
            log.warning("stored blocks do not fit the layout: %s", exc)
            return None
        return rebuild_cache(self.template, rebuilt)

    def new_blocks(
        self,
        cache: Sequence[Any],
        keys: list[bytes],
        data: bytes,
        path: Sequence[Node],
        *,
        root: bytes,
        block_size: int,
        direct: bool = False,
        host: WriterRoute | None = None,
    ) -> list[tuple[Node, Mapping[str, Tensors], Mapping, dict]]:
        """The blocks of `cache` after the stored `path`, with their index records.

        Args:
            cache: The cache of the prompt, covering every token of `data`.
            keys: The prompt's chain of block keys.
            data: The prompt's tokens as int32 bytes.
            path: The nodes of the blocks already stored (the first ``len(path)``).
            root: The chain's root key.
            block_size: Tokens per full block.
            direct: The bits of sequence leaves are views of `cache` itself (no copy:
                for a writer the caller waits for, which must be done with them before
                the caller goes on); `evaluate` then makes the copy the tensors are
                views of (the RAM tier's), while the writer writes.
            host: How the writer takes the copies to the host (`Target.writer_route`):
                given (a CUDA GPU), fields of one shape and dtype are one copy, evaluated
                with its device address, which the RAM tier's tensors are views of and the
                writer copies from on its own thread.

        Returns:
            ``(node, tensors by leaf, bits by leaf, origin by leaf)`` per new block:
            tensors are never views of `cache` (those of sequence leaves are views
            of one copy per field: a `CutFrom` where every leaf is one) and, for
            sequence leaves, left to `evaluate`
            (only the RAM tier keeps them); ``bits`` are what the segment writer
            takes, evaluated: for sequence leaves ``(numpy array of the bits, dtype
            name)``, a strided view (so the writer thread needs no MLX operation),
            else the tensors themselves; ``origin``
            names, for sequence leaves, that copy and the position it starts at
            (``(fields, position)``), so a restore can take one slice of it for many
            blocks. Size and checksum of the nodes are set once they are written.
        """
        now, n, bs = time.time_ns(), len(data) // 4, block_size
        # A tenant's prompt may start with a shared prefix: its first block hangs under the
        # shared root, and the block after the prefix names the tenant (`keys.TenantRoot`).
        start_key, shared = chain_start(root, data, bs)
        link = bytes(root).hex() if shared else None
        # Leaves a stored block holds no slice of: the one thing a uniform store asks of the
        # path (views of every leaf at every stored block were ~1 ms of a chat's turn).
        lacking = {lid for node in path for lid in node.extra.get("noslice", ())}
        # Sequence leaves: one copy per field of every new position (not one per block:
        # thousands of small copies were most of the caller's cost), blocks as views.
        offset, by_id = len(path) * bs, dict(leaves(cache))
        sources: dict[str, dict[str, mx.array]] = {}
        for lid, _, adapter in self.leaves:
            if adapter.kind == SEQ:
                held, first = adapter.held(by_id[lid])
                sources[lid] = {f: x[..., offset - first : n - first, :] for f, x in held.items()}
        ranges: dict[str, dict[str, mx.array]] = {}
        packs: list[Pack]
        if host is None:
            # What the writer reads, per field: the copy, or (direct) the caller's buffers,
            # as numpy bits taken once per field; each block's bits are numpy slices of
            # them (thousands of MLX slices and their evaluation cost more than the copy).
            ranges = {lid: {f: mx.contiguous(x) for f, x in fields.items()} for lid, fields in sources.items()}
            written = sources if direct else ranges
            packs = [
                (_as_uint(x), [(lid, f, dtype_info(x.dtype)[0])], None)
                for lid, fields in written.items()
                for f, x in fields.items()
            ]
            mx.eval([u for u, _, _ in packs])
        else:
            # A GPU with memory of its own (CUDA): a host view of an MLX buffer moves it into
            # managed memory (MLX's allocator: a copy, made with the GIL held, so the caller's
            # Python waits for it; docs/performance.md), which must never befall the caller's
            # cache (the range of a full buffer is that buffer) nor the RAM tier's copy. Fields
            # of one shape and dtype are one copy (stacked along the batch: one kernel for all
            # of a store's layers), evaluated with its device address, which the writer copies
            # from by the copy engine (`WriterRoute`); the RAM tier keeps views of it.
            alike: dict[tuple, list[tuple[str, str, str]]] = {}
            for lid, fields in sources.items():
                for f, x in fields.items():
                    alike.setdefault((x.dtype, tuple(x.shape)), []).append((lid, f, dtype_info(x.dtype)[0]))
            stacks = [stacked_copy([sources[lid][f] for lid, f, _ in names]) for names in alike.values()]
            bits = [_as_uint(stack) for stack in stacks]
            addresses = host.evaluate(bits)
            packs = list(zip(bits, alike.values(), addresses))
            # The RAM tier's copies: views of the stacks, or (no address: the writer's host view
            # moves a stack) copies of their own.
            stacked: dict[tuple[str, str], mx.array] = {}
            for stack, names, address in zip(stacks, alike.values(), addresses):
                batch = stack.shape[0] // len(names)
                for i, (lid, f, _) in enumerate(names):
                    if address is not None:
                        stacked[lid, f] = stack[i * batch : (i + 1) * batch]
            ranges = {
                lid: {f: stacked[lid, f] if (lid, f) in stacked else mx.contiguous(x) for f, x in fields.items()}
                for lid, fields in sources.items()
            }  # fmt: skip
        whole = WholeBits(packs, host)
        # Every leaf sliced along the sequence, every block before holding its slice: each
        # new block resumes (and trims) like the first, whose flags are worked out once
        # (asking every leaf at every block was a third of a long prompt's cost).
        uniform = len(whole) == len(self.leaves) and all(
            a.kind == SEQ and lid not in lacking for lid, _, a in self.leaves
        )  # fmt: skip
        # Each leaf's path of block views, for the flags `flags` works out (not needed where
        # a uniform store's are known).
        views = (
            {lid: ViewPath(self.view(node, lid) for node in path) for lid, _, _ in self.leaves}
            if not uniform or self._uniform_flags is None
            else {}
        )
        origin = {lid: (fields, offset) for lid, fields in ranges.items()}
        named = CutFrom.names_of(ranges)
        new: list[tuple[Node, Mapping[str, Tensors], Mapping, dict]] = []
        flags = None
        extra: dict[str, list[str]]  # the node's record (leaves without a slice, with a snapshot)
        tensors: Mapping[str, Tensors]
        per_block: list[dict] | None = None
        if not uniform:
            # Each block's pieces by leaf, then field, for `cut`: views of the copy, made by
            # one split per field (not one slice per block and field: 2,048 MLX calls for
            # 128 MiB), one dict per leaf and block built in C.
            bounds = [i * bs - offset for i in range(len(path) + 1, len(keys))]
            per_block = [{} for _ in range(len(keys) - len(path))]
            for lid, fields in ranges.items():
                parts = zip(*(mx.split(x, bounds, axis=2) for x in fields.values()))
                for block, part in zip(per_block, parts):  # (no new block: one empty part)
                    block[lid] = dict(zip(fields, part))
        for i in range(len(path), len(keys)):
            start, end = i * bs, min((i + 1) * bs, n)
            k = i - len(path)
            if uniform:  # what `cut` gives such a block: its pieces (made where asked for), nothing to record
                tensors, extra = CutFrom(ranges, start - offset, end - offset, named), {}
                if flags is None:  # the first one's flags (every leaf holds its slice: no view needed)
                    if self._uniform_flags is None:
                        for view_path in views.values():
                            view_path.append(BlockView(start, end, None, True, False))
                        self._uniform_flags = self.flags(views, start, end)
                    flags = self._uniform_flags
            else:
                assert per_block is not None  # (made above for a store that is not uniform)
                tensors, extra, cut = self.cut(cache, start, end, i == len(keys) - 1, per_block[k])
                for lid, view in cut.items():
                    views[lid].append(view)
                flags = self.flags(views, start, end)
            if link is not None and i == shared:  # the first block of the tenant's own chain names it
                extra = {**extra, "link": link}  # type: ignore[dict-item]
            node = Node(
                key=keys[i],
                parent=keys[i - 1] if i else start_key,
                position=start,
                tokens=data[4 * start : 4 * end],
                flags=flags,
                size=0,
                checksum=0,
                last_access=now,
                extra=extra,
            )
            new.append((node, tensors, BlockBits(whole, start - offset, end - offset, tensors), origin))
        # Snapshots (windows, recurrent states) are their own small copies, bits and all.
        if not uniform:
            mx.eval(
                [
                    x
                    for _, tensors, _, _ in new
                    for lid, part in tensors.items()
                    if lid not in whole
                    for x in part.values()
                ]
            )
        return new

    @staticmethod
    def evaluate(new: list[tuple[Node, Mapping[str, Tensors], Mapping, dict]]) -> None:
        """Evaluate what the RAM tier keeps of blocks from `new_blocks` (with ``direct``,
        this makes their copy): the copy each field's blocks are views of, once (not
        thousands of views), and the tensors of blocks without one."""
        origins = {id(origin): origin for _, _, _, origin in new}  # blocks of one store share theirs
        copies = {id(x): x for origin in origins.values() for fields, _ in origin.values() for x in fields.values()}
        mx.eval(
            list(copies.values())
            + [x for _, tensors, _, origin in new for lid in tensors if lid not in origin for x in tensors[lid].values()]
        )  # fmt: skip


class WholeBits:
    """Each sequence field's bits of one `Layout.new_blocks` call, shared by its blocks:
    evaluated MLX arrays of unsigned ints, each holding one field or several stacked along
    the batch (`Pack`), taken to the host (by `host`, where one is given) once, by the
    first thread that asks (the writer's)."""

    def __init__(self, packs: list[Pack], host: WriterRoute | None):
        self._packs, self._host, self._lock = packs, host, threading.Lock()
        self._leaves = {lid for _, names, _ in packs for lid, _, _ in names}
        self._fields: dict[str, dict[str, tuple]] | None = None

    def __contains__(self, lid: str) -> bool:
        return lid in self._leaves

    def __len__(self) -> int:
        return len(self._leaves)

    def leaf(self, lid: str) -> dict[str, tuple]:
        """The fields of leaf `lid`, as ``(numpy bits, dtype name)``."""
        if self._fields is None:
            with self._lock:
                if self._fields is None:
                    # Once taken, the copies are let go (a RAM tier's views may keep them).
                    self._fields, self._packs = self._to_host(), []
        return self._fields[lid]

    def _to_host(self) -> dict[str, dict[str, tuple]]:
        """Every field's bits in host memory."""
        fields: dict[str, dict[str, tuple]] = {}
        for u, names, address in self._packs:
            if self._host is not None:
                bits = self._host.bits(u, address)
            else:
                bits = np.asarray(memoryview(u))  # type: ignore[arg-type]  # MLX stubs: no buffer protocol
            batch = bits.shape[0] // len(names)
            for i, (name, f, dtype) in enumerate(names):
                fields.setdefault(name, {})[f] = (bits[i * batch : (i + 1) * batch], dtype)
        return fields


class BlockBits(Mapping):
    """One block's bits for the segment writer (see `Layout.new_blocks`): for sequence
    leaves numpy slices of each field's bits, cut when read (on the writer's thread:
    thousands of them were a long prompt's cost on the caller's) and not kept (a dict
    per leaf and block, alive for a whole write, outlived Python's young collections and
    brought on full ones: only those untrack dicts), for the others the block's tensors.
    Leaves come in the layout's order."""

    __slots__ = ("_whole", "_lo", "_hi", "_tensors")

    def __init__(self, whole: WholeBits, lo: int, hi: int, tensors: Mapping[str, Tensors]):
        self._whole, self._lo, self._hi, self._tensors = whole, lo, hi, tensors

    def __getitem__(self, lid: str):
        if lid in self._whole:
            lo, hi = self._lo, self._hi
            return {f: (a[..., lo:hi, :], dtype) for f, (a, dtype) in self._whole.leaf(lid).items()}
        return self._tensors[lid]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


# A writer's copy: its MLX array, the (leaf, field, dtype name) of each field stacked in it,
# and its device address where the writer copies it from there (`WriterRoute`; else None).
Pack = tuple[mx.array, list[tuple[str, str, str]], "int | None"]


def _as_uint(x: mx.array) -> mx.array:
    """The same bytes as unsigned ints of the same width (a view: numpy reads them)."""
    return x.view(mx_uint(x.itemsize))

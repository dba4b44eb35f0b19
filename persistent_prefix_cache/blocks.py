"""The vocabulary of a stored block: its record (`Node`), its fields and the dtypes they may have.

One place declares what a block holds, for every wing that handles blocks: `layers/`
names the fields when it cuts a cache into blocks and rebuilds one, `disk/` lays them out
in segment files and reads them back, the remote tier's wire form carries them.

- The **record** (`Node`): where a block sits in the trie (parent key, position, tokens)
  and where its bytes are (segment, size, checksum), with its flags. Its binary encoding
  (`Node.pack`, `Node.unpack`, `HEAD_AT`, `TOKENS_AT`) lives here too: the same bytes are
  the index's value, a segment's and an export's account of the block and part of the
  wire form, so they belong to the record, not to one medium (the lookup compares them
  without decoding).
- The **fields** (`FIELDS`): each tensor of a block is ``<leaf>.<field>``; a field is
  `SLICED` (a run of the leaf's state along the tokens: one block's piece of one tensor,
  joined with the other blocks' pieces on a restore) or a `SNAPSHOT` (a whole tensor that
  belongs to one block: a window, a recurrent state). A field's shape rule says which axis
  holds the tokens and which axes (with the dtype) must agree across the blocks of a
  model; its dtype rule is the dtype table (`DTYPES`), and `UINTS` (`mx_uint`,
  `np_uint`) the unsigned dtype its bits are seen as. `Tensors` is one block's tensors
  for one leaf, by field.

A new cache kind is a new `Field` (or field kind) here, and the code that asks
`is_sliced` / `sliced_spec` follows. Nothing here imports mlx or numpy at import time
(the index and maintenance never load them for a record).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:  # a type only: importing mlx here would load it for every record
    import mlx.core

# One block's tensors for one leaf, by field name (``keys``, ``values``, a snapshot):
# what `layers/` cuts and rebuilds, the RAM tier holds and the disk read path joins.
Tensors = dict[str, "mlx.core.array"]


class CutFrom(Mapping):
    """One block's tensors by leaf, then field, as rows ``lo:hi`` of one copy per field
    (``copies``: leaf -> field -> array, the tokens on the second axis from the end),
    each view made when its leaf is asked for and not kept: the blocks a store cuts from
    its copy weigh one small object each, not a view per field (every MLX array is an
    object Python's cyclic collector walks; making thousands was a third of a long
    prompt's `store()` on a CPU). `names` is the leaves and their fields, without views."""

    __slots__ = ("copies", "lo", "hi", "names")

    def __init__(self, copies: dict[str, dict[str, Any]], lo: int, hi: int, names: tuple):
        self.copies, self.lo, self.hi, self.names = copies, lo, hi, names

    def __getitem__(self, lid: str) -> Tensors:
        lo, hi = self.lo, self.hi
        return {f: x[..., lo:hi, :] for f, x in self.copies[lid].items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self.copies)

    def __len__(self) -> int:
        return len(self.copies)

    @staticmethod
    def names_of(copies: Mapping[str, Mapping[str, Any]]) -> tuple:
        """The `names` of blocks cut from `copies` (and of any tensors by leaf, then field)."""
        return tuple(copies), tuple(map(tuple, copies.values()))


# Tokens per block of a new store (the seed's); a store keeps its own in its index.
DEFAULT_BLOCK_SIZE = 64

# -- the record --------------------------------------------------------------------------

# version, parent key, position, token count, flags, bytes of the block, checksum,
# child count, last access (ns), length of the JSON tail; then (version 2) the segment.
_HEAD = struct.Struct("<B16sQIBQQIQH")
_SEGMENT = 16
RECORD_VERSION = 2
# A lookup matches packed records without decoding them: the slice of the record
# holding its parent key, position and token count, compared with `raw_head`, then its
# tokens from TOKENS_AT.
HEAD_AT = slice(1, 29)
_POSITION = struct.Struct("<QI")
TOKENS_AT = _HEAD.size

# Flags (computed by `layers.Layout.flags`): where this block's layers can be rebuilt.
RESUMABLE = 1  # every layer can be rebuilt at the end of this block
TRIMMABLE = 2  # every layer can be trimmed back to any position inside the block


def raw_head(parent: bytes, position: int, n_tokens: int) -> bytes:
    """What a packed record of a block with this parent, position and token count
    holds at `HEAD_AT`."""
    return parent + _POSITION.pack(position, n_tokens)


@dataclass(slots=True)
class Node:
    """One stored block: where it sits in the trie and where its bytes are.

    A block's tensors live in a segment file (see `disk.segment`) written by one writer
    for the blocks of one store; segment ids are random, so two processes that race
    to store one block never share, overwrite or unlink each other's file.
    """

    key: bytes
    parent: bytes
    position: int
    tokens: bytes  # int32 little-endian: compared byte-wise on every hit
    flags: int
    size: int
    checksum: int
    child_count: int = 0
    last_access: int = 0
    extra: dict = field(default_factory=dict)
    segment: bytes = bytes(_SEGMENT)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def end(self) -> int:
        return self.position + self.n_tokens

    @property
    def link(self) -> bytes | None:
        """The tenant root a block that continues a shared prefix names (``extra["link"]``,
        see `keys.TenantRoot`); None for every other block."""
        link = self.extra.get("link") if self.extra else None
        if not isinstance(link, str) or len(link) != 32:
            return None
        try:
            return bytes.fromhex(link)
        except ValueError:
            return None

    @property
    def resumable(self) -> bool:
        return bool(self.flags & RESUMABLE)

    @property
    def trimmable(self) -> bool:
        return bool(self.flags & TRIMMABLE)

    def pack(self) -> bytes:
        """The record as stored (version 2)."""
        tail = json.dumps(self.extra, separators=(",", ":")).encode() if self.extra else b""
        head = _HEAD.pack(
            RECORD_VERSION,
            self.parent,
            self.position,
            self.n_tokens,
            self.flags,
            self.size,
            self.checksum,
            self.child_count,
            self.last_access,
            len(tail),
        )
        return head + self.tokens + tail + self.segment

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> "Node":
        """Decode a record (version 2, or version 1 for the migration from schema v2).

        Raises:
            ValueError: If the record is malformed.
        """
        if len(raw) < _HEAD.size:
            raise ValueError("index record too short")
        (ver, parent, pos, n, flags, size, csum, children, access, n_tail) = _HEAD.unpack_from(raw)
        body = _HEAD.size + 4 * n + n_tail
        if ver not in (1, RECORD_VERSION) or len(raw) != body + (_SEGMENT if ver == 2 else 0):
            raise ValueError("index record has a bad version or length")
        tokens = bytes(raw[_HEAD.size : _HEAD.size + 4 * n])
        tail = raw[_HEAD.size + 4 * n : body]
        extra = json.loads(bytes(tail)) if n_tail else {}
        segment = bytes(raw[body:]) if ver == 2 else bytes(_SEGMENT)
        return cls(key, parent, pos, tokens, flags, size, csum, children, access, extra, segment)


# -- the fields ----------------------------------------------------------------------------


class Kind(enum.Enum):
    """How a field of a block is stored and joined."""

    SLICED = "sliced"  # one block's piece along the tokens; pieces of a path are joined
    SNAPSHOT = "snapshot"  # a whole tensor of one block (a window, a recurrent state)


@dataclass(frozen=True)
class Field:
    """A field of a block's leaf: what `layers/` cuts and `disk/` stores under ``<leaf>.<name>``.

    Attributes:
        name: The field's name (for a family such as the recurrent states ``s0``, ``s1``, …
            its prefix, with `indexed` set).
        kind: `Kind.SLICED` or `Kind.SNAPSHOT`.
        doc: What the tensor is.
        ndim: Dimensions of a sliced field's tensor (None: any shape).
        token_axis: The axis of a sliced field that holds the block's tokens.
        match: The axes that, with the dtype, must agree across the blocks of a model.
        indexed: Whether the name is a prefix followed by an index.
    """

    name: str
    kind: Kind
    doc: str
    ndim: int | None = None
    token_axis: int | None = None
    match: tuple[int, ...] = ()
    indexed: bool = False


def _kv(name: str, doc: str) -> Field:
    # [batch, heads, tokens, width]: the layout of mlx-lm's KV caches.
    return Field(name, Kind.SLICED, doc, ndim=4, token_axis=2, match=(0, 1, 3))


# Every field a block may hold. `layers/` names fields by these constants only.
KEYS, VALUES = "k", "v"
KV_FIELDS = (KEYS, VALUES)
QUANTIZED_KV_FIELDS = ("k0", "k1", "k2", "v0", "v1", "v2")  # (packed, scales, biases) of keys, values
WINDOW_SNAPSHOT = "snap_"  # + a KV field: the window a rotating/chunked layer holds at the block's end
STATE_SNAPSHOT = "s"  # + an index: entry i of a recurrent layer's state at the block's end

FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        _kv(KEYS, "keys of a KV layer"),
        _kv(VALUES, "values of a KV layer"),
        *(_kv(n, f"{'keys' if n[0] == 'k' else 'values'}: {('packed', 'scales', 'biases')[int(n[1])]} of a quantized KV layer")
          for n in QUANTIZED_KV_FIELDS),
        Field(WINDOW_SNAPSHOT + KEYS, Kind.SNAPSHOT, "keys a window layer holds at the block's end"),
        Field(WINDOW_SNAPSHOT + VALUES, Kind.SNAPSHOT, "values a window layer holds at the block's end"),
        Field(STATE_SNAPSHOT, Kind.SNAPSHOT, "entry i of a recurrent layer's state", indexed=True),
    )
}  # fmt: skip
SLICE_FIELDS = frozenset(name for name, f in FIELDS.items() if f.kind is Kind.SLICED)


def window_snapshot(kv_field: str) -> str:
    """The snapshot field of a window layer's KV field (``k`` -> ``snap_k``)."""
    return WINDOW_SNAPSHOT + kv_field


def state_snapshot(i: int) -> str:
    """The snapshot field of entry `i` of a recurrent layer's state."""
    return f"{STATE_SNAPSHOT}{i}"


def state_index(name: str) -> int:
    """The state entry a `state_snapshot` field holds."""
    return int(name[len(STATE_SNAPSHOT) :])


def field_of(name: str) -> Field | None:
    """The declared field of tensor ``<leaf>.<field>`` (or of a bare field name); None if
    undeclared."""
    fld = name.rpartition(".")[2]
    found = FIELDS.get(fld)
    if found is not None and not found.indexed:
        return found
    head = fld.rstrip("0123456789")
    found = FIELDS.get(head)
    return found if found is not None and found.indexed and head != fld else None


def is_sliced(name: str, shape: Sequence[int], n_tokens: int) -> bool:
    """Whether tensor ``<leaf>.<field>`` of a block of `n_tokens` tokens is stored sliced
    (one piece of a run along the tokens), else as a snapshot of the block.

    A sliced field's tensor that does not hold the block's tokens on its token axis is a
    snapshot too (what a window layer keeps under a KV name).
    """
    f = FIELDS.get(name.rpartition(".")[2])
    return (
        f is not None
        and f.kind is Kind.SLICED
        and len(shape) == f.ndim
        and f.token_axis is not None
        and shape[f.token_axis] == n_tokens
    )


def sliced_spec(name: str, dtype: str, shape: Sequence[int]) -> list:
    """What must agree across the blocks of a model for a sliced tensor: its dtype name,
    then its `Field.match` axes (``[dtype, batch, heads, width]`` for a KV field)."""
    f = FIELDS[name.rpartition(".")[2]]
    return [dtype, *(shape[a] for a in f.match)]


# -- the dtype rule: safetensors dtype names --------------------------------------------------

# safetensors dtype name -> (mlx dtype attribute, numpy dtype whose bytes match).
DTYPES = {
    "F32": ("float32", "<f4"),
    "F16": ("float16", "<f2"),
    "BF16": ("bfloat16", "<u2"),  # numpy has no bfloat16: view the bits
    "F64": ("float64", "<f8"),
    "U32": ("uint32", "<u4"),
    "I32": ("int32", "<i4"),
    "U8": ("uint8", "u1"),
    "I8": ("int8", "i1"),
    "U16": ("uint16", "<u2"),
    "I16": ("int16", "<i2"),
    "I64": ("int64", "<i8"),
    "U64": ("uint64", "<u8"),
    "BOOL": ("bool_", "?"),
}
_ITEMSIZE = {name: int(np_str[-1]) if np_str[-1].isdigit() else 1 for name, (_, np_str) in DTYPES.items()}
_BY_NUMPY = {"|u1": "U8", "|i1": "I8", "|b1": "BOOL"}
_BY_NUMPY.update({np_str: name for name, (_, np_str) in DTYPES.items() if name != "BF16" and np_str[0] == "<"})
_BY_MX: dict = {}  # mlx dtype -> name, filled on first use (mlx is imported by then)
_SEEN: dict = {}  # any dtype object asked about -> name (the write and wire paths ask per tensor)


def mx_dtype(name: str) -> Any:
    """The mlx dtype of a safetensors dtype name."""
    import mlx.core as mx

    return getattr(mx, DTYPES[name][0])


# Item size -> the unsigned dtype of that width: a tensor's bits, whatever its dtype, seen
# without a copy to copy, hash, join or send them (numpy has no bfloat16).
UINTS = {1: "U8", 2: "U16", 4: "U32", 8: "U64"}
_MX_UINTS: dict = {}  # item size -> mlx dtype, filled on first use (asked per tensor)


def mx_uint(itemsize: int) -> Any:
    """The mlx unsigned dtype of `itemsize` bytes (``x.view(mx_uint(x.itemsize))``)."""
    found = _MX_UINTS.get(itemsize)
    if found is None:
        found = _MX_UINTS[itemsize] = mx_dtype(UINTS[itemsize])
    return found


def np_uint(itemsize: int) -> str:
    """The numpy unsigned dtype of `itemsize` bytes, little-endian as the block formats
    store it (``"<u2"``: numpy takes the string wherever it takes a dtype)."""
    return DTYPES[UINTS[itemsize]][1]


def dtype_info(dtype: Any) -> tuple[str, int]:
    """(safetensors name, item size) of an mlx or numpy dtype, or of such a name.

    Raises:
        ValueError: For a dtype the block formats do not store.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        return dtype, _ITEMSIZE[dtype]
    try:
        name = _SEEN.get(dtype)
    except TypeError:  # unhashable: asked afresh
        name = None
    if name is None:
        name = _name_of(dtype)
        try:
            _SEEN[dtype] = name
        except TypeError:
            pass
    return name, _ITEMSIZE[name]


def _name_of(dtype: Any) -> str:
    if type(dtype).__module__.startswith("mlx"):
        if not _BY_MX:
            import mlx.core as mx

            _BY_MX.update({getattr(mx, attr): name for name, (attr, _) in DTYPES.items()})
        if dtype in _BY_MX:
            return _BY_MX[dtype]
    import numpy as np

    try:
        return _BY_NUMPY[np.dtype(dtype).str]
    except (TypeError, KeyError):
        raise ValueError(f"dtype {dtype} cannot be stored") from None

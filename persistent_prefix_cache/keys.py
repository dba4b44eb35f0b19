"""Block keys: a chained xxh3-128 hash over the token blocks of a prompt.

`root_key` binds the chain to one model fingerprint, namespace and cache layout;
`block_key` extends it by one block. Because every key covers the whole history
before it, a block is only ever reused at the same position after the same tokens.

A tenant's root may declare shared prefixes (`TenantRoot`): a prompt's leading full
blocks that equal a shared prefix's are keyed from the shared namespace's root (stored
once, hit by every tenant), and the block after them continues from `link_key` of the
last shared block and the tenant's root, so everything after a shared prefix stays the
tenant's. Such a block's record names its tenant's root (``extra["link"]``), so its key
can still be checked from the record alone (`key_follows`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np
import xxhash

from .blocks import Node
from .errors import InvalidArgumentError

T = TypeVar("T")
FORMAT_TAG = b"persistent_prefix_cache/block-key/v1"
LINK_TAG = b"persistent_prefix_cache/tenant-link/v1"
KEY_BYTES = 16
#: The range of token ids a store can key: ids are stored as int32. Negative ids are
#: fine (mlx-lm's server marks image patches with negative ids), wider ones are not.
TOKEN_MIN, TOKEN_MAX = -(2**31), 2**31 - 1


def _framed(*parts: bytes) -> bytes:
    # Length-prefix every part so that no two different tuples encode alike.
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def root_key(fingerprint: str, namespace: str, layout: str) -> bytes:
    """The key every chain starts from.

    Args:
        fingerprint: The model fingerprint (see `fingerprint.fingerprint_model`).
        namespace: A tenant or cache salt; "" for none.
        layout: The cache layout signature (see `layers.signature_of`).

    Returns:
        16 bytes.
    """
    data = _framed(FORMAT_TAG, fingerprint.encode(), namespace.encode(), layout.encode())
    return xxhash.xxh3_128_digest(data)


def block_key(parent: bytes, token_bytes: bytes) -> bytes:
    """The key of a block: its parent's key extended by the block's tokens.

    Args:
        parent: The previous block's key (or the root key).
        token_bytes: The block's tokens as int32 little-endian (see `as_token_array`).

    Returns:
        16 bytes.
    """
    return xxhash.xxh3_128_digest(parent + token_bytes)


def link_key(shared: bytes, tenant_root: bytes) -> bytes:
    """What a tenant's chain continues from after the last block of a shared prefix.

    Args:
        shared: The key of the shared prefix's last full block.
        tenant_root: The tenant's root key (`root_key` of its namespace).

    Returns:
        16 bytes: the parent the next block's key is hashed from (`block_key`); its
        record's parent stays `shared`.
    """
    return xxhash.xxh3_128_digest(_framed(LINK_TAG, bytes(shared), bytes(tenant_root)))


def key_follows(node: Node) -> bool:
    """Whether a record's key follows from its parent and tokens (through its tenant's
    link, for a block that continues a shared prefix): what a check of a record from
    outside the lookup (a repair, an import) asks."""
    link = node.link
    parent = link_key(node.parent, link) if link is not None else node.parent
    return block_key(parent, node.tokens) == node.key


class TenantRoot(bytes):
    """A tenant's root key with the shared prefixes its prompts may start with.

    It is the root key itself (compared, hashed and stored as those 16 bytes); what it
    adds is where a prompt's chain starts (`start`): at the shared root when the prompt
    begins with full blocks of a shared prefix, else here.

    Args:
        root: The tenant's root key.
        shared_root: The root key of the shared prefixes' namespace.
        prefixes: The shared prefixes, each as int32 little-endian bytes.
    """

    shared_root: bytes
    prefixes: tuple[bytes, ...]

    def __new__(cls, root: bytes, shared_root: bytes, prefixes: Sequence[bytes]) -> "TenantRoot":
        self = super().__new__(cls, root)
        self.shared_root, self.prefixes = bytes(shared_root), tuple(bytes(p) for p in prefixes)
        return self

    def shared_blocks(self, data: bytes, block_size: int) -> int:
        """How many leading full blocks of a prompt (int32 bytes) equal a shared prefix's."""
        step, best = 4 * block_size, 0
        for prefix in self.prefixes:
            n = min(len(prefix), len(data)) // step * step
            if n > best * step:
                shared = common_prefix(np.frombuffer(prefix[:n], "<i4"), np.frombuffer(data[:n], "<i4"))
                best = max(best, shared // block_size)
        return best

    def start(self, data: bytes, block_size: int) -> tuple[bytes, int]:
        """``(the key the prompt's chain starts from, its shared full blocks)``."""
        shared = self.shared_blocks(data, block_size)
        return (self.shared_root, shared) if shared else (bytes(self), 0)


def chain_start(root: bytes, data: bytes, block_size: int) -> tuple[bytes, int]:
    """Where a prompt's chain starts and how many of its full blocks are shared: a
    `TenantRoot`'s `start`, else ``(root, 0)``."""
    if isinstance(root, TenantRoot):
        return root.start(data, block_size)
    return root, 0


def starts_shared(root: bytes, node: Node) -> bool:
    """Whether new blocks that start with `node` start at a `TenantRoot`'s shared root
    (then their segment is the shared namespace's: a segment's chain starts under its root)."""
    return isinstance(root, TenantRoot) and node.position == 0 and node.parent != root


def shared_apart(root: bytes, groups: list[tuple[list[tuple[Node, Any]], int]]) -> list[tuple[list, int]]:
    """The writer's groups of new blocks ``(blocks, writes)``, a group that starts at a
    shared prefix (`starts_shared`) cut before the tenant's first block (`Node.link`)."""
    if not isinstance(root, TenantRoot):
        return groups
    out: list[tuple[list, int]] = []
    for new, n_writes in groups:
        cut = next((i for i, (node, _) in enumerate(new) if node.link is not None), None)
        if starts_shared(root, new[0][0]) and cut:
            out.append((new[:cut], 0))
            new = new[cut:]
        out.append((new, n_writes))
    return out


def as_token_array(tokens: Any) -> np.ndarray:
    """Validate a token sequence and return it as a 1-D int32 array.

    Args:
        tokens: A list/tuple of ints, a 1-D numpy array or a 1-D mlx array.

    Returns:
        A new little-endian int32 numpy array.

    Raises:
        InvalidArgumentError: If the tokens are not a 1-D sequence of integers, or an
            id does not fit the stored width (int32: ``[-2**31, 2**31)``).
    """
    if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray):
        tokens = tokens.tolist()  # an mlx array
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"tokens must be a sequence of ints: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype == object and arr.ndim == 1 and all(_is_int(t) for t in arr.tolist()):
        low, high = min(arr.tolist()), max(arr.tolist())  # ints too wide for int64
    elif arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    else:
        low, high = int(arr.min()), int(arr.max())
    if low < TOKEN_MIN or high > TOKEN_MAX:
        bad = low if low < TOKEN_MIN else high
        raise InvalidArgumentError(
            f"token id {bad} does not fit the store's token width: ids are stored as "
            f"int32, in [{TOKEN_MIN}, {TOKEN_MAX}]",
            hint="such prompts cannot be cached; map the ids into that range (or keep them uncached)",
        )
    return arr.astype("<i4")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def chain_keys(root: bytes, tokens: np.ndarray, block_size: int) -> list[bytes]:
    """Keys of every block of `tokens`, the last one possibly partial.

    Args:
        root: The chain's root key (a `TenantRoot`: from the shared root where the
            prompt starts with a shared prefix, then through `link_key`).
        tokens: int32 tokens from `as_token_array`.
        block_size: Tokens per full block.

    Returns:
        One key per block, in order.
    """
    keys = []
    data = tokens.tobytes()
    parent, shared = chain_start(root, data, block_size)
    step = 4 * block_size
    for start in range(0, len(data), step):
        parent = block_key(parent, data[start : start + step])
        keys.append(parent)
        if len(keys) == shared:  # the last shared block: the tenant's own chain goes on from here
            parent = link_key(parent, root)
    return keys


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def best_continuation(
    rest: np.ndarray,
    children: Iterable[tuple[bytes, Any, T]],
    *,
    partial_ok: Callable[[T], bool],
) -> tuple[T, int] | None:
    """The trie's rule for the last step of a prefix walk: of the children of the last
    full block, the one sharing the longest prefix with what is left of the query.

    Ties go to the child with fewer tokens (less to trim), then to the smaller `tie`.

    Args:
        rest: What is left of the query (at most one block).
        children: ``(token bytes, tie, item)`` per child.
        partial_ok: Whether a child may be used for fewer tokens than it holds.

    Returns:
        ``(item, tokens shared)``, or None if no child shares a token.
    """
    best = None
    for tokens, tie, item in children:
        n = len(tokens) // 4
        shared = common_prefix(np.frombuffer(tokens, dtype="<i4"), rest)
        if shared == 0 or (shared < n and not partial_ok(item)):
            continue
        rank = (-shared, n, tie)
        if best is None or rank < best[0]:
            best = (rank, item, shared)
    return None if best is None else (best[1], best[2])

"""Typed errors. Each carries a hint that says what the user can do about it.

Read-path damage (a broken segment file, a forged index entry) is never raised to the
caller: it becomes a cache miss. These errors are for misuse and for stores that
cannot be opened safely.
"""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of every error this package raises on purpose.

    Args:
        message: What went wrong, naming the input or file at fault.
        hint: What to do about it (shown after the message).
    """

    hint: str = ""

    def __init__(self, message: str, *, hint: str | None = None):
        if hint is not None:
            self.hint = hint
        text = f"{message} ({self.hint})" if self.hint else message
        super().__init__(text)
        self.message = message


class InvalidArgumentError(PrefixCacheError, ValueError):
    """An argument is malformed: fix the call; nothing was written."""

    hint = "fix the argument; nothing was written"


class StoreClosedError(InvalidArgumentError):
    """A call on a store handle after its `close()`. An `InvalidArgumentError` (what such
    a call raised before this class), as Python's closed files raise `ValueError`."""

    hint = "open the store again (PersistentPrefixCache(path, model)); a closed handle serves nothing"


class EmptiesStoreError(InvalidArgumentError):
    """A removal asked not to empty a store would have removed every block of it
    (nothing was removed).

    Attributes:
        blocks: How many blocks the store holds.
        block_bytes: Their bytes.
    """

    hint = "nothing was removed; ask for it explicitly to remove every block"

    def __init__(self, message: str, *, blocks: int, block_bytes: int, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.blocks, self.block_bytes = blocks, block_bytes


class UnverifiedPackError(InvalidArgumentError):
    """A pack neither this store nor the given secret signed, imported without a check."""

    hint = (
        "nothing was written; pass --model M to check its blocks against the model, --trust if you trust "
        "where it came from, or export it with a secret both sides hold ($PPC_PACK_SECRET)"
    )


class UnsupportedCacheError(PrefixCacheError, TypeError):
    """A cache class (or layout) this version cannot store exactly."""

    hint = "see the README's table of supported cache classes"


class LayoutMismatchError(PrefixCacheError, ValueError):
    """The cache given to `store()` does not have the layout the store was opened with."""

    hint = "open the store with the same model and kv_bits/kv_group_size as the cache"


class StoreVersionError(PrefixCacheError):
    """The store was written by a newer version of this library."""

    hint = "upgrade persistent_prefix_cache; the store was left untouched"


class StoreCorruptError(PrefixCacheError):
    """The store's index cannot be read safely."""

    hint = "run `ppc check --fix --store STORE`: it rebuilds the index from the store's segment files"


class StoreBusyError(PrefixCacheError):
    """The store is being repaired by another process, or a repair found it in use."""

    hint = "wait for `ppc check --fix` to finish, then open the store again"


class ReadOnlyStoreError(PrefixCacheError):
    """A write was asked of a store opened read-only."""

    hint = "open the store with readonly=False in a writable directory"


class StorePathError(InvalidArgumentError):
    """The store path cannot hold a store: a file, or a folder of other files (nothing
    was created)."""

    hint = "give a new or empty folder, or an existing store; nothing was created"


class StoreNotWritableError(ReadOnlyStoreError):
    """The store (or the folder to create it in) cannot be written by this process: its
    permissions, another user's files, or a read-only file system (nothing was written)."""

    hint = (
        "open it read-only (readonly=True; ppc's --store-readonly) to serve its hits, give another "
        "directory, or get write permission on it"
    )


class UnsupportedServerError(PrefixCacheError):
    """The installed ``mlx_lm.server`` does not have the structure ``ppc serve`` patches."""

    hint = "install an mlx-lm version ppc serve was checked with"


class MissingDependencyError(PrefixCacheError, ImportError):
    """An optional feature needs a package that is not installed."""

    hint = "pip install redis hiredis (the package's [remote] extra)"


class ModelMismatchError(PrefixCacheError, ValueError):
    """The loaded model is not the one in the folder given as its ``model_path``."""

    hint = (
        "pass the folder the model was loaded from as model_path, or omit model_path "
        "(the weights are then hashed at every open); nothing was remembered"
    )


class PromptCacheFileError(PrefixCacheError, ValueError):
    """An mlx-lm prompt-cache file cannot be used: not a cache file, truncated, a layout this
    version cannot read, or not the given model's or prompt's."""

    hint = "nothing was written; write the file again with mlx_lm.cache_prompt for this model and prompt"


class RemoteConfigError(InvalidArgumentError):
    """The remote server refuses what its URL asks for: a database it does not have,
    a user name or password it does not accept."""

    hint = "fix the remote URL: its db, user name or password"


class RemoteUnreachableError(PrefixCacheError, ConnectionError):
    """The remote server (or every node of a cluster) cannot be reached."""

    hint = "start the server, or check the remote URL"

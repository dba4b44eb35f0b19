"""The options `PersistentPrefixCache` is opened with (`Options`), and their checks."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Sequence

from .disk.store_dir import store_exists, unwritable_part
from .errors import InvalidArgumentError
from .keys import TOKEN_MAX, TOKEN_MIN
from .paths import expand_path


@dataclass(frozen=True, kw_only=True)
class Options:
    """The keyword options of a `PersistentPrefixCache`, every one as given, each
    documented here once (``help(PersistentPrefixCache)`` shows this text for its
    ``__init__``; docs/library.md has a table of them); `checked` expands and checks them.

    Attributes:
        fingerprint: Use this string as the model fingerprint instead of hashing the
            weights. Two models given the same string share blocks: only pass one you
            derive from the weights yourself.
        model_path: The folder `model` was loaded from; the fingerprint is then
            remembered in the store under the files' (path, size, mtime, inode),
            with a sample of the weights that every later open checks against the
            model loaded (`fingerprint.cached_fingerprint`). ``~`` and ``$VARS`` are
            expanded (`paths.expand_path`).
        model_name: The model's name in the store's record (``ppc inspect`` and
            ``ppc stats`` show it): a folder or hub id. Default: `model_path`.
        namespace: Keeps tenants apart: different namespaces never share a block.
        block_size: Tokens per block for a new store (64 if None); an existing store
            keeps its own, and a different explicit value is an error.
        memory_bytes: Budget of the RAM tier (0 disables it). ``"auto"`` (the
            default): 1/8 of the device's memory beside the model's weights, shared by
            the process's open handles, at least 512 MiB each (`opening.memory_tier`).
        disk_bytes: Budget of the blocks' bytes; least recently used leaves are
            evicted past it. ``"auto"`` (the default): what the store holds plus half
            the space free on its file system at open (`opening.disk_budget`). None
            means unbounded.
        namespace_bytes: A quota of this handle's namespace (its blocks of this model,
            counted in the index: `disk.index_owners`): past it, the writer evicts this
            namespace's least recently used leaves, never another's. None: no quota
            (the store-wide `disk_bytes` still holds). Needs a `namespace` other than
            `shared_namespace`.
        shared_prefixes: Token id lists the operator declares shared by every namespace
            (a system prompt): a prompt's leading full blocks that equal one of them are
            keyed and stored once, under `shared_namespace`, and hit for every tenant;
            the blocks after them stay this namespace's (`keys.TenantRoot`). Their blocks
            are charged to no namespace's quota. Not with `remote`.
        shared_namespace: The namespace the shared prefixes' blocks are stored under
            (default ``""``: where a handle without a namespace stores them).
        readonly: Serve hits only; `store()` writes nothing (silently: it was asked
            for). A store this process cannot write opens read-only with one warning.
        kv_bits: Quantize KV like mlx-lm's ``kv_bits`` (the store then holds and
            returns ``QuantizedKVCache`` layers).
        kv_group_size: Group size for `kv_bits`.
        sync_writes: Make `store()` return only once its blocks are on disk.
        cost_model: Restore only the prefix that is faster to restore than to compute,
            by the costs measured for this model on this device kind, kept in the
            store (see `costs`); False restores whatever is stored.
        remote: A Redis / Valkey URL (``redis://``, ``rediss://``, ``unix://``,
            ``redis+cluster://h:p,h:p``): the fleet's shared block tier, read after
            the local store and published to in the background (see `tiers.remote`).
        remote_secret: MAC every published value with this secret and accept only
            values carrying a valid MAC (each secret's blocks have keys of their own).
        remote_ttl: Seconds a published block lives on the server (None: until the
            server evicts it).
        remote_timeout: Seconds one round trip to the server may take; a server that
            does not answer costs a fetch at most about this, then is skipped for a
            back-off.
        remote_insecure: Share blocks without a secret (then required: it trusts
            whoever can write to the server).
        shared: Make a new store for a group: its folder 2770 (setgid) and its files
            0660, instead of private (0700 / 0600). An existing store keeps the mode
            of its folder (see `disk.store_dir`); others never get a bit.
    """

    fingerprint: str | None
    model_path: str | os.PathLike | None
    model_name: str | None
    namespace: str
    block_size: int | None
    memory_bytes: int | str
    disk_bytes: int | str | None
    namespace_bytes: int | None
    shared_prefixes: Sequence[Sequence[int]]
    shared_namespace: str
    readonly: bool
    kv_bits: int | None
    kv_group_size: int
    sync_writes: bool
    cost_model: bool
    remote: str | None
    remote_secret: str | bytes | None
    remote_ttl: float | None
    remote_timeout: float
    remote_insecure: bool
    shared: bool

    def checked(self) -> "Options":
        """These options with `model_path` expanded (`paths.expand_path`) and
        `model_name` defaulting to it (made absolute).

        Raises:
            InvalidArgumentError: For a malformed option (a remote's URL included), and for a
                remote without a secret that `remote_insecure` does not choose explicitly.
        """
        model_path = None if self.model_path is None else expand_path(self.model_path, what="model_path")
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise InvalidArgumentError(f"model_name must be a string, got {type(self.model_name).__name__}")
        check_remote(remote=self.remote, secret=self.remote_secret, ttl=self.remote_ttl, timeout=self.remote_timeout,
                     insecure=self.remote_insecure)  # fmt: skip
        check_options(
            fingerprint=self.fingerprint, model_path=model_path, namespace=self.namespace, block_size=self.block_size,
            memory_bytes=self.memory_bytes, disk_bytes=self.disk_bytes, kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size, shared=self.shared,
        )  # fmt: skip
        shared_prefixes = check_tenancy(
            namespace=self.namespace, namespace_bytes=self.namespace_bytes, shared_prefixes=self.shared_prefixes,
            shared_namespace=self.shared_namespace, remote=self.remote,
        )  # fmt: skip
        name = self.model_name or (None if model_path is None else os.path.abspath(model_path))
        return replace(self, model_path=model_path, model_name=name, shared_prefixes=shared_prefixes)


def existing_but_not_writable(path: str) -> bool:
    """Whether a store exists at `path` that this process cannot write to (a folder or
    index file of it: permissions, another user's files, a read-only file system)."""
    return store_exists(path) and unwritable_part(path) is not None


def check_options(
    *, fingerprint, model_path, namespace, block_size, memory_bytes, disk_bytes, kv_bits, kv_group_size, shared=False
) -> None:
    """Raise `InvalidArgumentError` for a malformed option of `PersistentPrefixCache`."""
    if not isinstance(shared, bool):
        raise InvalidArgumentError(f"shared must be True or False, got {shared!r}")
    for name, value, minimum, optional in (
        ("block_size", block_size, 1, True),
        ("memory_bytes", None if memory_bytes == "auto" else memory_bytes, 0, memory_bytes == "auto"),
        ("disk_bytes", None if disk_bytes == "auto" else disk_bytes, 0, True),
    ):
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    if not isinstance(namespace, str):
        raise InvalidArgumentError(f"namespace must be a str, got {type(namespace).__name__}")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise InvalidArgumentError("fingerprint must be a non-empty str")
    if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidArgumentError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8 (or None), got {kv_bits!r}")
    if kv_group_size not in (32, 64, 128):
        raise InvalidArgumentError(f"kv_group_size must be 32, 64 or 128, got {kv_group_size!r}")
    if model_path is not None and not os.path.isdir(model_path):
        raise InvalidArgumentError(f"model_path {model_path!r} is not a folder")


def check_tenancy(
    *, namespace: str, namespace_bytes: object, shared_prefixes: object, shared_namespace: object, remote: object
) -> tuple[tuple[int, ...], ...]:
    """Check the tenant options of `PersistentPrefixCache` (a namespace's quota, the shared
    prefixes its chains may start with) and return the prefixes as tuples of ints.

    Raises:
        InvalidArgumentError: For a malformed one, a quota or shared prefixes without a
            namespace of their own, or shared prefixes with a remote tier (its keys follow
            one root: not supported).
    """
    if namespace_bytes is not None:
        if not isinstance(namespace_bytes, int) or isinstance(namespace_bytes, bool) or namespace_bytes < 0:
            raise InvalidArgumentError(f"namespace_bytes must be an int >= 0 (or None), got {namespace_bytes!r}")
    if not isinstance(shared_namespace, str):
        raise InvalidArgumentError(f"shared_namespace must be a str, got {type(shared_namespace).__name__}")
    if isinstance(shared_prefixes, (str, bytes)) or not isinstance(shared_prefixes, (list, tuple)):
        raise InvalidArgumentError("shared_prefixes must be a list of token id lists")
    prefixes = []
    for prefix in shared_prefixes:
        if (
            isinstance(prefix, (str, bytes))
            or not isinstance(prefix, (list, tuple))
            or not all(isinstance(t, int) and not isinstance(t, bool) and TOKEN_MIN <= t <= TOKEN_MAX for t in prefix)
        ):
            raise InvalidArgumentError("each shared prefix must be a list of int32 token ids")
        prefixes.append(tuple(prefix))
    if (prefixes or namespace_bytes is not None) and namespace == shared_namespace:
        raise InvalidArgumentError(
            f"namespace_bytes and shared_prefixes need a namespace of the handle's own, not the shared one "
            f"({namespace!r})"
        )
    if prefixes and remote is not None:
        raise InvalidArgumentError("shared_prefixes cannot be used with remote= (not supported yet)")
    return tuple(prefixes)


INSECURE_HINT = (
    "a remote without a secret trusts whoever can write to the server (values are checked like the local disk: "
    "damage is caught, a forged value with a correct checksum is not)"
)


def check_remote(*, remote, secret, ttl, timeout, insecure=False) -> None:
    """Raise `InvalidArgumentError` for a malformed remote option (the URL included), and
    for a remote without a secret that `insecure` does not choose explicitly."""
    from .tiers.remote_client import parse_url

    if not isinstance(insecure, bool):
        raise InvalidArgumentError(f"remote_insecure must be True or False, got {insecure!r}")
    if remote is None:
        if secret is not None or ttl is not None or insecure:
            raise InvalidArgumentError("remote_secret, remote_ttl and remote_insecure need remote=URL")
        return
    if not isinstance(remote, str):
        raise InvalidArgumentError(f"remote must be a URL string, got {type(remote).__name__}")
    parse_url(remote)
    if secret is not None and (not isinstance(secret, (str, bytes)) or not secret):
        raise InvalidArgumentError("remote_secret must be a non-empty str or bytes")
    if secret is None and not insecure:
        raise InvalidArgumentError(
            "remote= needs remote_secret= (the fleet's secret), or remote_insecure=True to share blocks without one",
            hint=INSECURE_HINT,
        )
    if secret is not None and insecure:
        raise InvalidArgumentError("remote_insecure=True and remote_secret= contradict each other: give one")
    for name, value in (("remote_ttl", ttl), ("remote_timeout", timeout)):
        if value is None and name == "remote_ttl":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise InvalidArgumentError(f"{name} must be a number of seconds > 0, got {value!r}")

"""Checks of the options `PersistentPrefixCache` is opened with, and `OpenedWith`: what
a handle was opened with, read-only."""

from __future__ import annotations

import json
import os

from .disk.store_dir import store_exists, unwritable_part
from .errors import InvalidArgumentError


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


def _read_only(name: str, doc: str) -> property:
    # What a handle was opened with, shown without a setter: its collaborators are private.
    return property(lambda self: getattr(self, name), doc=doc)


class OpenedWith:
    """The part of `PersistentPrefixCache` that says what it was opened with: read-only
    views, and the model's record (what its root key stands for)."""

    path = _read_only("_path", "The store directory (an absolute path).")
    readonly = _read_only("_readonly", "Whether `store()` writes nothing (asked for, or a store this process cannot write).")
    block_size = _read_only("_block_size", "Tokens per block: the store's own.")
    fingerprint = _read_only("_fingerprint", "The model fingerprint this handle's blocks are keyed under.")
    model_name = _read_only("_model_name", "The model's name in the store's record (a folder or hub id; None: unknown).")
    namespace = _read_only("_namespace", "The namespace that keeps this handle's blocks apart from other tenants'.")

    def this_model(self) -> dict:
        """This handle's model as `stored_models` lists one (stored here or not yet).

        Returns:
            ``{"root", "fingerprint", "namespace", "layout", "name"}``.
        """
        return {"root": self._root.hex(), **{k: v for k, v in json.loads(self._describe()).items() if k != "fields"}}

    def _describe(self) -> bytes:
        """The model's record: what its root key stands for, and its KV's dtypes and shapes."""
        return json.dumps(
            {
                "fingerprint": self._fingerprint,
                "namespace": self._namespace,
                "layout": self._layout.signature,
                "fields": self._layout.fields or {},
                "name": self._model_name,
            }
        ).encode()

    def _recorded_fields(self) -> dict | None:
        with self._index.reader() as reader:
            raw = reader.model(self._root)
        try:
            return json.loads(raw).get("fields") or None if raw else None
        except (ValueError, AttributeError):
            return None

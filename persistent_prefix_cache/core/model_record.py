"""`ModelRecord`: the model a handle's blocks belong to, built once at open.

Its fingerprint (`fingerprint.cached_fingerprint`, unless the caller gave one), its
namespace, its cache layout and its name make its root key (`keys.root_key`), the key
every chain of blocks starts from. The store keeps a record of it (`describe`: in the
index's model table and in every segment's header, with its KV's dtypes and shapes),
which `stored_models` lists and `this_model` shows for this handle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..disk.index import Index
from ..fingerprint import cached_fingerprint
from ..keys import TenantRoot, root_key
from ..layers import Layout


@dataclass(frozen=True)
class ModelRecord:
    """What a handle's root key stands for.

    Attributes:
        fingerprint: The model fingerprint its blocks are keyed under.
        namespace: What keeps its blocks apart from other tenants'.
        name: Its name in the store's record (a folder or hub id; None: unknown).
        layout: Its cache layout (`layout.fields`: the KV's dtypes and shapes, learned
            from the first block stored or read from the store's record).
        root: The root key.
        shared_namespace: Where the shared prefixes of a `keys.TenantRoot` are stored.
    """

    fingerprint: str
    namespace: str
    name: str | None
    layout: Layout
    root: bytes
    shared_namespace: str = ""

    @classmethod
    def open(
        cls,
        index: Index,
        model: Any,
        layout: Layout,
        *,
        fingerprint: str | None,
        model_path: str | os.PathLike | None,
        name: str | None,
        namespace: str,
        shared_prefixes: Sequence[Sequence[int]] = (),
        shared_namespace: str = "",
    ) -> "ModelRecord":
        """The record of `model` in the store `index` belongs to: its fingerprint hashed
        (or remembered by `model_path`, verified) unless given, and `layout.fields` set to
        what the store recorded for it. With `shared_prefixes` its root is a
        `keys.TenantRoot` whose prompts start from `shared_namespace`'s root where they
        begin with one of them.

        Raises:
            ModelMismatchError: If `model` is proven not to be the model in `model_path`.
        """
        fingerprint = fingerprint or cached_fingerprint(
            model,
            None if model_path is None else os.fspath(model_path),
            index.remembered_fingerprint,
            index.remember_fingerprint,
            index.stored_fingerprints,
        )
        signature = layout.signature + layout.variant
        root = root_key(fingerprint, namespace, signature)
        if shared_prefixes:
            prefixes = [np.asarray(p, dtype="<i4").tobytes() for p in shared_prefixes]
            root = TenantRoot(root, root_key(fingerprint, shared_namespace, signature), prefixes)
        record = cls(fingerprint, namespace, name, layout, root, shared_namespace)
        with index.reader() as reader:
            raw = reader.model(root)
        try:
            layout.fields = json.loads(raw).get("fields") or None if raw else None
        except (ValueError, AttributeError):
            layout.fields = None
        return record

    def describe(self) -> bytes:
        """The model's record: what its root key stands for, and its KV's dtypes and shapes."""
        record = {
            "fingerprint": self.fingerprint,
            "namespace": self.namespace,
            "layout": self.layout.signature,
            "fields": self.layout.fields or {},
            "name": self.name,
        }
        if isinstance(self.root, TenantRoot):  # its segments may hold shared blocks: an index rebuild keeps them
            record["shared_root"] = self.root.shared_root.hex()
        return json.dumps(record).encode()

    def describe_shared(self) -> bytes:
        """The record of the shared prefixes' root (`keys.TenantRoot`): this model in the
        shared namespace, as a handle of that namespace records it."""
        record = json.loads(self.describe())
        record.pop("shared_root", None)
        return json.dumps({**record, "namespace": self.shared_namespace}).encode()

    def this_model(self) -> dict:
        """This model as `PersistentPrefixCache.stored_models` lists one.

        Returns:
            ``{"root", "fingerprint", "namespace", "layout", "name"}``.
        """
        return {"root": self.root.hex(), **{k: v for k, v in json.loads(self.describe()).items() if k != "fields"}}

    @property
    def model_root(self) -> str:
        """The root key of the model alone (no namespace), in hex: what this machine's
        measured costs are kept under (`machine_costs`), shared by every tenant."""
        return root_key(self.fingerprint, "", self.layout.signature + self.layout.variant).hex()

    @property
    def label(self) -> str:
        """The model's name for messages (its fingerprint's start where it has none)."""
        return self.name or self.fingerprint[:16]

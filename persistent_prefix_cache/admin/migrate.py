"""``ppc migrate``: a store's pending schema migrations, listed or applied in one transaction.

The migrations themselves ship in ``migrations/`` and `disk/index.py` applies them (the
version stamped last); this is the command's side: the schema asked once
(`disk/schema.check_schema`: a newer store names the upgrade), and a store this process
cannot write refused with the remedy before LMDB is asked to write it.
"""

from __future__ import annotations

import os

from ..disk.index import Index
from ..disk.schema import check_schema
from ..disk.store_dir import require_writable, unwritable_part
from .store_admin import WRITE_HINT


def migrate_store(path: str, *, dry_run: bool = False) -> dict:
    """List (`dry_run`) or apply the migrations the store at `path` needs.

    Args:
        path: The store directory (one ``ppc``'s `store_path` found).
        dry_run: Only list them; the store is opened read-only.

    Returns:
        store, from_version, to_version, pending (``{"version", "description"}`` each),
        applied (what `Index.apply_migrations` reports), dry_run.

    Raises:
        StoreVersionError: If a newer version of this library wrote the store.
        StoreNotWritableError: If migrations are pending and this process cannot write it.
    """
    # A store this user cannot write is read: "nothing to do" needs no write access.
    writable = not dry_run and unwritable_part(path) is None
    index = Index(os.path.join(path, "index"), readonly=not writable, migrate=False)
    try:
        version = index.version()
        check_schema(path, version, migrate=True)  # a newer store: upgrade the library
        pending = [{"version": m.VERSION, "description": m.DESCRIPTION} for m in index.pending_migrations()]
        applied = []
        if pending and not dry_run:
            # One line naming the remedy, not LMDB's "Read-only file system" traceback.
            require_writable(path, hint=f"{WRITE_HINT}; `ppc migrate --dry-run` only reads it")
            applied = index.apply_migrations({"block_size": index.block_size})
        return {"store": path, "from_version": version, "to_version": index.version(),
                "pending": pending, "applied": applied, "dry_run": dry_run}  # fmt: skip
    finally:
        index.close()

"""The schema: the shipped migrations (found without LMDB) and the version they reach.

Each module in ``persistent_prefix_cache.migrations`` (the repository's ``migrations/``)
has ``VERSION``, ``DESCRIPTION`` and ``upgrade(env, txn, params)``; `Index` applies the
pending ones in one write transaction and stamps the version last.
"""

from __future__ import annotations

import importlib.util
from importlib import resources

from ..errors import StoreVersionError


def load_migrations() -> list:
    """Every migration module shipped in ``persistent_prefix_cache.migrations``, by version."""
    found = []
    for entry in resources.files("persistent_prefix_cache.migrations").iterdir():
        name = entry.name
        if not (name[:4].isdigit() and name.endswith(".py")):
            continue
        spec = importlib.util.spec_from_file_location(f"_ppc_migration_{name[:-3]}", str(entry))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found.append(module)
    return sorted(found, key=lambda m: m.VERSION)


MIGRATIONS = load_migrations()
SCHEMA_VERSION = MIGRATIONS[-1].VERSION


def schema_error(store: str, version: int, *, shown: str | None = None) -> StoreVersionError:
    """The one error for a store of another schema than this library's: a newer one
    asks for an upgrade of the library, an older one for ``ppc migrate`` (which every
    ``ppc`` command but ``migrate`` itself leaves to the user: a migration rewrites the
    store's files, and no other process may use the store meanwhile).

    Args:
        store: The store directory.
        version: Its schema version (not `SCHEMA_VERSION`).
        shown: The store as the user wrote it, for the command to run (default: `store`).
    """
    if version > SCHEMA_VERSION:
        return StoreVersionError(f"store {store} has schema v{version}, newer than this version's v{SCHEMA_VERSION}")
    return StoreVersionError(
        f"store {store} has schema v{version}, older than this version's v{SCHEMA_VERSION}",
        hint=f"run `ppc migrate --store {shown or store}` while no other process uses the store; "
        "it was left untouched",
    )

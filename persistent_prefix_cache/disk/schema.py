"""The schema: the shipped migrations (found without LMDB), the version they reach, and
the one check of whether this process can use a store of a given version.

Each module in ``persistent_prefix_cache.migrations`` (the repository's ``migrations/``)
has ``VERSION``, ``DESCRIPTION`` and ``upgrade(env, txn, params)``; `Index` applies the
pending ones in one write transaction and stamps the version last.
"""

from __future__ import annotations

import importlib.util
from importlib import resources
from types import ModuleType

from ..errors import StoreVersionError


def load_migrations() -> list[ModuleType]:
    """Every migration module shipped in ``persistent_prefix_cache.migrations``, by version."""
    found = []
    for entry in resources.files("persistent_prefix_cache.migrations").iterdir():
        name = entry.name
        if not (name[:4].isdigit() and name.endswith(".py")):
            continue
        spec = importlib.util.spec_from_file_location(f"_ppc_migration_{name[:-3]}", str(entry))
        if spec is None or spec.loader is None:  # a .py file always has a spec and a loader
            raise ImportError(f"cannot load the migration {name}")
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
        hint=f"run `ppc migrate --store {shown or store}` while no other process uses the store; it was left untouched",
    )


def check_schema(store: str, version: int, *, migrate: bool = False, shown: str | None = None) -> bool:
    """Whether this process can use a store of schema `version`, asked by every opening
    of an index (the library's, the maintenance commands', each ``ppc`` command's walk
    of the index, ``ppc migrate``).

    Args:
        store: The store directory (for the error).
        version: The schema version stamped in its index.
        migrate: The caller may migrate an older store (a writable open, ``ppc
            migrate``); False: only this version is usable.
        shown: The store as the user wrote it, for the command to run (`schema_error`).

    Returns:
        True if migrations are pending (only with `migrate`), False if the store is at
        this version.

    Raises:
        StoreVersionError: A newer store (upgrade the library), or an older one the
            caller may not migrate (`schema_error`: run ``ppc migrate``).
    """
    if version == SCHEMA_VERSION:
        return False
    if version > SCHEMA_VERSION or not migrate:
        raise schema_error(store, version, shown=shown)
    return True

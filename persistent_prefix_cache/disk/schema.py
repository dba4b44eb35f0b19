"""The schema: the shipped migrations (found without LMDB) and the version they reach.

Each module in ``persistent_prefix_cache.migrations`` (the repository's ``migrations/``)
has ``VERSION``, ``DESCRIPTION`` and ``upgrade(env, txn, params)``; `Index` applies the
pending ones in one write transaction and stamps the version last.
"""

from __future__ import annotations

import importlib.util
from importlib import resources

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

"""The admin wing: a store looked after as a whole, without serving a model (``ppc check``,
``gc``, ``export``, ``import``, ``migrate``, ``push``, ``pull``, ``stats``, ``inspect``).

`StoreAdmin` is its entry point (a store opened for maintenance: summary, check, repair,
gc, export, import); `check_store` runs ``ppc check`` as a whole (the index probed in a
child process, rebuilt from the segments if damaged), `migrate_store` ``ppc migrate``;
`push_store` and `pull_model` move whole stores to and from the remote tier. It reaches
``disk/`` and ``tiers/`` through their public names and a store handle through its
public API only; nothing below it imports it (docs/architecture.md). The names here are
imported on first use, so that ``ppc stats`` does not import what checking a pack
against a model needs (mlx-lm).
"""

from importlib import import_module as _import_module

# public name -> module of this wing that defines it
_LAZY = {
    "StoreAdmin": ".store_admin",
    "migrate_store": ".migrate",
    "check_store": ".store_check",
    "describe_entries": ".store_audit",
    "describe_finding": ".store_audit",
    "permissions_finding": ".store_audit",
    "probe_index": ".index_probe",
    "PackReader": ".pack_members",
    "SECRET_ENV": ".pack_sign",
    "read_secret_file": ".pack_sign",
    "model_check": ".pack_check",
    "BULK_TIMEOUT": ".remote_sync",
    "reach": ".remote_sync",
    "push_store": ".remote_sync",
    "pull_model": ".remote_sync",
    "remote_key_spaces": ".remote_sync",
    "count_unauthenticated": ".remote_sync",
    "remote_summary": ".remote_sync",
}

__all__ = [
    "StoreAdmin",
    "migrate_store",
    "check_store",
    "describe_entries",
    "describe_finding",
    "permissions_finding",
    "probe_index",
    "PackReader",
    "SECRET_ENV",
    "read_secret_file",
    "model_check",
    "BULK_TIMEOUT",
    "reach",
    "push_store",
    "pull_model",
    "remote_key_spaces",
    "count_unauthenticated",
    "remote_summary",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(module, __name__), name)
    globals()[name] = value
    return value

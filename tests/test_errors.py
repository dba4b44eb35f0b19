"""The errors users meet: every one importable from the package's top level, and a
closed store's own (`StoreClosedError`) from every call that needs the store.

The walk imports every module of the package (the migrations and their frozen formats
included) and finds every exception class defined there: each of this package's typed
errors (`PrefixCacheError` and below) is exported, and every other class is an internal
signal, listed below with what turns it into something a user sees.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import pkgutil
import re
import shutil
import threading
import warnings

import pytest
from helpers import BLOCK, prefill, random_tokens

import persistent_prefix_cache as ppc
from persistent_prefix_cache import (
    BlockAwarePrefixCache,
    InvalidArgumentError,
    PagedCacheManager,
    PersistentLRUPromptCache,
    PersistentPrefixCache,
    PrefixCacheError,
    PrefixCacheManager,
    StoreClosedError,
    StoreCorruptError,
)

# Exception classes that never reach a caller of the API or of ppc as themselves.
INTERNAL = {
    "persistent_prefix_cache.disk.index_files._KeptChanging":
        "an LMDB file replaced at every link: `disk/index_files.py` raises StoreCorruptError naming ppc check --fix",
    "persistent_prefix_cache.disk.index_pages.DamagedPages":
        "the size guard's finding: `disk/index_files.py` raises StoreCorruptError naming ppc check --fix",
    "persistent_prefix_cache.files.NotRegularFileError":
        "an OSError (a link or a special file where a file or folder is opened): the store's opens "
        "turn it into StoreCorruptError naming ppc check --fix, the write path counts it (write_errors)",
    "persistent_prefix_cache.tiers.remote_wire.BadValue":
        "a remote value that fails its checks: a counted miss (remote_corrupt, remote_unauthenticated)",
    "persistent_prefix_cache.tiers.remote_replies.ProtocolError":
        "an OSError of our RESP reader: a failed round trip, counted (remote_errors), the server backed off",
    "persistent_prefix_cache.tiers.remote_replies.ReplyError":
        "returned, never raised: a server's error reply to one GET, counted",
    "persistent_prefix_cache.migrations.formats.block_files_v2.BlockDecodeError":
        "a damaged v1-v2 block file: `decode_block` raises ValueError, a migration drops the block, "
        "an import of an old pack raises InvalidArgumentError",
    "persistent_prefix_cache.cli.common.UserError": "ppc's one `error:` line and exit status 2",
    "persistent_prefix_cache.cli.progress.Terminated": "SIGTERM ending a ppc command as Ctrl-C does",
    "persistent_prefix_cache.cli.precompute._WriteFailed": "ppc precompute's own stop: an `error:` line",
    "persistent_prefix_cache.cli.serve._Captured": "ppc serve's capture of mlx_lm.server's exit",
    "persistent_prefix_cache.compat.tenants.Refused":
        "ppc serve --tenants: a request without a tenant, answered 401 by the server (never raised to a caller)",
}  # fmt: skip


def _modules() -> list[str]:
    names = [ppc.__name__]
    for package in (ppc, importlib.import_module("persistent_prefix_cache.migrations")):
        if package is not ppc:
            names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return [n for n in names if not n.endswith("__main__")]  # it runs ppc


def _exception_classes() -> dict[str, type]:
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                found[f"{name}.{cls.__qualname__}"] = cls
    return found


def test_every_error_a_user_can_meet_is_exported_from_the_top_level():
    found = _exception_classes()
    typed = {q: c for q, c in found.items() if issubclass(c, PrefixCacheError)}
    assert {"RemoteConfigError", "RemoteUnreachableError", "MissingDependencyError", "PromptCacheFileError",
            "StoreClosedError", "UnverifiedPackError"} <= {c.__name__ for c in typed.values()}  # fmt: skip
    for qualified, cls in typed.items():
        assert cls.__name__ in ppc.__all__ and getattr(ppc, cls.__name__) is cls, f"{qualified} is not exported"
        assert cls.__module__ == "persistent_prefix_cache.errors", f"{qualified}: errors.py is the typed errors' home"
        assert cls is PrefixCacheError or cls.hint, f"{qualified} has no hint of what to do"
    others = set(found) - set(typed)
    assert others == set(INTERNAL), (
        f"classify: {sorted(others - set(INTERNAL))}; gone: {sorted(set(INTERNAL) - others)}"
    )
    exported_errors = {
        n for n in ppc.__all__ if isinstance(getattr(ppc, n), type) and issubclass(getattr(ppc, n), BaseException)
    }
    assert exported_errors == {c.__name__ for c in typed.values()}  # nothing internal leaks into the API


def _raises(doc: str | None) -> list[str]:
    """The exception names of a Google-style docstring's ``Raises:`` section."""
    names, inside, indent = [], False, None
    for line in (doc or "").splitlines():
        text, depth = line.strip(), len(line) - len(line.lstrip())
        if text == "Raises:":
            inside, indent = True, None
        elif inside and text:
            if re.fullmatch(r"[A-Z]\w*:", text) or (indent is not None and depth < indent):
                inside = False  # the next section
            elif indent is None or depth == indent:
                indent = depth
                names += re.findall(r"\w+", text.split(":")[0])
    return names


def test_every_error_the_public_docstrings_name_is_exported():
    import builtins

    named = {}
    for name in ppc.__all__:
        obj = getattr(ppc, name)
        members = [(name, obj)]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            members += [(f"{name}.{m}", f) for m, f in inspect.getmembers(obj) if not m.startswith("_")]
        for where, member in members:
            member = member.fget if isinstance(member, property) else member
            for error in _raises(getattr(member, "__doc__", None)):
                named.setdefault(error, where)
    assert {"StoreClosedError", "RemoteConfigError", "MissingDependencyError", "StoreBusyError"} <= set(named)
    for error, where in named.items():
        assert error in ppc.__all__ or isinstance(getattr(builtins, error, None), type), f"{where} raises {error}"


# -- a closed store ---------------------------------------------------------------------


def test_a_closed_store_raises_its_own_error_from_every_call_that_needs_the_store(store_dir, model):
    tokens = random_tokens(2 * BLOCK + 3, seed=71, first=71)
    _, cache = prefill(model, tokens)
    store = PersistentPrefixCache(store_dir, model, block_size=BLOCK)
    opened = {
        n: getattr(store, n) for n in ("path", "readonly", "block_size", "fingerprint", "model_name", "namespace")
    }
    ours, costs = store.this_model(), store.costs
    store.close()
    calls = {
        "fetch": lambda: store.fetch(tokens),
        "last_fetch": lambda: store.last_fetch,
        "peek": lambda: store.peek(tokens),
        "make_cache": lambda: store.make_cache(),
        "store": lambda: store.store(tokens, cache),
        "flush": lambda: store.flush(),
        "stats": lambda: store.stats(),
        "stored_models": lambda: store.stored_models(),
        "forget_fingerprints": lambda: store.forget_fingerprints(),
        "sweep_orphans": lambda: store.sweep_orphans(grace=0),
        "limit_memory": lambda: store.limit_memory(1 << 20),
        "observe_prefill": lambda: store.observe_prefill(64, 0.01),
        "calibrate": lambda: store.calibrate(model),
        "resumable_step": lambda: store.resumable_step(),
        "hold_writer": lambda: store.hold_writer(threading.Event()),
        "remote_fill": lambda: store.remote_fill,  # the remote's part: a closed handle hands out nothing
        "ram_tier": lambda: store.ram_tier,  # nor its RAM tier (emptied at close)
        # The cost model, a public object of the handle, closes with it.
        "costs.observe_prefill": lambda: store.costs.observe_prefill(64, 0.01),
        "costs.calibrate": lambda: store.costs.calibrate(model),
        "costs.resumable_step": lambda: store.costs.resumable_step(),
    }
    # What the handle was opened with still answers, as a closed file's name and mode do.
    answers = {**opened, "closed": True, "this_model": ours, "close": None, "costs": costs}
    surface = {n for n in dir(store) if not n.startswith("_")}
    assert {n for n in calls if "." not in n} | set(answers) == surface, "classify every public name of the handle"
    for name, call in calls.items():
        with pytest.raises(StoreClosedError) as err:
            call()
        assert str(err.value) == (
            f"store {store.path} is closed (open the store again (PersistentPrefixCache(path, model)); "
            "a closed handle serves nothing)"
        ), name
        # Callers that caught the error a closed store raised before still catch it.
        assert isinstance(err.value, InvalidArgumentError) and isinstance(err.value, ValueError), name
    with pytest.raises(StoreClosedError):
        with store:
            pass
    for name, value in answers.items():
        got = getattr(store, name)
        assert (got() if callable(got) else got) == value, name
    with PersistentPrefixCache(store_dir, model) as again:  # the store() above wrote nothing
        assert again.stats()["blocks"] == 0 and again.peek(tokens) == 0


def test_compat_objects_over_a_closed_store_serve_from_memory_and_say_so(store_dir, model, caplog):
    """A store is an optimisation behind the compat layers: one closed under them is a
    warning naming it (and the remedy), never a failed request, whatever call meets it
    first (a write after a read also teaches the store's cost model: that call too)."""
    tokens = random_tokens(2 * BLOCK + 3, seed=72, first=72)
    _, cache = prefill(model, tokens)
    store = PersistentPrefixCache(store_dir, model, block_size=BLOCK)
    manager = PrefixCacheManager(model, store=store)
    blocks = BlockAwarePrefixCache(model, PagedCacheManager(block_size=BLOCK, max_blocks=16), store=store)
    lru = PersistentLRUPromptCache(store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert manager.fetch_cache(tokens)[0] is None and blocks.fetch_cache("r", tokens)[0] is None  # misses
        assert lru.fetch_nearest_cache("m", tokens)[0] is None
        assert not caught
        store.close()
        for compat in (manager, blocks):
            del caught[:]
            if compat is manager:
                compat.store_cache(tokens, cache)
                hit, rest = compat.fetch_cache(tokens + [5])
            else:
                compat.store_cache("r", tokens, cache)
                hit, rest = compat.fetch_cache("s", tokens + [5])
            assert hit is not None and list(rest) == [5]  # served from memory
            said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            assert len(said) == 1 and f"store {store.path} is closed" in said[0], said
            assert "open the store again" in said[0]
            compat.close()
    with caplog.at_level(logging.WARNING, logger="persistent_prefix_cache"):
        lru.insert_cache("m", tokens, cache)
        hit, rest = lru.fetch_nearest_cache("m", tokens + [5])
        lru.flush()
        assert lru.persistent_stats()["stores"] == [] and lru.nbytes > 0
        lru.close()
    assert hit is not None and rest == [5]
    said = [r.getMessage() for r in caplog.records if "is closed" in r.getMessage()]
    assert said == [f"persistent prompt cache: the store {store.path} is closed; caches stay in memory only"]


# -- a link where the index folder goes ----------------------------------------------------


@pytest.mark.parametrize("readonly", [False, True])
def test_a_linked_index_folder_is_refused_naming_the_repair(store_dir, tmp_path, model, readonly):
    """A link in place of ``index/`` is refused like one in place of ``segments/`` or
    ``tmp/`` (a `StoreCorruptError` naming ``ppc check --fix``), not an OSError of the
    file layer the package does not export; nothing is written where it points."""
    PersistentPrefixCache(store_dir, model, block_size=BLOCK).close()
    elsewhere = tmp_path / "elsewhere"
    shutil.move(store_dir / "index", elsewhere)
    os.symlink(elsewhere, store_dir / "index")
    before = sorted(os.listdir(elsewhere))
    with pytest.raises(StoreCorruptError) as err:
        PersistentPrefixCache(store_dir, model, readonly=readonly)
    assert str(err.value).startswith(f"store {store_dir}: index is a symbolic link or a file, not a folder")
    assert f"ppc check --fix --store {store_dir}" in str(err.value)
    assert sorted(os.listdir(elsewhere)) == before

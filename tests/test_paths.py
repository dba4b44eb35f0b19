"""``~`` and ``$VARS`` in every path the library and ``ppc`` take (`paths.expand_path`).

HOME points at a temporary folder and the tests run from another one, so a path that
was not expanded shows up as a literal ``~`` (or ``$NAME``) folder in the working
directory, and one that was shows up under HOME.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import BLOCK, random_tokens

from persistent_prefix_cache import (
    BlockAwarePrefixCache,
    InvalidArgumentError,
    PagedCacheManager,
    PersistentPrefixCache,
    PrefixCacheManager,
)
from persistent_prefix_cache.cli import main as ppc_main
from persistent_prefix_cache.compat.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.disk.store_dir import check_location
from persistent_prefix_cache.paths import expand_path
from persistent_prefix_cache.prefill import prefill


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME and $KVROOT set to temporary folders; the cwd is a third, empty one."""
    home, work, root = tmp_path / "home", tmp_path / "work", tmp_path / "root"
    for d in (home, work, root):
        d.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KVROOT", str(root))
    monkeypatch.delenv("PPC_STORE", raising=False)
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    monkeypatch.chdir(work)
    return {"home": home, "work": work, "root": root}


def _is_store(path) -> bool:
    return os.path.isdir(os.path.join(path, "index"))


def _nothing_literal(home) -> None:
    assert os.listdir(home["work"]) == [], "a literal ~ or $ folder was created in the cwd"


def test_expand_path_rules(home):
    assert expand_path("~/a") == os.path.join(str(home["home"]), "a")
    assert expand_path("$KVROOT/a") == os.path.join(str(home["root"]), "a")
    assert expand_path("${KVROOT}/b") == os.path.join(str(home["root"]), "b")
    assert expand_path("rel/dir") == "rel/dir"  # relative paths stay relative
    assert expand_path("cost$") == "cost$"  # a bare $ is no variable
    with pytest.raises(InvalidArgumentError, match=r"\$NOT_SET_ANYWHERE"):
        expand_path("$NOT_SET_ANYWHERE/kv")
    with pytest.raises(InvalidArgumentError, match="empty"):
        expand_path("")
    with pytest.raises(InvalidArgumentError, match="str or os.PathLike"):
        expand_path(3)


def test_store_and_model_path(home, model, tiny_model_dir):
    os.symlink(tiny_model_dir, home["home"] / "model")
    with PersistentPrefixCache("~/kv", model, block_size=BLOCK, model_path="~/model") as store:
        assert store.path == str(home["home"] / "kv")
        prefill(model, random_tokens(40, seed=1), store)
    with PersistentPrefixCache("$KVROOT/kv", model, block_size=BLOCK) as store:
        assert store.path == str(home["root"] / "kv")
    assert _is_store(home["home"] / "kv") and _is_store(home["root"] / "kv")
    with pytest.raises(InvalidArgumentError, match="NOT_SET_ANYWHERE"):
        PersistentPrefixCache("$NOT_SET_ANYWHERE/kv", model)
    _nothing_literal(home)


def test_a_bare_relative_store_name(home, model):
    """`--store kv` / `PersistentPrefixCache("kv")`: a new store in the working directory (its parent is "")."""
    with PersistentPrefixCache("kv", model, block_size=BLOCK) as store:
        prefill(model, random_tokens(40, seed=1), store)
    assert _is_store(home["work"] / "kv")
    # ppc checks the place before it loads the model: that check once took "" for the parent folder.
    assert check_location("kv2", what="--store") is False  # a store may be created there


def test_compat_layers_take_expanded_paths(home, model):
    tokens = random_tokens(40, seed=2)
    from helpers import prefill as plain_prefill

    _, cache = plain_prefill(model, tokens)
    with PrefixCacheManager(model, store="~/pcm") as pcm:
        pcm.store_cache(tokens, cache)
        assert pcm.store.path == str(home["home"] / "pcm")
    with BlockAwarePrefixCache(model, PagedCacheManager(block_size=BLOCK, max_blocks=16), store="~/bapc") as bapc:
        bapc.store_cache("r", tokens, cache)
        assert bapc.store.path == str(home["home"] / "bapc")
    # PersistentLRUPromptCache takes a store (or a function giving one), not a path.
    with PersistentPrefixCache("~/lru", model) as store:
        lru = PersistentLRUPromptCache(store)
        lru.insert_cache("m", tokens, cache)
        lru.flush()
        assert store.stats()["blocks"] > 0
    for name in ("pcm", "bapc", "lru"):
        assert _is_store(home["home"] / name), name
    _nothing_literal(home)


def test_maintenance_paths(home, model):
    with PersistentPrefixCache("~/kv", model, block_size=BLOCK) as store:
        prefill(model, random_tokens(40, seed=3), store)
    with StoreAdmin("~/kv", readonly=True) as admin:
        assert admin.path == str(home["home"] / "kv")
        admin.export_pack("~/pack.tar", secret=b"s")
    assert (home["home"] / "pack.tar").is_file()
    with StoreAdmin("$KVROOT/copy", create=True, block_size=BLOCK) as admin:
        assert admin.import_pack("~/pack.tar", secret=b"s")["added"] > 0
    _nothing_literal(home)


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "--store=~/kv"],
        ["stats", "--store", "$KVROOT/../home/kv"],
        ["inspect", "--store=~/kv"],
        ["check", "--store=~/kv"],
        ["gc", "--store=~/kv", "--max-bytes", "1G"],
        ["migrate", "--store=~/kv"],
        ["export", "--store=~/kv", "~/out.tar"],
    ],
)
def test_cli_store_flags(home, model, argv, capsys):
    with PersistentPrefixCache(home["home"] / "kv", model, block_size=BLOCK) as store:
        prefill(model, random_tokens(40, seed=4), store)
    assert ppc_main(argv) == 0, capsys.readouterr().err
    if argv[0] == "export":
        assert (home["home"] / "out.tar").is_file()
        assert ppc_main(["import", "--store=$KVROOT/imported", "~/out.tar", "--trust"]) == 0
        assert _is_store(home["root"] / "imported")
    _nothing_literal(home)


def test_cli_store_from_environment(home, model, monkeypatch, capsys):
    with PersistentPrefixCache(home["home"] / "kv", model, block_size=BLOCK) as store:
        prefill(model, random_tokens(40, seed=5), store)
    monkeypatch.setenv("PPC_STORE", "~/kv")  # as a config file or a quoted export sets it
    assert ppc_main(["stats", "--json"]) == 0
    assert '"blocks"' in capsys.readouterr().out
    _nothing_literal(home)


def test_cli_unset_variable_is_a_clear_error(home, capsys):
    with pytest.raises(SystemExit) as exit_:
        ppc_main(["stats", "--store", "$NOT_SET_ANYWHERE/kv"])
    assert exit_.value.code == 2
    assert "NOT_SET_ANYWHERE" in capsys.readouterr().err
    _nothing_literal(home)


@pytest.mark.slow
def test_precompute_and_generate_with_tilde_paths(home, tiny_model_dir):
    """The whole CLI path in real processes: model, inputs and store all under ``~``."""
    os.symlink(tiny_model_dir, home["home"] / "model")
    (home["home"] / "prompt.txt").write_text("The closer the shelf, the smaller it is. " * 6)
    env = {**os.environ, "HOME": str(home["home"]), "HF_HUB_OFFLINE": "1"}
    env.pop("PPC_STORE", None)

    def ppc(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "persistent_prefix_cache", *args],
            capture_output=True, text=True, cwd=home["work"], env=env, timeout=300,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        return proc

    ppc("precompute", "--model=~/model", "--store=~/kv", "--block-size", "16", "~/prompt.txt",
        "--ignore-chat-template", "--no-progress")  # fmt: skip
    assert _is_store(home["home"] / "kv")
    ppc("generate", "--model", "~/model", "--store=~/kv", "--prompt", "hello", "-m", "2", "--quiet")
    _nothing_literal(home)

"""Fixtures: a tiny random-weight llama written as a real model folder, and store paths.

The model is deliberately tiny (hidden 64, 2 layers, vocab 512) because MLX's CPU matmul
is slow here. It has 2 query heads and 1 KV head, so head_dim is 32: the smallest
width mlx's quantizer accepts (group size 32), which the kv_bits tests need.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

# Every option that decides the model's shapes; the "other model" differs only by seed.
TINY_MODEL = dict(TEST_MODEL)


def pytest_configure(config):
    """Ctrl-C reaches the processes the tests start as it reaches a user's: a suite run
    as a background job of a non-interactive shell starts with SIGINT ignored, and every
    child would inherit that (tests/test_precompute_stops.py's SIGINT then did nothing)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A model folder `mlx_lm.load` opens (weights, config, tokenizer), seed 0."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0, **TINY_MODEL)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """Same shapes and config as `tiny_model_dir`, different random weights."""
    return write_tiny_model(tmp_path_factory.mktemp("other_model"), seed=1, **TINY_MODEL)


@pytest.fixture(scope="session")
def model(tiny_model_dir):
    """The tiny model, loaded once: tests only run forward passes, never change it."""
    return load_tiny_model(tiny_model_dir)


@pytest.fixture(scope="session")
def other_model(other_model_dir):
    """The same-shaped model with different weights (think: a fine-tune)."""
    return load_tiny_model(other_model_dir)


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory):
    """The server tests' model folder (tests/test_serve.py, tests/test_serve_memory.py):
    a tiny llama (weights, tokenizer, chat template), seed 0, of its own for the servers."""
    return write_tiny_model(tmp_path_factory.mktemp("serve_model"), seed=0, **TINY_MODEL)


@pytest.fixture(scope="session")
def serve_model(serve_model_dir):
    """The model of `serve_model_dir`, loaded once."""
    return load_tiny_model(serve_model_dir)


@pytest.fixture(scope="session", autouse=True)
def machine_costs_folder(tmp_path_factory):
    """The per-user record of the prefills this machine measured (`machine_costs`) in a
    folder of the session's, never the user's ``~/.cache``: for this process and the
    ones the tests start (``XDG_CACHE_HOME``). Shared by the whole session, as a user's
    is by every store: a test that counts calibrations points it elsewhere."""
    base = tmp_path_factory.mktemp("xdg_cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(base)
    yield base / "persistent-prefix-cache"
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def no_quiet_merges(monkeypatch):
    """A writer's tidy of a burst runs at close only, not after a quiet spell: a test's
    segment layout never depends on how fast the machine ran it (tests/test_prefill.py
    sets the spell itself where it tests it)."""
    from persistent_prefix_cache.core import merging

    monkeypatch.setattr(merging, "QUIET_SECONDS", 0.0)


@pytest.fixture(autouse=True)
def kernels_compiled():
    """This process has run a forward (a process's first teaches the cost model nothing:
    it compiles the kernels), so what a test's forwards teach never depends on which test
    ran first (tests/test_costs.py tests the first one itself)."""
    from persistent_prefix_cache.core.costs import first_forward_here

    first_forward_here()


@pytest.fixture
def separate_segments(monkeypatch):
    """Keep every store()'s segment apart (no merge of a chain's small segments): for
    tests that damage or inspect one block's own segment file."""
    from persistent_prefix_cache.disk import compaction

    monkeypatch.setattr(compaction, "MERGE_RATIO", 0.0)
    monkeypatch.setattr(compaction, "TIDY_RATIO", 0.0)


@pytest.fixture
def store_dir(tmp_path):
    """A fresh, not yet existing store directory."""
    return tmp_path / "store"


@pytest.fixture
def legacy(tmp_path):
    """Stores written by this project before schema v3 (see data/make_legacy_stores.py),
    extracted afresh: a dict with ``model`` (loaded), ``model_dir``, ``v1``, ``v2``
    (store paths), ``prompts`` and ``block_size``."""
    import json
    import tarfile
    from pathlib import Path

    from persistent_prefix_cache.layers.mlx_lm_versions import layout_variant

    if layout_variant():  # the tests below read what these stores hold back
        pytest.skip("the stores in tests/data were written under mlx-lm 0.32; this line keys its stores apart")
    with tarfile.open(Path(__file__).parent / "data" / "legacy_stores.tar.gz") as tar:
        tar.extractall(tmp_path / "legacy", filter="data")
    root = tmp_path / "legacy"
    spec = json.loads((root / "prompts.json").read_text())
    return {
        "model": load_tiny_model(root / "model"),
        "model_dir": root / "model",
        "v1": root / "v1",
        "v2": root / "v2",
        "prompts": spec["prompts"],
        "block_size": spec["block_size"],
    }


@pytest.fixture
def legacy_v3(tmp_path, legacy):
    """A schema v3 store (segment format v3) and a ``ppc-export/2`` pack of it, written
    by the v3 code (see data/make_v3_stores.py) with the model of `legacy`: a dict
    with ``model``, ``model_dir``, ``v3`` (store path), ``pack``, ``prompts`` and
    ``block_size``."""
    import json
    import tarfile
    from pathlib import Path

    root = tmp_path / "legacy_v3"
    with tarfile.open(Path(__file__).parent / "data" / "v3_stores.tar.gz") as tar:
        tar.extractall(root, filter="data")
    spec = json.loads((root / "v3_prompts.json").read_text())
    return {
        "model": legacy["model"],
        "model_dir": legacy["model_dir"],
        "v3": root / "v3",
        "pack": root / "v3.ppcpack",
        "prompts": spec["prompts"],
        "block_size": spec["block_size"],
    }


@pytest.fixture
def legacy_v4(tmp_path, legacy):
    """A schema v4 store (segment format v4, checksums over bytes alone) and a
    ``ppc-export/3`` pack of it, written by the v4 code (see data/make_v4_stores.py) with
    the model of `legacy`: a dict with ``model``, ``model_dir``, ``v4`` (store path),
    ``pack``, ``prompts`` and ``block_size``."""
    import json
    import tarfile
    from pathlib import Path

    root = tmp_path / "legacy_v4"
    with tarfile.open(Path(__file__).parent / "data" / "v4_stores.tar.gz") as tar:
        tar.extractall(root, filter="data")
    spec = json.loads((root / "v4_prompts.json").read_text())
    return {
        "model": legacy["model"],
        "model_dir": legacy["model_dir"],
        "v4": root / "v4",
        "pack": root / "v4.ppcpack",
        "prompts": spec["prompts"],
        "block_size": spec["block_size"],
    }


@pytest.fixture(scope="session", params=["redis", "valkey"])
def redis_engine(request):
    """Each server engine the remote tests run against ("redis", "valkey"): skipped
    with how to install it when missing (failed under the test hook require=<engine>)."""
    from redis_servers import require_engine

    require_engine(request.param)
    return request.param


@pytest.fixture
def redis_server(tmp_path, redis_engine):
    """A fresh server of the engine on a free 127.0.0.1 port, no persistence; stopped after."""
    from redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis", engine=redis_engine).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory, redis_engine):
    """Three cluster-enabled nodes of the engine joined by ``<engine>-cli --cluster create``."""
    from redis_servers import RedisCluster

    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"), engine=redis_engine)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs mounted at tmp_path/fs (skipped where mounting is not allowed): a
    disk that fills (a test may remount it larger)."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {proc.stderr}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], timeout=30)

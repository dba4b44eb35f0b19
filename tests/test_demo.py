"""``ppc demo --workdir DIR`` never deletes or reuses what it did not create (issue 31, item 1).

Every command runs as a real ``ppc`` subprocess; the stores are real, filled with the
real model code.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from helpers import BLOCK, random_tokens

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.prefill import prefill
from persistent_prefix_cache.cli.demo import MARKER
from persistent_prefix_cache.tiny_model import load_tiny_model


def ppc(*args, expect: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def snapshot(top) -> dict:
    """Every entry under `top`: its kind, mode and bytes (a link: its target)."""
    out = {}
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if os.path.islink(path):
                what = os.readlink(path)
            elif os.path.isdir(path):
                what = "dir"
            else:
                with open(path, "rb") as f:
                    what = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, top)] = (st.st_mode, what)
    return out


@pytest.fixture
def ten_blocks(tmp_path, model, tiny_model_dir):
    """A work folder whose ``store/`` is a real store of 10 blocks the demo did not make."""
    work = tmp_path / "work"
    with PersistentPrefixCache(work / "store", model, block_size=BLOCK, model_path=tiny_model_dir) as store:
        prefill(model, random_tokens(10 * BLOCK, seed=31, first=3), store)
        store.flush()
        assert store.stats()["blocks"] == 10
    return work


@pytest.mark.slow
def test_a_store_the_demo_did_not_make_survives_byte_for_byte(ten_blocks, tmp_path):
    before = snapshot(ten_blocks)
    err = ppc("demo", "--workdir", ten_blocks, expect=2).stderr
    assert err == (
        f"error: {ten_blocks / 'store'} exists and is not marked as the demo's (no {MARKER} in it): ppc demo "
        "deletes and reuses only what it made; move it away (or remove an older demo's), or pass another --workdir\n"
    )
    assert snapshot(ten_blocks) == before  # nothing removed, nothing added (no tiny-model/ either)

    # A link named store (to the same store elsewhere) is not the demo's either.
    elsewhere = tmp_path / "elsewhere"
    os.rename(ten_blocks / "store", elsewhere)
    os.symlink(elsewhere, ten_blocks / "store")
    kept = snapshot(elsewhere)
    assert "is not marked as the demo's" in ppc("demo", "--workdir", ten_blocks, expect=2).stderr
    assert snapshot(elsewhere) == kept and os.path.islink(ten_blocks / "store")


@pytest.mark.slow
def test_a_tiny_model_folder_the_demo_did_not_make_is_refused(tmp_path):
    work = tmp_path / "work"
    (work / "tiny-model").mkdir(parents=True)
    (work / "tiny-model" / "config.json").write_text('{"mine": true}')
    before = snapshot(work)
    err = ppc("demo", "--workdir", work, expect=2).stderr
    assert (
        err.startswith(f"error: {work / 'tiny-model'} exists and is not marked as the demo's") and err.count("\n") == 1
    )
    assert snapshot(work) == before  # no store/ made either: every name is checked first
    # A marker file that is not the demo's text does not make it the demo's.
    (work / "tiny-model" / MARKER).write_text("something else\n")
    assert "is not marked as the demo's" in ppc("demo", "--workdir", work, expect=2).stderr
    assert (work / "tiny-model" / "config.json").read_text() == '{"mine": true}'


@pytest.mark.slow
def test_the_demo_replaces_its_own_store_at_the_next_run(tmp_path):
    work = tmp_path / "work"
    small = ("--prompt-tokens", "80", "--max-tokens", "2")
    first = ppc("demo", "--workdir", work, *small, "--json", expect=0)
    assert (work / "store" / MARKER).is_file() and (work / "tiny-model" / MARKER).is_file()
    model_files = snapshot(work / "tiny-model")
    blocks = json.loads(first.stdout)["warm"]["blocks"]
    # Work of the user's in the demo's own store: the demo's to replace all the same.
    demo_model = load_tiny_model(work / "tiny-model")
    with PersistentPrefixCache(work / "store", demo_model) as store:
        prefill(demo_model, random_tokens(200, seed=32, first=7), store)
        store.flush()
        assert store.stats()["blocks"] > blocks
    second = ppc("demo", "--workdir", work, *small, "--json", expect=0)
    assert json.loads(second.stdout)["cold"]["blocks"] == blocks  # the cold run started from nothing
    assert snapshot(work / "tiny-model") == model_files  # its own model reused as it was
    assert "writing a tiny random-weight model" not in second.stderr
    ppc("check", "--store", work / "store", expect=0)

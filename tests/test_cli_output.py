"""What ``ppc`` prints must say what happened: counts that match the files, names that
tell query hits from block hits, no error when the reader of stdout leaves, misses
that show, an ETA on the progress line.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import BLOCK, prefill, random_tokens, segment_files

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.cli import main as ppc_main
from persistent_prefix_cache.compat.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.prefill import prefill as store_prefill
from persistent_prefix_cache.tiny_model import DEMO_TEXT


def _ppc(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    return subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)],
        stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.fixture
def filled(store_dir, model):
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for seed in (1, 2):
            store_prefill(model, random_tokens(40, seed=seed, first=seed), store)
    return store_dir


def test_check_fix_counts_the_files_it_removed(filled):
    segments = segment_files(filled)
    some = os.path.join(filled, "segments", next(iter(segments)))
    strays = []
    for i in range(5):  # copies of a segment under ids nothing references
        name = f"{i:02x}" + "ab" * 15
        os.makedirs(os.path.join(filled, "segments", name[:2]), exist_ok=True)
        strays.append(os.path.join(filled, "segments", name[:2], f"{name}.seg"))
        shutil.copy(some, strays[-1])
    for i in range(4):  # temporary files of writers long gone
        strays.append(os.path.join(filled, "tmp", f"leftover-{i}"))
        with open(strays[-1], "wb") as f:
            f.write(b"x" * 100)
    proc = _ppc("check", "--store", filled, "--fix", "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert "removed 0 block(s) from the index and 9 file(s)" in proc.stdout
    assert not any(os.path.exists(p) for p in strays)
    assert segment_files(filled) == segments  # nothing else went
    report = json.loads(_ppc("check", "--store", filled, "--json").stdout)
    assert report["clean"] and report["removed_files"] == 0


@pytest.mark.slow
def test_stats_says_query_hits_and_inspect_says_block_hits(filled, model):
    with PersistentPrefixCache(filled, model) as store:
        store.fetch(random_tokens(40, seed=1, first=1) + [3])  # 3 blocks restored: one query
    stats = _ppc("stats", "--store", filled).stdout
    assert "query hits" in stats and "query misses" in stats
    inspect = _ppc("inspect", "--store", filled).stdout
    headers = [line.split("  ") for line in inspect.splitlines() if line.startswith("model ")]
    assert len(headers) == 2 and all("block hits" in [c.strip() for c in h if c] for h in headers)
    assert " hits " not in inspect.replace("block hits", "")
    info = json.loads(_ppc("inspect", "--store", filled, "--json").stdout)
    assert info["hits"] == 1 and info["models"][0]["block_hits"] == 3


@pytest.mark.parametrize("argv", [["stats", "--json"], ["inspect"], ["--help"]])
def test_a_closed_stdout_ends_quietly(filled, argv):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: EPIPE, every time
    try:
        proc = _ppc(*argv, *(["--store", filled] if argv[-1] != "--help" else []), stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


def test_a_request_that_found_nothing_is_a_miss(store_dir, model):
    PersistentPrefixCache(store_dir, model, block_size=BLOCK).close()
    with PersistentPrefixCache(store_dir, model) as store:
        lru = PersistentLRUPromptCache(store)
        cache, rest = lru.fetch_nearest_cache("m", random_tokens(30, seed=5))
        assert cache is None and len(rest) == 30
        assert (store.stats()["queries"], store.stats()["misses"]) == (1, 1)
        # A request served in memory (by the store's RAM tier: the LRU does not keep what
        # the store took, docs/serve.md): a hit, not a store miss.
        tokens = random_tokens(40, seed=6)
        lru.insert_cache("m", tokens, prefill(model, tokens)[1])
        lru.fetch_nearest_cache("m", tokens + [1])
        assert store.stats()["misses"] == 1 and store.stats()["hits"] == 1
        # One the LRU answered (it keeps a cache the store cannot serve from RAM: the tier
        # is off here), and the store holds no more of: not a store miss either.
        store.limit_memory(0)
        lru = PersistentLRUPromptCache(store)  # takes the tier's budget (0) as its cap
        lru.insert_cache("m", tokens[:20], prefill(model, tokens[:20])[1])
        lru.fetch_nearest_cache("m", tokens[:20] + [1])
        assert store.stats()["misses"] == 1 and store.stats()["not_longer"] == 1
    with StoreAdmin(store_dir, readonly=True) as admin:
        assert admin.summary()["misses"] == 1  # what `ppc stats` prints
    assert re.search(r"^query misses +1$", _ppc("stats", "--store", store_dir).stdout, re.M)


def test_precompute_explains_blocks_written_and_in_store(tmp_path, tiny_model_dir, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(DEMO_TEXT.split()[:40]))
    store = tmp_path / "store"
    argv = ["precompute", "--model", str(tiny_model_dir), "--store", str(store)]
    argv += ["--block-size", str(BLOCK), "--ignore-chat-template", "--no-progress", str(prompt)]
    assert ppc_main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    n = summary["tokens"]
    # The whole prompt stored once: every block written once (the last one was written
    # twice when prefill stored all but the last token first).
    assert summary["blocks_in_store_before"] == 0
    assert summary["blocks_written"] == summary["blocks_in_store"] == math.ceil(n / BLOCK)
    assert ppc_main(argv) == 0
    text = capsys.readouterr().out
    now = summary["blocks_in_store"]
    assert "blocks written (this run)" in text and f"blocks in store (all writers)  {now} -> {now}" in text


@pytest.mark.slow
def test_two_precompute_runs_at_once_count_only_their_own_writes(tmp_path, tiny_model_dir):
    """Two runs on one store at the same time (disjoint prompts): each reports what it
    wrote itself, the same as it writes alone into an empty store."""
    words = DEMO_TEXT.split()
    prompts = []
    for i, chunk in enumerate((words[:60], words[60:130])):
        path = tmp_path / f"p{i}.txt"
        path.write_text(("alpha " if i == 0 else "omega ") + " ".join(chunk))
        prompts.append(path)

    def start(store, prompt):
        return subprocess.Popen(
            [sys.executable, "-m", "persistent_prefix_cache", "precompute", "--model", str(tiny_model_dir),
             "--store", str(store), "--block-size", str(BLOCK), "--ignore-chat-template", "--no-progress",
             "--json", str(prompt)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def finish(proc) -> dict:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        return json.loads(out)

    alone = [finish(start(tmp_path / f"alone{i}", p)) for i, p in enumerate(prompts)]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    runs = [start(shared, p) for p in prompts]
    together = [finish(proc) for proc in runs]
    for solo, run in zip(alone, together):
        assert run["blocks_written"] == solo["blocks_written"] > 0
        assert run["bytes_written"] == solo["bytes_written"] > 0
    final = StoreAdmin(str(shared), readonly=True)
    try:
        assert final.summary()["blocks"] == sum(r["blocks_in_store"] for r in alone)
    finally:
        final.close()


def test_progress_line_has_an_eta(monkeypatch, capsys):
    from persistent_prefix_cache.cli import progress as progress_line

    clock = iter([100.0, 105.0, 110.0, 130.0])  # start, then three redraws
    monkeypatch.setattr(progress_line.time, "perf_counter", lambda: next(clock))
    progress = progress_line.Progress(2, 1000, enabled=True)
    progress.enabled = True  # stderr is not a terminal under pytest
    progress.update(100, 100, force=True)  # too few computed tokens to tell a rate by
    assert capsys.readouterr().err.rstrip().endswith("ETA -")
    progress.update(300, 300, force=True)  # 300 tokens computed in 10 s: 700 left at 30/s
    assert capsys.readouterr().err.rstrip().endswith("30 tok/s  ETA 0:23")
    # 600 more restored in 10 s, 100 more computed in 10 s: the rate is computing's.
    progress.update(900, 400, restoring=10.0, force=True)
    assert capsys.readouterr().err.rstrip().endswith("20 tok/s  ETA 0:05")
    assert progress_line.eta(10, 0.0) == "-"
    assert progress_line.eta(9_999, 1.0) == "2:46:39"


# -- ppc as mlx-lm users expect it --------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_printed(flag):
    from persistent_prefix_cache import __version__

    done = _ppc(flag)
    assert done.returncode == 0 and done.stdout.strip().endswith(__version__), done


def test_an_unknown_command_suggests_the_nearest():
    done = _ppc("generat")
    assert done.returncode == 2
    assert "did you mean generate?" in done.stderr.splitlines()[0]


@pytest.mark.slow
def test_serve_names_a_misspelt_option_before_anything_else(tmp_path):
    done = _ppc("serve", "--stor", tmp_path / "s")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: unknown option --stor (did you mean --store?)", done.stderr
    assert not (tmp_path / "s").exists()
    # mlx_lm.server's own options (and their unambiguous prefixes) still pass through.
    theirs = _ppc("serve", "--prompt-cache-siz", "3")
    assert "unknown option" not in theirs.stderr and "no store given" in theirs.stderr


def test_check_counts_blocks_and_segment_files_and_names_the_damaged_file(filled):
    clean = _ppc("check", "--store", filled)
    n_segments = len(segment_files(filled))
    report = json.loads(_ppc("check", "--store", filled, "--json").stdout)
    assert report["segments_verified"] == n_segments and report["blocks_verified"] == report["nodes"]
    assert (
        clean.stdout.splitlines()[0]
        == f"{report['nodes']} of {report['nodes']} blocks verified in {n_segments} segment files"
    )
    name = sorted(segment_files(filled))[0]
    path = os.path.join(filled, "segments", name)
    with open(path, "r+b") as f:  # a flipped byte near the end: one block's checksum fails
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged = _ppc("check", "--store", filled)
    assert damaged.returncode == 1
    assert os.path.join("segments", name) in damaged.stdout, damaged.stdout

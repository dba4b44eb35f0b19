"""``ppc stats / inspect / check / gc / migrate / export / import``, run as a user would.

Stores are filled in-process with the real model code; every command runs as a real
``python -m persistent_prefix_cache`` subprocess on the real files.
"""

from __future__ import annotations

import argparse

import json
import re
import os
import subprocess
import sys
import time

import pytest
from helpers import BLOCK, assert_same_logits, cold_logits, random_tokens, read_index, segment_files, warm_logits

from persistent_prefix_cache import PersistentPrefixCache, StoreVersionError
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.admin import StoreAdmin
from persistent_prefix_cache.prefill import prefill


def ppc(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    """Run ``ppc`` in a subprocess; check its exit code and that it never tracebacks."""
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def ppc_json(*args: str, expect: int = 0) -> dict:
    return json.loads(ppc(*args, "--json", expect=expect).stdout)


@pytest.fixture
def filled(store_dir, model):
    """A store holding two prompts that share 32 tokens, plus one fetch (a hit)."""
    base = random_tokens(32, seed=1, first=5)
    prompts = [base + random_tokens(40, seed=2), base + random_tokens(20, seed=3)]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for p in prompts:
            prefill(model, p, store)
        store.fetch(prompts[0] + [1, 2])
    return store_dir, prompts


def test_stats_and_inspect(filled):
    store_dir, prompts = filled
    stats = ppc_json("stats", "--store", store_dir)
    files = segment_files(store_dir)
    assert stats["blocks"] == len(read_index(store_dir)["nodes"])
    assert stats["bytes_on_disk"] == sum(files.values())
    assert stats["block_bytes"] == sum(n.size for n in read_index(store_dir)["nodes"].values())
    # Two hits: the second prefill restored the shared 32 tokens, then the fetch (of a
    # prompt that extends the first: all its tokens, stored whole by prefill).
    assert stats["hits"] == 2 and stats["tokens_saved"] == 32 + len(prompts[0])
    text = ppc("stats", "--store", store_dir).stdout
    assert "bytes on disk" in text and f"{stats['blocks']:,}" in text
    # The hit rate of the queries that asked; each model with its bytes and last use.
    asked = stats["hits"] + stats["misses"]
    assert stats["hit_rate"] == round(stats["hits"] / asked, 4) and asked >= 2
    assert re.search(rf"^hit rate +{100 * stats['hit_rate']:.1f} %$", text, re.M), text
    (m,) = stats["models"]
    assert m["bytes"] == stats["block_bytes"] and m["last_used"] > 0
    when = time.strftime("%Y-%m-%d", time.gmtime(m["last_used"] / 1e9))
    assert re.search(rf"^{m['root'][:12]} .* {m['blocks']} +{m['bytes']:,} +{when} \d\d:\d\d$", text, re.M), text

    info = ppc_json("inspect", "--store", store_dir, "--top", "5")
    (model,) = info["models"]
    assert model["blocks"] == stats["blocks"] and model["namespace"] == ""
    ends = [p["tokens"] for p in info["longest_prefixes"]]
    # prefill stores each prompt whole (this model's layers are all sliced).
    assert ends == sorted([len(p) for p in prompts], reverse=True)
    assert "longest stored prefixes" in ppc("inspect", "--store", store_dir).stdout


def test_store_from_environment_and_missing_store(filled, tmp_path):
    store_dir, _ = filled
    env = dict(os.environ, PPC_STORE=str(store_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "stats", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout)["blocks"] > 0
    err = ppc("stats", "--store", tmp_path / "nowhere", expect=2).stderr
    assert "no store at" in err


@pytest.mark.slow
def test_check_finds_and_fixes_damage(filled, model):
    store_dir, prompts = filled
    assert ppc_json("check", "--store", store_dir)["clean"]
    files = sorted(segment_files(store_dir))
    victim = os.path.join(store_dir, "segments", files[0])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 3)
    orphan = os.path.join(store_dir, "segments", "ff", "f" * 32 + ".seg")
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    with open(orphan, "wb") as f:
        f.write(b"left by a crash")
    stale_tmp = os.path.join(store_dir, "tmp", f"{'a' * 32}.999999999.1.tmp")
    with open(stale_tmp, "wb") as f:
        f.write(b"partial")

    report = ppc_json("check", "--store", store_dir, "--grace", "0", expect=1)
    kinds = {p["kind"] for p in report["problems"]}
    assert {"file does not decode", "unreferenced file", "leftover temporary file"} <= kinds
    fixed = ppc_json("check", "--store", store_dir, "--fix", "--grace", "0")
    assert fixed["fixed"] and fixed["removed_nodes"] >= 1
    assert not os.path.exists(orphan) and not os.path.exists(stale_tmp)
    assert ppc_json("check", "--store", store_dir)["clean"]
    # What survived still restores exactly; what was dropped is a clean miss or shorter hit.
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        for p in prompts:
            cache, remaining = store.fetch(p)
            assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, p))
        assert store.stats()["corrupt"] == 0


@pytest.mark.slow
def test_gc_evicts_to_budget(filled):
    store_dir, _ = filled
    before = ppc_json("stats", "--store", store_dir)
    budget = before["block_bytes"] // 2
    result = ppc_json("gc", "--store", store_dir, "--max-bytes", str(budget))
    assert result["block_bytes_after"] <= budget and result["removed_blocks"] > 0
    assert sum(segment_files(store_dir).values()) == result["bytes_after"] < before["bytes_on_disk"]
    assert ppc_json("check", "--store", store_dir)["clean"]
    assert "expected a size" in ppc("gc", "--store", store_dir, "--max-bytes", "lots", expect=2).stderr
    assert ppc_json("gc", "--store", store_dir, "--max-bytes", "1G")["removed_blocks"] == 0


@pytest.mark.slow
def test_gc_by_model_and_by_age(store_dir, model, other_model, tiny_model_dir, other_model_dir):
    """`ppc gc --model` takes a folder (or hub id, or hash prefix) and removes that model's
    blocks only; `--unused-for` removes what was not used for that long, leaves first."""
    old = random_tokens(40, seed=21, first=3)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, model_path=tiny_model_dir) as store:
        prefill(model, old, store)
    time.sleep(1.0)  # a gap between the two chains' last use, far wider than the gc's own delay
    fresh = random_tokens(40, seed=22, first=4)
    with PersistentPrefixCache(store_dir, other_model, block_size=BLOCK, model_path=other_model_dir) as store:
        prefill(other_model, fresh, store)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        prefill(model, fresh, store)  # a second, newer chain of the first model
    per_model = {m["name"]: m["blocks"] for m in ppc_json("stats", "--store", store_dir)["models"]}
    first, second = str(tiny_model_dir), str(other_model_dir)
    # Export, like every --model, takes the folder (a hash prefix works too).
    exported = ppc_json("export", "--store", store_dir, str(store_dir.parent / "p.tar"), "--model", second)
    assert (exported["models"], exported["blocks"]) == (1, per_model[second])
    # By folder: only the other model's blocks go, and its record with them.
    gone = ppc_json("gc", "--store", store_dir, "--model", second)
    assert gone["removed_blocks"] == per_model[second]
    names = {m["name"]: m["blocks"] for m in ppc_json("stats", "--store", store_dir)["models"]}
    assert names == {first: per_model[first]}
    assert ppc_json("gc", "--store", store_dir, "--unused-for", "30d")["removed_blocks"] == 0
    # By age: the first chain (last used before the gap) goes, the newer one stays.
    with StoreAdmin(str(store_dir)) as admin:
        with admin.index.reader() as reader:
            times = sorted(n.last_access for n in reader.iter_nodes())
        gap = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
        middle = (times[gap - 1] + times[gap]) // 2
        aged = admin.gc(unused_for=(time.time_ns() - middle) / 1e9)
    assert 0 < len(aged) < per_model[first]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert store.peek(old) == 0 and store.peek(fresh) == len(fresh) - 1
    assert ppc_json("check", "--store", store_dir)["clean"]
    assert "matches 0 models" in ppc("gc", "--store", store_dir, "--model", "nope", expect=2).stderr
    assert "say what to remove" in ppc("gc", "--store", store_dir, expect=2).stderr
    assert "not a duration" in ppc("gc", "--store", store_dir, "--unused-for", "soon", expect=2).stderr


@pytest.mark.slow
def test_export_import_roundtrip(filled, model, other_model, tmp_path, monkeypatch):
    """A pack moves between two stores with a secret both hold ($PPC_PACK_SECRET): signed
    by it, verified by it; the other store's key alone proves nothing there."""
    store_dir, prompts = filled
    monkeypatch.setenv("PPC_PACK_SECRET", "the fleet's pack secret")
    # A second model in the same store: export must be able to take one model only.
    with PersistentPrefixCache(store_dir, other_model) as store:
        prefill(other_model, prompts[0], store)
    info = ppc_json("inspect", "--store", store_dir)
    assert len(info["models"]) == 2
    with PersistentPrefixCache(store_dir, model) as store:
        root = store.this_model()["root"]
    pack = tmp_path / "one-model.tar"
    out = ppc_json("export", "--store", store_dir, pack, "--model", root[:12])
    assert out["models"] == 1 and pack.stat().st_size > out["bytes"]

    assert out["signed_by"] == ["store", "secret"]
    target = tmp_path / "copy"
    monkeypatch.setenv("PPC_PACK_SECRET", "another secret")
    refused = ppc("import", "--store", target, pack, expect=2).stderr
    assert "is signed by another store" in refused and "not with your secret" in refused and not target.exists()
    monkeypatch.setenv("PPC_PACK_SECRET", "the fleet's pack secret")
    first = ppc_json("import", "--store", target, pack)
    assert first["added"] == out["blocks"] and first["verified"] == "secret"
    assert ppc_json("import", "--store", target, pack)["skipped"] == out["blocks"]
    assert ppc_json("check", "--store", target)["clean"]
    with PersistentPrefixCache(target, model, memory_bytes=0) as store:
        for p in prompts:
            cache, remaining = store.fetch(p)
            assert len(remaining) == 1
            assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, p))
    with PersistentPrefixCache(target, other_model) as store:
        assert store.fetch(prompts[0])[0] is None  # the other model was not exported

    bogus = tmp_path / "bogus.tar"
    bogus.write_bytes(b"not a tar file at all")
    assert "not a ppc export" in ppc("import", "--store", target, bogus, expect=2).stderr
    assert "matches 0 models" in ppc("export", "--store", store_dir, tmp_path / "x", "--model", "zz", expect=2).stderr


def test_store_from_a_newer_version_is_refused_untouched(filled, model):
    store_dir, _ = filled
    index = Index(os.path.join(store_dir, "index"))
    index.write(lambda w: w.put_meta(b"version", b"99"))
    index.close()
    before = sorted(segment_files(store_dir).items())
    for command in (("stats",), ("check", "--fix"), ("migrate",), ("gc", "--max-bytes", "0")):
        err = ppc(*command, "--store", store_dir, expect=2).stderr
        assert "newer" in err or "upgrade" in err
    with pytest.raises(StoreVersionError):
        PersistentPrefixCache(store_dir, model)
    assert sorted(segment_files(store_dir).items()) == before


@pytest.mark.slow
def test_top_level_usage():
    assert "commands:" in ppc("--help").stdout
    assert "unknown command" in ppc("frobnicate", expect=2).stderr
    for command in ("stats", "inspect", "check", "gc", "migrate", "export", "import", "demo"):
        assert "usage: ppc " + command in ppc(command, "--help").stdout


def test_one_size_parser_for_every_command():
    # Bare letters are binary (as `ppc gc` always took them), B suffixes decimal, iB binary.
    from persistent_prefix_cache.cli import gc, serve
    from persistent_prefix_cache.cli.common import parse_size

    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("2G") == parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5g") == int(1.5 * 2**30)
    assert parse_size("100K") == 100 * 1024 and parse_size("100kb") == 100_000
    assert parse_size("1000") == parse_size("1000B") == 1000
    for bad in ("lots", "-5M", "2X", "", "G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    assert gc.parse_size is parse_size and serve.parse_size is parse_size


def test_check_fix_settles_a_wrong_segment_size(filled, capsys):
    """Issue 29, item 15: a segment whose recorded size is not its file's (every block of it
    verifies): ``--fix`` records the file's size, and the next ``check`` is clean (before,
    --fix said "fixed" and the next check found it again)."""
    from persistent_prefix_cache.cli import main
    from persistent_prefix_cache.disk.index_tables import SEGMENTS

    store_dir, prompts = filled

    def wrong_size(w):
        seg, (blocks, nbytes, size) = next(iter(w.segments().items()))
        record = b"".join(int(x).to_bytes(8, "little") for x in (blocks, nbytes, size + 100))
        w.txn.put(SEGMENTS + seg, record)
        return seg, size

    with StoreAdmin(str(store_dir)) as admin:
        seg, size = admin.index.write(wrong_size)
    assert main(["check", "--store", str(store_dir), "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["problems"]
    assert {"kind": "segment size", "detail": f"{seg.hex()}: {size + 100} recorded, the file has {size}"} in found
    assert main(["check", "--store", str(store_dir), "--fix", "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["fixed"] and fixed["remaining"] == [] and fixed["unfixed"] == []
    assert f"recorded the size of segment {seg.hex()}: {size} bytes" in fixed["notes"]
    assert main(["check", "--store", str(store_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["clean"]
    with StoreAdmin(str(store_dir)) as admin:
        with admin.index.reader() as reader:
            recorded = reader.segments()
            assert recorded[seg][2] == size and reader.file_bytes() == sum(v[2] for v in recorded.values())

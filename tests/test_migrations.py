"""Stores written before schema v5, migrated in place (migration 0005 for a v4 store;
0004 before it for v3, 0003 before them for v2, and 0002 before that for v1). The stores
were written by the code of their own schema (see data/make_legacy_stores.py,
data/make_v3_stores.py and data/make_v4_stores.py); every restore is compared bit for
bit with a cold prefill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_same_logits, assert_tree_consistent, cold_logits, ppc_check, warm_logits
from store_worker import Worker, wait_for_pause
from test_reliability import _snapshot

from persistent_prefix_cache.disk.faults import hooks_value
from persistent_prefix_cache import PersistentPrefixCache, StoreVersionError
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.disk.schema import SCHEMA_VERSION
from persistent_prefix_cache.blocks import Node


def _version(store_dir) -> int:
    index = Index(os.path.join(store_dir, "index"), readonly=True, migrate=False)
    try:
        return index.version()
    finally:
        index.close()


def ppc(*args, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == expect, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _assert_restores_exactly(path, legacy) -> None:
    model = legacy["model"]
    with PersistentPrefixCache(path, model, memory_bytes=0) as store:
        for tokens in legacy["prompts"]:
            cache, remaining = store.fetch(tokens)
            assert cache is not None and len(tokens) - len(remaining) == len(tokens) - 1
            assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, tokens))
        assert store.stats()["corrupt"] == 0


@pytest.mark.parametrize("schema", ["v1", "v2"])
def test_read_only_open_of_an_older_store_says_to_migrate_and_changes_nothing(legacy, schema):
    path = legacy[schema]
    before = _snapshot(path)
    with pytest.raises(StoreVersionError, match="ppc migrate"):
        PersistentPrefixCache(path, legacy["model"], readonly=True)
    assert "ppc migrate" in ppc("stats", "--store", path, expect=2).stderr
    assert _snapshot(path) == before and _version(path) == int(schema[1])


@pytest.mark.slow
@pytest.mark.parametrize("schema, pending", [("v1", [2, 3, 4, 5]), ("v2", [3, 4, 5])])
def test_ppc_migrate_converts_an_older_store_in_place(legacy, schema, pending):
    path = legacy[schema]
    dry = json.loads(ppc("migrate", "--store", path, "--dry-run", "--json").stdout)
    assert [p["version"] for p in dry["pending"]] == pending
    done = json.loads(ppc("migrate", "--store", path, "--json").stdout)
    assert done["applied"] == pending and done["to_version"] == SCHEMA_VERSION == 5
    assert json.loads(ppc("migrate", "--store", path, "--json").stdout)["pending"] == []
    # Every block now lives in a segment; the v2 block files are gone.
    assert not (path / "blocks").exists() and any((path / "segments").iterdir())
    assert ppc_check(path)[1]["clean"]
    nodes = assert_tree_consistent(path)
    assert len(nodes) == 8  # 2 + 1 + 1 + 4 blocks of the three prompts, shared one once
    stats = json.loads(ppc("stats", "--store", path, "--json").stdout)
    assert stats["schema_version"] == 5
    assert stats["hits"] == (1 if schema == "v2" else 0)  # v2's counters came along
    _assert_restores_exactly(path, legacy)


def test_a_writable_open_migrates(legacy):
    _assert_restores_exactly(legacy["v2"], legacy)
    assert _version(legacy["v2"]) == SCHEMA_VERSION
    assert ppc_check(legacy["v2"])[1]["clean"]


@pytest.mark.slow
def test_a_damaged_block_file_is_dropped_by_the_migration(legacy):
    # A read would have found the damage: the migration drops the block and what was
    # stored after it, and everything else restores exactly.
    path = legacy["v2"]
    blocks = sorted(os.path.join(d, n) for d, _, ns in os.walk(path / "blocks") for n in ns)
    victim = blocks[0]
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.seek(size - 5)
        byte = f.read(1)
        f.seek(size - 5)
        f.write(bytes([byte[0] ^ 1]))
    ppc("migrate", "--store", path)
    assert ppc_check(path)[1]["clean"]
    assert len(assert_tree_consistent(path)) < 8
    model = legacy["model"]
    with PersistentPrefixCache(path, model, memory_bytes=0) as store:
        for tokens in legacy["prompts"]:
            cache, remaining = store.fetch(tokens)
            assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, tokens))


@pytest.mark.slow
def test_kill9_during_the_migration_leaves_the_old_store(tmp_path, legacy):
    path = legacy["v2"]
    before = _snapshot(path)
    marker = tmp_path / "paused"
    # The migration is the first write transaction of a writable open.
    worker = Worker(
        {"model": str(legacy["model_dir"]), "store": str(path), "steps": []},
        str(tmp_path),
        env={"PPC_TEST_HOOKS": hooks_value(pause_at="in_write_txn", pause_file=marker)},
    )
    try:
        wait_for_pause(str(marker), worker, "in_write_txn")
    finally:
        worker.reap()
    assert worker.proc.returncode == -signal.SIGKILL
    assert _version(path) == 2
    # The v2 files are untouched; only segments the dead migration wrote are new.
    after = _snapshot(path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert all(
        k.startswith(("segments", "tmp")) or k == "lock" for k in set(after) - set(before)
    )  # lock: every open shares it
    _assert_restores_exactly(path, legacy)
    assert ppc_check(path)[1]["clean"]


# -- schema v3 -> v5: segment files rewritten as self-describing safetensors files --


def _index_records(path) -> tuple[dict, dict, dict]:
    """(nodes by key, models by root, hits by key) as the index holds them."""
    index = Index(os.path.join(path, "index"), readonly=True)
    try:
        with index.reader() as r:
            nodes = {n.key: n for n in r.iter_nodes()}
            return nodes, r.models(), {k: r.hits(k) for k in nodes}
    finally:
        index.close()


def _old_records(path) -> tuple[dict, dict, dict]:
    """As `_index_records`, for a store not yet migrated (left as it is)."""
    index = Index(os.path.join(path, "index"), readonly=True, migrate=False)
    try:
        with index.reader() as r:
            nodes = {n.key: n for n in r.iter_nodes()}
            return nodes, r.models(), {k: r.hits(k) for k in nodes}
    finally:
        index.close()


@pytest.mark.slow
def test_ppc_migrate_rewrites_v3_segments_as_v5_and_restores_bitwise(legacy_v3):
    from persistent_prefix_cache.disk.manifest import read_manifest

    path = legacy_v3["v3"]
    before, models, hits = _old_records(path)
    old_files = sorted(str(p) for p in path.glob("segments/*/*.seg"))
    dry = json.loads(ppc("migrate", "--store", path, "--dry-run", "--json").stdout)
    assert [p["version"] for p in dry["pending"]] == [4, 5]
    done = json.loads(ppc("migrate", "--store", path, "--json").stdout)
    assert done["applied"] == [4, 5] and done["to_version"] == SCHEMA_VERSION
    assert ppc_check(path)[1]["clean"]
    after, models_after, hits_after = _index_records(path)
    # Every record survives, only its segment and checksum (v5: bound to the record)
    # changed; models and hit counts are kept.
    assert set(after) == set(before) and models_after == models and hits_after == hits and sum(hits.values()) > 0
    for key, node in after.items():
        old = before[key]
        assert node.segment != old.segment and node.checksum != old.checksum
        old.segment, old.checksum = node.segment, node.checksum
        assert node == old
    # The v3 files are gone (and the v4 files 0004 wrote); every file left is v5 and
    # names its blocks and model.
    new_files = sorted(str(p) for p in path.glob("segments/*/*.seg"))
    assert not set(old_files) & set(new_files) and not any((path / "tmp").iterdir())
    listed = {}
    for f in new_files:
        m = read_manifest(f)
        assert m.model == models[m.root]
        listed.update({n.key: n for n in m.nodes})
    for key, node in after.items():
        node.child_count = node.last_access = 0
        assert listed[key] == node
    _assert_restores_exactly(path, legacy_v3)


def test_a_writable_open_migrates_a_v3_store(legacy_v3):
    _assert_restores_exactly(legacy_v3["v3"], legacy_v3)
    assert _version(legacy_v3["v3"]) == SCHEMA_VERSION
    assert ppc_check(legacy_v3["v3"])[1]["clean"]


def test_a_damaged_v3_segment_drops_its_blocks_and_what_follows(legacy_v3):
    path = legacy_v3["v3"]
    before, _, _ = _old_records(path)
    # The long prompt was stored in two steps: damage the last byte of the segment of
    # its first two blocks (the second block's); the later segment's blocks hang below
    # it and go too.
    long = legacy_v3["prompts"][-1]
    first = next(n for n in before.values() if n.position == 0 and n.tokens[:4] == long[0].to_bytes(4, "little"))
    victim = path / "segments" / first.segment.hex()[:2] / f"{first.segment.hex()}.seg"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.seek(size - 3)
        byte = f.read(1)
        f.seek(size - 3)
        f.write(bytes([byte[0] ^ 1]))
    ppc("migrate", "--store", path)
    assert ppc_check(path)[1]["clean"]
    after = assert_tree_consistent(path)
    assert len(after) == len(before) - 4  # 1 + 3 blocks of the long prompt
    model = legacy_v3["model"]
    with PersistentPrefixCache(path, model, memory_bytes=0) as store:
        for tokens in legacy_v3["prompts"][:-1]:
            cache, remaining = store.fetch(tokens)
            assert len(tokens) - len(remaining) == len(tokens) - 1
            assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, tokens))
        cache, remaining = store.fetch(long)
        assert len(long) - len(remaining) == legacy_v3["block_size"]  # the intact first block
        assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, long))
        assert store.stats()["corrupt"] == 0


@pytest.mark.slow
def test_kill9_during_the_v4_migration_leaves_the_v3_store(tmp_path, legacy_v3):
    path = legacy_v3["v3"]
    before = _snapshot(path)
    marker = tmp_path / "paused"
    worker = Worker(
        {"model": str(legacy_v3["model_dir"]), "store": str(path), "steps": []},
        str(tmp_path),
        env={"PPC_TEST_HOOKS": hooks_value(pause_at="in_write_txn", pause_file=marker)},
    )
    try:
        wait_for_pause(str(marker), worker, "in_write_txn")
    finally:
        worker.reap()
    assert worker.proc.returncode == -signal.SIGKILL
    assert _version(path) == 3
    after = _snapshot(path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert all(
        k.startswith(("segments", "tmp")) or k == "lock" for k in set(after) - set(before)
    )  # lock: every open shares it
    _assert_restores_exactly(path, legacy_v3)  # the rerun finishes the migration
    assert _version(path) == SCHEMA_VERSION and ppc_check(path)[1]["clean"]


def test_a_v3_export_imports_into_a_v5_store(tmp_path, legacy_v3):
    from persistent_prefix_cache.disk.manifest import read_manifest

    target = tmp_path / "imported"
    # Packs of older versions carry no signature: checked against the model, or trusted.
    refused = ppc("import", legacy_v3["pack"], "--store", target, expect=2).stderr
    assert "is not signed" in refused and "--model M" in refused and not target.exists()
    out = json.loads(ppc("import", legacy_v3["pack"], "--store", target, "--model", legacy_v3["model_dir"],
                         "--check-chains", "all", "--json").stdout)  # fmt: skip
    assert out["added"] == 13 and ppc_check(target)[1]["clean"]
    assert out["verified"] == "model" and out["checked"]["chains"] == out["checked"]["of"] > 0
    assert out["checked"]["blocks"] == 13 and out["checked"]["difference"] < 1e-5
    assert all(read_manifest(str(p)).nodes for p in target.glob("segments/*/*.seg"))
    _assert_restores_exactly(target, legacy_v3)


def _downgrade_to_v3(path) -> None:
    """Turn a store into the v3 store the v3 code wrote: every segment rewritten by
    the frozen v3 writer (`migrations/formats/segment_v3.py`, the v3 code as it was), records moved,
    schema stamped 3 (the v3 test data holds no snapshots: this one does)."""
    from persistent_prefix_cache.migrations.formats import segment_v3
    from persistent_prefix_cache.disk.segment import SegmentFiles

    files = SegmentFiles(str(path))
    index = Index(os.path.join(path, "index"))
    try:
        with index.reader() as r:
            nodes = sorted(r.iter_nodes(), key=lambda n: n.position)
        moves, old = [], set()
        for segment in dict.fromkeys(n.segment for n in nodes):
            seg = files.open(segment)
            run = [(n, seg.block_tensors(n)) for n in nodes if n.segment == segment]
            seg.close()
            copies = [(Node(**{k: getattr(n, k) for k in Node.__slots__}), t) for n, t in run]
            new, size, digest = segment_v3.write(str(path), copies)
            moves.append((new, size, digest, [n for n, _ in run], [c.checksum for c, _ in copies]))
            old.add(segment)

        def commit(w):
            for new, size, digest, moved, checksums in moves:
                w.add_segment(new, size, digest)
                assert all(w.move(n, new, checksum=c) for n, c in zip(moved, checksums))  # v3's rule
            w.put_meta(b"version", b"3")
            return w.freed

        files.unlink(index.write(commit))
    finally:
        index.close()
    assert _version(path) == 3


def test_a_v3_store_with_snapshots_migrates_exactly(tmp_path):
    from families import build
    from helpers import prefill, random_tokens
    from safetensors import safe_open

    from persistent_prefix_cache.disk.manifest import read_manifest

    model = build("mamba2")
    tokens = [t % 256 for t in random_tokens(3 * 16 + 5, seed=77, first=1)]
    path = tmp_path / "s"
    with PersistentPrefixCache(path, model, block_size=16) as store:
        store.store(tokens, prefill(model, tokens)[1])
        store.flush()
    query = tokens + [9, 8, 7]

    def restored():
        with PersistentPrefixCache(path, model, block_size=16, memory_bytes=0) as store:
            cache, remaining = store.fetch(query)
            assert cache is not None and store.stats()["corrupt"] == 0
            return len(query) - len(remaining), warm_logits(model, cache, remaining)

    matched, before = restored()
    _downgrade_to_v3(path)
    got_matched, got = restored()  # a writable open migrates
    assert got_matched == matched > 0
    assert_same_logits(got, before)
    assert _version(path) == SCHEMA_VERSION and ppc_check(path)[1]["clean"]
    manifests = [read_manifest(str(p)) for p in path.glob("segments/*/*.seg")]
    with safe_open(str(next(path.glob("segments/*/*.seg"))), "numpy") as f:
        assert f.metadata()["format"] == "ppc-segment/5"
    assert any(json.loads(safe_open(str(p), "numpy").metadata()["snaps"]) for p in path.glob("segments/*/*.seg"))
    assert sum(len(m.nodes) for m in manifests) == 4


def test_a_v2_export_imports_into_a_v5_store(tmp_path, legacy):
    # A ppc-export/1 pack (one file per block) written by the v2 code from the v2 store.
    from pathlib import Path

    from persistent_prefix_cache.disk.manifest import read_manifest

    pack = Path(__file__).parent / "data" / "v2_export.ppcpack"
    target = tmp_path / "imported"
    out = json.loads(ppc("import", pack, "--store", target, "--trust", "--json").stdout)
    assert out["added"] == 8 and ppc_check(target)[1]["clean"] and out["verified"] == "trust"
    manifests = [read_manifest(str(p)) for p in target.glob("segments/*/*.seg")]
    assert sum(len(m.nodes) for m in manifests) == 8 and len({m.root for m in manifests}) == 1
    _assert_restores_exactly(target, legacy)


# -- schema v4 -> v5: checksums bound to the field, layer, block and segment of their bytes --


def _v4_tensors(path) -> dict:
    """Every block's tensors as the v4 store holds them, read and verified by the frozen
    v4 reader (`migrations/formats/segment_v4.py`), by key."""
    from persistent_prefix_cache.migrations.formats import segment_v4

    nodes, _, _ = _old_records(path)
    out = {}
    for key, node in nodes.items():
        seg = segment_v4.open_segment(str(path), node.segment)
        out[key] = seg.block_tensors(node)
        seg.close()
    assert all(t is not None for t in out.values())
    return out


def _assert_same_tensors(path, expected: dict) -> None:
    """Every block of the store holds `expected`'s tensors, bit for bit, verified by the
    live reader (v5 checksums)."""
    from persistent_prefix_cache.disk.segment import SegmentFiles

    files = SegmentFiles(str(path), readonly=True)
    nodes, _, _ = _index_records(path)
    assert set(nodes) == set(expected)
    for key, node in nodes.items():
        seg = files.open(node.segment)
        got = seg.block_tensors(node)
        seg.close()
        assert got is not None and got.keys() == expected[key].keys()
        for lid, part in got.items():
            assert part.keys() == expected[key][lid].keys()
            for fld, (bits, dtype) in part.items():
                want, want_dtype = expected[key][lid][fld]
                assert dtype == want_dtype and bits.shape == want.shape and (bits == want).all()


def _v5_files(path) -> list[str]:
    from persistent_prefix_cache.disk.manifest import read_manifest

    files = sorted(str(p) for p in path.glob("segments/*/*.seg"))
    assert all(read_manifest(f).nodes for f in files)  # every one parses as v5
    return files


@pytest.mark.slow
def test_ppc_migrate_rewrites_v4_segments_as_v5_and_every_block_restores_bitwise(legacy_v4):
    path = legacy_v4["v4"]
    before, models, hits = _old_records(path)
    tensors = _v4_tensors(path)
    old_files = sorted(str(p) for p in path.glob("segments/*/*.seg"))
    dry = json.loads(ppc("migrate", "--store", path, "--dry-run", "--json").stdout)
    assert [p["version"] for p in dry["pending"]] == [5]
    done = json.loads(ppc("migrate", "--store", path, "--json").stdout)
    assert done["applied"] == [5] and done["to_version"] == SCHEMA_VERSION == 5
    assert ppc_check(path)[1]["clean"]
    after, models_after, hits_after = _index_records(path)
    # Every record survives with a new segment and its v5 checksum; models and hits kept.
    assert set(after) == set(before) and models_after == models and hits_after == hits and sum(hits.values()) > 0
    for key, node in after.items():
        old = before[key]
        assert node.segment != old.segment and node.checksum != old.checksum
        old.segment, old.checksum = node.segment, node.checksum
        assert node == old
    new_files = _v5_files(path)
    assert not set(old_files) & set(new_files) and not any((path / "tmp").iterdir())
    _assert_same_tensors(path, tensors)
    _assert_restores_exactly(path, legacy_v4)


def test_a_writable_open_migrates_a_v4_store(legacy_v4):
    _assert_restores_exactly(legacy_v4["v4"], legacy_v4)
    assert _version(legacy_v4["v4"]) == SCHEMA_VERSION
    assert ppc_check(legacy_v4["v4"])[1]["clean"]
    _v5_files(legacy_v4["v4"])


def test_a_v4_export_imports_into_a_v5_store(tmp_path, legacy_v4):
    target = tmp_path / "imported"
    assert "is not signed" in ppc("import", legacy_v4["pack"], "--store", target, expect=2).stderr
    out = json.loads(ppc("import", legacy_v4["pack"], "--store", target, "--model", legacy_v4["model_dir"],
                         "--json").stdout)  # fmt: skip
    assert out["added"] == 13 and ppc_check(target)[1]["clean"] and out["verified"] == "model"
    _v5_files(target)
    _assert_restores_exactly(target, legacy_v4)


def test_a_v4_export_whose_header_moved_tensors_is_refused(tmp_path, legacy_v4):
    # As for the migration: v4's checksums cannot see 0.k and 0.v swapped in a packed
    # segment's header, v4's writer never wrote that order, and the import refuses it.
    import tarfile

    from test_digest_binding import Edit, swap_fields
    from test_reliability import _join

    work = tmp_path / "unpacked"
    with tarfile.open(legacy_v4["pack"]) as tar:
        tar.extractall(work, filter="data")
    member = sorted((work / "segments").iterdir())[0]
    e = Edit.of(member.read_bytes())
    swap_fields(e, {})
    member.write_bytes(_join(e.header, bytes(e.body)))
    pack = tmp_path / "edited.ppcpack"
    with tarfile.open(pack, "w") as tar:
        for name in ("manifest.json", "nodes.bin", "segments"):
            tar.add(work / name, arcname=name)
    err = ppc("import", pack, "--store", tmp_path / "imported", "--trust", expect=2).stderr
    assert err.startswith("error: ") and "is damaged" in err and err.count("\n") == 1
    assert not (tmp_path / "imported").exists()  # a refused pack leaves no store behind


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_rename", "in_write_txn"])
def test_kill9_during_the_v5_migration_leaves_the_v4_store(tmp_path, legacy_v4, point):
    # Killed as it renames its first v5 segment, or with every one written and the
    # index commit pending: the v4 store is as it was, and the next open migrates it.
    path = legacy_v4["v4"]
    tensors = _v4_tensors(path)
    before = _snapshot(path)
    marker = tmp_path / "paused"
    worker = Worker(
        {"model": str(legacy_v4["model_dir"]), "store": str(path), "steps": []},
        str(tmp_path),
        env={"PPC_TEST_HOOKS": hooks_value(pause_at=point, pause_file=marker)},
    )
    try:
        wait_for_pause(str(marker), worker, point)
    finally:
        worker.reap()
    assert worker.proc.returncode == -signal.SIGKILL
    assert _version(path) == 4
    after = _snapshot(path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) and all(k.startswith(("segments", "tmp")) for k in set(after) - set(before))
    _assert_restores_exactly(path, legacy_v4)  # the rerun finishes the migration
    assert _version(path) == SCHEMA_VERSION and ppc_check(path)[1]["clean"]
    _assert_same_tensors(path, tensors)


def test_a_v4_segment_whose_header_moved_tensors_is_dropped_not_rebound(legacy_v4):
    # v4's checksums cannot see 0.k and 0.v swapped in a header (its digest recomputed);
    # v4's writer never wrote them so, and the migration drops those blocks rather than
    # binding the wrong labels into v5 checksums.
    from test_digest_binding import Edit, swap_fields

    path = legacy_v4["v4"]
    before, _, _ = _old_records(path)
    long = legacy_v4["prompts"][-1]
    first = next(n for n in before.values() if n.position == 0 and n.tokens[:4] == long[0].to_bytes(4, "little"))
    victim = path / "segments" / first.segment.hex()[:2] / f"{first.segment.hex()}.seg"
    e = Edit.of(victim.read_bytes())
    swap_fields(e, {})
    from test_reliability import _join  # the v4 header digest made to fit (the same rule)

    e.meta["blocks"] = json.dumps(e.records, separators=(",", ":"))
    victim.write_bytes(_join(e.header, bytes(e.body)))
    ppc("migrate", "--store", path)
    assert ppc_check(path)[1]["clean"]
    after = assert_tree_consistent(path)
    assert len(after) == len(before) - 5  # the long prompt's 2 + 3 blocks
    model = legacy_v4["model"]
    with PersistentPrefixCache(path, model, memory_bytes=0) as store:
        for tokens in legacy_v4["prompts"]:
            cache, remaining = store.fetch(tokens)
            assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, tokens))
        assert store.stats()["corrupt"] == 0


def test_a_v4_store_whose_index_is_lost_is_rebuilt_as_v5(legacy_v4):
    path = legacy_v4["v4"]
    tensors = _v4_tensors(path)
    old_files = sorted(str(p) for p in path.glob("segments/*/*.seg"))
    import shutil

    shutil.rmtree(path / "index")
    rc, report = ppc_check(path, "--fix")
    assert rc == 0 and report["rebuild"]["converted"] == len(old_files) and report["rebuild"]["unusable"] == []
    assert report["rebuild"]["blocks"] == 13
    assert not set(old_files) & set(_v5_files(path))
    assert ppc_check(path)[1]["clean"]
    _assert_same_tensors(path, tensors)
    _assert_restores_exactly(path, legacy_v4)


def _downgrade_to_v4(path) -> None:
    """Turn a store into the v4 store the v4 code wrote: every segment rewritten by the
    frozen v4 writer, records moved with their v4 checksums, schema stamped 4."""
    from persistent_prefix_cache.disk.segment import SegmentFiles
    from persistent_prefix_cache.migrations.formats import segment_v4

    files = SegmentFiles(str(path))
    index = Index(os.path.join(path, "index"))
    try:
        with index.reader() as r:
            nodes = sorted(r.iter_nodes(), key=lambda n: n.position)
        moves = []
        for segment in dict.fromkeys(n.segment for n in nodes):
            seg = files.open(segment)
            run = [(n, seg.block_tensors(n)) for n in nodes if n.segment == segment]
            root, model, block_size = seg.root, seg.model, seg.block_size
            seg.close()
            copies = [(Node(**{k: getattr(n, k) for k in Node.__slots__}), t) for n, t in run]
            new, size, digest = segment_v4.write(str(path), copies, root=root, model=model, block_size=block_size)
            moves.append((new, size, digest, [n for n, _ in run], [c.checksum for c, _ in copies]))

        def commit(w):
            for new, size, digest, moved, checksums in moves:
                w.add_segment(new, size, digest)
                assert all(w.move(n, new, checksum=c) for n, c in zip(moved, checksums))
            w.put_meta(b"version", b"4")
            return w.freed

        files.unlink(index.write(commit))
    finally:
        index.close()
    assert _version(path) == 4


def test_a_v4_store_with_snapshots_migrates_exactly(tmp_path):
    from families import build
    from helpers import prefill, random_tokens

    model = build("mamba2")
    tokens = [t % 256 for t in random_tokens(3 * 16 + 5, seed=78, first=1)]
    path = tmp_path / "s"
    with PersistentPrefixCache(path, model, block_size=16) as store:
        store.store(tokens[:32], prefill(model, tokens[:32])[1])
        store.store(tokens, prefill(model, tokens)[1])
        store.flush()

    def restored(query):
        with PersistentPrefixCache(path, model, block_size=16, memory_bytes=0) as store:
            cache, remaining = store.fetch(query)
            assert cache is not None and store.stats()["corrupt"] == 0
            return len(query) - len(remaining), [[np.array(x) for x in c.cache] for c in cache]

    queries = [tokens + [9, 8], tokens[:32] + [7]]
    want = [restored(q) for q in queries]
    _downgrade_to_v4(path)
    tensors = _v4_tensors(path)
    for q, (matched, state) in zip(queries, want):  # a writable open migrates
        got_matched, got = restored(q)
        assert got_matched == matched > 0
        assert all(np.array_equal(a, b) for x, y in zip(got, state) for a, b in zip(x, y))
    assert _version(path) == SCHEMA_VERSION and ppc_check(path)[1]["clean"]
    _v5_files(path)
    _assert_same_tensors(path, tensors)

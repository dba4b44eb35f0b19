"""Packs prove what they store (issue 29, items 7 and 12): signed by the store or the secret
that wrote them, or checked against the model, or trusted by name; read member by member,
each bounded before it is read.

Stores are filled in-process with the real model; every command runs as a real ``ppc``
subprocess on real files.
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import zlib

import pytest
from helpers import BLOCK, assert_same_logits, cold_logits, prefill, random_tokens, warm_logits

from persistent_prefix_cache import PersistentPrefixCache


def ppc(*args, expect: int = 0, env: dict | None = None, limit_kb: int | None = None) -> subprocess.CompletedProcess:
    """Run ``ppc`` (under an address-space limit if given); check its exit code, and that a
    failure is one ``error:`` line and never a traceback."""
    pre = None
    if limit_kb is not None:
        import resource

        def pre():
            resource.setrlimit(resource.RLIMIT_AS, (limit_kb << 10, limit_kb << 10))

    environ = {k: v for k, v in os.environ.items() if k != "PPC_PACK_SECRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)],
        capture_output=True, text=True, timeout=300, env={**environ, **(env or {})}, preexec_fn=pre,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    if expect == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return proc


def ppc_json(*args, **kwargs) -> dict:
    return json.loads(ppc(*args, "--json", **kwargs).stdout)


A = random_tokens(40, seed=71, first=3)
B = random_tokens(40, seed=72, first=4)


def fill(store, model, model_dir, pairs) -> None:
    """Store each (tokens, cache of the tokens the cache was computed from)."""
    with PersistentPrefixCache(store, model, model_path=model_dir, block_size=BLOCK) as handle:
        for tokens, computed_from in pairs:
            handle.store(tokens, prefill(model, computed_from)[1])


def restored_logits(store, model, tokens) -> tuple:
    with PersistentPrefixCache(store, model, memory_bytes=0) as handle:
        cache, remaining = handle.fetch(tokens)
    return warm_logits(model, cache, remaining), len(tokens) - len(remaining)


@pytest.mark.slow
def test_a_pack_goes_back_into_its_own_store_verified_by_its_key(tmp_path, model, tiny_model_dir):
    store = tmp_path / "store"
    fill(store, model, tiny_model_dir, [(A, A), (B, B)])
    out = ppc_json("export", "--store", store, tmp_path / "p.tar")
    assert out["signed_by"] == ["store"]
    key = store / "pack.key"
    assert stat.S_IMODE(key.lstat().st_mode) == 0o600 and key.stat().st_size == 32
    ppc("gc", "--store", store, "--max-bytes", "0", "--yes")
    back = ppc_json("import", "--store", store, tmp_path / "p.tar")
    assert back["verified"] == "store" and back["added"] == out["blocks"]
    for tokens in (A, B):
        got, restored = restored_logits(store, model, tokens)
        assert restored == len(tokens) - 1
        assert_same_logits(got, cold_logits(model, tokens))


@pytest.mark.slow
def test_relabelled_kv_in_a_pack_is_refused(tmp_path, model, tiny_model_dir):
    """The issue's pack: ``store(tokens_B, cache_of_A)`` exported from another store."""
    other = tmp_path / "other"
    fill(other, model, tiny_model_dir, [(B, A)])
    pack = tmp_path / "relabelled.tar"
    ppc("export", "--store", other, pack)
    target = tmp_path / "target"
    refused = ppc("import", "--store", target, pack, expect=2).stderr
    assert "is signed by another store" in refused and "--model M" in refused and "--trust" in refused
    checked = ppc("import", "--store", target, pack, "--model", tiny_model_dir, expect=2).stderr
    assert "is not the model's KV of its tokens" in checked and "differs by" in checked
    assert not target.exists()  # nothing was written, not even an empty store
    # A genuine pack of another store checks out, and restores exactly.
    genuine = tmp_path / "genuine"
    fill(genuine, model, tiny_model_dir, [(A, A)])
    good = tmp_path / "good.tar"
    ppc("export", "--store", genuine, good)
    out = ppc_json("import", "--store", target, good, "--model", tiny_model_dir, "--check-chains", "all")
    assert out["verified"] == "model" and out["checked"]["chains"] == 1 and out["checked"]["difference"] == 0
    got, restored = restored_logits(target, model, A)
    assert restored == len(A) - 1
    assert_same_logits(got, cold_logits(model, A))
    # --trust imports what nothing verifies: the user's explicit choice.
    trusted = ppc_json("import", "--store", tmp_path / "trusting", pack, "--trust")
    assert trusted["verified"] == "trust" and trusted["added"] > 0


@pytest.mark.slow
def test_a_pack_of_another_model_is_refused_by_the_model_check(tmp_path, model, tiny_model_dir, other_model_dir):
    store = tmp_path / "store"
    fill(store, model, tiny_model_dir, [(A, A)])
    ppc("export", "--store", store, tmp_path / "p.tar")
    line = ppc("import", "--store", tmp_path / "t", tmp_path / "p.tar", "--model", other_model_dir, expect=2).stderr
    assert "are not of --model's model" in line and not (tmp_path / "t").exists()


@pytest.mark.slow
def test_a_secret_moves_packs_between_stores(tmp_path, model, tiny_model_dir):
    store = tmp_path / "store"
    fill(store, model, tiny_model_dir, [(A, A)])
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    out = ppc_json("export", "--store", store, tmp_path / "p.tar", "--secret-file", secret)
    assert out["signed_by"] == ["store", "secret"]
    wrong = ppc("import", "--store", tmp_path / "t", tmp_path / "p.tar", env={"PPC_PACK_SECRET": "other"}, expect=2)
    assert "not with your secret" in wrong.stderr and "a secret (key" in wrong.stderr
    right = ppc_json("import", "--store", tmp_path / "t", tmp_path / "p.tar",
                     env={"PPC_PACK_SECRET": "correct horse battery staple"})  # fmt: skip
    assert right["verified"] == "secret" and right["added"] == out["blocks"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # never read: a FIFO would block a plain open
    line = ppc("export", "--store", store, tmp_path / "q.tar", "--secret-file", fifo, expect=2).stderr
    assert "not a regular file" in line


def _members(pack) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(pack) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def _write(pack, members, *, mode="w") -> None:
    with tarfile.open(pack, mode) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.slow
def test_an_altered_signed_pack_is_refused(tmp_path, model, tiny_model_dir):
    store = tmp_path / "store"
    fill(store, model, tiny_model_dir, [(A, A)])
    pack = tmp_path / "p.tar"
    ppc("export", "--store", store, pack)
    members = _members(pack)
    # the manifest renamed (blocks intact): the signature lists another digest
    edited = [(i, d.replace(b'"name"', b'"nAme"') if i.name == "manifest.json" else d) for i, d in members]
    _write(tmp_path / "a.tar", edited)
    line = ppc("import", "--store", store, tmp_path / "a.tar", expect=2).stderr
    assert "was altered after it was signed: manifest.json" in line
    # ... and the digests in signature.json rewritten to match: the MAC does not
    from persistent_prefix_cache.admin.packs import digest_of

    sig = json.loads(edited[-1][1])
    sig["digests"]["manifest.json"] = digest_of(edited[0][1]).hex()
    _write(tmp_path / "b.tar", edited[:-1] + [(edited[-1][0], json.dumps(sig).encode())])
    line = ppc("import", "--store", store, tmp_path / "b.tar", expect=2).stderr
    assert "its store signature does not match its contents" in line
    assert ppc_json("stats", "--store", store)["blocks"] > 0  # the store is as it was


@pytest.mark.slow
def test_the_store_key_is_never_taken_from_a_link_or_another_user(tmp_path, model, tiny_model_dir):
    store = tmp_path / "store"
    fill(store, model, tiny_model_dir, [(A, A)])
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, store / "pack.key")
    out = ppc_json("export", "--store", store, tmp_path / "p.tar")
    assert out["signed_by"] == [] and victim.read_bytes() == b"precious"
    os.unlink(store / "pack.key")
    (store / "pack.key").write_bytes(os.urandom(32))
    os.chmod(store / "pack.key", 0o644)  # others could read it: it signs nothing
    assert ppc_json("export", "--store", store, tmp_path / "p.tar")["signed_by"] == []
    line = ppc("import", "--store", store, tmp_path / "p.tar", expect=2).stderr
    assert "is not signed" in line


@pytest.mark.slow
def test_an_older_unsigned_pack_needs_model_or_trust(tmp_path, model, tiny_model_dir):
    store = tmp_path / "store"
    fill(store, model, tiny_model_dir, [(A, A)])
    ppc("export", "--store", store, tmp_path / "p.tar")
    members = [(i, d) for i, d in _members(tmp_path / "p.tar") if i.name != "signature.json"]
    _write(tmp_path / "old.tar", members)  # what ppc export wrote before packs were signed
    assert "is not signed" in ppc("import", "--store", store, tmp_path / "old.tar", expect=2).stderr
    out = ppc_json("import", "--store", tmp_path / "t", tmp_path / "old.tar", "--model", tiny_model_dir)
    assert out["verified"] == "model" and out["added"] > 0


def test_signatures_and_the_model_check_in_process(tmp_path, model, tiny_model_dir):
    """The same rules through `StoreAdmin` (the fast loop's share of this file)."""
    from persistent_prefix_cache.admin import StoreAdmin
    from persistent_prefix_cache.admin.packs import UnverifiedPackError
    from persistent_prefix_cache.errors import InvalidArgumentError
    from persistent_prefix_cache.admin.pack_check import model_check

    bad, good = tmp_path / "bad", tmp_path / "good"
    fill(bad, model, tiny_model_dir, [(B, A)])
    fill(good, model, tiny_model_dir, [(A, A)])
    for store in (bad, good):
        with StoreAdmin(str(store), readonly=True) as admin:
            assert admin.export_pack(str(store) + ".tar", secret=b"s")["signed_by"] == ["store", "secret"]
    check = model_check(model, chains=None)
    with StoreAdmin(str(tmp_path / "t"), create=True, block_size=BLOCK) as admin:
        with pytest.raises(UnverifiedPackError, match="signed by another store"):
            admin.import_pack(str(bad) + ".tar")
        with pytest.raises(InvalidArgumentError, match="is not the model's KV of its tokens"):
            admin.import_pack(str(bad) + ".tar", check=check)
        assert admin.summary()["blocks"] == 0 and not list((tmp_path / "t" / "segments").rglob("*.seg"))
        out = admin.import_pack(str(good) + ".tar", check=check)
        assert out["verified"] == "model" and out["checked"]["difference"] == 0.0
        again = admin.import_pack(str(good) + ".tar", check=check)  # all present: nothing to check
        assert (again["added"], again["checked"]["chains"]) == (0, 0)
        assert admin.import_pack(str(bad) + ".tar", secret=b"s")["verified"] == "secret"  # a secret vouches
    with StoreAdmin(str(good)) as admin:
        assert admin.import_pack(str(good) + ".tar")["verified"] == "store"


def test_a_declared_size_is_checked_before_reading_in_process(tmp_path):
    from persistent_prefix_cache.admin.pack_members import PackReader
    from persistent_prefix_cache.errors import InvalidArgumentError

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = 1 << 40
        tar.addfile(info)  # the header only
    (tmp_path / "p.tar").write_bytes(raw.getvalue())
    with PackReader(str(tmp_path / "p.tar")) as reader:
        with pytest.raises(InvalidArgumentError, match="declares 1,099,511,627,776 bytes, more than the 4,194,304"):
            reader.manifest()


# -- bounded reading (item 12) ------------------------------------------------------------


def _hostile(tmp_path, model, tiny_model_dir, name, replace) -> str:
    """A gzip pack of a real store with one member replaced: `replace(info, data)` gives the
    new (info, data), data may be a callable writing the member's bytes itself."""
    store = tmp_path / "src"
    if not store.exists():
        fill(store, model, tiny_model_dir, [(A, A)])
        ppc("export", "--store", store, tmp_path / "src.tar")
    pack = tmp_path / name
    with tarfile.open(pack, "w:gz", compresslevel=1) as tar:
        for info, data in _members(tmp_path / "src.tar"):
            info, data = replace(info, data)
            if data is None:
                continue
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(pack)


@pytest.mark.slow
def test_members_larger_than_they_may_be_are_refused_before_reading(tmp_path, model, tiny_model_dir):
    nested = b"[" * 3000 + b"]" * 3000
    cases = {
        "manifest.json": (b'{"format": "ppc-export/3", "models": {"x": ' + nested + b"}}", "nests deeper"),
        "nodes.bin": (bytes(64 << 20), "more than the"),
    }
    for member, (data, words) in cases.items():
        pack = _hostile(tmp_path, model, tiny_model_dir, f"{member}.tgz",
                        lambda i, d: (i, data if i.name == member else d))  # fmt: skip
        line = ppc("import", "--store", tmp_path / "t", pack, "--trust", expect=2).stderr
        assert words in line, line
        assert not (tmp_path / "t").exists()
    # A member whose header declares far more than it may hold, its data never sent.
    src = _members(tmp_path / "src.tar")
    segment = next(i for i, _ in src if i.name.startswith("segments/"))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, data in src:
            if info.name == segment.name:
                info.size = 1 << 40
                tar.addfile(info)  # the header only: a reader that trusted it would read a TiB
                break
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "declared.tar").write_bytes(raw.getvalue())
    line = ppc("import", "--store", tmp_path / "t", tmp_path / "declared.tar", "--trust", expect=2).stderr
    assert "declares 1,099,511,627,776 bytes, more than the" in line


@pytest.mark.slow
def test_a_small_gzip_pack_with_a_2_gib_member_is_one_line_under_a_memory_limit(tmp_path, model, tiny_model_dir):
    """The issue's pack: ~2 MB of gzip holding a 2 GiB segment member; ``ppc import`` under a
    1 GiB address-space limit says so in one line (it read it whole: a MemoryError)."""
    store = tmp_path / "src"
    fill(store, model, tiny_model_dir, [(A, A)])
    ppc("export", "--store", store, tmp_path / "src.tar")
    src = _members(tmp_path / "src.tar")
    pack = tmp_path / "bomb.tgz"
    zeros, size = bytes(64 << 20), 2 << 30
    with open(pack, "wb") as raw:
        deflate = zlib.compressobj(1, zlib.DEFLATED, 31, 9, zlib.Z_RLE)  # gzip framing
        plain = io.BytesIO()
        with tarfile.open(fileobj=plain, mode="w") as tar:
            for info, data in src:
                if info.name.startswith("segments/"):
                    info.size = size
                    tar.addfile(info)  # its data streams below
                    break
                tar.addfile(info, io.BytesIO(data))
        raw.write(deflate.compress(plain.getvalue()))
        for _ in range(size // len(zeros)):
            raw.write(deflate.compress(zeros))
        raw.write(deflate.compress(bytes(1024)))  # the end-of-archive blocks
        raw.write(deflate.flush())
    assert pack.stat().st_size < 16 << 20
    line = ppc("import", "--store", tmp_path / "t", pack, "--trust", limit_kb=1 << 20, expect=2).stderr
    assert "declares 2,147,483,648 bytes, more than the" in line
    assert not (tmp_path / "t").exists()

"""The index is a cache of the segments: damage to it is a finding, and ``--fix``
rebuilds it from the segment files.

- The sweep: a store of 24 prompts (stored one at a time), then for every 4 KiB page of
  ``index/data.mdb``, on a fresh copy, that page overwritten with random bytes; ``ppc
  check`` and ``ppc check --fix`` run as real subprocesses (no traceback, no death by a
  signal, exit codes as documented), then every prompt restores fully and bitwise equal
  to the cache it was stored from, and a new write goes through.
- A rebuild killed (SIGKILL) at each of its steps: the store says what to run, and a
  rerun finishes it.
- Other processes: a repair refuses to start while the store is open elsewhere; an open
  during a repair gets `StoreBusyError`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import BLOCK, prefill, random_tokens, run_python

from persistent_prefix_cache.disk.faults import hooks_value
from persistent_prefix_cache import PersistentPrefixCache

HERE = Path(__file__).parent
PAGE = 4096


def _prompts() -> list[list[int]]:
    """24 prompts of 1-4 blocks and a partial tail, half sharing a prefix of 1-2 blocks."""
    base = random_tokens(2 * BLOCK, seed=300, first=1)
    out = []
    for i in range(24):
        shared = base[: BLOCK * (i % 3)] if i % 2 else []
        out.append(shared + random_tokens(BLOCK * (1 + i % 4) + 3 * (i % 5), seed=310 + i, first=2 + i))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_dir):
    """The store (24 prompts, one `store()` each) and the original KV of each prompt."""
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(tiny_model_dir)
    root = tmp_path_factory.mktemp("damage")
    prompts = _prompts()
    originals = {}
    with PersistentPrefixCache(root / "store", model, block_size=BLOCK) as store:
        for i, tokens in enumerate(prompts):
            cache = prefill(model, tokens)[1]
            store.store(tokens, cache)
            for j, layer in enumerate(cache):
                keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
                originals[f"{i}.{j}.k"], originals[f"{i}.{j}.v"] = np.array(keys), np.array(values)
    np.savez(root / "originals.npz", **originals)
    return {"root": root, "store": root / "store", "prompts": prompts, "originals": root / "originals.npz"}


def _sweep(source, tiny_model_dir, tmp_path, **extra) -> tuple[int, list[dict]]:
    """Run `damage_worker.py` over every page of the source store's index (restarted
    after a page it died on); its JSON lines, and a ``worker_died`` line per death."""
    pages = os.path.getsize(source["store"] / "index" / "data.mdb") // PAGE
    spec = {
        "store": str(source["store"]),
        "work": str(tmp_path),
        "model": str(tiny_model_dir),
        "prompts": source["prompts"],
        "originals": str(source["originals"]),
        "pages": pages,
        **extra,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    lines, first = [], 0
    while first < pages:  # one worker for many pages; restarted after a page it died on
        proc = subprocess.run(
            [sys.executable, str(HERE / "damage_worker.py"), str(tmp_path / "spec.json"), str(first)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        lines += done
        first += len(done)
        if first < pages:
            assert proc.returncode != 0, proc.stderr[-2000:]
            lines.append({"page": first, "worker_died": proc.returncode, "stderr": proc.stderr[-500:]})
            first += 1
    return pages, lines


@pytest.mark.slow
def test_every_damaged_index_page_is_found_and_rebuilt(source, tiny_model_dir, tmp_path):
    pages, lines = _sweep(source, tiny_model_dir, tmp_path)
    runs = [r for line in lines if "check" in line for r in (line["check"], line["fix"])]
    figures = {
        "pages": pages,
        "found_damaged": sum(1 for line in lines if "check" in line and line["check"]["rc"] == 1),
        "rebuilt": sum(1 for line in lines if line.get("fix", {}).get("rebuilt")),
        # Pages every read passed, found by the trial write only (the free list's).
        "found_by_trial_write": sum(
            1
            for line in lines
            if any(p.startswith("a write would fail") for p in line.get("check", {}).get("problems", []))
        ),
        "tracebacks": sum(r["traceback"] for r in runs),
        "aborts": sum(r["signal"] is not None for r in runs) + sum("worker_died" in line for line in lines),
        "opens_after_fix": sum(1 for line in lines if line.get("opens")),
        "prompts_restored": sum(line.get("restored", 0) for line in lines),
        "prompts": pages * len(source["prompts"]),
    }
    print("index damage sweep:", json.dumps(figures))
    bad = [line for line in lines if "worker_died" in line or line["failures"] or not line["opens"]]
    assert not bad, bad[:3]
    assert figures["tracebacks"] == 0 and figures["aborts"] == 0
    for line in lines:
        # check: 0 clean, 1 damage found; check --fix: 0 (clean or repaired)
        assert line["check"]["rc"] in (0, 1), line
        assert line["fix"]["rc"] == 0, line
        assert line["check"]["clean"] == (line["check"]["rc"] == 0), line
        # Whatever check found, --fix repaired by a rebuild (the damage was the index's).
        assert line["fix"]["rebuilt"] == (line["check"]["rc"] == 1), line
    assert figures["opens_after_fix"] == pages
    assert figures["prompts_restored"] == figures["prompts"]
    # The sweep means something: most pages in use are found damaged (the rest are free),
    # and at least one (a page of LMDB's free list) only by the trial write: without it,
    # check said "clean" while every write failed.
    assert figures["found_damaged"] >= pages // 3
    assert figures["found_by_trial_write"] >= 1


# -- a rebuild killed midway; other processes ---------------------------------------------


def _damaged_copy(source, tmp_path, page: int = 0) -> Path:
    """A copy of the sweep's store with one index page (0: a meta page) overwritten."""
    import random
    import shutil

    store = tmp_path / "store"
    shutil.copytree(source["store"], store)
    with open(store / "index" / "data.mdb", "r+b") as f:
        f.seek(page * PAGE)
        f.write(random.Random(page).randbytes(PAGE))
    return store


def _ppc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


# Open the store as the library does (read-write), report the error's type and text.
_OPEN = """
    import json, sys
    from persistent_prefix_cache.disk import store_guard
    from persistent_prefix_cache.admin import StoreAdmin
    store_guard.OPEN_WAIT = 0.2  # a repair in progress is said after a short wait
    try:
        StoreAdmin(sys.argv[1]).close()
        print(json.dumps(None))
    except Exception as exc:
        print(json.dumps([type(exc).__name__, str(exc)]))
"""


def _open_error(store) -> list | None:
    return json.loads(run_python(_OPEN, str(store)).stdout)


def _assert_all_restore(store, model, source) -> None:
    with PersistentPrefixCache(store, model, memory_bytes=0) as cache_store:
        for tokens in source["prompts"]:
            cache, remaining = cache_store.fetch(tokens + [1])
            assert len(remaining) == 1, "a prompt did not restore fully"
        assert cache_store.stats()["corrupt"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("point", ["in_write_txn", "rebuild_built", "rebuild_swap"])
def test_rebuild_killed_midway_then_finished_by_a_rerun(source, model, tmp_path, point):
    import signal
    import time

    store = _damaged_copy(source, tmp_path)
    marker = tmp_path / "paused"
    fixer = subprocess.Popen(
        [sys.executable, "-m", "persistent_prefix_cache", "check", "--fix", "--store", str(store)],
        env={**os.environ, "PPC_TEST_HOOKS": hooks_value(pause_at=point, pause_file=marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text() == point):
            assert fixer.poll() is None, fixer.stderr.read().decode()
            assert time.monotonic() < deadline, "the repair never paused"
            time.sleep(0.02)
        # While the repair runs, an open says so (after a short wait), typed.
        name, message = _open_error(store)
        assert name == "StoreBusyError" and "is being repaired" in message, message
        # A second repair refuses to start.
        second = _ppc("check", "--fix", "--store", str(store))
        assert second.returncode == 2 and "being repaired" in second.stderr, second.stderr
    finally:
        fixer.send_signal(signal.SIGKILL)
        fixer.wait()
    # Killed: an open names the command that finishes the repair; check reports it.
    name, message = _open_error(store)
    assert name == "StoreCorruptError", message
    assert "interrupted" in message and f"ppc check --fix --store {store}" in message, message
    checked = _ppc("check", "--store", str(store))
    assert checked.returncode == 1 and "index damaged" in checked.stdout, checked.stdout
    # A rerun finishes it; nothing the segments hold is lost.
    fixed = _ppc("check", "--fix", "--store", str(store))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert _ppc("check", "--store", str(store)).returncode == 0
    assert sorted(os.listdir(store / "segments")) == sorted(os.listdir(source["store"] / "segments"))
    _assert_all_restore(store, model, source)


@pytest.mark.slow
def test_a_repair_refuses_while_the_store_is_open_elsewhere(source, model, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(source["store"], store)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "open", holder.stderr.read()
        with open(store / "index" / "data.mdb", "r+b") as f:  # damage under the open handle
            f.seek(0)
            f.write(bytes(PAGE))
        checked = _ppc("check", "--store", str(store))
        assert checked.returncode == 1 and "index damaged" in checked.stdout
        refused = _ppc("check", "--fix", "--store", str(store))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.startswith("error: ") and len(refused.stderr.strip().splitlines()) == 1
        assert "is open in another process" in refused.stderr and "close ppc serve" in refused.stderr
        assert (store / "index").is_dir() and not (store / "index.new").exists()
    finally:
        holder.kill()
        holder.wait()
    assert _ppc("check", "--fix", "--store", str(store)).returncode == 0
    _assert_all_restore(store, model, source)


# Hold a store open (as ppc serve would) until killed.
_HOLD = """
import sys, time
from persistent_prefix_cache.admin import StoreAdmin
admin = StoreAdmin(sys.argv[1])
print("open", flush=True)
time.sleep(600)
"""


def test_a_forked_child_closing_its_copy_keeps_the_parents_lock(source, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(source["store"], store)
    code = """
        import os, sys
        from persistent_prefix_cache.admin import StoreAdmin
        from persistent_prefix_cache.disk import store_guard
        from persistent_prefix_cache.errors import StoreBusyError
        admin = StoreAdmin(sys.argv[1])
        pid = os.fork()
        if pid == 0:  # the child forgets the inherited lock (closes its copy) and exits
            os._exit(0 if not store_guard._HELD else 1)
        _, status = os.waitpid(pid, 0)
        assert status == 0, "the child kept the parent's lock record"
        # The parent still holds the store: a repair in another process refuses.
        import subprocess
        probe = subprocess.run([sys.executable, "-c", "import sys\\n"
            "from persistent_prefix_cache.disk import store_guard\\n"
            "from persistent_prefix_cache.errors import StoreBusyError\\n"
            "try:\\n    with store_guard.exclusive(sys.argv[1]): print('got it')\\n"
            "except StoreBusyError: print('busy')", sys.argv[1]], capture_output=True, text=True)
        print(probe.stdout.strip())
        admin.close()
    """
    assert run_python(code, str(store)).stdout.strip() == "busy"


@pytest.mark.slow
def test_rebuild_sets_a_damaged_segment_aside_and_keeps_everything_else(source, model, tmp_path):
    from persistent_prefix_cache.disk.manifest import read_manifest
    from persistent_prefix_cache.keys import block_key

    store = _damaged_copy(source, tmp_path)
    paths = sorted((store / "segments").rglob("*.seg"))
    manifests = [read_manifest(str(p)) for p in paths]
    # The victim: the segment of prompt 1's blocks after the shared first one.
    where = {n.key: m.segment for m in manifests for n in m.nodes}
    root = manifests[0].root

    def chain(tokens):
        keys, parent = [], root
        for at in range(0, len(tokens), BLOCK):
            parent = block_key(parent, np.asarray(tokens[at : at + BLOCK], dtype="<i4").tobytes())
            keys.append((at, parent))
        return keys

    victim = where[chain(source["prompts"][1])[1][1]]
    victim_path = next(p for p in paths if p.name.startswith(victim.hex()))
    with open(victim_path, "r+b") as f:  # one flipped byte near the end: a tensor's bytes
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    fixed = json.loads(_ppc("check", "--fix", "--json", "--store", str(store)).stdout)
    assert fixed["fixed"] and fixed["rebuild"]["unusable"][0]["file"].endswith(victim_path.name)
    aside = Path(fixed["rebuild"]["aside"])
    assert (aside / "index" / "data.mdb").exists()
    assert (aside / victim_path.relative_to(store)).exists(), "the damaged segment is kept aside"
    # The files whose every block followed the lost one are gone with the fix, whatever
    # their age: a check without grace finds no orphan (with the default grace of 60 s,
    # this passed or failed by how long ago the fixture wrote them).
    assert fixed["rebuild"]["emptied"] > 0
    after = _ppc("check", "--grace", "0", "--store", str(store))
    assert after.returncode == 0, after.stdout
    # Every prompt restores up to its first block in the damaged segment, all of it otherwise.
    with PersistentPrefixCache(store, model, memory_bytes=0) as cache_store:
        for tokens in source["prompts"]:
            lost = [at for at, key in chain(tokens) if where[key] == victim]
            cache, remaining = cache_store.fetch(tokens + [1])
            assert len(tokens) + 1 - len(remaining) == (lost[0] if lost else len(tokens))
        assert cache_store.stats()["corrupt"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("command", [["stats"], ["inspect"], ["gc", "--max-bytes", "0"], ["export"]])
def test_every_command_on_a_damaged_index_is_one_error_line(source, tmp_path, command):
    from persistent_prefix_cache.admin.index_probe import probe_index

    # A tree page, which LMDB reports (or aborts on) only when it is read; and page 0,
    # a meta page (LMDB refuses the file at once).
    tree = next(
        p
        for p in range(2, os.path.getsize(source["store"] / "index" / "data.mdb") // PAGE)
        if probe_index(str(_damaged_copy(source, tmp_path / f"t{p}", p) / "index"), trial_write=False).damaged
    )
    for page in (tree, 0):
        store = _damaged_copy(source, tmp_path / f"p{page}", page)
        extra = [str(tmp_path / "x.tar")] if command == ["export"] else []
        proc = _ppc(command[0], "--store", str(store), *command[1:], *extra)
        assert proc.returncode == 2, (page, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "index damaged" in lines[0] and f"ppc check --fix --store {store}" in lines[0], lines[0]
        assert "rebuilds the index from the 24 segment files" in lines[0], lines[0]


def test_an_index_gone_while_the_segments_stayed_is_rebuilt(source, model, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(source["store"], store)
    shutil.rmtree(store / "index")
    checked = _ppc("check", "--store", str(store))
    assert checked.returncode == 1 and "index/ is missing" in checked.stdout, checked.stdout
    assert "rebuilds the index from the 24 segment files" in checked.stdout
    assert _ppc("check", "--fix", "--store", str(store)).returncode == 0
    assert not list(store.glob("damaged-*")), "nothing was set aside"
    _assert_all_restore(store, model, source)


def test_a_rebuild_on_a_read_only_mount_is_one_error_line(source, tmp_path):
    import shlex
    import shutil

    store = _damaged_copy(source, tmp_path)
    fix = f"{shlex.quote(sys.executable)} -m persistent_prefix_cache check --fix --store {shlex.quote(str(store))}"
    mount = f"mount --bind {shlex.quote(str(store))} {shlex.quote(str(store))}"
    remount = f"mount -o remount,bind,ro {shlex.quote(str(store))}"
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here to make a read-only mount")
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"{mount} && {remount} || exit 99; {fix}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 99 or "unshare" in proc.stderr:
        pytest.skip(f"cannot make a read-only mount here (needs root): {proc.stderr.strip()[:200]}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not writable" in lines[0], proc.stderr
    assert (store / "index").is_dir() and not list(store.glob("damaged-*")), "nothing moved"


def test_a_lost_index_is_never_replaced_by_an_empty_one(tmp_path):
    """A store whose index/ is gone still holds its blocks in segments/: an open (the
    library, any ppc command) must not make a fresh index there (the next sweep would
    take the segments for orphans); it names the rebuild instead, and the rebuild
    brings every block back."""
    import shutil

    from persistent_prefix_cache import PersistentPrefixCache, StoreCorruptError
    from persistent_prefix_cache.tiny_model import load_tiny_model, write_tiny_model

    model_dir = write_tiny_model(tmp_path / "model", seed=3)
    model = load_tiny_model(model_dir)
    store = tmp_path / "store"
    tokens = list(range(1, 50))
    from helpers import prefill

    with PersistentPrefixCache(store, model, block_size=16) as handle:
        handle.store(tokens, prefill(model, tokens)[1])
        handle.flush()
    segments = sorted(p.name for p in (store / "segments").rglob("*.seg"))
    assert segments
    shutil.rmtree(store / "index")
    with pytest.raises(StoreCorruptError, match="ppc check --fix"):
        PersistentPrefixCache(store, model, block_size=16)
    assert not (store / "index").exists()
    assert sorted(p.name for p in (store / "segments").rglob("*.seg")) == segments
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    stats = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert stats.returncode == 2 and "ppc check --fix" in stats.stderr and "Traceback" not in stats.stderr
    fix = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "check", "--fix", "--store", str(store)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert fix.returncode == 0, fix.stdout + fix.stderr
    with PersistentPrefixCache(store, model, block_size=16) as handle:
        cache, rest = handle.fetch(tokens)
        assert len(tokens) - len(rest) == len(tokens) - 1


def test_a_rebuild_keeps_the_block_size_when_no_block_is_full(tmp_path):
    """Every segment records the block size it was cut with: a rebuild takes it from
    there, not from the longest block (here every block is a short prompt's last)."""
    import shutil

    from persistent_prefix_cache.admin import StoreAdmin
    from persistent_prefix_cache.tiny_model import load_tiny_model, write_tiny_model

    model = load_tiny_model(write_tiny_model(tmp_path / "model", seed=4))
    store = tmp_path / "store"
    prompts = [list(range(s, s + 20)) for s in (1, 100)]
    with PersistentPrefixCache(store, model, block_size=64) as handle:
        for tokens in prompts:
            handle.store(tokens, prefill(model, tokens)[1])
    shutil.rmtree(store / "index")
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    fix = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "check", "--fix", "--store", str(store)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert fix.returncode == 0, fix.stdout + fix.stderr
    with StoreAdmin(str(store), readonly=True) as admin:
        assert admin.index.block_size == 64
    with PersistentPrefixCache(store, model) as handle:
        for tokens in prompts:
            assert len(tokens) - len(handle.fetch(tokens)[1]) == len(tokens) - 1


@pytest.mark.slow
def test_a_serving_process_on_a_damaged_index_gets_hits_or_misses(source, tiny_model_dir, tmp_path):
    """Before anyone runs `ppc check`: a process that opens the damaged store with the
    library and fetches every prompt gets one typed error at open, or exact hits and
    counted misses — never an exception from a fetch, never wrong KV. (An LMDB abort
    inside the process, on a page its reads meet, is counted: a known limit.)"""
    pages, lines = _sweep(source, tiny_model_dir, tmp_path, serve=True)
    served = [line["served"] for line in lines if "served" in line]
    figures = {
        "pages": pages,
        "refused_at_open": sum(s["refused_at_open"] for s in served),
        "fetches_exact": sum(s["exact"] for s in served),
        "fetches_missed": sum(s["misses"] for s in served),
        "fetch_errors": sum(len(s["errors"]) for s in served),
        "wrong_kv": sum(s["wrong"] for s in served),
        "aborts": sum("worker_died" in line for line in lines),
    }
    print("serving on a damaged index:", json.dumps(figures))
    assert figures["fetch_errors"] == 0, [s["errors"] for s in served if s["errors"]][:3]
    assert figures["wrong_kv"] == 0
    assert figures["fetches_exact"] > 0  # the sweep means something: most pages leave most prompts


@pytest.mark.slow
def test_damage_that_only_breaks_writes_is_one_line_not_a_traceback(source, tiny_model_dir, tmp_path):
    """Issue 29, item 11: a page whose damage only a write meets (``check``: "a write
    would fail"). ``ppc generate`` restores, then its writes (the new blocks, recency and
    hit counts, the fingerprint) fail: one line naming ``ppc check --fix``, counted in
    write_errors, exit 0; never a traceback."""
    import random
    import shutil

    from persistent_prefix_cache.admin.index_probe import probe_index

    clean = tmp_path / "clean"
    shutil.copytree(source["store"], clean)
    prompt = "A cache is a promise that the second time will be cheaper than the first."
    generate = ["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-tokens", "2", "--json"]
    _ppc(*generate, "--store", str(clean))  # stores the prompt, remembers the model's fingerprint
    store, found = tmp_path / "store", None
    for page in range(2, os.path.getsize(clean / "index" / "data.mdb") // PAGE):
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(clean, store)
        with open(store / "index" / "data.mdb", "r+b") as f:
            f.seek(page * PAGE)
            f.write(random.Random(page).randbytes(PAGE))
        damage = probe_index(str(store / "index")).damaged or ""
        if damage.startswith("a write would fail"):
            found = page
            break
    assert found is not None, "no page of this index breaks only writes: the case is not exercised"
    proc = _ppc(*generate, "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "index damaged" in line]
    assert len(said) == 1 and "ppc check --fix" in said[0] and "write" in said[0], proc.stderr
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert result["restored_tokens"] > 0 and result["new_blocks"] == 0
    # The library's handle counts it, and says it once however many writes fail.
    counts = run_python(
        """
        import json, sys
        sys.path.insert(0, sys.argv[3])
        from persistent_prefix_cache import PersistentPrefixCache
        from persistent_prefix_cache.tiny_model import load_tiny_model
        from helpers import prefill, random_tokens
        model = load_tiny_model(sys.argv[2])
        with PersistentPrefixCache(sys.argv[1], model, model_path=sys.argv[2]) as store:
            for seed in range(3):
                tokens = random_tokens(40, seed=9000 + seed, first=7)
                store.store(tokens, prefill(model, tokens)[1])
                store.flush()
            print(json.dumps(store.stats()))
        """,
        str(store),
        str(tiny_model_dir),
        str(HERE),
    )
    assert json.loads(counts.stdout.splitlines()[-1])["write_errors"] >= 3
    lines = [line for line in counts.stderr.splitlines() if line.strip()]
    assert "Traceback" not in counts.stderr and len([s for s in lines if "index damaged" in s]) == 1, counts.stderr

"""Crashes and hostile storage: kill -9 at each step of a write and inside the LMDB write
transaction, a damaged index file, a full LMDB map, a full disk, a file-size quota.

Writers are real processes (``store_worker.py``) that pause at a named point of the write
path (the ``pause_at`` test hook, see ``faults.py``) and are killed there with SIGKILL. Everything
afterwards is checked from other processes: what was committed restores bit for bit,
what was not is a miss, and what the crash left behind is swept, but never a file that a
live writer is still working on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import (
    BLOCK,
    assert_same_logits,
    assert_tree_consistent,
    segment_files,
    cold_logits,
    different_tokens,
    ppc_check,
    prefill,
    random_tokens,
    read_index,
    run_python,
    warm_logits,
)
from store_worker import Worker, wait_for_pause

from persistent_prefix_cache.disk.faults import hooks_value
from persistent_prefix_cache import PersistentPrefixCache

# -- shared set-up ----------------------------------------------------------------------


def _prompts() -> tuple[list[int], list[int], list[int]]:
    """A and B (committed before the crash, sharing a first block) and P, the prompt
    being written when the writer dies: it extends A's two full blocks with two blocks
    of its own, so only those two are at stake."""
    a = random_tokens(2 * BLOCK + 5, seed=200, first=1)
    b = a[:BLOCK] + different_tokens(BLOCK + 3, a[BLOCK], seed=201)
    p = a[: 2 * BLOCK] + different_tokens(BLOCK + 4, a[2 * BLOCK], seed=202)
    return a, b, p


@pytest.fixture
def committed(store_dir, model):
    """A store holding A and B, committed and closed; returns (A, B, P)."""
    a, b, p = _prompts()
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        for tokens in (a, b):
            store.store(tokens, prefill(model, tokens)[1])
    return a, b, p


def spec(model_dir, store_dir, steps, **options) -> dict:
    """A `store_worker` spec."""
    return {"model": str(model_dir), "store": str(store_dir), "steps": steps, **options}


def pause_env(point: str, marker) -> dict:
    return {"PPC_TEST_HOOKS": hooks_value(pause_at=point, pause_file=marker)}


def assert_fetch(store, model, query, matched: int) -> None:
    """`query` restores exactly `matched` tokens and continues like a cold prefill."""
    cache, remaining = store.fetch(query)
    assert len(query) - len(remaining) == matched
    assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, query))


def assert_restores(store_dir, model, expected: dict) -> None:
    """From disk only (a fresh handle, no RAM tier): each query restores as expected."""
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        for query, matched in expected.items():
            assert_fetch(store, model, list(query), matched)
        assert store.stats()["corrupt"] == 0


# -- 1. kill -9 at each step of a block write ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_rename", "before_commit", "after_commit"])
def test_kill9_during_a_write(tmp_path, store_dir, committed, model, tiny_model_dir, point):
    a, b, p = committed
    marker = tmp_path / "paused"
    before = read_index(store_dir)["nodes"]
    old_files = set(segment_files(store_dir))
    writer = Worker(
        spec(tiny_model_dir, store_dir, [["store", p], ["flush"]]),
        str(tmp_path),
        env=pause_env(point, marker),
    )
    try:
        wait_for_pause(str(marker), writer, point)
        in_flight = os.listdir(store_dir / "tmp")
        new_files = set(segment_files(store_dir)) - old_files
        if point == "before_rename":
            # P's two new blocks are written and fsynced under tmp/ (one segment),
            # named by the writer's pid; nothing is renamed yet.
            assert len(in_flight) == 1
            assert all(f".{writer.pid}." in name for name in in_flight)
            assert not new_files
            # A live writer's file survives another process's open and check --fix.
            with PersistentPrefixCache(store_dir, model) as other:
                other.flush()  # the open-time sweep has run
            code, report = ppc_check(store_dir, "--fix", "--grace", "0")
            assert code == 0 and report["clean"], report
            assert os.listdir(store_dir / "tmp") == in_flight
        elif point == "before_commit":
            assert not in_flight and len(new_files) == 1  # renamed, not committed
            assert read_index(store_dir)["nodes"].keys() == before.keys()
            # Young unreferenced files may be a live writer's: the open and the default
            # grace of check --fix leave them alone.
            with PersistentPrefixCache(store_dir, model) as other:
                other.flush()
            code, report = ppc_check(store_dir, "--fix")
            assert code == 0 and report["clean"], report
            assert new_files <= set(segment_files(store_dir))
        else:
            assert len(read_index(store_dir)["nodes"]) == len(before) + 2
    finally:
        writer.reap()
    assert writer.proc.returncode == -signal.SIGKILL

    if point == "before_rename":
        code, report = ppc_check(store_dir)
        assert code == 1
        assert [x["kind"] for x in report["problems"]] == ["leftover temporary file"]
        # The next open sweeps a dead writer's temporary file.
        with PersistentPrefixCache(store_dir, model) as store:
            store.flush()
        assert os.listdir(store_dir / "tmp") == []
    elif point == "before_commit":
        # A fresh open keeps young orphans (open-time grace: 600 s)...
        with PersistentPrefixCache(store_dir, model) as store:
            store.flush()
        assert new_files <= set(segment_files(store_dir))
        # ... and check --fix with no grace removes them.
        code, report = ppc_check(store_dir, "--fix", "--grace", "0")
        assert code == 0 and report["fixed"] and report["removed_files"] == 1, report
        assert report["removed_nodes"] == 0
        assert not new_files & set(segment_files(store_dir))
    code, report = ppc_check(store_dir)
    assert code == 0 and report["clean"], report
    assert_tree_consistent(store_dir)

    committed_p = point == "after_commit"
    assert_restores(
        store_dir,
        model,
        {
            tuple(a): len(a) - 1,
            tuple(b): len(b) - 1,
            # Uncommitted work is a miss: only A's two blocks serve P.
            tuple(p): len(p) - 1 if committed_p else 2 * BLOCK,
        },
    )


@pytest.mark.slow
def test_kill9_during_a_merge_of_a_chains_segments(tmp_path, store_dir, model, tiny_model_dir):
    # A prompt stored a block at a time: the second write's merge job writes one segment
    # of both blocks, then moves their records there. Killed before the move, the old
    # segments still serve, and the merged file is an orphan that check --fix removes.
    tokens = random_tokens(2 * BLOCK, seed=210, first=5)
    steps = [["store", tokens[:BLOCK]], ["flush"], ["store", tokens], ["flush"]]
    marker = tmp_path / "paused"
    writer = Worker(
        spec(tiny_model_dir, store_dir, steps, block_size=BLOCK), str(tmp_path), env=pause_env("before_move", marker)
    )
    try:
        wait_for_pause(str(marker), writer, "before_move")
        nodes = read_index(store_dir)["nodes"]
        in_index = {n.segment.hex() for n in nodes.values()}
        on_disk = {os.path.basename(f).split(".")[0] for f in segment_files(store_dir)}
        assert len(nodes) == 2 and len(in_index) == 2  # the records still name the old files
        assert len(on_disk - in_index) == 1 and in_index <= on_disk  # the merged file: written, unreferenced
    finally:
        writer.reap()
    assert writer.proc.returncode == -signal.SIGKILL
    code, report = ppc_check(store_dir, "--fix", "--grace", "0")
    assert code == 0 and report["removed_files"] == 1, report
    code, report = ppc_check(store_dir)
    assert code == 0 and report["clean"], report
    assert_tree_consistent(store_dir)
    assert {os.path.basename(f).split(".")[0] for f in segment_files(store_dir)} == in_index
    assert_restores(store_dir, model, {tuple(tokens + [7]): 2 * BLOCK})
    # The next write of the chain merges it (the store heals by itself).
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        more = tokens + random_tokens(2 * BLOCK, seed=211)
        store.store(more, prefill(model, more)[1])
    assert len(segment_files(store_dir)) == 1
    assert_restores(store_dir, model, {tuple(more + [7]): len(more)})


# -- 2. kill -9 inside the LMDB write transaction -------------------------------------------


@pytest.mark.slow
def test_kill9_inside_the_write_transaction(tmp_path, store_dir, committed, model, tiny_model_dir):
    a, b, _ = committed
    # R is new from its first block, so the writer's first write transaction is the
    # commit of R's blocks (a prompt extending stored blocks would first commit their
    # access times). Q is the next writer's prompt.
    r = random_tokens(2 * BLOCK + 4, seed=204, first=6)
    q = random_tokens(2 * BLOCK + 3, seed=203, first=5)
    marker = tmp_path / "paused"
    nodes_before = read_index(store_dir)["nodes"]
    # Another process keeps the store open across the crash: LMDB's lock file (and
    # the dead writer's hold on its write mutex) is not reset by a fresh first open.
    holder = Worker(
        spec(
            tiny_model_dir,
            store_dir,
            [["ready", "open"], ["wait"], ["fetch", a], ["fetch", r], ["fetch", q]],
        ),
        str(tmp_path),
        name="holder",
    )
    workers = [holder]
    try:
        holder.wait_ready("open")
        writer = Worker(
            spec(tiny_model_dir, store_dir, [["store", r], ["flush"]]),
            str(tmp_path),
            env=pause_env("in_write_txn", marker),
            name="writer",
        )
        workers.append(writer)
        wait_for_pause(str(marker), writer, "in_write_txn")
        writer.kill()
        assert writer.proc.returncode == -signal.SIGKILL

        # The next writer gets the lock the dead one held (bounded by the timeout).
        started = time.monotonic()
        following = Worker(
            spec(
                tiny_model_dir,
                store_dir,
                [["store", q], ["flush"], ["fetch", q], ["fetch", r]],
            ),
            str(tmp_path),
            name="next",
        )
        workers.append(following)
        result = following.result(timeout=60)
        assert time.monotonic() - started < 60
        assert result["steps"][0] == 3
        assert result["steps"][2] == {"matched": len(q) - 1, "exact": True}
        # The half transaction is invisible: R is a miss.
        assert result["steps"][3] == {"matched": 0, "exact": True}

        holder.go()
        seen = holder.result()["steps"][2:]
        assert seen == [
            {"matched": len(a) - 1, "exact": True},
            {"matched": 0, "exact": True},
            {"matched": len(q) - 1, "exact": True},
        ]
    finally:
        for w in workers:
            w.reap()

    nodes = read_index(store_dir)["nodes"]
    assert nodes.keys() > nodes_before.keys() and len(nodes) == len(nodes_before) + 3
    # R's segment was renamed into segments/ before the commit died: an orphan for check.
    code, report = ppc_check(store_dir, "--fix", "--grace", "0")
    assert code == 0 and report["removed_files"] == 1 and report["removed_nodes"] == 0
    assert ppc_check(store_dir)[1]["clean"]
    assert_tree_consistent(store_dir)
    assert_restores(
        store_dir,
        model,
        {tuple(a): len(a) - 1, tuple(b): len(b) - 1, tuple(q): len(q) - 1},
    )


@pytest.mark.parametrize(
    "readonly",
    [
        True,
        False,
    ],
    ids=["read_only", "writable"],
)
@pytest.mark.slow
def test_open_during_another_process_commit_does_not_wait(tmp_path, store_dir, committed, tiny_model_dir, readonly):
    a, _, _ = committed
    r = random_tokens(2 * BLOCK + 4, seed=204, first=6)  # new from its first block
    marker = tmp_path / "paused"
    writer = Worker(
        spec(tiny_model_dir, store_dir, [["store", r], ["flush"]]),
        str(tmp_path),
        env=pause_env("in_write_txn", marker),
        name="writer",
    )
    workers = [writer]
    try:
        wait_for_pause(str(marker), writer, "in_write_txn")
        # LMDB readers never wait for the writer; a handle that only reads need not
        # either (the store needs no migration and no fingerprint is remembered).
        reader = Worker(
            spec(tiny_model_dir, store_dir, [["fetch", a], ["fetch", r]], readonly=readonly),
            str(tmp_path),
            name="reader",
        )
        workers.append(reader)
        # The writer sleeps inside its transaction until it is killed: a reader that
        # waited for it would never finish. The bound only turns that hang into a
        # failure; it must leave room for a slow start (importing MLX on a loaded
        # machine took over 10 s).
        assert reader.result(timeout=300)["steps"] == [
            {"matched": len(a) - 1, "exact": True},
            {"matched": 0, "exact": True},
        ]
        assert writer.proc.poll() is None  # still inside its write transaction
    finally:
        for w in workers:
            w.reap()


# A process that reads the index (any LMDB client of the store: a tool, a server
# thread) and is killed inside its read transaction.
_DIES_READING = """
    import sys, time
    import lmdb
    env = lmdb.open(sys.argv[1], max_dbs=16)
    txn = env.begin()
    txn.get(b"meta")
    print("READY", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_reader_killed_mid_transaction_does_not_bloat_the_index(tmp_path, store_dir, committed, model, tiny_model_dir):
    # Regression: a reader slot left by a process killed mid-read was never cleared, so
    # LMDB could not reuse freed pages; a 5-minute soak with kills grew the index to
    # 700 MB for 72 MB of block files.
    a, _, _ = committed
    data = store_dir / "index" / "data.mdb"
    # Another process keeps the store open throughout: LMDB only resets its reader
    # table when the last process closes the store.
    holder = Worker(
        spec(tiny_model_dir, store_dir, [["ready", "open"], ["wait"]]),
        str(tmp_path),
        name="holder",
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_DIES_READING), str(store_dir / "index")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        holder.wait_ready("open")
        assert reader.stdout.readline().strip() == "READY"
        reader.kill()
        reader.wait(timeout=30)
        before = os.path.getsize(data)
        with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
            for i in range(200):  # each fetch's bookkeeping is one small commit
                store.fetch(a + [i])
                store.flush()
        grown = (os.path.getsize(data) - before) // 4096
        holder.go()
        holder.result()
    finally:
        holder.reap()
        if reader.poll() is None:
            reader.kill()
        reader.wait(timeout=30)
        reader.stdout.close()
    # With page reuse, 200 commits take a few dozen pages at most (~10 measured).
    assert grown < 100, f"the index grew by {grown} pages"


# -- 4. a damaged index file -------------------------------------------------------------------

# Open the store read-write and read-only, with a stand-in model (no MLX work needed to
# reach the index), and report what each open raised.
_OPEN_DAMAGED = """
    import json, sys, types
    from persistent_prefix_cache import PersistentPrefixCache
    model = types.SimpleNamespace(layers=[None, None])
    out = {}
    for mode in ("rw", "ro"):
        try:
            with PersistentPrefixCache(sys.argv[1], model, fingerprint="f",
                                       readonly=mode == "ro") as store:
                store.fetch(list(range(1, 40)))
            out[mode] = None
        except Exception as exc:
            out[mode] = [type(exc).__name__, str(exc)]
    print(json.dumps(out))
"""


def _zero_all(path):
    with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))


def _zero_after_meta(path):
    # The two meta pages survive, every tree page reads as zeros.
    with open(path, "r+b") as f:
        f.seek(2 * 4096)
        f.write(bytes(os.path.getsize(path) - 2 * 4096))


def _truncate_to(fraction: float, minus: int = 0):
    def damage(path):
        os.truncate(path, int(os.path.getsize(path) * fraction) - minus)

    return damage


INDEX_DAMAGE = {
    "zeroed": _zero_all,
    "truncated_to_nothing": _truncate_to(0),
    "truncated_to_half": _truncate_to(0.5),
    "truncated_by_one_byte": _truncate_to(1, minus=1),
    # Regression: LMDB's MDB_CORRUPTED used to escape as lmdb.CorruptedError.
    "zeroed_tree_pages": _zero_after_meta,
}


@pytest.fixture(scope="module")
def index_source(tiny_model_dir, tmp_path_factory):
    """A store with a few prompts, copied by each index-damage test."""
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(tiny_model_dir)
    path = tmp_path_factory.mktemp("index_source") / "store"
    with PersistentPrefixCache(path, model, block_size=BLOCK) as store:
        for i in range(6):
            tokens = random_tokens(3 * BLOCK, seed=210 + i, first=i)
            store.store(tokens, prefill(model, tokens)[1])
    return path


@pytest.mark.slow
@pytest.mark.parametrize("damage", INDEX_DAMAGE.values(), ids=INDEX_DAMAGE.keys())
def test_damaged_index_is_a_typed_error(tmp_path, index_source, damage):
    store = tmp_path / "store"
    shutil.copytree(index_source, store)
    damage(str(store / "index" / "data.mdb"))
    proc = run_python(_OPEN_DAMAGED, str(store), check=False)
    # Never a crash of the interpreter (SIGBUS on a short map, say).
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    out = json.loads(proc.stdout)
    for mode in ("rw", "ro"):
        assert out[mode] is not None, f"{mode} open of a damaged index succeeded"
        name, message = out[mode]
        assert name == "StoreCorruptError", out[mode]
        # The hint says what `ppc check --fix` will do, from how many segment files.
        assert str(store) in message and f"ppc check --fix --store {store}" in message, message
        assert "rebuilds the index from the 6 segment files" in message, message


# -- 5. the LMDB map fills up -------------------------------------------------------------------

SMALL_MAP = 256 * 1024


@pytest.mark.slow
def test_full_map_grows_and_other_processes_follow(tmp_path, store_dir, model, tiny_model_dir):
    block = 4  # small blocks: many index records per byte of KV
    first = random_tokens(3 * block, seed=220, first=1)
    # Enough records to outgrow 256 KiB of map a few times over.
    prompts = [random_tokens(48, seed=221 + i, first=2 + i) for i in range(40)]
    late = random_tokens(20, seed=299, first=100)
    with PersistentPrefixCache(store_dir, model, block_size=block) as store:
        store.store(first, prefill(model, first)[1])
    reader_steps = [["fetch", first], ["ready", "open"], ["wait"]]
    reader_steps += [["fetch", t] for t in [first, *prompts]]
    reader_steps += [["store", late], ["flush"], ["fetch", late]]
    # The reader opens (and maps 256 KiB) before the writer grows the map.
    reader = Worker(spec(tiny_model_dir, store_dir, reader_steps, initial_map_size=SMALL_MAP), str(tmp_path))
    writer = None
    try:
        reader.wait_ready("open")
        # A flush after each store: one commit each (stores queued together share one,
        # which would leave the map too little to outgrow).
        writer_steps = [step for t in prompts for step in (["store", t], ["flush"])] + [["stats"]]
        writer = Worker(
            spec(tiny_model_dir, store_dir, writer_steps, initial_map_size=SMALL_MAP), str(tmp_path), name="wr"
        )
        stats = writer.result(timeout=120)["steps"][-1]
        assert stats["write_errors"] == 0 and stats["blocks"] == 3 + 40 * 12
        # The file cannot outgrow the map: it grew.
        assert os.path.getsize(store_dir / "index" / "data.mdb") > SMALL_MAP
        reader.go()
        steps = reader.result(timeout=120)["steps"]
    finally:
        reader.reap()
        if writer is not None:
            writer.reap()
    fetched = [s for s in steps if isinstance(s, dict)]
    assert fetched[0] == {"matched": len(first) - 1, "exact": True}
    for got, tokens in zip(fetched[1:], [first, *prompts]):
        assert got == {"matched": len(tokens) - 1, "exact": True}
    assert steps[-3] == 5 and fetched[-1] == {"matched": len(late) - 1, "exact": True}
    # Nothing lost, seen from a process with the default map.
    assert ppc_check(store_dir)[1]["clean"]
    assert len(assert_tree_consistent(store_dir)) == 3 + 40 * 12 + 5
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        for tokens in (first, prompts[0], prompts[-1], late):
            assert_fetch(store, model, tokens, len(tokens) - 1)


# -- 6. disk full -------------------------------------------------------------------------------


def _snapshot_index(store_dir) -> dict:
    return {k: (n.segment, n.size) for k, n in read_index(store_dir)["nodes"].items()}


def _fill(folder) -> str:
    """Fill the file system holding `folder` to the last byte; returns the filler."""
    filler = os.path.join(folder, "filler")
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\xff" * 65536
        while chunk:
            try:
                f.write(chunk)
            except OSError:
                chunk = chunk[: len(chunk) // 2]  # top up what is left
    return filler


def test_disk_full_fails_cleanly(small_tmpfs, model):
    store_dir = small_tmpfs / "store"
    a = random_tokens(2 * BLOCK + 5, seed=230, first=1)
    p = random_tokens(3 * BLOCK + 2, seed=231, first=2)
    store = PersistentPrefixCache(store_dir, model, block_size=BLOCK)
    try:
        store.store(a, prefill(model, a)[1])
        store.flush()
        index_before, files_before = _snapshot_index(store_dir), segment_files(store_dir)
        filler = _fill(small_tmpfs)
        store.store(p, prefill(model, p)[1])  # never raises: the write is background work
        store.flush()
        stats = store.stats()
        assert stats["write_errors"] >= 1
        assert os.listdir(store_dir / "tmp") == []  # the partial file went
        assert _snapshot_index(store_dir) == index_before
        assert segment_files(store_dir) == files_before
        # Reads keep serving, and generation goes on uncached.
        assert_fetch(store, model, a, len(a) - 1)
        assert_fetch(store, model, p, 0)
        # Once there is room again, the same prompt is stored.
        os.unlink(filler)
        assert store.store(p, prefill(model, p)[1]) == 4
        store.flush()
        assert_fetch(store, model, p, len(p) - 1)
    finally:
        store.close()
    assert ppc_check(store_dir)[1]["clean"]
    assert_tree_consistent(store_dir)


@pytest.mark.parametrize(
    "limit, failure",
    [(4096, "could not write blocks"), (24576, "could not commit blocks")],
    ids=["block_file_fails", "index_commit_fails"],
)
@pytest.mark.slow
def test_file_size_quota_fails_cleanly(tmp_path, store_dir, committed, model, tiny_model_dir, limit, failure):
    # P's segment (two blocks) is ~17 KiB: at 4 KiB its own write fails; at 24 KiB it
    # is written and renamed, but the index commit (pages past 24 KiB of data.mdb) fails.
    a, b, p = committed
    index_before, files_before = _snapshot_index(store_dir), segment_files(store_dir)
    steps = [
        ["fsize_limit", limit],
        ["store", p],
        ["flush"],
        ["stats"],
        ["fetch", a],
        ["fetch", p],
    ]
    worker = Worker(spec(tiny_model_dir, store_dir, steps, memory_bytes=64 << 20), str(tmp_path))
    try:
        result = worker.result(timeout=120)
    finally:
        worker.reap()
    assert failure in worker.stderr()  # the step of the write path that was refused
    store_step, stats, fetch_a, fetch_p = result["steps"][1], *result["steps"][3:]
    assert store_step == 2 and stats["write_errors"] >= 1
    assert fetch_a == {"matched": len(a) - 1, "exact": True}
    assert fetch_p == {"matched": 2 * BLOCK, "exact": True}  # P's own blocks: uncached
    assert os.listdir(store_dir / "tmp") == []
    assert _snapshot_index(store_dir) == index_before
    # A segment that could not be committed is removed at once (its id is this
    # writer's alone); nothing else on disk changed.
    left = set(segment_files(store_dir)) - set(files_before)
    assert len(left) == 0
    assert {k: v for k, v in segment_files(store_dir).items() if k in files_before} == files_before
    code, report = ppc_check(store_dir, "--fix", "--grace", "0")
    assert code == 0 and report["removed_files"] == len(left) and report["removed_nodes"] == 0
    assert ppc_check(store_dir)[1]["clean"]
    assert_tree_consistent(store_dir)

"""Many processes and threads on one store, fork(), and one store opened twice.

- Four processes x four threads store and fetch overlapping prompts for ten seconds
  (``tools/soak.py`` without kills): every fetch continues exactly like a cold prefill,
  ``ppc check`` is clean, every block file is referenced exactly once and the recorded
  bytes equal the files on disk.
- A process that forked after opening a store: the child opens it anew and works; the
  handle it inherited refuses to be used, with a clear error.
- One store opened twice in one process shares one LMDB environment safely.
- Races: the LMDB map growing under the store's other threads; a writer whose commit
  fails, or who removes a block, while another writer commits the same (content-named)
  files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import lmdb
import pytest
from helpers import (
    BLOCK,
    assert_same_logits,
    assert_tree_consistent,
    segment_files,
    cold_logits,
    ppc_check,
    prefill,
    random_tokens,
    read_index,
    run_python_json,
    warm_logits,
)

import persistent_prefix_cache.disk.index_env as index_module
from persistent_prefix_cache import PersistentPrefixCache, ReadOnlyStoreError
from persistent_prefix_cache.disk.faults import acting_at
from persistent_prefix_cache.fingerprint import fingerprint_model

SOAK = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "soak.py")


def assert_fetch(store, model, query, matched: int) -> None:
    """`query` restores exactly `matched` tokens and continues like a cold prefill."""
    cache, remaining = store.fetch(query)
    assert len(query) - len(remaining) == matched
    assert_same_logits(warm_logits(model, cache, remaining), cold_logits(model, query))


# -- 8. four processes x four threads ---------------------------------------------------------


@pytest.mark.slow
def test_four_processes_four_threads_on_one_store(tmp_path, tiny_model_dir):
    store_dir = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, SOAK, "--seconds", "10", "--procs", "4", "--threads", "4"]
        # At least 8 operations per thread (128 in all) however slowly the workers start:
        # the assertions below count operations, so the run must not depend on the clock.
        + ["--min-ops", "8", "--no-kills"]
        + ["--store", str(store_dir), "--model", str(tiny_model_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads(proc.stdout)
    if proc.returncode != 0 or not summary["ok"]:
        # Whole (an assertion's message is cut short): which check failed, and the
        # traceback of a worker that died on its own.
        pytest.fail(json.dumps(summary, indent=1), pytrace=False)
    # Every fetch was compared with a cold prefill by the worker that made it.
    assert summary["operations"] > 100 and summary["full_hits"] > 0
    assert summary["corrupt_served"] == 0 and summary["errors"] == 0
    assert summary["store_write_errors"] == 0
    # Without kills there is nothing to sweep: clean before any fix.
    assert summary["check"]["problems_by_kind"] == {}
    assert summary["verify"]["wrong"] == 0 and summary["verify"]["hits"] > 0

    code, report = ppc_check(store_dir)
    assert code == 0 and report["clean"]
    # No duplicate blocks: one record per key (LMDB keys), every segment file
    # referenced and counted (assert_tree_consistent); recorded bytes and count equal
    # the nodes', and the files on disk the recorded segment bytes.
    nodes = assert_tree_consistent(store_dir)
    assert read_index(store_dir)["totals"] == (sum(n.size for n in nodes.values()), len(nodes))
    assert read_index(store_dir)["file_bytes"] == sum(segment_files(store_dir).values())


# -- 10. fork() --------------------------------------------------------------------------------

# The parent opens the store with a stand-in model (the real fingerprint passed in), so
# it never evaluates anything with MLX before the fork: MLX cannot evaluate in a child
# forked after it ran. The child may then use MLX freely.
_FORK = """
    import json, os, sys, threading, time, types
    from persistent_prefix_cache import PersistentPrefixCache, ReadOnlyStoreError

    store_path, fingerprint, model_dir, prompt, new = (
        sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
    )
    stand_in = types.SimpleNamespace(layers=[None, None])
    parent_store = PersistentPrefixCache(store_path, stand_in, fingerprint=fingerprint)
    blocks_before = parent_store.stats()["blocks"]
    result_path = store_path + ".child.json"

    def attempt(call):
        # In a thread with a deadline: a call that hangs is reported, not waited for.
        box = {}
        def run():
            try:
                call()
                box["r"] = "returned"
            except Exception as exc:
                box["r"] = [type(exc).__name__, str(exc)]
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        return box.get("r", "hung")

    pid = os.fork()
    if pid == 0:
        out = {}
        try:
            out["inherited"] = {
                "fetch": attempt(lambda: parent_store.fetch(prompt)),
                "store": attempt(lambda: parent_store.store(prompt, [])),
                "stats": attempt(parent_store.stats),
                "sweep_orphans": attempt(lambda: parent_store.sweep_orphans(grace=600)),
                "flush": attempt(parent_store.flush),
            }
            import mlx.core as mx
            from mlx_lm.models.cache import make_prompt_cache
            from persistent_prefix_cache.tiny_model import load_tiny_model

            model = load_tiny_model(model_dir)
            def cold(tokens):
                return model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]
            with PersistentPrefixCache(store_path, model) as store:
                cache, rest = store.fetch(prompt)
                warm = model(mx.array(rest)[None], cache=cache)[0, -1]
                out["fetch"] = [len(prompt) - len(rest), mx.array_equal(warm, cold(prompt)).item()]
                cache = make_prompt_cache(model)
                model(mx.array(new)[None], cache=cache)
                out["stored"] = store.store(new, cache)
            out["inherited_close"] = attempt(parent_store.close)
        except BaseException as exc:
            out["error"] = repr(exc)
        with open(result_path, "w") as f:
            json.dump(out, f)
        os._exit(0)

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = "killed after 120 s"
    out = {"child_status": status}
    if os.path.exists(result_path):
        out["child"] = json.load(open(result_path))
    # The parent's handle still works after the fork, and sees the child's block.
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from persistent_prefix_cache.tiny_model import load_tiny_model
    model = load_tiny_model(model_dir)
    cache, rest = parent_store.fetch(new + [1])
    warm = model(mx.array(rest)[None], cache=cache)[0, -1]
    cold = model(mx.array(new + [1])[None], cache=make_prompt_cache(model))[0, -1]
    out["parent"] = {
        "blocks_before": blocks_before,
        "blocks_after": parent_store.stats()["blocks"],
        "fetch_new": [len(new) + 1 - len(rest), mx.array_equal(warm, cold).item()],
    }
    parent_store.close()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def forked(tiny_model_dir, model, tmp_path_factory):
    """Run the fork scenario once; return (prompt, new prompt, report)."""
    store_dir = tmp_path_factory.mktemp("fork") / "store"
    prompt = random_tokens(2 * BLOCK + 5, seed=400, first=1)
    new = random_tokens(BLOCK + 2, seed=401, first=2)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.store(prompt, prefill(model, prompt)[1])
    report = run_python_json(
        _FORK,
        str(store_dir),
        fingerprint_model(model),
        str(tiny_model_dir),
        json.dumps(prompt),
        json.dumps(new),
    )
    assert report["child_status"] == 0, report
    assert "error" not in report["child"], report["child"]
    return prompt, new, report


@pytest.mark.slow
def test_child_of_a_fork_opens_the_store_anew(forked):
    prompt, new, report = forked
    child = report["child"]
    assert child["fetch"] == [len(prompt) - 1, True]
    assert child["stored"] == 2
    assert child["inherited_close"] == "returned"  # closing a copy is harmless
    # The parent's handle survived the child and sees what the child stored.
    parent = report["parent"]
    assert parent["blocks_after"] == parent["blocks_before"] + 2
    assert parent["fetch_new"] == [len(new), True]


@pytest.mark.slow
@pytest.mark.parametrize("call", ["fetch", "store"])
def test_inherited_handle_refuses_use_in_the_child(forked, call):
    outcome = forked[2]["child"]["inherited"][call]
    assert outcome[0] == "InvalidArgumentError"
    assert "fork" in outcome[1] and "open the store again" in outcome[1]


@pytest.mark.slow
@pytest.mark.parametrize("call", ["stats", "sweep_orphans", "flush"])
def test_inherited_handle_refuses_every_call_in_the_child(forked, call):
    # Regression: stats() and sweep_orphans() raised lmdb.Error, flush() hung forever
    # (it waited on the parent's writer thread, which does not exist in the child).
    outcome = forked[2]["child"]["inherited"][call]
    assert outcome != "hung" and outcome[0] == "InvalidArgumentError", outcome


# -- one store opened twice in one process ----------------------------------------------------


def test_same_store_opened_twice_in_one_process(store_dir, model):
    a = random_tokens(2 * BLOCK + 3, seed=410, first=1)
    b = random_tokens(BLOCK + 5, seed=411, first=2)
    first = PersistentPrefixCache(store_dir, model, block_size=BLOCK)
    second = PersistentPrefixCache(store_dir, model, memory_bytes=0)
    try:
        first.store(a, prefill(model, a)[1])
        first.flush()
        assert_fetch(second, model, a, len(a) - 1)  # committed by one, read by the other
        first.close()  # the shared environment stays open for the other handle
        assert second.store(b, prefill(model, b)[1]) == 2
        second.flush()
        assert_fetch(second, model, b, len(b) - 1)
        assert second.stats()["write_errors"] == 0
    finally:
        first.close()
        second.close()
    index_path = os.path.realpath(store_dir / "index")
    assert not any(path == index_path for _, path in index_module._ENVS)  # released
    assert_tree_consistent(store_dir)


def test_writable_handle_after_a_readonly_one_in_one_process(store_dir, model):
    # Regression: the writable handle silently shared the read-only handle's read-only
    # LMDB environment, and every commit failed. One process holds one environment per
    # store, so the writable handle is now refused up front, saying what to do.
    a = random_tokens(BLOCK + 3, seed=412, first=1)
    b = random_tokens(BLOCK + 3, seed=413, first=2)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.store(a, prefill(model, a)[1])
    with PersistentPrefixCache(store_dir, model, readonly=True) as ro:
        with pytest.raises(ReadOnlyStoreError, match="open the writable handle first"):
            PersistentPrefixCache(store_dir, model)
        assert_fetch(ro, model, a, len(a) - 1)  # the read-only handle is unharmed
    # The other order works: writable first, then read-only, both usable.
    with PersistentPrefixCache(store_dir, model) as writable:
        with PersistentPrefixCache(store_dir, model, readonly=True, memory_bytes=0) as ro:
            writable.store(b, prefill(model, b)[1])
            writable.flush()
            assert writable.stats()["write_errors"] == 0
            assert_fetch(ro, model, b, len(b) - 1)


# -- races -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_map_growth_under_concurrent_fetches(tmp_path, model, monkeypatch):
    # Regression: growing the map (set_mapsize) invalidated the read transactions of the
    # store's other threads: fetch() and store() raised lmdb errors, and a thread could
    # keep failing afterwards (seen in the soak with the default map size).
    # The map size is read when an environment opens: start tiny so that it grows
    # every few dozen blocks, and start over with a fresh store after three doublings
    # (the early ones are quick), for a fixed number of rounds or until a call failed:
    # the same work however loaded the machine (a deadline would test less there).
    monkeypatch.setattr(index_module, "INITIAL_MAP_SIZE", 32 * 1024)
    errors: list[str] = []
    for round_ in range(1, 5):  # the bug showed within ~2 s (a round or two) in every trial
        if errors:
            break
        store = PersistentPrefixCache(tmp_path / f"store{round_}", model, block_size=4)
        stop = threading.Event()

        def fetch_loop():
            while not stop.is_set():
                try:
                    # Shorter than a block: the lookup scans the root's children,
                    # so the read transaction is open most of the time.
                    store.fetch([3, 3])
                except Exception as exc:  # what the caller of fetch() gets
                    errors.append(repr(exc))
                time.sleep(0.0002)  # let the storing thread run

        threads = [threading.Thread(target=fetch_loop) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            i = 0
            while not errors:
                # The index's file past four maps of 32 KiB: the map has doubled three times.
                if os.path.getsize(tmp_path / f"store{round_}" / "index" / "data.mdb") > 4 * 32 * 1024:
                    break
                tokens = random_tokens(8, seed=1000 + i, first=i % 512)
                i += 1
                try:
                    store.store(tokens, prefill(model, tokens)[1])
                    if i % 4 == 0:
                        store.flush()
                except Exception as exc:
                    errors.append(repr(exc))
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
            store.close()
    assert errors == []


def test_an_action_runs_where_a_thread_passes_its_point_while_it_is_set():
    from persistent_prefix_cache.disk.faults import pause_point

    seen = []
    with acting_at("before_commit", lambda: seen.append(threading.current_thread().name)):
        pause_point("after_commit")  # another point: nothing
        pause_point("before_commit")
        worker = threading.Thread(target=pause_point, args=("before_commit",), name="writer")
        worker.start()
        worker.join()
        with pytest.raises(ValueError, match="already set"):
            with acting_at("before_commit", lambda: None):
                pass
    pause_point("before_commit")  # the block ended: nothing runs
    assert seen == [threading.current_thread().name, "writer"]

    def refuse():
        raise lmdb.Error("refused")

    with acting_at("in_write_txn", refuse):
        with pytest.raises(lmdb.Error, match="refused"):
            pause_point("in_write_txn")  # what the action raises is raised at the point


def test_failed_commit_keeps_another_writers_committed_file(store_dir, model):
    # Regression: a writer whose index commit failed used to unlink its files by name,
    # and the name is shared by every writer of the block (key and checksum).
    prompt = random_tokens(2 * BLOCK + 3, seed=430, first=1)
    cache = prefill(model, prompt)[1]
    winner = PersistentPrefixCache(store_dir, model, block_size=BLOCK)
    loser = PersistentPrefixCache(store_dir, model, memory_bytes=0)
    losing = []  # the loser's writer thread, once it reached its commit

    def winner_commits_first():
        # While the loser's files (same names as the winner's) wait for their commit,
        # the winner stores and commits the same blocks (its own commit passes here too).
        if losing:
            return
        losing.append(threading.current_thread())
        if winner.store(prompt, cache):
            winner.flush()

    def commit_refused():
        # Then the loser's index commit fails, as on a full disk.
        if threading.current_thread() in losing:
            raise lmdb.Error("mdb_txn_commit: No space left on device (simulated)")

    try:
        with acting_at("before_commit", winner_commits_first), acting_at("in_write_txn", commit_refused):
            assert loser.store(prompt, cache) == 3
            loser.flush()
        assert losing and loser.stats()["write_errors"] >= 1
        assert winner.stats()["write_errors"] == 0 and winner.stats()["blocks_written"] == 3
    finally:
        loser.close()
        winner.close()
    # The winner's committed blocks must still be whole.
    code, report = ppc_check(store_dir)
    assert code == 0 and report["clean"], report
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        assert_fetch(store, model, prompt, len(prompt) - 1)


def test_unlink_after_a_removal_keeps_a_block_stored_again_meanwhile(store_dir, model):
    tokens = random_tokens(2 * BLOCK, seed=440, first=1)
    short = tokens[: BLOCK + 4]  # one full block and a partial leaf L
    short_cache = prefill(model, short)[1]
    # Y has no RAM tier: it must look in the index, where L will be gone.
    y = PersistentPrefixCache(store_dir, model, block_size=BLOCK, memory_bytes=0)
    x = PersistentPrefixCache(store_dir, model)
    calls = []

    def y_stores_l_again():
        # X committed the full second block, which supersedes L (its record is gone);
        # before X unlinks what that commit freed, Y stores L again (same key, bytes).
        # Y's own commit passes here too.
        if calls:
            return
        calls.append(threading.current_thread())
        assert y.store(short, short_cache) == 1
        y.flush()

    try:
        y.store(short, short_cache)
        y.flush()
        with acting_at("after_commit", y_stores_l_again):
            x.store(tokens, prefill(model, tokens)[1])
            x.flush()
        assert calls and y.stats()["blocks_written"] == 3 and y.stats()["write_errors"] == 0
    finally:
        x.close()
        y.close()
    # Y's committed record of L must still have its file.
    code, report = ppc_check(store_dir)
    assert code == 0 and report["clean"], report
    with PersistentPrefixCache(store_dir, model, memory_bytes=0) as store:
        assert_fetch(store, model, short + [7], len(short))
        assert store.stats()["corrupt"] == 0

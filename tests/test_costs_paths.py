"""The cost model's memory and its sources: costs persist in the store per model and
device kind across a real process restart, and every user path feeds them (`prefill`,
``ppc generate``, ``ppc serve`` through a real server process and HTTP request, the
vllm-mlx and mlx-lm compat layers). Nothing here decides by timing: the tests check
that a measurement arrived and was kept, never its value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import BLOCK, counted_forwards, prefill, random_tokens, run_python_json
from test_serve import FIRST, OTHER, SHAPE, SYSTEM, Server

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.compat.prefix_cache import PrefixCacheManager
from persistent_prefix_cache.core.cost_model import FILE_NAME
from persistent_prefix_cache.device.target import device_kind
from persistent_prefix_cache.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.tiny_model import write_tiny_model

FIGURES = ("prefill_tokens_per_s", "prefill_growth", "restore_bytes_per_s_disk", "restore_fixed_s_disk")

SHOW = """
import json, sys
from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.tiny_model import load_tiny_model
store = PersistentPrefixCache(sys.argv[1], load_tiny_model(sys.argv[2]))
if len(sys.argv) > 3:  # teach: set the rates as a benchmark would
    store.costs.learned.set_prefill(1234.0, 1e-7)
    store.costs.learned.set_restore({"disk": 5e8}, {"disk": 0.002})
stats = store.stats()
store.close()
print(json.dumps({k: stats[k] for k in %r + ("cost_device",)}))
""" % (FIGURES,)


def _records(store_dir) -> dict:
    with open(os.path.join(store_dir, FILE_NAME)) as f:
        return json.load(f)["models"]


@pytest.mark.slow
def test_costs_persist_across_a_restart_per_device_kind(store_dir, model, tiny_model_dir):
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK):
        pass  # make the store
    taught = run_python_json(SHOW, str(store_dir), str(tiny_model_dir), "teach")
    assert taught["prefill_tokens_per_s"] is not None and taught["cost_device"] == device_kind()
    again = run_python_json(SHOW, str(store_dir), str(tiny_model_dir))  # a fresh process
    for key in FIGURES:
        assert again[key] == pytest.approx(taught[key]), key
    # Measured on another device kind: never used here (and kept for that device).
    models = _records(store_dir)
    (root,) = models
    models[root] = {"gpu:Some Other GPU": models[root][device_kind()]}
    with open(os.path.join(store_dir, FILE_NAME), "w") as f:
        json.dump({"version": 1, "models": models}, f)
    other = run_python_json(SHOW, str(store_dir), str(tiny_model_dir))
    assert all(other[key] is None for key in FIGURES)
    assert "gpu:Some Other GPU" in _records(store_dir)[root]
    # Too old: measured again rather than trusted.
    record = dict(models[root]["gpu:Some Other GPU"], saved=time.time() - 400 * 24 * 3600)
    with open(os.path.join(store_dir, FILE_NAME), "w") as f:
        json.dump({"version": 1, "models": {root: {device_kind(): record}}}, f)
    assert run_python_json(SHOW, str(store_dir), str(tiny_model_dir))["prefill_tokens_per_s"] is None
    # Damaged: ignored, never an error.
    with open(os.path.join(store_dir, FILE_NAME), "w") as f:
        f.write("{not json")
    assert run_python_json(SHOW, str(store_dir), str(tiny_model_dir))["prefill_tokens_per_s"] is None


def test_a_readonly_store_never_writes_its_costs(store_dir, model):
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK):
        pass
    with PersistentPrefixCache(store_dir, model, readonly=True) as store:
        store.costs.learned.set_prefill(99.0)
    assert not os.path.exists(os.path.join(store_dir, FILE_NAME))


def test_prefill_and_calibrate_feed_and_keep_the_model(store_dir, model, monkeypatch):
    from persistent_prefix_cache.prefill import prefill as block_prefill

    tokens = random_tokens(4 * BLOCK + 3, seed=910)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        block_prefill(model, tokens, store)
        # Timed (whether two forwards of the tiny model price a token is the machine's say).
        assert store.costs.learned.measured
        store.costs.learned.set_prefill(1000.0)  # priced: the first forward below is judged by it
        # A second prefill restores, then times the first forward on the restored cache.
        block_prefill(model, tokens + random_tokens(BLOCK, seed=911), store)
        assert store.stats()["first_forward_s_per_token"] is not None
    forwards = counted_forwards(model, monkeypatch)
    with PersistentPrefixCache(store_dir, model) as store:
        assert store.costs.learned.measured  # remembered: nothing to measure
        assert store.calibrate(model, tokens=32, only_if_unknown=True) == store.costs.learned.prefill_tokens_per_s
        assert forwards == []
    with PersistentPrefixCache(os.path.join(store_dir, "..", "fresh"), model, block_size=BLOCK) as store:
        assert store.calibrate(model, tokens=32, only_if_unknown=True) > 0  # measured, or as this machine did


def test_ppc_generate_feeds_the_model(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "generate", "--model", str(tiny_model_dir),
         "--store", str(store), "--block-size", str(BLOCK), "--prompt", "hello " * 40,
         "--max-tokens", "2", "--temp", "0", "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (per_device,) = _records(store).values()
    assert per_device[device_kind()]["prefill"][0] > 0  # a prefill was observed and kept


def test_the_vllm_mlx_layer_calibrates_once_and_keeps_it(store_dir, model, tmp_path, monkeypatch):
    from persistent_prefix_cache.core import machine_costs

    monkeypatch.setattr(machine_costs, "FOLDER", str(tmp_path / "machine"))  # nothing measured before
    tokens = random_tokens(20 * BLOCK, seed=912)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.store(tokens, prefill(model, tokens)[1])  # filled without timing its prefill
    counted_forwards(model, monkeypatch)
    manager = PrefixCacheManager(model, store=str(store_dir))
    manager.fetch_cache(tokens + [1])  # the first read of this model on this device that finds a prefix
    assert manager.store.stats()["prefill_tokens_per_s"] is not None
    manager.close()
    (per_device,) = _records(store_dir).values()
    assert device_kind() in per_device
    assert os.listdir(tmp_path / "machine") == [machine_costs.FILE_NAME]  # and for every store of it here


def test_the_lru_layer_times_the_prefill_between_a_read_and_a_prompt_write(store_dir, model):
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        lru = PersistentLRUPromptCache(store)
        prompt = random_tokens(3 * BLOCK, seed=913)
        cache, rest = lru.fetch_nearest_cache("m", prompt)
        assert cache is None and store.stats()["prefill_tokens_per_s"] is None
        lru.insert_cache("m", prompt[: 2 * BLOCK], prefill(model, prompt[: 2 * BLOCK])[1])  # a prompt segment
        assert store.stats()["prefill_tokens_per_s"] is not None
        # A write holding generated tokens also holds their decoding: it teaches nothing.
        store.costs.learned.prefill_tokens_per_s = None
        longer = prompt + [5, 6]
        lru.fetch_nearest_cache("m", prompt + [9] * BLOCK)
        lru.insert_cache("m", longer, prefill(model, longer)[1])
        assert store.stats()["prefill_tokens_per_s"] is None


@pytest.fixture(scope="module")
def costs_serve_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("costs_serve_model"), seed=0, **SHAPE)


@pytest.mark.slow
def test_serve_measures_once_per_model_and_machine_where_it_may_restore(costs_serve_model_dir, tmp_path, monkeypatch):
    measured = "cost model: measured the prefill"
    # A system prompt long enough to be worth a calibration (288 tokens and more).
    longer = [{"role": "system", "content": " ".join([SYSTEM] * 5)}, OTHER[1]]
    machine = tmp_path / "xdg" / "persistent-prefix-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # this machine has measured nothing yet
    store = tmp_path / "store"
    # A new store has nothing to decide: no calibration; the first request's prefill teaches the rate.
    with Server(costs_serve_model_dir, store, tmp_path / "one.log") as server:
        server.chat(FIRST)
        assert server.stop() == 0
        assert measured not in server.log()
    (per_device,) = _records(store).values()
    # Taught by a request's time: kept apart from timed forwards (it holds more than them).
    assert per_device[device_kind()]["prefill_requests"][0] > 0 and per_device[device_kind()]["prefill"][0] == 0
    assert per_device[device_kind()]["timed_forwards"] is False
    assert per_device[device_kind()]["first_forward_per_token"] is None
    with Server(costs_serve_model_dir, store, tmp_path / "two.log") as server:
        server.chat(OTHER)  # the same system prompt: restored from the store
        assert server.stop() == 0
        assert server.restored() and measured not in server.log()  # remembered
    # The time from a restoring read to the server's next write holds its whole request
    # (merging into the batch, sampling), not a first forward's own cost: it teaches
    # nothing (as a first forward's cost it made a CPU server skip every 512-token
    # restore, 80 x faster than the prefill, after one 2k prompt; tools/user_paths.py row 5).
    (per_device,) = _records(store).values()
    assert per_device[device_kind()]["first_forward_per_token"] is None
    # A store that holds the model's blocks and no rate (made on another machine): a read
    # that finds a prefix too short to be worth it restores without measuring; one worth
    # it measures, once, said once with its duration, and kept for this machine...
    with Server(costs_serve_model_dir, store, tmp_path / "fill.log") as server:
        server.chat(longer)
        assert server.stop() == 0
    os.remove(store / FILE_NAME)
    # (Its forwards timed by a clock of their own: those of the tiny model are bound by their
    # calls, and on a busy machine priced a token at nothing, which keeps no rate.)
    with Server(costs_serve_model_dir, store, tmp_path / "three.log", counted=True) as server:
        server.chat(FIRST)
        assert server.restored() and measured not in server.log()
        server.chat([longer[0], FIRST[1]])
        assert server.stop() == 0
        assert len(server.restored()) == 2 and server.restored()[1] >= 288
        said = [line for line in server.log().splitlines() if measured in line]
        assert len(said) == 1 and " s: " in said[0] and str(machine) in said[0], said
    assert os.listdir(machine) == ["prefill.json"]
    # ... so the next such store takes the rate from there: no forward, nothing said.
    os.remove(store / FILE_NAME)
    with Server(costs_serve_model_dir, store, tmp_path / "four.log") as server:
        server.chat(longer)
        assert server.stop() == 0
        assert server.restored() and measured not in server.log()
    (per_device,) = _records(store).values()
    assert per_device[device_kind()]["prefill"][0] > 0


RUNS = """
import json, sys
from persistent_prefix_cache import PersistentPrefixCache, prefill
from persistent_prefix_cache.tiny_model import load_tiny_model
model, tokens = load_tiny_model(sys.argv[2]), json.loads(sys.argv[3])
with PersistentPrefixCache(sys.argv[1], model, block_size=int(sys.argv[4])) as store:
    seen = []
    for _ in range(3):
        prefill(model, tokens, store)
        seen.append([store.last_fetch.restored, store.last_fetch.tier, store.last_fetch.reason])
    if len(sys.argv) > 5:  # the tiers' rates, as a GPU's restores of an 8B model teach them
        store.costs.learned.set_restore({"ram": 3e10, "disk": 3e9}, {"ram": 1e-3, "disk": 5e-3})
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_a_prompt_prefilled_once_is_restored_in_every_later_process(store_dir, tiny_model_dir, tmp_path, monkeypatch):
    # The README's path, a process at a time: prefill() on an empty store, then new processes
    # that call it three times. The first process runs two forwards: the prompt but its last
    # token (a process's first forward compiles kernels: not timed) and that last token alone
    # (timed), a forward bound by its call, which prices a token at nothing. Taken as the prefill's
    # cost, that made every restore look worthless: once the tiers' rates were known (the
    # tiny model's restores are too small to teach them; a GPU's teach them in one process)
    # every later call recomputed what the store held (an H100 and an 8B model: 30 ms
    # against 11 ms from the RAM tier at 512 tokens). A fit that cannot price a token
    # decides nothing: the store restores, as before anything was timed. (Nothing measured on
    # this machine before, which a restore would take the rate from; and a prompt too short
    # for a restore to measure the prefill itself: under 288 tokens.)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokens = random_tokens(5 * BLOCK + 3, seed=920)
    args = (str(store_dir), str(tiny_model_dir), json.dumps(tokens), str(BLOCK))
    first = run_python_json(RUNS, *args, "teach")
    assert first[0] == [0, None, "never_stored"] and first[1][:2] == [len(tokens) - 1, "ram"]
    # On a CPU a block read from disk joins the RAM tier at its second read.
    whole = len(tokens) - 1
    assert run_python_json(RUNS, *args) == [[whole, "disk", None], [whole, "disk", None], [whole, "ram", None]]


def test_a_prefill_never_priced_is_measured_at_the_first_resume(store_dir, model, tmp_path, monkeypatch):
    # A prompt prefilled once per process is one forward (a process's first: not taught, it
    # compiles kernels) and its last token (which prices nothing): the store would restore
    # blind for ever. The first restore of prefill() measures the prefill, once.
    from persistent_prefix_cache.core import costs, machine_costs
    from persistent_prefix_cache.prefill import prefill as block_prefill

    monkeypatch.setattr(machine_costs, "FOLDER", str(tmp_path / "machine"))  # nothing measured before
    forwards = counted_forwards(model, monkeypatch)
    tokens = random_tokens(20 * BLOCK + 3, seed=913)  # restored, more than calibration's floor (288)
    monkeypatch.setattr(costs, "_restored_here", set())  # a new process
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        block_prefill(model, tokens, store)
        assert forwards == [len(tokens) - 1, 1]
        assert store.costs.learned.measured and store.stats()["prefill_tokens_per_s"] is None
    monkeypatch.setattr(costs, "_restored_here", set())  # restarted
    forwards.clear()
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        block_prefill(model, tokens, store)
        assert store.stats()["tokens_saved"] == len(tokens) - 1
        assert store.stats()["prefill_tokens_per_s"] is not None
        assert len(forwards) > 1 and forwards[-1] == 1  # the calibration's, then the last token
        before = len(forwards)
        block_prefill(model, tokens, store)  # known now: the last token's forward alone
        assert forwards[before:] == [1]
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        assert store.stats()["prefill_tokens_per_s"] is not None  # kept in the store

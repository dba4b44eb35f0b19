"""The admission rule (``store(..., admit=)``): what a store writes at first sight, what
only at a second, what it counts (`stats()`, the metrics), and what a restart keeps."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from helpers import BLOCK, prefill, random_tokens, run_python_json, segment_files

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.core.admission import SEEN_BITS, SEEN_KEYS, Admission
from persistent_prefix_cache.errors import InvalidArgumentError
from persistent_prefix_cache.key_filter import KeyFilter
from persistent_prefix_cache.metrics import Families, exposition, handle_metrics


def open_store(path, model, **kwargs) -> PersistentPrefixCache:
    kwargs.setdefault("block_size", BLOCK)
    return PersistentPrefixCache(path, model, **kwargs)


def put(store, model, tokens, admit) -> int:
    written = store.store(tokens, prefill(model, tokens)[1], admit=admit)
    store.flush()
    return written


def test_a_one_off_prompt_is_written_at_its_second_sighting(store_dir, model):
    prompt = random_tokens(4 * BLOCK + 5, seed=1)  # 4 full blocks and a partial one
    with open_store(store_dir, model) as store:
        assert put(store, model, prompt, "reuse") == 0
        stats = store.stats()
        assert (stats["blocks"], stats["blocks_written"], segment_files(store_dir)) == (0, 0, {})
        assert (stats["blocks_not_admitted"], stats["tokens_not_admitted"]) == (5, 4 * BLOCK + 5)
        assert store.peek(prompt) == 0
        store.fetch(prompt)  # a miss that says why
        assert store.last_fetch.reason == "not_admitted" and store.stats()["miss_not_admitted"] == 1
        store.fetch(prompt[: 2 * BLOCK] + random_tokens(2 * BLOCK, seed=9))  # never seen past its first 2 blocks
        assert store.last_fetch.reason == "not_admitted"  # (where the lookup stopped: its first block)
        store.fetch(random_tokens(2 * BLOCK, seed=8))
        assert store.last_fetch.reason == "never_stored"
        assert put(store, model, prompt, "reuse") == 5  # seen before: all of it
        stats = store.stats()
        assert (stats["blocks"], stats["blocks_written"], stats["blocks_not_admitted"]) == (5, 5, 5)
        assert store.peek(prompt) == len(prompt) - 1


def test_always_writes_at_first_sight_and_is_the_default(store_dir, model):
    first, second = random_tokens(3 * BLOCK, seed=1), random_tokens(3 * BLOCK, seed=2)
    with open_store(store_dir, model) as store:
        assert put(store, model, first, "always") == 3
        store.store(second, prefill(model, second)[1])
        store.flush()
        stats = store.stats()
        assert (stats["blocks"], stats["blocks_not_admitted"], stats["tokens_not_admitted"]) == (6, 0, 0)


def test_a_growing_chat_is_written_from_its_second_turn_on(store_dir, model):
    turns = [random_tokens(2 * BLOCK + 3, seed=1)]
    for seed in (2, 3, 4):  # each turn's prompt: the last one's and more
        turns.append(turns[-1] + random_tokens(BLOCK + 7, seed=seed))
    with open_store(store_dir, model) as store:
        assert put(store, model, turns[0], "reuse") == 0  # a first turn is a one-off as far as anyone knows
        for turn in turns[1:]:
            put(store, model, turn, "reuse")
            assert store.peek(turn) == len(turn) - 1  # every turn whole, at first sight
        stats = store.stats()
        assert stats["blocks_not_admitted"] == 3 and stats["blocks"] == len(turns[-1]) // BLOCK + 1


def test_a_shared_prefix_is_written_when_a_second_prompt_shares_it(store_dir, model):
    system = random_tokens(3 * BLOCK, seed=7)
    first, second, third = (system + random_tokens(2 * BLOCK + 4, seed=s) for s in (1, 2, 3))
    with open_store(store_dir, model) as store:
        assert put(store, model, first, "reuse") == 0
        # The system prompt's blocks (its second sighting) and the block it ends in.
        assert put(store, model, second, "reuse") == 3 + 1
        assert store.peek(third) == 3 * BLOCK and store.peek(second) == 4 * BLOCK  # the rest of each: not
        assert store.stats()["blocks_not_admitted"] == 6 + 2  # all of the first, the tail of the second
        # "seen" writes the same here: it differs only for a continuation.
        assert put(store, model, third, "seen") == 0


def test_seen_writes_no_continuation_and_a_checkpoint_makes_none(store_dir, model):
    system = random_tokens(2 * BLOCK + 5, seed=7)
    request = system + random_tokens(2 * BLOCK, seed=1)
    chat = random_tokens(2 * BLOCK + 3, seed=2)
    with open_store(store_dir, model) as store:
        put(store, model, chat, "seen")
        # The seen part and the block it ends in, no more.
        assert put(store, model, chat + random_tokens(BLOCK, seed=3), "seen") == 2 + 1
        # A server's checkpoint at the end of the system prompt ("seen"), then the
        # request's end ("reuse"): the system prompt's full blocks are seen twice (written),
        # but the request is no continuation of its own checkpoint: the rest waits.
        assert put(store, model, system, "seen") == 0
        assert put(store, model, request, "reuse") == 2 + 1
        # Its next turn is one: all of it (its 5 full blocks and a partial one, less the 3 stored).
        assert put(store, model, request + random_tokens(BLOCK, seed=4), "reuse") == 3


def test_a_layout_that_is_not_sliced_is_written_whole_or_not_at_all(store_dir):
    from families import build

    model = build("gemma3_text")  # rotating windows: a snapshot only at the end of a store
    system = random_tokens(2 * BLOCK, seed=7)
    first, second = system + random_tokens(BLOCK + 3, seed=1), system + random_tokens(BLOCK + 3, seed=2)
    with open_store(store_dir, model) as store:
        assert put(store, model, first, "reuse") == 0
        assert put(store, model, second, "reuse") == 0  # its first two blocks seen, not all: nothing
        assert put(store, model, second, "reuse") == 4  # all of it seen: all of it
        assert store.stats()["blocks_not_admitted"] == 4 + 4


def test_an_unknown_rule_is_one_clear_error(store_dir, model):
    tokens = random_tokens(BLOCK, seed=1)
    with open_store(store_dir, model) as store:
        for bad in ("sometimes", None, 1):
            with pytest.raises(InvalidArgumentError, match="admit must be one of 'always', 'seen', 'reuse'"):
                store.store(tokens, prefill(model, tokens)[1], admit=bad)
        assert store.stats()["blocks_not_admitted"] == 0


def test_the_memory_of_seen_keys_is_bounded_and_forgets_the_oldest_generation():
    sketch = KeyFilter(bits=1 << 12, generation=8)
    keys = [os.urandom(16) for _ in range(24)]
    sketch.add(keys[:8])
    sketch.add(keys[8:16])  # a second generation: the first still answers
    assert all(sketch.holds(k) for k in keys[:16])
    sketch.add(keys[16:])  # a third: the first is gone
    assert not any(sketch.holds(k) for k in keys[:8]) and all(sketch.holds(k) for k in keys[8:])
    assert sketch.nbytes == 2 * (1 << 12) // 8
    with pytest.raises(ValueError):
        KeyFilter(bits=1000, generation=8)
    # A handle's: 1 MiB whatever it has seen.
    admission = Admission(b"\0" * 16, BLOCK)
    assert admission.seen.nbytes == 2 * SEEN_BITS // 8 == 1 << 20 and SEEN_BITS == 16 * SEEN_KEYS
    for i in range(3):
        admission.admitted([os.urandom(16) for _ in range(SEEN_KEYS // 2)], 0, 0, "seen", whole_only=False)
    assert admission.seen.nbytes == 1 << 20


def test_stats_and_metrics_count_writes_restores_and_what_was_left_out(store_dir, model):
    one_off, repeated = random_tokens(3 * BLOCK + 2, seed=1), random_tokens(4 * BLOCK, seed=2)
    with open_store(store_dir, model) as store:
        assert store.stats()["write_amplification"] is None  # nothing restored yet
        put(store, model, one_off, "reuse")
        put(store, model, repeated, "reuse")
        put(store, model, repeated, "reuse")  # its second sighting: written
        written = sum(segment_files(store_dir).values())
        store.fetch(repeated)  # from the RAM tier: 3 full blocks and the last one's first 15 tokens
        stats = store.stats()
        block_bytes = stats["block_bytes"]  # the four blocks of `repeated`
        assert (stats["blocks_not_admitted"], stats["tokens_not_admitted"]) == (4 + 4, 3 * BLOCK + 2 + 4 * BLOCK)
        assert stats["bytes_written"] == written and stats["bytes_rewritten"] == 0
        assert stats["bytes_restored_ram"] == block_bytes and stats["bytes_restored_disk"] == 0
        assert stats["write_amplification"] == written / block_bytes
        families = Families()
        handle_metrics(families, stats, model="m", namespace="")
        text = exposition(families)
    assert 'ppc_not_admitted_blocks_total{model="m",namespace=""} 8\n' in text
    assert f'ppc_not_admitted_tokens_total{{model="m",namespace=""}} {7 * BLOCK + 2}\n' in text
    value = float(text.split('ppc_write_amplification{model="m",namespace=""} ')[1].split("\n")[0])
    assert math.isclose(value, written / block_bytes, rel_tol=1e-12)


# A process that stores a prompt twice and another once under "reuse", then exits.
FILL = """
import json, sys
from mlx_lm import load
from persistent_prefix_cache import PersistentPrefixCache
from mlx_lm.models.cache import make_prompt_cache
import mlx.core as mx

model, _ = load(sys.argv[1])
twice, once = json.loads(sys.argv[3]), json.loads(sys.argv[4])

def cache_of(tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    return cache

with PersistentPrefixCache(sys.argv[2], model, block_size=16) as store:
    for tokens in (twice, once, twice):
        store.store(tokens, cache_of(tokens), admit="reuse")
    store.flush()
    stats = store.stats()
print(json.dumps({k: stats[k] for k in ("blocks", "blocks_not_admitted")}))
"""


def test_a_prompt_seen_twice_before_a_restart_hits_after_it(tiny_model_dir, model, store_dir):
    twice, once = random_tokens(4 * BLOCK + 9, seed=1), random_tokens(3 * BLOCK + 4, seed=2)
    filled = run_python_json(FILL, str(tiny_model_dir), str(store_dir), json.dumps(twice), json.dumps(once))
    assert filled == {"blocks": 5, "blocks_not_admitted": 5 + 4}
    with open_store(store_dir, model) as store:  # this process: a fresh RAM tier, the disk only
        cache, rest = store.fetch(twice)
        assert cache is not None and len(rest) == 1 and store.last_fetch.tier == "disk"
        cache, rest = store.fetch(once)
        assert cache is None and store.last_fetch.reason == "never_stored"


def test_ppc_stats_says_what_the_blocks_held_were_read_back_for(store_dir, model):
    read, unread = random_tokens(4 * BLOCK, seed=1), random_tokens(3 * BLOCK, seed=2)
    with open_store(store_dir, model, model_name="tiny") as store:
        put(store, model, read, "always")
        put(store, model, unread, "always")
        store.fetch(read)  # all but the last token: its 4 blocks restored, twice
        store.fetch(read)
        block = store.stats()["block_bytes"] // 7  # 7 full blocks of one size
        handle = store.stats()
    run = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store_dir),
                          "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["bytes_restored"] == 2 * 4 * block and summary["block_bytes"] == 7 * block
    # Store-wide, over every process: the segment bytes written, the bytes fetches restored.
    written = handle["bytes_written"] + handle["bytes_rewritten"]
    assert summary["written_bytes"] == written >= summary["bytes_on_disk"] > 7 * block
    assert summary["restored_bytes"] == handle["bytes_restored_ram"] + handle["bytes_restored_disk"] == 8 * block
    assert summary["write_amplification"] == written / (8 * block)
    assert (summary["never_restored_blocks"], summary["never_restored_bytes"]) == (3, 3 * block)
    run = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store_dir)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert re.search(rf"bytes restored \(blocks held\) +{8 * block:,}\n", run.stdout), run.stdout
    assert re.search(r"restored per byte held +1.14\n", run.stdout), run.stdout  # 8 blocks read of 7 held
    assert re.search(r"blocks never restored +3\n", run.stdout), run.stdout
    assert re.search(rf"bytes never restored +{3 * block:,}\n", run.stdout), run.stdout
    assert re.search(rf"written per byte restored +{written / (8 * block):.2f}\n", run.stdout), run.stdout
    run = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store_dir),
                          "--prometheus"], capture_output=True, text=True, timeout=120)  # fmt: skip
    at = f'store="{store_dir}",model="tiny",namespace=""'
    assert f"ppc_store_model_restored_bytes{{{at}}} {8 * block}\n" in run.stdout, run.stdout
    assert f"ppc_store_model_never_restored_bytes{{{at}}} {3 * block}\n" in run.stdout, run.stdout


def test_the_server_cache_counts_one_sighting_per_request(store_dir, model):
    from persistent_prefix_cache.compat.lru_prompt_cache import PersistentLRUPromptCache

    system = random_tokens(2 * BLOCK + 5, seed=7)
    prompt = system + random_tokens(BLOCK, seed=1)
    turn = prompt + random_tokens(BLOCK, seed=3)  # prompt and reply: 4 full blocks and 5 tokens
    with open_store(store_dir, model) as store:
        with pytest.raises(InvalidArgumentError, match="admit must be one of"):
            PersistentLRUPromptCache(store, admit="never")
        lru = PersistentLRUPromptCache(store, admit="reuse")
        # mlx_lm.server: the prompt's cache asked for, the system prompt's cache on the way (a
        # checkpoint), then the request's (prompt and reply): one request, one sighting.
        assert lru.fetch_nearest_cache("m", prompt)[0] is None
        lru.insert_cache("m", system, prefill(model, system)[1], cache_type="system")
        lru.insert_cache("m", turn, prefill(model, turn)[1], cache_type="assistant")
        store.flush()
        assert store.stats()["blocks"] == 0 and store.stats()["blocks_not_admitted"] == 5
        cache, rest = lru.fetch_nearest_cache("m", turn)  # the LRU kept what the store left out
        assert cache is not None and len(turn) - len(rest) == len(turn)
        following = turn + random_tokens(BLOCK, seed=2)
        lru.fetch_nearest_cache("m", following)
        lru.insert_cache("m", following, prefill(model, following)[1])  # the next turn: written whole
        store.flush()
        assert store.peek(following) == len(following) - 1
        assert store.stats()["blocks_not_admitted"] == 5  # the first request's, nothing since
        lru.close()

"""`PersistentLRUPromptCache` and ``ppc serve`` (mlx_lm.server with a persistent cache).

- The class answers mlx-lm's ``LRUPromptCache`` call sequence exactly as mlx-lm's own
  class does, both when its in-memory tier holds everything and when only the store
  can answer (then a restored cache must continue bit for bit like a cold prefill).
- A restart test for the class alone: one process inserts, a fresh one fetches.
- The server end to end: real ``ppc serve`` processes on 127.0.0.1; a second server
  on the same store restores the shared prefix from disk and answers exactly (same
  text, same logprobs) as a server that started from an empty store.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request

import mlx.core as mx
import numpy as np
import pytest
from helpers import COUNTED_PPC, assert_same_logits, cold_logits, feed, random_tokens, run_python_json
from mlx_lm.models.cache import LRUPromptCache, QuantizedKVCache, make_prompt_cache

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.cli import serve
from persistent_prefix_cache.compat import server_patch
from persistent_prefix_cache.errors import UnsupportedServerError
from persistent_prefix_cache.lru_prompt_cache import PersistentLRUPromptCache
from persistent_prefix_cache.tiny_model import TEST_MODEL, load_tiny_model, write_tiny_model

BLOCK = 16
SHAPE = dict(TEST_MODEL)
RESTORED = re.compile(r"Restored (\d+) of (\d+) prompt tokens from the persistent store")


@pytest.fixture(scope="session")
def serve_other_model(tmp_path_factory):
    """Same shapes, other weights: a second model the server could load."""
    folder = write_tiny_model(tmp_path_factory.mktemp("serve_other_model"), seed=1, **SHAPE)
    return load_tiny_model(folder)


def _prefill(model, tokens):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache


def _covered(cache) -> int:
    return 0 if cache is None else cache[0].offset


# -- the call sequence, against mlx-lm's own LRUPromptCache ------------------------

BASE = random_tokens(40, seed=11, first=1)
A = BASE  # 2.5 blocks
B = BASE[:24] + random_tokens(20, seed=12, first=300)  # leaves A inside block 2
C = A + random_tokens(10, seed=13, first=7)  # extends A (mlx-lm then drops A)
STEPS = [
    ("fetch", A),  # miss
    ("insert", A, "system"),
    ("fetch", A),  # exact hit in memory
    ("fetch", A + [5, 6, 7]),  # a stored prefix of the query
    ("fetch", A[:30]),  # a prefix of a stored prompt: trimmed
    ("fetch", BASE[:24] + [9, 9, 9]),  # diverges from A after 24 tokens
    ("fetch", A[:1]),  # one token: nothing can be restored
    ("insert", B, "user"),
    ("fetch", B[:30] + [4, 4]),
    ("insert", C, "assistant"),
    ("fetch", C + [1, 2, 3]),
    ("fetch", A),  # A itself is gone from memory: trimmed from C
    ("fetch", [2] + A[1:]),  # differs at the first token: miss
]


def _run_steps(prompt_cache, model, caches):
    """Play STEPS on `prompt_cache`; returns one answer per fetch."""
    answers = []
    for step in STEPS:
        if step[0] == "insert":
            _, tokens, kind = step
            prompt_cache.insert_cache("m", list(tokens), caches[tuple(tokens)], cache_type=kind)
            continue
        tokens = list(step[1])
        cache, rest = prompt_cache.fetch_nearest_cache("m", tokens)
        assert isinstance(rest, list)
        assert _covered(cache) + len(rest) == len(tokens)
        assert rest == tokens[len(tokens) - len(rest) :]
        answers.append((tokens, cache, rest))
    return answers


@pytest.fixture(scope="module")
def step_caches(serve_model):
    return {tuple(s[1]): _prefill(serve_model, s[1]) for s in STEPS if s[0] == "insert"}


def test_front_tier_answers_like_mlx_lm(serve_model, step_caches, tmp_path):
    # One copy of each cache: what the store took lives as blocks in its RAM tier, not
    # in the LRU as well; every hit is restored from the tier, exactly.
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK)
    ours = PersistentLRUPromptCache(store, max_size=10)
    theirs = LRUPromptCache(max_size=10)
    got = _run_steps(ours, serve_model, step_caches)
    want = _run_steps(theirs, serve_model, step_caches)
    for (tokens, cache, rest), (_, mlx_cache, mlx_rest) in zip(got, want):
        if mlx_rest == [] and tokens:  # mlx-lm's exact hit covers everything; the store leaves the last token
            assert (_covered(cache), rest) == (len(tokens) - 1, tokens[-1:])
        else:
            assert (_covered(cache), rest) == (_covered(mlx_cache), mlx_rest)
        if cache is not None and rest:
            assert_same_logits(feed(serve_model, cache, rest), cold_logits(serve_model, tokens))
    assert len(ours) == 0 and ours.nbytes == store.stats()["bytes_in_memory"] > 0
    stats = ours.persistent_stats()
    assert stats["stored_sequences"] == 3 and stats["store_skipped"] == stats["memory_only_sequences"] == 0
    assert stats["store_hits"] == sum(1 for _, c, _ in got if _covered(c))
    assert store.stats()["restored_blocks_disk"] == 0  # every hit came from the RAM tier
    ours.close()
    store.close()


def test_store_alone_answers_like_mlx_lm(serve_model, step_caches, tmp_path):
    # No in-memory tier (max_size=0) and no RAM tier in the store: every hit is read
    # from the block files.
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK, memory_bytes=0, sync_writes=True)
    ours = PersistentLRUPromptCache(store, max_size=0)
    got = _run_steps(ours, serve_model, step_caches)
    want = _run_steps(LRUPromptCache(max_size=10), serve_model, step_caches)
    assert len(ours) == 0
    for (tokens, cache, rest), (_, mlx_cache, mlx_rest) in zip(got, want):
        if mlx_rest == [] and tokens:
            # mlx-lm's exact hit covers everything; the store leaves the last token.
            assert (_covered(cache), rest) == (len(tokens) - 1, tokens[-1:])
        else:
            assert (_covered(cache), rest) == (_covered(mlx_cache), mlx_rest)
        if cache is not None and rest:
            assert_same_logits(feed(serve_model, cache, rest), cold_logits(serve_model, tokens))
    assert ours.persistent_stats()["store_hits"] == sum(1 for _, c, _ in got if _covered(c))
    store.close()


def test_keep_last_token_turns_an_exact_hit_into_all_but_one(serve_model, tmp_path):
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK)
    ours = PersistentLRUPromptCache(store, keep_last_token=True)
    ours.insert_cache("m", A, _prefill(serve_model, A))
    cache, rest = ours.fetch_nearest_cache("m", A)
    assert (_covered(cache), rest) == (len(A) - 1, A[-1:])
    assert_same_logits(feed(serve_model, cache, rest), cold_logits(serve_model, A))
    store.close()


def test_what_the_store_cannot_hold_stays_in_memory(serve_model, tmp_path, caplog):
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK)
    ours = PersistentLRUPromptCache(store)
    # mlx-lm keys image patches by negative ids of up to 60 bits: wider than the store's
    # int32 (negative ids that fit are stored: tests/test_token_ids.py).
    image = [-1 - 2**59] * 4 + A[4:]
    quantized = [c.to_quantized(group_size=32, bits=4) for c in _prefill(serve_model, B)]
    assert isinstance(quantized[0], QuantizedKVCache)
    with caplog.at_level(logging.WARNING, logger="persistent_prefix_cache"):
        ours.insert_cache("m", image, _prefill(serve_model, A))
        ours.insert_cache("m", B, quantized)
        ours.insert_cache("m", B, quantized)  # warned once per cause, not per call
        cache, rest = ours.fetch_nearest_cache("m", image + [1])
    assert (_covered(cache), rest) == (len(image), [1])  # from memory
    assert len(ours) == 2
    assert ours.persistent_stats()["store_skipped"] == 3
    assert store.stats()["blocks"] == 0
    warnings = [r for r in caplog.records if "kept in memory only" in r.getMessage()]
    assert len(warnings) == 2
    store.close()


def test_layers_of_different_lengths_are_stored_up_to_the_shortest(serve_model, tmp_path):
    # Speculative decoding: the model's and the draft's layers may end a token apart.
    store = PersistentPrefixCache(tmp_path / "store", serve_model, block_size=BLOCK)
    ours = PersistentLRUPromptCache(store, max_size=0)
    cache = _prefill(serve_model, C)
    cache[1].trim(3)
    ours.insert_cache("m", C, cache)
    assert [c.offset for c in cache] == [len(C), len(C) - 3]  # the caller's, untouched
    restored, rest = ours.fetch_nearest_cache("m", C + [1])
    assert rest == C[len(C) - 3 :] + [1]
    assert_same_logits(feed(serve_model, restored, rest), cold_logits(serve_model, C + [1]))
    store.close()


def test_one_store_per_model_key(serve_model, serve_other_model, tmp_path):
    models = {"first": serve_model, "second": serve_other_model}
    opened = []

    def open_store(key):
        if key not in models:
            return None  # e.g. a model the server is not running: memory only
        opened.append(key)
        return PersistentPrefixCache(tmp_path / "store", models[key], block_size=BLOCK)

    ours = PersistentLRUPromptCache(open_store, max_size=0)
    for key, model in models.items():
        ours.insert_cache(key, A, _prefill(model, A))
    ours.insert_cache("unknown", A, _prefill(serve_model, A))
    ours.flush()
    for key, model in models.items():
        cache, rest = ours.fetch_nearest_cache(key, A + [3])
        assert rest == [3]
        want = _prefill(model, A)
        for layer in (0, 1):
            got = cache[layer].keys[..., : len(A), :]
            assert mx.array_equal(got, want[layer].keys[..., : len(A), :]).item()
    assert ours.fetch_nearest_cache("unknown", A + [3])[0] is None
    assert opened == ["first", "second"]
    ours.close()
    assert [s["model"] for s in ours.persistent_stats()["stores"]] == []


# -- a restart of the class alone -----------------------------------------------------

INSERT_SNIPPET = """
    import json, os, sys
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.lru_prompt_cache import PersistentLRUPromptCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    store = PersistentPrefixCache(
        spec["store"], model, model_path=spec["model"], block_size=spec["block_size"]
    )
    prompt_cache = PersistentLRUPromptCache(store)
    for tokens in spec["prompts"]:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(tokens)[None], cache=cache))
        prompt_cache.insert_cache(("model", None, None), tokens, cache)
    prompt_cache.close()
    store.close()
    print(json.dumps({"pid": os.getpid(), **prompt_cache.persistent_stats()}))
"""

FETCH_SNIPPET = """
    import json, os, sys
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.lru_prompt_cache import PersistentLRUPromptCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    spec = json.load(open(sys.argv[1]))
    model = load_tiny_model(spec["model"])
    store = PersistentPrefixCache(spec["store"], model, model_path=spec["model"])
    prompt_cache = PersistentLRUPromptCache(store)
    covered = []
    for i, tokens in enumerate(spec["queries"]):
        cache, rest = prompt_cache.fetch_nearest_cache(("model", None, None), tokens)
        covered.append(len(tokens) - len(rest))
        if cache is None:
            cache = make_prompt_cache(model)
        logits = model(mx.array(rest)[None], cache=cache)[0, -1]
        np.save(os.path.join(spec["out"], f"q{i}.npy"), np.array(logits))
    stats = prompt_cache.persistent_stats()
    store.close()
    print(json.dumps({"pid": os.getpid(), "covered": covered, "store_hits": stats["store_hits"]}))
"""


@pytest.mark.slow
def test_class_restores_across_a_restart(serve_model_dir, serve_model, tmp_path):
    system = random_tokens(37, seed=21, first=3)
    first = system + random_tokens(12, seed=22, first=8)
    queries = [
        system + random_tokens(9, seed=23, first=9),  # shares the system prompt
        first + random_tokens(5, seed=24, first=10),  # extends a stored prompt
        first,  # a stored prompt again: all but its last token
        random_tokens(15, seed=25, first=11),  # unrelated: miss
    ]
    spec = {
        "model": str(serve_model_dir),
        "store": str(tmp_path / "store"),
        "block_size": BLOCK,
        "prompts": [first],
        "queries": queries,
        "out": str(tmp_path),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    a = run_python_json(INSERT_SNIPPET, str(tmp_path / "spec.json"), timeout=60)
    b = run_python_json(FETCH_SNIPPET, str(tmp_path / "spec.json"), timeout=60)
    assert len({a["pid"], b["pid"], os.getpid()}) == 3
    assert a["stored_sequences"] == 1
    assert b["covered"] == [len(system), len(first), len(first) - 1, 0]
    assert b["store_hits"] == 3
    for i, tokens in enumerate(queries):
        got = mx.array(np.load(tmp_path / f"q{i}.npy"))
        assert_same_logits(got, cold_logits(serve_model, tokens))


# -- the patch ------------------------------------------------------------------------


def test_patch_matches_the_installed_server_and_is_undone():
    from mlx_lm import server

    server_patch.check_server(server)
    original = (server.run, server.LRUPromptCache)
    made = []
    with server_patch.patched_server(server, lambda *a: made.append(a) or "cache") as built:
        assert server.LRUPromptCache(7) == "cache"
        assert made == [(None, 7, 1 << 63)] and built["cache"] == "cache"
    assert (server.run, server.LRUPromptCache) == original


def test_an_unknown_server_structure_is_refused():
    fake = types.SimpleNamespace(main=lambda: None, run=lambda host, port: None)
    with pytest.raises(UnsupportedServerError) as info:
        server_patch.check_server(fake)
    text = str(info.value)
    assert "no LRUPromptCache" in text and server_patch.CHECKED_MLX_LM_VERSIONS[-1] in text


# -- the server, end to end -------------------------------------------------------------

SYSTEM = (
    "You are the librarian of a quiet town. Old librarians knew this long before anyone "
    "wrote a line of code. They kept the most requested books on a cart beside the desk."
)
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}]
OTHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any rain today?"}]
REQUEST_TIMEOUT = 60
START_TIMEOUT = 60
STOP_TIMEOUT = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``ppc serve`` process on 127.0.0.1; its output goes to a log file (`counted`: its
    forwards timed by `helpers.counted_forwards`, for what a calibration decides)."""

    def __init__(self, model_dir, store, log_path, *extra: str, counted: bool = False):
        self.log_path = log_path
        self._argv = [
            sys.executable, *(["-c", COUNTED_PPC] if counted else ["-m", "persistent_prefix_cache"]), "serve",
            "--model", str(model_dir), "--store", str(store), "--store-block-size", str(BLOCK),
            "--host", "127.0.0.1", "--log-level", "INFO", *extra,
        ]  # fmt: skip
        self._start()

    def _start(self) -> None:
        self.port, self._log = _free_port(), open(self.log_path, "w")
        env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
        self.proc = subprocess.Popen(self._argv + ["--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, env=env)  # fmt: skip

    def __enter__(self):
        deadline, tries = time.monotonic() + START_TIMEOUT, 0
        while time.monotonic() < deadline:
            if "Address already in use" in self.log() and tries < 3:  # a parallel test took the port
                self.__exit__()
                self._start()
                tries += 1
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"server not up after {START_TIMEOUT} s:\n{self.log()}")

    def __exit__(self, *exc):
        # Always end the process, even when the test failed half-way.
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)
        self._log.close()

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def chat(self, messages, **extra):
        body = {"messages": messages, "max_tokens": 8, "temperature": 0.0}
        body.update(logprobs=True, top_logprobs=3, **extra)
        request = urllib.request.Request(
            self.url("/v1/chat/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
            return json.loads(r.read())

    def complete(self, prompt, max_tokens):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        request = urllib.request.Request(
            self.url("/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        """SIGTERM (a clean stop: pending block writes are flushed); the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def restored(self) -> list[int]:
        return [int(m.group(1)) for m in RESTORED.finditer(self.log())]


def _answer(response):
    choice = response["choices"][0]
    logprobs = [(t["id"], t["logprob"], t["top_logprobs"]) for t in choice["logprobs"]["content"]]
    return choice["message"]["content"], logprobs


def _cached(response) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_server_restores_from_the_store_after_a_restart(serve_model_dir, tmp_path):
    store, empty = tmp_path / "store", tmp_path / "empty_store"

    with Server(serve_model_dir, store, tmp_path / "first.log") as server:
        first = server.chat(FIRST)
        assert server.stop() == 0, server.log()
    assert _cached(first) == 0 and server.restored() == []
    assert os.listdir(store / "segments"), "the first server stored nothing"

    second = FIRST + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And a library?"},
    ]
    # A seeded request takes the server's sequential path, the other one its batched
    # path: both must restore from the store (memory is empty after the restart).
    with Server(serve_model_dir, store, tmp_path / "restarted.log") as server:
        warm_other = server.chat(OTHER, seed=3)
        warm_second = server.chat(second)
        assert server.stop() == 0, server.log()
    restored = server.restored()
    assert re.findall(r"served by disk \d+ blocks", server.log()), server.log()  # a restarted server: disk
    assert restored == [_cached(warm_other), _cached(warm_second)], server.log()
    assert 0 < restored[0] < warm_other["usage"]["prompt_tokens"]
    # The whole first conversation came back (its prompt and what was generated).
    assert restored[1] >= first["usage"]["prompt_tokens"]
    # On its way out it says what its store decided (why a seen prompt could miss).
    said = re.search(
        r"store .*: (\d+) fetches, (\d+) hits, (\d+) misses; restored all (\d+), .*; costs: prefill ", server.log()
    )
    assert said, server.log()
    fetches, hits, misses, all_ = map(int, said.groups())
    assert fetches == hits + misses and hits >= 2 and all_ >= 1, said.group(0)

    with Server(serve_model_dir, empty, tmp_path / "cold.log") as server:
        cold_other = server.chat(OTHER, seed=3)
        cold_second = server.chat(second)
        assert server.stop() == 0, server.log()
    # Nothing came from disk; a hit in the same process is served by the RAM tier.
    assert "served by disk" not in server.log() and _cached(cold_other) == 0
    assert _answer(warm_other) == _answer(cold_other)
    assert _answer(warm_second) == _answer(cold_second)


@pytest.mark.slow
def test_server_survives_an_exact_hit(serve_model_dir, tmp_path):
    # A prompt equal to a cached sequence (a prompt plus its generated token) is an
    # exact hit, which stops stock mlx_lm.server 0.32.2's generation thread ("empty
    # prompt"); ppc serve leaves the last token to compute instead.
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(serve_model_dir)
    text = "A cache is a promise that the second time will be cheaper than the first.\n"
    with Server(serve_model_dir, tmp_path / "store", tmp_path / "exact.log") as server:
        first = server.complete(text, max_tokens=1)
        again = text + first["choices"][0]["text"]
        tokens = tokenizer.encode(again)
        assert len(tokens) == first["usage"]["total_tokens"], "pick a text that round-trips"
        second = server.complete(again, max_tokens=2)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tokens) - 1
        assert server.chat(OTHER)["choices"][0]["finish_reason"] == "length"
        assert server.stop() == 0, server.log()


def test_serve_refuses_a_missing_model_folder(tmp_path, capsys):
    code = serve.main(["--model", str(tmp_path / "nope"), "--store", str(tmp_path / "s")])
    assert code == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_on_a_taken_port_says_so_and_exits(serve_model_dir, tmp_path):
    # mlx_lm.server starts its generation thread before it listens, and never stops it
    # when the listen fails: ppc serve hung there, after its error line.
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "persistent_prefix_cache", "serve", "--model", str(serve_model_dir),
               "--store", str(tmp_path / "store"), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "cannot listen" in errors[0] and "--port" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


# -- configuration errors stop the server before it starts -----------------------------


def _serve_exit(model_dir, store, *extra: str) -> subprocess.CompletedProcess:
    """``ppc serve`` that must refuse to start: exit code 2, one message, no traceback."""
    cmd = [sys.executable, "-m", "persistent_prefix_cache", "serve", "--model", str(model_dir)]
    cmd += ["--store", str(store), "--port", str(_free_port()), *extra]
    env = {k: v for k, v in os.environ.items() if k != "PPC_STORE"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: "), proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_serve_refuses_a_damaged_index_at_startup(serve_model_dir, serve_model, tmp_path, how):
    store = tmp_path / "store"
    PersistentPrefixCache(store, serve_model, block_size=BLOCK).close()
    data = store / "index" / "data.mdb"
    if how == "truncated":
        os.truncate(data, 100)
    else:
        data.write_bytes(b"\x5a" * data.stat().st_size)
    proc = _serve_exit(serve_model_dir, store)
    assert "index damaged" in proc.stderr and f"ppc check --fix --store {store}" in proc.stderr


@pytest.mark.slow
def test_serve_refuses_another_block_size_at_startup(serve_model_dir, serve_model, tmp_path):
    store = tmp_path / "store"
    PersistentPrefixCache(store, serve_model, block_size=2 * BLOCK).close()
    proc = _serve_exit(serve_model_dir, store, "--store-block-size", str(BLOCK))
    assert f"--store-block-size {BLOCK}: the store at" in proc.stderr
    assert f"uses {2 * BLOCK}-token blocks" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "other files", "readonly without a store"])
def test_serve_refuses_a_path_that_is_no_store(serve_model_dir, tmp_path, kind):
    target = tmp_path / "target"
    extra = []
    if kind == "file":
        target.write_text("not a store")
        expect = "is a file, not a store directory"
    elif kind == "other files":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
        expect = "folder has files but no store in it"
    else:
        extra, expect = ["--store-readonly"], "no store at"
    proc = _serve_exit(serve_model_dir, target, *extra)
    assert expect in proc.stderr
    if kind == "other files":
        assert os.listdir(target) == ["notes.txt"]  # nothing was created among them


@pytest.mark.slow
def test_serve_store_optional_degrades_with_a_warning(serve_model_dir, serve_model, tmp_path):
    store = tmp_path / "store"
    PersistentPrefixCache(store, serve_model, block_size=2 * BLOCK).close()
    with Server(serve_model_dir, store, tmp_path / "optional.log", "--store-optional") as server:
        assert server.chat(FIRST)["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.stop() == 0, server.log()
    log = server.log()
    assert "--store-optional: serving without a persistent cache" in log
    assert f"uses {2 * BLOCK}-token blocks" in log
    segments = store / "segments"
    assert not segments.exists() or os.listdir(segments) == []  # the store was not used


@pytest.mark.slow
def test_a_read_only_server_says_what_it_did_and_warns_about_nothing(serve_model_dir, tmp_path):
    """`--store-readonly` as asked: hits restored, nothing written, and neither a Python
    warning nor a count of writes that never happened."""
    store = tmp_path / "store"
    with Server(serve_model_dir, store, tmp_path / "fill.log") as server:
        server.chat(FIRST)
        assert server.stop() == 0, server.log()
    before = sorted(p.name for p in (store / "segments").rglob("*.seg"))
    with Server(serve_model_dir, store, tmp_path / "ro.log", "--store-readonly") as server:
        server.chat(FIRST + [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "More?"}])
        assert server.stop() == 0, server.log()
    log = server.log()
    assert len(server.restored()) == 1, log
    assert re.search(r"closed \(read-only\): 1 prompts restored from the store \(\d+ tokens\), 0 written", log), log
    # (mlx_lm.server's own "not recommended for production" warning is not ours.)
    assert not re.search(r"Warning: .*(store|read-only)", log) and "readonly=False" not in log, log
    assert sorted(p.name for p in (store / "segments").rglob("*.seg")) == before

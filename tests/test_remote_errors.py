"""The remote tier's misconfiguration and failures, said plainly, from real ``ppc`` processes.

- A db that is not a number (``/abc``) is refused when the URL is parsed; a db the
  server does not have (``/99`` on a 16-db server) at first contact, by every command
  (exit 2, one ``error:`` line).
- A mistyped ``$PPC_REMOTE_SECRET`` cannot block the fleet (each secret has its own key
  space); ``ppc pull`` tells "your secret differs from the writers'" apart from "values
  under your key id were written with another secret", and ``ppc push
  --replace-unauthenticated`` writes over the latter.
- A server nothing listens on: ``push`` and ``pull`` stop (exit 2) with "cannot reach
  URL: connection refused; nothing was pushed"; ``generate``, ``precompute`` and ``serve``
  go on from the local store and say it once.
- A password is never printed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from helpers import random_tokens
from test_remote import BS, fetch_exact, open_host, publish

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.errors import InvalidArgumentError, RemoteConfigError


def ppc(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """A real ``ppc`` process; no ``PPC_*`` settings from the caller's environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
    base["PPC_REMOTE_TIMEOUT"] = "10"  # a loaded machine must not turn a slow answer into a failure
    base["PPC_REMOTE_SECRET"] = "the fleet's secret"  # a fleet has one (see the tests of --remote-insecure)
    return subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})},
    )  # fmt: skip


def one_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one ``error:`` line of a failed command (and no traceback)."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture
def dead_url():
    """A URL of 127.0.0.1 on a port bound but never listening: connection refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a document about caches " * 8 + "\n")
    return path


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory, tiny_model_dir, prompts):
    """A store precomputed from `prompts` (no remote) by a real ``ppc``, once a module."""
    store = tmp_path_factory.mktemp("precomputed") / "filled"
    out = ppc("precompute", "--model", tiny_model_dir, "--store", store, "--block-size", BS, prompts)
    assert out.returncode == 0, out.stderr
    return store


@pytest.fixture
def filled(tmp_path, precomputed):
    """The test's own copy of `precomputed` (tests push from it, and generate adds to it)."""
    return shutil.copytree(precomputed, tmp_path / "filled", symlinks=True)


# -- the db: a number, and one the server has ------------------------------------------


@pytest.mark.parametrize("tail", ["/abc", "/-1", "/0/1", "?db=x", "/1?db=2"])
def test_a_db_that_is_not_a_number_is_refused_when_parsed(tmp_path, model, tail):
    with pytest.raises(InvalidArgumentError) as err:
        PersistentPrefixCache(tmp_path / "s", model, remote=f"redis://127.0.0.1:6379{tail}")
    assert "remote URL" in str(err.value) and "db" in str(err.value)
    assert not (tmp_path / "s").exists()  # nothing was written


def test_a_cluster_has_db_0_only(tmp_path, model):
    with pytest.raises(InvalidArgumentError, match="a cluster has db 0 only"):
        PersistentPrefixCache(tmp_path / "s", model, remote="redis+cluster://127.0.0.1:7000/2")


@pytest.mark.slow
def test_a_bad_db_from_ppc_is_one_line_and_exit_2(tmp_path, tiny_model_dir, filled):
    line = one_error(ppc("push", "--store", filled, "--remote", "redis://127.0.0.1:6379/abc"))
    assert "the db must be a number >= 0, not 'abc'" in line
    line = one_error(ppc("generate", "--model", tiny_model_dir, "--store", filled, "--prompt", "hi",
                         env={"PPC_REMOTE": "redis://127.0.0.1:6379/abc"}))  # fmt: skip
    assert "the db must be a number >= 0, not 'abc'" in line


@pytest.mark.slow
def test_a_db_the_server_lacks_is_said_by_every_command(tmp_path, model, tiny_model_dir, filled, prompts, redis_server):
    url = f"{redis_server.url}/99"
    said = f"{url}: the server has 16 databases (0-15), not db 99"
    with pytest.raises(RemoteConfigError) as err:
        PersistentPrefixCache(tmp_path / "lib", model, remote=url, remote_secret="the fleet's secret")
    assert said in str(err.value)
    assert not (tmp_path / "lib").exists()  # a store made for nothing is taken back
    runs = {
        "push": ppc("push", "--store", filled, "--remote", url),
        "pull": ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "p", "--remote", url),
        "generate": ppc("generate", "--model", tiny_model_dir, "--store", filled, "--prompt", "hi", "--remote", url),
        "precompute": ppc("precompute", "--model", tiny_model_dir, "--store", tmp_path / "c", "--remote", url, prompts),
        "serve": ppc("serve", "--model", tiny_model_dir, "--store", filled, "--port", _free_port(), "--remote", url),
    }
    for command, proc in runs.items():
        assert said in one_error(proc), command
    stats = ppc("stats", "--store", filled, "--remote", url, "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["remote"] == {"url": url, "reachable": False, "error": said}
    assert redis_server.client().dbsize() == 0  # nothing went to db 0 instead


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a wrong secret ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_mistyped_secret_cannot_spoil_the_fleet_and_each_mistake_is_told_apart(
    tmp_path, tiny_model_dir, filled, prompts, redis_server
):
    """Issue 29, item 9: a host with a typo in $PPC_REMOTE_SECRET pushes first; the fleet's
    hosts are not blocked (each secret writes its own key space), a host whose secret
    differs from every writer's is told so, and values forged under the fleet's key id
    are told apart and replaced by ``ppc push --replace-unauthenticated``."""
    url = redis_server.url
    typo, fleet, other = ({"PPC_REMOTE_SECRET": s} for s in ("fleet-0ne", "fleet-one", "fleet-two"))
    first = ppc("push", "--store", filled, "--remote", url, "--json", env=typo)
    assert first.returncode == 0, first.stderr
    blocks = json.loads(first.stdout)["pushed"]
    assert blocks > 1
    right = ppc("push", "--store", filled, "--remote", url, "--json", env=fleet)
    assert right.returncode == 0 and json.loads(right.stdout)["pushed"] == blocks  # never "already"
    pulled = ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "b", "--remote", url, "--json", env=fleet)
    assert pulled.returncode == 0, pulled.stderr
    out = json.loads(pulled.stdout)
    assert (out["found"], out["pulled"], out["other_secrets"], out["rejected"]) == (blocks, blocks, blocks, 0)
    # A secret no writer used: told that it differs from the writers'.
    whole = ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "c", "--remote", url, "--json", env=other)
    line = one_error(whole, 1)
    assert line == (f"error: the server holds {2 * blocks} block(s) of this model written with other secrets (or "
                    "none) and none under yours: your $PPC_REMOTE_SECRET differs from the writers'")  # fmt: skip
    assert json.loads(whole.stdout)["blocks_in_store"] == 0
    by_prompt = ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "d", "--remote", url, "--block-size", BS,
                    prompts, "--json", env=other)  # fmt: skip
    assert "your $PPC_REMOTE_SECRET differs from the writers'" in one_error(by_prompt, 1)
    stats = json.loads(ppc("stats", "--store", filled, "--remote", url, "--json", env=fleet).stdout)["remote"]
    assert (stats["blocks"], stats["other_secrets"]) == (blocks, blocks) and len(stats["secret"]) == 16
    # Values under the fleet's key id that its secret did not make (a MAC of another
    # secret, written by hand): "written with another secret", and replaced by a push.
    from persistent_prefix_cache.tiers import remote_wire as wire

    client = redis_server.client()
    mine = sorted(k for k in client.scan_iter(match=b"ppc:b1:*") if wire.split_key(k)[0] == stats["secret"])
    theirs = sorted(
        k for k in client.scan_iter(match=b"ppc:b1:*") if wire.split_key(k)[0] not in (None, stats["secret"])
    )
    by_block = {wire.split_key(k)[1]: k for k in theirs}
    for k in mine[:2]:
        client.set(k, client.get(by_block[wire.split_key(k)[1]]))  # the typo's value of that very block
    forged = ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "e", "--remote", url, "--json", env=fleet)
    line = one_error(forged, 1)
    assert line.startswith("error: 2 blocks under your secret's key id failed authentication: written with another "
                           "secret (forged)") and "ppc push --replace-unauthenticated" in line  # fmt: skip
    fixed = ppc("push", "--store", filled, "--remote", url, "--replace-unauthenticated", "--json", env=fleet)
    assert fixed.returncode == 0, fixed.stderr
    assert (json.loads(fixed.stdout)["replaced"], json.loads(fixed.stdout)["already"]) == (2, blocks - 2)
    clean = ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "f", "--remote", url, "--json", env=fleet)
    assert clean.returncode == 0 and json.loads(clean.stdout)["pulled"] == blocks, clean.stderr


def test_a_mistyped_secret_does_not_block_the_fleets_writes(tmp_path, model, redis_server):
    """The library: the typo host publishes every block first; the fleet's host still
    publishes all of its own, and a third host of the fleet restores them all."""
    toks = random_tokens(48, 90, first=90)
    t = open_host(tmp_path / "t", model, redis_server.url, remote_secret="fleet-0ne")
    n = publish(t, model, toks)
    a = open_host(tmp_path / "a", model, redis_server.url, remote_secret="fleet-one")
    assert publish(a, model, toks) == n
    assert a.stats()["remote_published"] == n and a.stats()["remote_already"] == 0
    b = open_host(tmp_path / "b", model, redis_server.url, remote_secret="fleet-one", memory_bytes=0)
    assert fetch_exact(b, model, toks + [1]) == len(toks)
    st = b.stats()
    assert st["remote_unauthenticated"] == 0 and st["remote_blocks"] == n
    assert st["remote_key_id"] == a.stats()["remote_key_id"] != t.stats()["remote_key_id"]
    for h in (t, a, b):
        h.close()


@pytest.mark.slow
def test_a_pull_whose_server_dies_midway_exits_1_and_says_what_was_pulled(
    tmp_path, model, tiny_model_dir, redis_server
):
    """Issue 29, item 15: the server is killed after the first batch of a pull; the blocks
    it never sent are counted as unread (not as orphans), the pull exits 1 saying so, and
    what it did pull restores exactly."""
    from persistent_prefix_cache.disk.faults import hooks_value

    store = tmp_path / "src"
    chains = [random_tokens(64, 200 + i, first=200 + i) for i in range(8)]  # 32 blocks: two batches and more
    with PersistentPrefixCache(store, model, block_size=BS) as handle:
        for toks in chains:
            handle.store(toks, prefill_cache(model, toks))
    pushed = ppc("push", "--store", store, "--remote", redis_server.url, "--json")
    assert pushed.returncode == 0 and json.loads(pushed.stdout)["pushed"] == 32, pushed.stderr
    marker = tmp_path / "held"
    env = {"PPC_TEST_HOOKS": hooks_value(hold_at="pull_batch", pause_file=marker)}
    cmd = [sys.executable, "-m", "persistent_prefix_cache", "pull", "--model", str(tiny_model_dir), "--store",
           str(tmp_path / "b"), "--remote", redis_server.url, "--json"]  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
    base.update({"PPC_REMOTE_TIMEOUT": "10", "PPC_REMOTE_SECRET": "the fleet's secret", **env})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()
        redis_server.kill()  # mid-pull: 16 of 32 blocks read
        marker.unlink()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, (out, err)
    result = json.loads(out)
    assert result["found"] == 32 and result["unread"] == 16 and result["remote_errors"] > 0
    assert result["orphans"] == 0 and result["pulled"] + result["waiting"] + result["rejected"] == 16
    assert result["pulled"] == result["blocks_in_store"]
    assert f"error: the server stopped answering: 16 of the 32 blocks found were not read ({result['waiting']} more " \
           f"wait for them); {result['pulled']} pulled; run ppc pull again" in err  # fmt: skip
    with PersistentPrefixCache(tmp_path / "b", model, memory_bytes=0) as handle:
        for toks in chains:  # what was pulled restores exactly (a fetch checks it against a cold prefill)
            fetch_exact(handle, model, toks + [1])


def prefill_cache(model, toks):
    from helpers import prefill

    return prefill(model, toks)[1]


# -- a server that cannot be reached -----------------------------------------------------


@pytest.mark.slow
def test_push_and_pull_stop_when_the_server_cannot_be_reached(tmp_path, tiny_model_dir, filled, dead_url):
    line = one_error(ppc("push", "--store", filled, "--remote", dead_url))
    assert line.startswith(f"error: cannot reach {dead_url}: connection refused; nothing was pushed"), line
    line = one_error(ppc("pull", "--model", tiny_model_dir, "--store", tmp_path / "b", "--remote", dead_url))
    assert line.startswith(f"error: cannot reach {dead_url}: connection refused; nothing was pulled"), line
    assert not (tmp_path / "b").exists()  # stopped before opening (or making) a store


@pytest.mark.slow
def test_generate_and_precompute_go_on_locally_and_say_it_once(tmp_path, tiny_model_dir, filled, prompts, dead_url):
    said = f"cannot reach {dead_url}: connection refused; serving from the local store only"
    gen = ppc("generate", "--model", tiny_model_dir, "--store", filled, "--prompt", "a document about caches " * 8,
              "--max-tokens", 3, "--remote", dead_url, "--json")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert gen.stderr.count("cannot reach") == 1 and said in gen.stderr.splitlines(), gen.stderr
    assert json.loads(gen.stdout)["restored_tokens"] > 0  # the local store served
    pre = ppc("precompute", "--model", tiny_model_dir, "--store", tmp_path / "c", "--block-size", BS,
              "--remote", dead_url, prompts, "--json")  # fmt: skip
    assert pre.returncode == 0, pre.stderr
    assert pre.stderr.count("cannot reach") == 1 and said in pre.stderr.splitlines(), pre.stderr
    summary = json.loads(pre.stdout)
    assert summary["blocks_in_store"] > 0 and summary["remote_published"] == 0


@pytest.mark.slow
def test_serve_goes_on_locally_and_says_it_once(tmp_path, tiny_model_dir, dead_url):
    from test_serve import FIRST, OTHER, Server

    with Server(tiny_model_dir, tmp_path / "store", tmp_path / "serve.log", "--remote", dead_url,
                "--remote-insecure") as server:  # fmt: skip
        for messages in (FIRST, OTHER, FIRST):  # the store opens at the first request
            assert server.chat(messages)["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.stop() == 0, server.log()
    log = server.log()
    assert log.count("cannot reach") == 1, log
    assert f"cannot reach {dead_url}: connection refused; serving from the local store only" in log
    assert log.count("without a secret (--remote-insecure)") == 1, log  # the operator's choice, said once
    assert os.listdir(tmp_path / "store" / "segments")  # it stored locally all the same


@pytest.mark.slow
def test_the_library_says_it_once_until_the_server_answers_again(tmp_path, model, redis_server, caplog):
    toks = random_tokens(40, 91, first=91)
    url = redis_server.url
    with caplog.at_level(logging.INFO, logger="persistent_prefix_cache"):
        a = open_host(tmp_path / "a", model, url, remote_timeout=1.0)
        redis_server.kill()
        for i in range(3):
            time.sleep(0.6)  # past the breaker's first back-off: each fetch asks the server
            assert fetch_exact(a, model, toks + [i]) == 0
        b = open_host(tmp_path / "b", model, url, remote_timeout=1.0)  # another handle, same server
        publish(b, model, toks)
        down = [r for r in caplog.records if "cannot reach" in r.getMessage()]
        assert len(down) == 1 and down[0].levelno == logging.WARNING
        assert down[0].getMessage() == f"cannot reach {url}: connection refused; serving from the local store only"
        assert a.stats()["remote_errors"] >= 2  # every failure is counted, only the first said
        redis_server.start()  # same port
        time.sleep(1.1)
        assert fetch_exact(a, model, toks + [5]) == 0  # answers (it holds nothing)
        assert any(r.getMessage() == f"{url} answers again" for r in caplog.records)
        redis_server.kill()
        time.sleep(1.1)
        fetch_exact(a, model, toks + [6])
        assert len([r for r in caplog.records if "cannot reach" in r.getMessage()]) == 2  # a new outage is said
    for h in (a, b):
        h.close()


@pytest.mark.slow
def test_passwords_are_never_printed(tmp_path, tiny_model_dir, filled, dead_url, redis_engine):
    from redis_servers import RedisServer

    hidden = dead_url.replace("redis://", "redis://:hunter2@")
    line = one_error(ppc("push", "--store", filled, "--remote", hidden))
    assert "hunter2" not in line and f"cannot reach {dead_url.replace('//', '//:***@')}" in line
    server = RedisServer(tmp_path / "redis", args=["--requirepass", "s3cret"], engine=redis_engine).start()
    try:
        url = f"redis://:hunter2@127.0.0.1:{server.port}"
        line = one_error(ppc("push", "--store", filled, "--remote", url))
        assert "hunter2" not in line and "refuses the URL's user name or password" in line
        gen = ppc("generate", "--model", tiny_model_dir, "--store", filled, "--prompt", "hi", "--remote", url)
        assert "hunter2" not in one_error(gen)
        line = one_error(ppc("push", "--store", filled, "--remote", f"redis://127.0.0.1:{server.port}"))
        assert "the server asks for a password, and the URL gives none" in line
    finally:
        server.stop()


@pytest.mark.slow
def test_a_cluster_nothing_answers_is_said_once(tmp_path, model, caplog):
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
    toks = random_tokens(40, 92, first=92)
    try:
        with caplog.at_level(logging.WARNING, logger="persistent_prefix_cache"):
            host = open_host(tmp_path / "a", model, url, remote_timeout=1.0)
            for i in range(3):
                time.sleep(0.6)  # past the breaker's first back-off
                assert fetch_exact(host, model, toks + [i]) == 0
            publish(host, model, toks)
        said = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
        assert said == [f"cannot reach any node of {url}: connection refused; serving from the local store only"]
        assert host.stats()["remote_errors"] >= 2
        host.close()
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_push_to_a_full_server_that_evicts_nothing_says_why(tmp_path, filled, redis_engine):
    from redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis", args=["--maxmemory", "1", "--maxmemory-policy", "noeviction"],
                         engine=redis_engine).start()  # fmt: skip
    try:
        proc = ppc("push", "--store", filled, "--remote", server.url, "--json")
        line = one_error(proc, 1)
        blocks = json.loads(proc.stdout)["blocks"]
        assert json.loads(proc.stdout)["failed"] == blocks > 0
        assert line.startswith(f"error: {blocks} blocks not taken by the server (the server says: "), line
        assert "maxmemory" in line and line.endswith("set its maxmemory-policy to allkeys-lru"), line
    finally:
        server.stop()

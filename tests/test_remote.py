"""The remote (fleet) tier against a real server (Redis, Valkey): URLs, the wire form, faults.

Two store handles with their own directories stand for two hosts that share nothing
but the server (the tests in test_remote_fleet.py use separate processes). Every
fetch is checked bitwise: the next-token logits after a restore equal a cold prefill.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import assert_same_logits, cold_logits, prefill, random_tokens, warm_logits

from persistent_prefix_cache import InvalidArgumentError, PersistentPrefixCache, RemoteConfigError
from persistent_prefix_cache.disk import faults
from persistent_prefix_cache.keys import chain_keys
from persistent_prefix_cache.tiers import remote_wire as wire

BS = 16


# Generous: on a loaded machine a loopback server can stall for more than the default
# 0.1 s, and a test must not depend on timing; the fault tests set their own.
TIMEOUT = 10.0


def open_host(path, model, url, **kw):
    """A host of the fleet; without a `remote_secret`, one that chose to share blocks without one."""
    kw.setdefault("memory_bytes", 64 << 20)
    kw.setdefault("remote_timeout", TIMEOUT)
    if kw.get("remote_secret") is None:
        kw.setdefault("remote_insecure", True)
    return PersistentPrefixCache(path, model, block_size=BS, remote=url, **kw)


def publish(host, model, toks):
    _, cache = prefill(model, toks)
    n = host.store(toks, cache)
    host.flush()
    return n


def fetch_exact(host, model, toks) -> int:
    """Fetch `toks`, check the continuation bitwise; the number of tokens restored."""
    cache, rest = host.fetch(toks)
    assert_same_logits(warm_logits(model, cache, rest), cold_logits(model, toks))
    return len(toks) - len(rest)


def server_keys(host, toks) -> list[bytes]:
    root = bytes.fromhex(host.this_model()["root"])
    return [host.remote_fill.remote.key(k) for k in chain_keys(root, np.asarray(toks, "<i4"), BS)]


@pytest.mark.parametrize(
    "url",
    [
        "localhost:6379",
        "http://h:1",
        "redis://",
        "redis://h",
        "redis://h:0",
        "redis://a:1,b:2",
        "unix://",
        "redis+cluster://",
    ],
)
def test_bad_urls_are_clear_errors(tmp_path, model, url):
    with pytest.raises(InvalidArgumentError) as err:
        PersistentPrefixCache(tmp_path / "s", model, remote=url)
    assert "remote URL" in str(err.value)
    assert not (tmp_path / "s").exists()  # nothing was written


def test_secret_and_ttl_need_a_remote(tmp_path, model):
    with pytest.raises(InvalidArgumentError):
        PersistentPrefixCache(tmp_path / "s", model, remote_secret="x")
    with pytest.raises(InvalidArgumentError):
        PersistentPrefixCache(tmp_path / "s", model, remote="redis://h:1", remote_ttl=0, remote_insecure=True)


def test_a_remote_without_a_secret_is_an_explicit_choice(tmp_path, model):
    """Code written before the choice was asked for gets one clear error naming the option."""
    with pytest.raises(InvalidArgumentError, match=r"remote_insecure=True to share blocks without one") as err:
        PersistentPrefixCache(tmp_path / "s", model, remote="redis://h:1")
    assert "trusts whoever can write to the server" in str(err.value)
    with pytest.raises(InvalidArgumentError, match="contradict"):
        PersistentPrefixCache(tmp_path / "s", model, remote="redis://h:1", remote_secret="x", remote_insecure=True)
    with pytest.raises(InvalidArgumentError, match="need remote=URL"):
        PersistentPrefixCache(tmp_path / "s", model, remote_insecure=True)
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_core_install_does_not_import_redis_and_missing_redis_is_a_clear_error(tmp_path, tiny_model_dir):
    code = f"""
import sys
sys.modules['redis'] = None  # as if redis-py were not installed
from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache import MissingDependencyError
from persistent_prefix_cache.tiny_model import load_tiny_model
m = load_tiny_model({str(tiny_model_dir)!r})
s = PersistentPrefixCache({str(tmp_path / "local")!r}, m)
s.close()
try:
    PersistentPrefixCache({str(tmp_path / "r")!r}, m, remote='redis://127.0.0.1:1', remote_insecure=True)
except MissingDependencyError as e:
    print('MISSING', e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "MISSING" in out.stdout and "pip install redis hiredis" in out.stdout


def test_host_b_restores_what_host_a_stored(tmp_path, model, redis_server):
    toks = random_tokens(100, 1, first=1)
    a = open_host(tmp_path / "a", model, redis_server.url)
    assert publish(a, model, toks) == 7
    st = a.stats()
    assert (st["remote_published"], st["remote_pending"], st["remote_errors"]) == (7, 0, 0)
    b = open_host(tmp_path / "b", model, redis_server.url)
    query = toks + random_tokens(9, 2)
    assert fetch_exact(b, model, query) == 100
    b.flush()
    st = b.stats()
    assert (st["remote_hits"], st["remote_blocks"], st["blocks"]) == (1, 7, 7)  # now on B's disk too
    # The chain breaks at a full block of a longer query: the stored partial one still serves.
    c = open_host(tmp_path / "c", model, redis_server.url, memory_bytes=0)
    assert fetch_exact(c, model, toks + random_tokens(30, 3)) == 100
    c.close()
    b.close()
    b = open_host(tmp_path / "b", model, redis_server.url)
    redis_server.client().flushall()  # the next fetch must be local
    assert fetch_exact(b, model, query) == 100
    assert b.stats()["remote_hits"] == 0
    for h in (a, b):
        h.close()


def test_the_remote_fill_is_what_a_pull_goes_through(tmp_path, model, redis_server):
    # The handle's public seam for ppc pull (instead of its private parts): the tier, the
    # layout check, which keys the index holds, and the writer thread.
    from persistent_prefix_cache.admin.remote_sync import checked_value

    plain = PersistentPrefixCache(tmp_path / "p", model, block_size=BS)
    assert plain.remote_fill is None
    plain.close()
    toks = random_tokens(100, 1, first=1)
    a = open_host(tmp_path / "a", model, redis_server.url)
    assert publish(a, model, toks) == 7
    b = open_host(tmp_path / "b", model, redis_server.url)
    fill, skeys = b.remote_fill, server_keys(b, toks)
    values = fill.remote.bulk.get_values(skeys)
    blocks = [checked_value(k, v, fill.remote.root, fill.remote.mac) for k, v in zip(skeys, values)]
    keys = [block.node.key for block in blocks]
    assert all(fill.fits(block) for block in blocks) and fill.held(keys) == set()
    first = blocks[0]
    assert not fill.fits(dataclasses.replace(first, bits={"no such leaf": next(iter(first.bits.values()))}))
    fill.write(blocks).result()
    assert fill.held(keys) == set(keys)
    redis_server.client().flushall()  # what b restores now is its own
    assert fetch_exact(b, model, toks + random_tokens(9, 2)) == 100
    assert b.stats()["remote_hits"] == 0
    for h in (a, b):
        h.close()


def test_the_cost_model_leaves_a_remote_slower_than_prefill_on_the_server(tmp_path, model, redis_server):
    toks = random_tokens(96, 21, first=21)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, toks)
    # Host B learned, as from real work, that the remote reads 1 MB/s and the model
    # prefills a million tokens a second: reading the continuation loses.
    b = open_host(tmp_path / "b", model, redis_server.url)
    b.costs.learned.observe_restore("remote", 1 << 20, 1.0)
    b.remote_fill.remote.value_bytes = 20_000  # as if a block of this model had been read before
    b.observe_prefill(1_000_000, 1.0)
    cache, rest = b.fetch(toks + [1])
    assert cache is None and len(rest) == len(toks) + 1
    st = b.stats()
    assert (st["remote_slower"], st["tokens_skipped"], st["remote_blocks"], st["remote_misses"]) == (1, 96, 0, 0)
    # cost_model=False reads it all the same; so does a host whose prefill is slow.
    c = open_host(tmp_path / "c", model, redis_server.url, cost_model=False)
    c.costs.learned.observe_restore("remote", 1 << 20, 1.0)
    c.observe_prefill(1_000_000, 1.0)
    assert fetch_exact(c, model, toks + [1]) == 96 and c.stats()["remote_slower"] == 0
    d = open_host(tmp_path / "d", model, redis_server.url)
    d.costs.learned.observe_restore("remote", 1 << 20, 1.0)
    d.remote_fill.remote.value_bytes = 20_000
    d.observe_prefill(10, 1.0)  # 10 tokens/s: any read wins
    assert fetch_exact(d, model, toks + [1]) == 96 and d.stats()["remote_slower"] == 0
    for h in (a, b, c, d):
        h.close()


def test_a_longer_local_prefix_is_not_read_again(tmp_path, model, redis_server):
    toks = random_tokens(64, 3, first=2)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, toks)
    assert fetch_exact(a, model, toks + [5]) == 64
    assert a.stats()["remote_blocks"] == 0
    a.close()


def test_server_not_running_at_open(tmp_path, model):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    url = f"redis://127.0.0.1:{port.getsockname()[1]}"  # bound, never listening: refused
    toks = random_tokens(50, 4, first=3)
    host = open_host(tmp_path / "a", model, url)
    assert publish(host, model, toks) == 4  # stored locally all the same
    assert fetch_exact(host, model, toks + [1]) == 50
    assert fetch_exact(host, model, random_tokens(40, 5, first=4)) == 0
    st = host.stats()
    assert st["remote_errors"] >= 1 and st["remote_publish_failed"] == 4 and st["remote_published"] == 0
    host.close()
    port.close()


def test_server_killed_mid_run(tmp_path, model, redis_server):
    first, second = random_tokens(48, 6, first=5), random_tokens(48, 7, first=6)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, first)
    publish(a, model, second)
    b = open_host(tmp_path / "b", model, redis_server.url)
    assert fetch_exact(b, model, first + [1]) == 48
    redis_server.kill()
    assert fetch_exact(b, model, second + [1]) == 0  # the server is gone: computed
    assert fetch_exact(b, model, first + [1]) == 48  # what came before is local now
    publish(b, model, random_tokens(40, 8, first=7))  # flush returns: failed, counted
    st = b.stats()
    assert st["remote_errors"] >= 1 and st["remote_publish_failed"] + st["remote_dropped"] >= 1
    for h in (a, b):
        h.close()


def test_server_paused_costs_one_timeout_then_backs_off(tmp_path, model, redis_server):
    toks = random_tokens(48, 9, first=8)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, toks)
    b = open_host(tmp_path / "b", model, redis_server.url, remote_timeout=0.5)
    redis_server.client().execute_command("CLIENT", "PAUSE", 60000, "ALL")
    try:
        started = time.monotonic()
        assert fetch_exact(b, model, toks + [1]) == 0
        # A bound for a hang, not a timing margin: the server stays paused for 60 s.
        assert time.monotonic() - started < 30
        assert b.stats()["remote_errors"] == 1
        assert fetch_exact(b, model, toks + [2]) == 0
        st = b.stats()
        assert st["remote_errors"] == 1 and st["remote_skipped"] == 1  # the breaker skipped it
    finally:
        redis_server.kill()  # a paused server answers nothing, not even CLIENT UNPAUSE
    for h in (a, b):
        h.close()


def test_server_restarted_empty(tmp_path, model, redis_server):
    toks = random_tokens(48, 10, first=9)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, toks)
    redis_server.stop()
    redis_server.start()  # same port, nothing in it
    b = open_host(tmp_path / "b", model, redis_server.url)
    assert fetch_exact(b, model, toks + [1]) == 0
    assert b.stats()["remote_misses"] >= 1 or b.stats()["remote_errors"] >= 1
    more = random_tokens(40, 11, first=10)
    publish(a, model, more)  # A's pooled connection died with the server: reconnected
    assert a.stats()["remote_published"] == 3 + 3
    assert fetch_exact(b, model, more + [1]) == 40
    for h in (a, b):
        h.close()


def test_eviction_inside_a_chain_gives_a_shorter_prefix(tmp_path, model, redis_server):
    toks = random_tokens(96, 12, first=12)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, toks)
    keys = server_keys(a, toks)
    redis_server.client().delete(keys[3])  # what the server's LRU does to a block
    b = open_host(tmp_path / "b", model, redis_server.url)
    assert fetch_exact(b, model, toks + [1]) == 3 * BS
    for h in (a, b):
        h.close()


def test_maxmemory_eviction_never_gives_wrong_kv(tmp_path, model, redis_server):
    client = redis_server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory", used + 200_000)  # room for some 25 blocks of ~8 KB
    a = open_host(tmp_path / "a", model, redis_server.url)
    prompts = [random_tokens(160, 100 + i, first=20 + i) for i in range(6)]
    for p in prompts:
        publish(a, model, p)
    b = open_host(tmp_path / "b", model, redis_server.url)
    restored = 0
    for p in prompts:
        keys = server_keys(a, p)
        present = [bool(client.exists(k)) for k in keys]
        held = present.index(False) if False in present else len(present)
        got = fetch_exact(b, model, p + [1])  # bitwise, however short
        # The server may evict more while b reads: its replies count towards maxmemory
        # (and its LRU clock ticks once a second, so equally fresh keys go at random).
        # So b restores at most what was there, and stops only at a block now gone.
        assert got % BS == 0 and got <= BS * held
        if got < BS * held:
            assert not client.exists(keys[got // BS])
        restored += got // BS
    assert client.info("stats")["evicted_keys"] > 0  # the server did evict
    assert b.stats()["remote_blocks"] == restored
    for h in (a, b):
        h.close()


def test_garbage_value_is_a_counted_miss(tmp_path, model, redis_server):
    toks = random_tokens(64, 13, first=13)
    a = open_host(tmp_path / "a", model, redis_server.url)
    publish(a, model, toks)
    keys = server_keys(a, toks)
    client = redis_server.client()
    value = bytearray(client.get(keys[2]))
    value[len(value) // 2] ^= 0x40  # one flipped bit inside the KV
    client.set(keys[2], bytes(value))
    client.set(keys[1], b"garbage" * 100)
    b = open_host(tmp_path / "b", model, redis_server.url)
    assert fetch_exact(b, model, toks + [1]) == BS
    assert b.stats()["remote_corrupt"] == 1
    client.set(keys[1], client.get(keys[0]))  # a valid value under another block's key
    c = open_host(tmp_path / "c", model, redis_server.url)
    assert fetch_exact(c, model, toks + [1]) == BS
    assert c.stats()["remote_corrupt"] == 1
    for h in (a, b, c):
        h.close()


def test_forged_value_is_rejected_with_a_secret(tmp_path, model, redis_server, caplog):
    toks = random_tokens(64, 14, first=14)
    a = open_host(tmp_path / "a", model, redis_server.url, remote_secret="fleet-secret")
    publish(a, model, toks)
    keys = server_keys(a, toks)
    client = redis_server.client()
    # A forger who can write to the server: a well-formed value for block 1 with the
    # right key, parent and tokens, a correct checksum, other KV and no valid MAC.
    root = bytes.fromhex(a.this_model()["root"])
    chain = chain_keys(root, np.asarray(toks, "<i4"), BS)
    block = np.asarray(toks[BS : 2 * BS], "<i4").tobytes()
    good = wire.decode(client.get(keys[1]), keys[1], key=chain[1], parent=chain[0], position=BS, tokens=block, mac=None)
    forged = {lid: {f: (np.zeros_like(bits), d) for f, (bits, d) in part.items()} for lid, part in good.bits.items()}
    client.set(keys[1], wire.encode(keys[1], good.node, forged, mac=None))
    b = open_host(tmp_path / "b", model, redis_server.url, remote_secret="fleet-secret")
    assert fetch_exact(b, model, toks + [1]) == BS
    assert b.stats()["remote_unauthenticated"] == 1
    client.set(keys[1], wire.encode(keys[1], good.node, forged, mac=wire.mac_key("another secret")))
    c = open_host(tmp_path / "c", model, redis_server.url, remote_secret="fleet-secret")
    assert fetch_exact(c, model, toks + [1]) == BS
    assert c.stats()["remote_unauthenticated"] == 1
    # A host without a secret reads the key space of values without one: the fleet's
    # values are not there (a miss); values it finds there are trusted like a disk.
    d = open_host(tmp_path / "d", model, redis_server.url, memory_bytes=0)
    assert fetch_exact(d, model, toks + [1]) == 0 and d.stats()["remote_unauthenticated"] == 0
    for k, plain in zip(keys, chain):
        client.set(wire.server_key(root, plain), client.get(k))  # MAC-carrying values where d reads
    client.set(wire.server_key(root, chain[1]), wire.encode(keys[1], good.node, forged, mac=None))
    e = open_host(tmp_path / "e", model, redis_server.url, memory_bytes=0)
    with caplog.at_level(logging.WARNING, logger="persistent_prefix_cache"):
        cache, rest = e.fetch(toks + [1])
        e.fetch(toks + [2])
    assert len(toks) + 1 - len(rest) == 64 and e.stats()["remote_unauthenticated"] == 0  # the forgery is used
    said = [r.getMessage() for r in caplog.records if "carry a MAC this host cannot check" in r.getMessage()]
    assert len(said) == 1, said  # said once
    for h in (a, b, c, d, e):
        h.close()


def test_auth_and_a_wrong_password(tmp_path, model, redis_engine):
    from redis_servers import RedisServer

    server = RedisServer(tmp_path / "redis", args=["--requirepass", "s3cret"], engine=redis_engine).start()
    try:
        toks = random_tokens(40, 15, first=15)
        a = open_host(tmp_path / "a", model, f"redis://:s3cret@127.0.0.1:{server.port}")
        publish(a, model, toks)
        assert a.stats()["remote_published"] == 3
        assert a.stats()["remote"] == f"redis://:***@127.0.0.1:{server.port}"
        b = open_host(tmp_path / "b", model, f"redis://default:s3cret@127.0.0.1:{server.port}/0")
        assert fetch_exact(b, model, toks + [1]) == 40
        # A password the server refuses is a misconfiguration, said at open (never shown).
        with pytest.raises(RemoteConfigError) as err:
            open_host(tmp_path / "c", model, f"redis://:wrong@127.0.0.1:{server.port}")
        assert "refuses the URL's user name or password" in str(err.value) and "wrong" not in str(err.value)
        with pytest.raises(RemoteConfigError, match="asks for a password, and the URL gives none"):
            open_host(tmp_path / "c", model, f"redis://127.0.0.1:{server.port}")
        for h in (a, b):
            h.close()
    finally:
        server.stop()


def _wait_for(path, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"the writer never reached {path.name}"
        time.sleep(0.01)


def test_block_writes_with_a_remote_join_the_group_commit_then_publish(tmp_path, model, redis_server, monkeypatch):
    """With a remote, store() calls queued behind a busy writer share one index transaction
    (they once skipped the group commit: the writer picked it by comparing bound methods);
    each is published only once the commit that holds it is done, and another host
    restores every prompt from the server."""
    n = 5
    prompts = [random_tokens(2 * BS + 3, 60 + i, first=60 + i) for i in range(n)]
    caches = [prefill(model, p)[1] for p in prompts]
    a = open_host(tmp_path / "a", model, redis_server.url)
    a.flush()  # the writer's first sweep is done: only our writes follow
    marker, hooks = tmp_path / "held", os.environ.get(faults.VARIABLE, "")
    # The writer holds its first write uncommitted (segment written) until the marker goes.
    monkeypatch.setenv(faults.VARIABLE, ",".join(filter(None, [hooks, faults.hooks_value(
        hold_at="before_commit", pause_file=marker)])))  # fmt: skip
    assert a.store(prompts[0], caches[0]) == 3
    _wait_for(marker)
    assert a.stats()["remote_published"] == 0 and redis_server.client().dbsize() == 0  # not before its commit
    # The others queue behind it, from threads at once and from this one.
    threads = [threading.Thread(target=a.store, args=(prompts[i], caches[i])) for i in range(1, n - 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.store(prompts[-1], caches[-1])
    monkeypatch.setenv(faults.VARIABLE, hooks)  # no hold at the next commit
    marker.unlink()
    a.flush()
    st = a.stats()
    assert (st["group_commits"], st["group_commit_writes"]) == (2, n)  # n writes, 2 transactions
    assert st["blocks_written"] == st["remote_published"] == 3 * n and st["write_errors"] == 0
    assert st["remote_dropped"] == st["remote_publish_failed"] == 0
    a.close()
    b = open_host(tmp_path / "b", model, redis_server.url)
    for p in prompts:
        assert fetch_exact(b, model, p + random_tokens(5, 99)) == len(p)
    st = b.stats()
    assert (st["remote_hits"], st["remote_blocks"]) == (n, 3 * n)
    b.close()


def test_ttl_and_publish_queue_bound(tmp_path, model, redis_server):
    toks = random_tokens(40, 16, first=16)
    a = open_host(tmp_path / "a", model, redis_server.url, remote_ttl=3600)
    publish(a, model, toks)
    ttl = redis_server.client().pttl(server_keys(a, toks)[0])
    assert 0 < ttl <= 3600 * 1000
    a.remote_fill.remote.queue_bytes = 1  # no room: every block is dropped and counted, none waits
    publish(a, model, random_tokens(40, 17, first=17))
    st = a.stats()
    assert st["remote_dropped"] == 3 and st["remote_pending"] == 0
    a.close()


def test_tls(tmp_path, model, redis_engine):
    import shutil

    from redis_servers import RedisServer

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server = RedisServer(tmp_path / "redis", tls=(cert, key), engine=redis_engine).start()
    try:
        url = f"rediss://127.0.0.1:{server.port}?ssl_ca_certs={cert}&ssl_check_hostname=false"
        toks = random_tokens(40, 18, first=18)
        a = open_host(tmp_path / "a", model, url)
        publish(a, model, toks)
        assert a.stats()["remote_published"] == 3
        b = open_host(tmp_path / "b", model, url)
        assert fetch_exact(b, model, toks + [1]) == 40
        plain = open_host(tmp_path / "c", model, f"redis://127.0.0.1:{server.port}")  # TLS port, no TLS
        assert fetch_exact(plain, model, toks + [1]) == 0 and plain.stats()["remote_errors"] == 1
        for h in (a, b, plain):
            h.close()
    finally:
        server.stop()


def test_recurrent_and_window_layers_restore_from_the_remote(tmp_path, redis_server):
    # Snapshots (a recurrent state, a rotating window) travel in the value too.
    from families import VOCAB, build
    from mlx_lm.models.cache import make_prompt_cache

    from helpers import feed

    for family in ("qwen3_next", "gemma3_text"):
        model = build(family)
        # Ids inside the family models' vocabulary: an id past it makes the embedding
        # read whatever memory follows (NaN logits that depend on earlier tests).
        toks = [t % VOCAB for t in random_tokens(48, 19, first=19)]
        rest = [t % VOCAB for t in random_tokens(5, 20)]
        a = open_host(tmp_path / f"a-{family}", model, redis_server.url)
        cache = make_prompt_cache(model)
        feed(model, cache, toks)
        a.store(toks, cache)
        a.flush()
        want = feed(model, cache, rest)  # how the cache A stored goes on
        b = open_host(tmp_path / f"b-{family}", model, redis_server.url)
        restored, remaining = b.fetch(toks + rest)
        assert len(remaining) == len(rest) and b.stats()["remote_blocks"] == 3
        assert_same_logits(feed(model, restored, remaining), want)
        for h in (a, b):
            h.close()


def test_replies_are_read_straight_into_buffers_and_errors_are_clear(redis_server):
    import redis

    from persistent_prefix_cache.tiers.remote_replies import ProtocolError, ReplyError, read_values

    client = redis_server.client()
    big = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # many socket reads
    client.set(b"big", big)
    client.set(b"empty", b"")
    client.rpush(b"list", b"x")  # GET of a list: an error reply for that key only
    got = read_values(client, [b"big", b"missing", b"empty", b"list", b"big"])
    assert bytes(got[0]) == big and got[1] is None and bytes(got[2]) == b"" and bytes(got[4]) == big
    assert isinstance(got[3], ReplyError) and "WRONGTYPE" in str(got[3])
    assert client.ping()  # the connection went back to the pool clean

    # A server that answers something a GET never gets: a clear error, the connection dropped.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        liar = redis.Redis(port=port, socket_timeout=5)

        replies = [b">2\r\n$6\r\nMOVING\r\n*1\r\n:7\r\n$3\r\nabc\r\n", b"*1\r\n$1\r\nx\r\n"]

        def answer():  # redis-py's handshake answered, then `replies`, one per GET
            conn, _ = listener.accept()
            while replies:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                if b"GET" in chunk:
                    conn.sendall(replies.pop(0))
                    continue
                n, hello = chunk.count(b"\r\n*") + chunk.startswith(b"*"), b"HELLO" in chunk
                conn.sendall((b"%1\r\n$5\r\nproto\r\n:3\r\n" if hello else b"") + b"+OK\r\n" * (n - hello))
            conn.close()

        t = threading.Thread(target=answer)
        t.start()
        assert [bytes(v) for v in read_values(liar, [b"k"])] == [b"abc"]  # the push message skipped
        with pytest.raises(ProtocolError):
            read_values(liar, [b"j"])
        t.join(10)
        assert not liar.connection_pool._available_connections or all(
            getattr(c, "_sock", None) is None for c in liar.connection_pool._available_connections
        )

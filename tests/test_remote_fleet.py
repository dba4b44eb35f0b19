"""A fleet of hosts sharing one server: hosts are separate processes with their own stores.

The headline: host A precomputes prompts into an empty store with ``remote=``; host B,
with an empty directory of its own, restores them bitwise. Then a publisher killed
with SIGKILL mid-batch, two hosts storing one prompt at once, and a Redis Cluster that
loses a node (its slots miss, the rest serve).
"""

from __future__ import annotations


import numpy as np
import pytest
from helpers import random_tokens
from store_worker import Worker, wait_for_pause
from test_remote import BS, TIMEOUT, fetch_exact, open_host, publish, server_keys

from persistent_prefix_cache.disk.faults import hooks_value
from persistent_prefix_cache.keys import chain_keys
from persistent_prefix_cache.tiers import remote_wire as wire


FLEET = "the fleet's secret"  # the secret every host of these fleets holds


def host(tmp_path, store, tiny_model_dir, url, steps, *, name=None, env=None):
    """A host process with its own store directory (``tmp_path / store``)."""
    spec = {"model": str(tiny_model_dir), "store": str(tmp_path / store), "block_size": BS, "remote": url,
            "remote_secret": FLEET, "remote_timeout": TIMEOUT, "steps": steps}  # fmt: skip
    return Worker(spec, str(tmp_path), name=name or store, env=env)


@pytest.mark.slow
def test_host_b_restores_host_a_precompute_bitwise(tmp_path, tiny_model_dir, redis_server):
    prompts = [random_tokens(n, 30 + i, first=30 + i) for i, n in enumerate((40, 64, 100))]
    a = host(tmp_path, "a", tiny_model_dir, redis_server.url, [["store", p] for p in prompts] + [["flush"], ["stats"]])
    try:
        stats = a.result(timeout=300)["steps"][-1]
    finally:
        a.reap()
    assert stats["remote_published"] == 3 + 4 + 7 and stats["remote_errors"] == 0
    queries = [p + random_tokens(5, 40 + i) for i, p in enumerate(prompts)]
    b = host(tmp_path, "b", tiny_model_dir, redis_server.url, [["fetch", q] for q in queries] + [["flush"], ["stats"]])
    try:
        out = b.result(timeout=300)["steps"]
    finally:
        b.reap()
    assert out[:3] == [{"matched": len(p), "exact": True} for p in prompts]
    assert out[-1]["remote_hits"] == 3 and out[-1]["blocks"] == 14  # written into B's store
    redis_server.client().flushall()
    again = host(
        tmp_path, "b", tiny_model_dir, redis_server.url, [["fetch", q] for q in queries] + [["stats"]], name="b2"
    )
    try:
        out = again.result(timeout=300)["steps"]
    finally:
        again.reap()
    assert out[:3] == [{"matched": len(p), "exact": True} for p in prompts]  # local now
    assert out[-1]["remote_hits"] == 0


@pytest.mark.slow
def test_publisher_killed_mid_batch_leaves_whole_values_only(tmp_path, tiny_model_dir, model, redis_server):
    toks = random_tokens(80, 50, first=50)
    marker = str(tmp_path / "pause")
    w = host(
        tmp_path, "a", tiny_model_dir, redis_server.url, [["store", toks], ["flush"]],
        env={"PPC_TEST_HOOKS": hooks_value(pause_at="remote_publish", pause_file=marker)},
    )  # fmt: skip
    try:
        wait_for_pause(marker, w, "remote_publish", timeout=300)
        w.kill()
    finally:
        w.reap()
    client = redis_server.client()
    b = open_host(tmp_path / "b", model, redis_server.url, remote_secret=FLEET)
    keys = server_keys(b, toks)
    assert [bool(client.exists(k)) for k in keys] == [True] + [False] * 4
    root = bytes.fromhex(b.this_model()["root"])
    chain = chain_keys(root, np.asarray(toks, "<i4"), BS)
    block = wire.decode(client.get(keys[0]), keys[0], key=chain[0], parent=root, position=0,
                        tokens=np.asarray(toks[:BS], "<i4").tobytes(), mac=b.remote_fill.remote.mac)  # fmt: skip
    assert block.node.n_tokens == BS
    assert fetch_exact(b, model, toks + [1]) == BS
    b.close()


@pytest.mark.slow
def test_two_hosts_store_one_prompt_at_once(tmp_path, tiny_model_dir, model, redis_server):
    toks = random_tokens(96, 60, first=60)
    steps = [["ready", "x"], ["wait"], ["store", toks], ["flush"], ["stats"]]
    workers = [host(tmp_path, n, tiny_model_dir, redis_server.url, steps) for n in ("a1", "a2")]
    try:
        for w in workers:
            w.wait_ready("x", timeout=300)
        for w in workers:
            w.go()
        stats = [w.result(timeout=300)["steps"][-1] for w in workers]
    finally:
        for w in workers:
            w.reap()
    # SET NX: each block was written by exactly one host; the other found it there.
    assert sum(s["remote_published"] for s in stats) == 6
    assert sum(s["remote_already"] for s in stats) == 6
    b = open_host(tmp_path / "b", model, redis_server.url, remote_secret=FLEET)
    assert fetch_exact(b, model, toks + [1]) == 96
    b.close()


@pytest.mark.slow
def test_cluster_node_down_its_slots_miss_the_rest_serve(tmp_path, model, redis_cluster):
    url = redis_cluster.url
    prompts = [random_tokens(48, 70 + i, first=70 + i) for i in range(6)]
    a = open_host(tmp_path / "a", model, url)
    for p in prompts:
        publish(a, model, p)
    assert a.stats()["remote_published"] == 18 and a.stats()["remote_errors"] == 0
    b = open_host(tmp_path / "b", model, url)
    assert [fetch_exact(b, model, p + [1]) for p in prompts[:2]] == [48, 48]
    b.close()
    down = redis_cluster.nodes[1]
    down.kill()
    c = open_host(tmp_path / "c", model, url)
    want = []
    for p in prompts[2:]:
        on_down = [redis_cluster.node_of(k) is down for k in server_keys(c, p)]
        want.append(BS * (on_down.index(True) if True in on_down else 3))
    got = [fetch_exact(c, model, p + [1]) for p in prompts[2:]]
    assert got == want
    assert any(w < 48 for w in want) and c.stats()["remote_errors"] >= 1  # the test met the dead node
    for h in (a, c):
        h.close()

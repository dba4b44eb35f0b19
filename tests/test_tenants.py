"""Tenants in one store (the library's side of ``ppc serve --tenants``): per-namespace
quotas whose eviction takes only the namespace's own leaves (`disk.index_owners`), and
shared prefixes keyed once for every tenant (`keys.TenantRoot`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import BLOCK, assert_restores_kv, assert_tree_consistent, prefill, random_tokens, read_index

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.blocks import Node
from persistent_prefix_cache.disk.index import Index
from persistent_prefix_cache.errors import InvalidArgumentError
from persistent_prefix_cache.keys import TenantRoot, block_key, chain_keys, key_follows, link_key, root_key

SYSTEM = random_tokens(3 * BLOCK, seed=900)  # a system prompt of three full blocks


def open_store(path, model, namespace, **kwargs) -> PersistentPrefixCache:
    return PersistentPrefixCache(path, model, namespace=namespace, block_size=BLOCK, **kwargs)


def put(store, model, tokens) -> None:
    store.store(tokens, prefill(model, tokens)[1])
    store.flush()


# -- keys --------------------------------------------------------------------------------


def test_a_tenant_chain_starts_at_the_shared_root_and_continues_through_its_link():
    shared, a, b = root_key("fp", "", "L"), root_key("fp", "a", "L"), root_key("fp", "b", "L")
    prefix = np.asarray(SYSTEM, dtype="<i4").tobytes()
    ra, rb = TenantRoot(a, shared, [prefix]), TenantRoot(b, shared, [prefix])
    suffix = random_tokens(2 * BLOCK + 5, seed=901)
    toks = np.asarray(SYSTEM + suffix, dtype="<i4")
    keys_a, keys_b = chain_keys(ra, toks, BLOCK), chain_keys(rb, toks, BLOCK)
    plain = chain_keys(shared, toks, BLOCK)  # a store without tenants: the same first blocks
    assert keys_a[:3] == keys_b[:3] == plain[:3]
    assert not set(keys_a[3:]) & set(keys_b[3:]) and not set(keys_a[3:]) & set(plain[3:])
    data = toks.tobytes()
    assert keys_a[3] == block_key(link_key(keys_a[2], a), data[4 * 3 * BLOCK : 4 * 4 * BLOCK])
    # A root without shared prefixes chains exactly as before.
    assert chain_keys(a, toks, BLOCK)[0] == block_key(a, data[: 4 * BLOCK])
    assert chain_keys(ra, np.asarray(suffix, dtype="<i4"), BLOCK) == chain_keys(a, np.asarray(suffix, "<i4"), BLOCK)
    # Only whole blocks of the prefix are shared: two blocks of it, then the tenant's.
    short = np.asarray(SYSTEM[: 2 * BLOCK] + suffix, dtype="<i4")
    assert ra.shared_blocks(short.tobytes(), BLOCK) == 2
    assert chain_keys(ra, short, BLOCK)[:2] == plain[:2]
    assert chain_keys(ra, short, BLOCK)[2] != chain_keys(rb, short, BLOCK)[2]


def test_a_block_after_a_shared_prefix_checks_through_its_link_only():
    shared, a = root_key("fp", "", "L"), root_key("fp", "a", "L")
    tokens = np.arange(BLOCK, dtype="<i4").tobytes()
    parent = bytes(range(16))
    key = block_key(link_key(parent, a), tokens)
    node = Node(key, parent, BLOCK, tokens, 1, 0, 0, extra={"link": a.hex()})
    assert key_follows(node)
    assert not key_follows(Node(key, parent, BLOCK, tokens, 1, 0, 0))  # without its link: a forged key
    assert not key_follows(Node(key, parent, BLOCK, tokens, 1, 0, 0, extra={"link": shared.hex()}))


def test_tenant_options_are_checked(store_dir, model):
    for kwargs in (
        {"namespace": "a", "namespace_bytes": -1},
        {"namespace": "a", "namespace_bytes": "lots"},
        {"namespace": "", "namespace_bytes": 10},
        {"namespace": "a", "shared_prefixes": "hello"},
        {"namespace": "a", "shared_prefixes": [[1, 2**40]]},
        {"namespace": "a", "shared_prefixes": [[1]], "remote": "redis://127.0.0.1:1", "remote_insecure": True},
    ):
        with pytest.raises(InvalidArgumentError):
            PersistentPrefixCache(store_dir, model, block_size=BLOCK, **kwargs)
    assert not os.path.exists(os.path.join(store_dir, "segments"))


# -- quotas ------------------------------------------------------------------------------


def test_a_flooding_tenant_evicts_only_its_own_blocks(store_dir, model):
    hot = random_tokens(4 * BLOCK, seed=910)
    with open_store(store_dir, model, "quiet", namespace_bytes=10**9) as quiet:
        put(quiet, model, hot)
        quiet_blocks = quiet.stats()["namespace_blocks"]
    assert quiet_blocks == 4
    one_prompt = None
    with open_store(store_dir, model, "flood", namespace_bytes=0) as probe:
        put(probe, model, random_tokens(4 * BLOCK, seed=911))
        one_prompt = probe.stats()["bytes_written"]
    quota = 3 * one_prompt  # about three prompts' blocks
    with open_store(store_dir, model, "flood", namespace_bytes=quota) as flood:
        for i in range(12):
            put(flood, model, random_tokens(4 * BLOCK, seed=1000 + i))
        stats = flood.stats()
        assert stats["namespace_bytes"] <= quota
        assert stats["quota_evictions"] >= 8 * 4 - 4  # most of the flood went, block by block
        assert stats["budget_evictions"] == 0
    with open_store(store_dir, model, "quiet", namespace_bytes=10**9) as quiet:
        assert quiet.stats()["namespace_blocks"] == 4  # counted again at open: nothing of it went
        assert quiet.peek(hot) == len(hot) - 1
    assert_tree_consistent(store_dir)


def test_the_quota_count_survives_reopening_and_an_older_writer(store_dir, model):
    prompts = [random_tokens(3 * BLOCK, seed=920 + i) for i in range(3)]
    with open_store(store_dir, model, "t") as plain:  # no quota: nothing counted (an older library alike)
        for p in prompts[:2]:
            put(plain, model, p)
    index = Index(os.path.join(store_dir, "index"), readonly=True)
    try:
        with index.reader() as r:
            assert r.accounted() == {}
    finally:
        index.close()
    with open_store(store_dir, model, "t", namespace_bytes=10**9) as counted:
        assert counted.stats()["namespace_blocks"] == 6  # adopted at open
        put(counted, model, prompts[2])
        stats = counted.stats()
        assert stats["namespace_blocks"] == 9
        assert stats["namespace_bytes"] == stats["block_bytes"]


def test_index_quota_eviction_takes_only_the_owners_leaves(tmp_path):
    """`Writer.evict_owned` directly: two accounted roots' chains and an unaccounted one."""
    index = Index(str(tmp_path / "index"), block_size=4)
    roots = [bytes([i]) * 16 for i in (1, 2, 3)]
    try:

        def build(w):
            for r in roots[:2]:
                w.owners.txn.put(b"\x0b" + r, bytes(16))  # accounted, empty
            t = 0
            for r in roots:
                parent = r
                for pos in range(0, 20, 4):
                    t += 1
                    data = np.arange(pos, pos + 4, dtype="<i4").tobytes()
                    node = Node(block_key(parent, data), parent, pos, data, 1, 100, 0, last_access=t)
                    assert w.insert(node)
                    parent = node.key

        index.write(build)
        with index.reader() as r:
            assert r.accounted() == {roots[0]: (5, 500), roots[1]: (5, 500)}
        removed = index.write(lambda w: w.evict_owned(roots[1], 250))
        assert len(removed) == 3  # leaf by leaf, from the end of its chain
        with index.reader() as r:
            assert r.owned(roots[1]) == (2, 200) and r.owned(roots[0]) == (5, 500)
            left = {n.key for n in r.iter_nodes()}
        assert not {n.key for n in removed} & (left)
        assert len(left) == 12  # roots[0]'s five and roots[2]'s five untouched
        assert index.write(lambda w: w.evict_owned(roots[2], 0)) == []  # not accounted: nothing
        assert index.write(lambda w: w.adopt_root(roots[2])) == (5, 500)
    finally:
        index.close()


# -- shared prefixes ---------------------------------------------------------------------


def test_a_shared_prefix_is_stored_once_and_hits_for_every_tenant(store_dir, model):
    suffix_a, suffix_b = random_tokens(2 * BLOCK + 3, seed=930), random_tokens(2 * BLOCK + 3, seed=931)
    shared = {"shared_prefixes": [SYSTEM]}
    with open_store(store_dir, model, "a", **shared) as a:
        cache_a = prefill(model, SYSTEM + suffix_a)[1]
        a.store(SYSTEM + suffix_a, cache_a)
        a.flush()
        assert_restores_kv(a, SYSTEM + suffix_a, cache_a)
    index = read_index(store_dir)
    assert len(index["nodes"]) == 6  # 3 shared blocks, then a's 3
    with open_store(store_dir, model, "b", **shared) as b:
        # b's prompt: the system prompt hits (stored by a), b's suffix does not (a's is a's)
        assert b.peek(SYSTEM + suffix_a) == len(SYSTEM)
        assert b.fetch(SYSTEM + suffix_a)[0] is not None
        cache_b = prefill(model, SYSTEM + suffix_b)[1]
        assert b.store(SYSTEM + suffix_b, cache_b) == 3  # only its own blocks are new
        b.flush()
        assert_restores_kv(b, SYSTEM + suffix_b, cache_b)
    assert len(read_index(store_dir)["nodes"]) == 9  # the shared blocks once
    with open_store(store_dir, model, "") as plain:  # the shared namespace itself: the prefix, no suffix
        assert plain.peek(SYSTEM + suffix_a) == len(SYSTEM)
    with open_store(store_dir, model, "a", **shared) as a:
        assert a.peek(SYSTEM + suffix_b) == len(SYSTEM)  # b's suffix stays b's
        assert a.peek(SYSTEM + suffix_a) == len(SYSTEM + suffix_a) - 1
    assert_tree_consistent(store_dir)
    # ppc stats: each namespace's blocks, a tenant's after the shared prefix its own.
    proc = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store_dir),
                           "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    blocks = {m["namespace"]: m["blocks"] for m in json.loads(proc.stdout)["models"]}
    assert blocks == {"": 3, "a": 3, "b": 3}


def test_a_shared_prefix_is_not_charged_to_the_quota_and_survives_a_flood(store_dir, model):
    shared = {"shared_prefixes": [SYSTEM]}
    with open_store(store_dir, model, "a", namespace_bytes=10**9, **shared) as a:
        put(a, model, SYSTEM + random_tokens(2 * BLOCK, seed=940))
        stats = a.stats()
        assert stats["namespace_blocks"] == 2  # the system prompt's three blocks are nobody's
        per_block = stats["namespace_bytes"] // 2
    with open_store(store_dir, model, "a", namespace_bytes=4 * per_block, **shared) as a:
        for i in range(6):
            put(a, model, SYSTEM + random_tokens(2 * BLOCK, seed=950 + i))
        assert a.stats()["namespace_bytes"] <= 4 * per_block
    with open_store(store_dir, model, "b", **shared) as b:
        assert b.peek(SYSTEM + random_tokens(BLOCK, seed=960)) == len(SYSTEM)


def test_an_index_rebuild_keeps_the_blocks_after_a_shared_prefix(store_dir, model):
    from helpers import ppc_check

    shared = {"shared_prefixes": [SYSTEM]}
    tokens = SYSTEM + random_tokens(2 * BLOCK + 1, seed=970)
    with open_store(store_dir, model, "a", **shared) as a:
        put(a, model, tokens)
    before = set(read_index(store_dir)["nodes"])
    code, report = ppc_check(store_dir)
    assert code == 0, report
    os.remove(os.path.join(store_dir, "index", "data.mdb"))
    code, report = ppc_check(store_dir, "--fix")
    assert set(read_index(store_dir)["nodes"]) == before
    with open_store(store_dir, model, "a", **shared) as a:
        assert a.peek(tokens) == len(tokens) - 1


def test_exporting_one_tenant_takes_its_prompts_after_the_shared_prefix(store_dir, model, tmp_path):
    shared = {"shared_prefixes": [SYSTEM]}
    suffix = {name: random_tokens(2 * BLOCK + 3, seed=980 + i) for i, name in enumerate("ab")}
    for name in "ab":
        with open_store(store_dir, model, name, **shared) as store:
            put(store, model, SYSTEM + suffix[name])
            put(store, model, random_tokens(BLOCK + 5, seed=990 + ord(name)))  # one without the prefix
            root = store.this_model()["root"]
    env = {**os.environ, "PPC_PACK_SECRET": "a fleet secret"}

    def ppc(*args):
        proc = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", *map(str, args), "--json"],
                              capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        return json.loads(proc.stdout)

    pack, target = tmp_path / "b.tar", tmp_path / "copy"
    out = ppc("export", "--store", store_dir, pack, "--model", root[:12])  # tenant b
    # b's own prompt (2 blocks), the shared prefix (3) and b's blocks after it (3); not a's.
    assert out["blocks"] == 2 + 3 + 3 and out["models"] == 2
    assert ppc("import", "--store", target, pack)["added"] == out["blocks"]
    assert ppc("check", "--store", target)["clean"]
    with open_store(target, model, "b", **shared) as b:
        assert b.peek(SYSTEM + suffix["b"]) == len(SYSTEM + suffix["b"]) - 1
        assert b.peek(SYSTEM + suffix["a"]) == len(SYSTEM)
    with open_store(target, model, "a", **shared) as a:
        assert a.peek(SYSTEM + suffix["a"]) == len(SYSTEM)  # a's blocks stayed home
    assert_tree_consistent(target)

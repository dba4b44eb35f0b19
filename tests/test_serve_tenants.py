"""``ppc serve --tenants`` and ``--tenant-header``, end to end: real servers over HTTP on
the serve tests' tiny model, a real store, the per-request log lines and ``/metrics``.

Two tenants with two keys: a quiet one with a hot prompt, a flooding one past its quota;
the shared system prompt stored once and hit by both, no block of one tenant's own ever
restored for the other, the quiet tenant's prompt whole after the flood (a restarted
server: from the store alone). A forged or missing key gets 401; a proxy's header picks
the tenant; a malformed tenants file is one line at start-up."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import read_index
from test_serve import BLOCK, REQUEST_TIMEOUT, SYSTEM, Server
from test_serve_metrics import Scrape

from persistent_prefix_cache.compat.tenants import Refused, Tenant, Tenants

HOT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}]
QUOTA = 40_000  # the flooding tenant's: about five blocks of the test model's KV
LINE = re.compile(
    r"Restored (\d+|none) of (\d+) prompt tokens from the persistent store [^,(]+, namespace (\w+) \(memory had (\d+)"
)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def post(server: Server, messages, *, headers: dict[str, str]) -> tuple[int, dict]:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0.0}
    request = urllib.request.Request(
        server.url("/v1/chat/completions"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def settled(server: Server) -> Scrape:
    """Scrape until no tenant's writer has anything queued (at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        scrape = Scrape(server)
        if not any(s.value for s in scrape.families["ppc_pending_writes"].samples) or time.monotonic() > deadline:
            return scrape
        time.sleep(0.1)


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def shared_tokens(model_dir: Path) -> int:
    """The tokens of the system prompt's full blocks (what every tenant shares)."""
    from mlx_lm.utils import load_tokenizer

    rendered = load_tokenizer(Path(model_dir)).apply_chat_template(
        [{"role": "system", "content": SYSTEM}], tokenize=True, add_generation_prompt=False
    )
    return len(rendered) // BLOCK * BLOCK


@pytest.mark.slow
def test_two_tenants_one_flooding_past_its_quota(serve_model_dir, tmp_path):
    store = tmp_path / "store"
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": {
                    "quiet": {"key_sha256": [digest("quiet-key")]},
                    "flood": {"key_sha256": [digest("flood-key")], "quota": QUOTA},
                },
                "shared": [{"system": SYSTEM}],
            }
        )
    )
    quiet, flood = {"Authorization": "Bearer quiet-key"}, {"Authorization": "Bearer flood-key"}
    shared = shared_tokens(serve_model_dir)
    assert shared >= 2 * BLOCK
    with Server(serve_model_dir, store, tmp_path / "first.log", "--tenants", str(tenants)) as server:
        status, first = post(server, HOT, headers=quiet)
        assert status == 200 and cached(first) == 0
        status, again = post(server, HOT, headers=quiet)
        assert cached(again) == again["usage"]["prompt_tokens"] - 1  # the quiet tenant's own prompt, whole
        # The other tenant, the same prompt: the shared system prompt only, never the quiet one's blocks.
        status, theirs = post(server, HOT, headers=flood)
        assert status == 200 and cached(theirs) == shared
        for i in range(10):  # the flood: distinct prompts after the shared system prompt
            ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: {'why ' * i}?"}]
            status, answer = post(server, ask, headers=flood)
            assert status == 200 and cached(answer) >= shared
        # Refused: a forged key, no key, another scheme; the key never reaches the log.
        for headers in ({"Authorization": "Bearer forged-key"}, {}, {"Authorization": "Basic cXVpZXQta2V5"}):
            status, body = post(server, HOT, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        scrape = settled(server)
        assert server.stop() == 0, server.log()
    log = server.log()
    assert "forged-key" not in log and "quiet-key" not in log
    assert len(re.findall(r"refused a request from 127\.0\.0\.1: ", log)) == 3

    # Every request the store helped, by namespace: the flooding tenant never restored more
    # than the shared prefix of the quiet tenant's prompt (its one request for it).
    lines = [(m.group(1), int(m.group(2)), m.group(3)) for m in LINE.finditer(log)]
    memory = [int(m.group(4)) for m in LINE.finditer(log)]
    assert [n for n, _, ns in lines if ns == "quiet"] == ["none", str(again["usage"]["prompt_tokens"] - 1)]
    assert sum(ns == "flood" for _, _, ns in lines) == 11
    assert lines[2] == (str(shared), theirs["usage"]["prompt_tokens"], "flood")

    # /metrics: each tenant under its namespace, the flood's bytes within its quota.
    def total(family: str, namespace: str) -> float:
        return sum(s.value for s in scrape.families[family].samples if s.labels.get("namespace") == namespace)

    assert scrape.value("ppc_namespace_quota_bytes", namespace="flood") == QUOTA
    assert 0 < scrape.value("ppc_namespace_bytes", namespace="flood") <= QUOTA
    assert scrape.value("ppc_quota_evictions", namespace="flood") > 0
    assert not [s for s in scrape.families["ppc_namespace_quota_bytes"].samples if s.labels["namespace"] == "quiet"]
    for namespace in ("quiet", "flood"):  # under the store's budget: nothing (the quota did it)
        assert scrape.value("ppc_evictions", namespace=namespace, tier="disk") == 0
    # A hit per flood request the store served. Another may find its prefix in the server's
    # own cache instead (its line says "none", and memory had the shared prefix at least): a CI
    # run on a busy machine once had 2 of the 11 so, which no run here reproduced (writer and
    # caller slowed at random, one core shared); which tier serves is not what this test is for.
    flooded = [(n, had) for (n, _, ns), had in zip(lines, memory) if ns == "flood"]
    assert all(had >= shared for n, had in flooded if n == "none"), log
    assert total("ppc_hits", "quiet") == 1 and total("ppc_hits", "flood") == sum(n != "none" for n, _ in flooded)
    assert total("ppc_tokens_restored", "flood") == sum(int(n) for n, _ in flooded if n != "none")
    assert total("ppc_tokens_restored", "quiet") == again["usage"]["prompt_tokens"] - 1
    assert total("ppc_misses", "quiet") == 1 and total("ppc_misses", "flood") == 0

    # The shared system prompt is stored once: one block per position before its end.
    nodes = read_index(store)["nodes"].values()
    assert sorted(n.position for n in nodes if n.position < shared) == list(range(0, shared, BLOCK))

    # A fresh server (nothing in memory): the quiet tenant's prompt whole, from the store.
    with Server(serve_model_dir, store, tmp_path / "second.log", "--tenants", str(tenants)) as server:
        status, after = post(server, HOT, headers=quiet)
        assert status == 200 and cached(after) == after["usage"]["prompt_tokens"] - 1
        # What the flooding tenant gets of a prompt it never sent: the shared prefix and
        # the chat template's tokens its own prompts stored, nothing more ...
        probe = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Rain today?"}]
        status, own = post(server, probe, headers=flood)
        assert status == 200 and cached(own) >= shared
        # ... and the same of a prompt the quiet tenant stored a moment ago.
        mine = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the cart kept?"}]
        status, first = post(server, mine, headers=quiet)
        status, again = post(server, mine, headers=quiet)
        assert cached(again) == again["usage"]["prompt_tokens"] - 1
        status, theirs = post(server, mine, headers=flood)
        assert status == 200 and cached(theirs) == cached(own) < cached(again)
        assert server.stop() == 0, server.log()
    namespaces = [m.group(3) for m in LINE.finditer(server.log())]
    assert namespaces == ["quiet", "flood", "quiet", "quiet", "flood"]


@pytest.mark.slow
def test_a_proxys_header_picks_the_tenant(serve_model_dir, tmp_path):
    store = tmp_path / "store"
    args = ("--tenant-header", "X-Tenant")
    with Server(serve_model_dir, store, tmp_path / "serve.log", *args) as server:
        status, first = post(server, HOT, headers={"X-Tenant": "a"})
        assert status == 200 and cached(first) == 0
        status, other = post(server, HOT, headers={"X-Tenant": "b"})
        assert status == 200 and cached(other) == 0  # no shared prefix declared: nothing of a's
        status, again = post(server, HOT, headers={"X-Tenant": "a", "Authorization": "Bearer whatever"})
        assert cached(again) == again["usage"]["prompt_tokens"] - 1
        for headers in ({}, {"X-Tenant": "../etc"}):
            status, body = post(server, HOT, headers=headers)
            assert status == 401, body
        assert server.stop() == 0, server.log()
    namespaces = {m.group(3) for m in LINE.finditer(server.log())}
    assert namespaces == {"a", "b"}


BAD_FILES = {
    "not json {": "not valid JSON",
    json.dumps({"tenants": {"a": {"key_sha256": ["abc"]}}}): "is not 64 hex digits",
    json.dumps({"tenants": {"a": {"key_sha256": [digest("k")], "quota": -1}}}): "quota must be >= 0",
    json.dumps({"tenants": {"a": {"key_sha256": [digest("k")], "qouta": 5}}}): "unknown key 'qouta'",
    json.dumps({"tenants": {"a b": {}}}): "tenant name 'a b'",
    json.dumps({"tenants": {"a": {}, "b": {}}}): "every request would be refused",
    json.dumps({"tenants": {"a": {"key_sha256": [digest("k")]}, "b": {"key_sha256": [digest("k")]}}}): "also belongs",
    json.dumps({"tenants": {"a": {"key_sha256": [digest("k")]}}, "shared": [{"tokens": "1 2"}]}): "int32 token ids",
    json.dumps({"tenants": {"a": {"key_sha256": [digest("k")]}}, "default": "z"}): "default 'z' is not one",
}


def test_a_malformed_tenants_file_is_one_line_at_start_up(serve_model_dir, tmp_path):
    for i, (text, said) in enumerate([*BAD_FILES.items(), (None, "No such file")]):
        path = tmp_path / f"t{i}.json"
        if text is not None:
            path.write_text(text)
        proc = subprocess.run(
            [sys.executable, "-m", "persistent_prefix_cache", "serve", "--model", str(serve_model_dir),
             "--store", str(tmp_path / "store"), "--tenants", str(path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --tenants {path}: ") and said in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_requests_tenant_comes_from_its_key_or_the_proxys_header():
    keys = {hashlib.sha256(b"k1").digest(): "one", hashlib.sha256(b"k2").digest(): "two"}
    tenants = Tenants([Tenant("one", 10), Tenant("two")], key_digests=keys)
    assert tenants.tenant({"Authorization": "Bearer k1"}) == Tenant("one", 10)
    assert tenants.tenant({"Authorization": "bearer  k2 "}).name == "two"
    for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "k1"}, {"Authorization": "Bearer "}):
        with pytest.raises(Refused):
            tenants.tenant(headers)
    guest = Tenants([Tenant("one"), Tenant("guest")], key_digests=keys, default="guest")
    assert guest.tenant({"Authorization": "Bearer nope"}).name == "guest"
    proxied = Tenants([], header="X-Tenant", reserved=["shared"])
    assert proxied.tenant({"X-Tenant": "acme", "Authorization": "Bearer k1"}).name == "acme"
    for headers in ({}, {"X-Tenant": ""}, {"X-Tenant": "a/b"}, {"X-Tenant": "x" * 65}, {"X-Tenant": "shared"}):
        with pytest.raises(Refused):
            proxied.tenant(headers)
    listed = Tenants([Tenant("one")], header="X-Tenant")
    with pytest.raises(Refused):
        listed.tenant({"X-Tenant": "two"})  # with a file, the proxy names a declared tenant only

"""``GET /metrics`` of a real ``ppc serve``: every family it exports, checked against what
the requests did (a seen prompt, an unseen one, a restart), and ``ppc stats
--prometheus`` of the store they left."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from test_serve import BLOCK, FIRST, OTHER, Server

from persistent_prefix_cache.core.counters import MISS_REASONS
from persistent_prefix_cache.tiny_model import TEST_MODEL

parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.slow

BUDGET = 64_000_000  # --prompt-cache-bytes: the server's in-memory budget
# Bytes of one token's KV in the test model: layers x (keys, values) x KV heads x head width x float32.
TOKEN_BYTES = TEST_MODEL["num_layers"] * 2 * TEST_MODEL["num_kv_heads"] * (
    TEST_MODEL["hidden_size"] // TEST_MODEL["num_heads"]
) * 4  # fmt: skip
UNSEEN = "zebra quartz"  # a completion prompt sharing no token with the chat template

HANDLE_FAMILIES = {
    "ppc_hits", "ppc_tokens_restored", "ppc_tokens_recomputed", "ppc_misses", "ppc_short_hits",
    "ppc_restore_decisions", "ppc_read_bytes", "ppc_written_bytes", "ppc_write_amplification", "ppc_evictions",
    "ppc_damaged_blocks", "ppc_write_errors", "ppc_ram_tier_bytes", "ppc_ram_tier_budget_bytes",
    "ppc_pending_writes", "ppc_not_admitted_blocks", "ppc_not_admitted_tokens",
}  # fmt: skip
STORE_FAMILIES = {
    "ppc_store_blocks", "ppc_store_block_bytes", "ppc_store_file_bytes", "ppc_store_budget_bytes",
    "ppc_store_queries", "ppc_store_tokens_restored", "ppc_store_damaged_blocks", "ppc_store_written_bytes",
    "ppc_store_restored_bytes",
}  # fmt: skip
SERVER_FAMILIES = {
    "ppc_server_prompt_tokens", "ppc_server_inserted_sequences", "ppc_server_memory_bytes",
    "ppc_server_memory_peak_bytes", "ppc_server_memory_budget_bytes",
}  # fmt: skip


class Scrape:
    """One scrape of ``/metrics``, parsed by prometheus_client: ``value(name, **labels)``."""

    def __init__(self, server: Server):
        with urllib.request.urlopen(server.url("/metrics"), timeout=30) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            self.text = r.read().decode()
        self.families = {f.name: f for f in parser.text_string_to_metric_families(self.text)}

    def value(self, family: str, **labels: str) -> float:
        """The one sample of `family` whose labels include `labels`."""
        found = [s.value for s in self.families[family].samples if labels.items() <= s.labels.items()]
        assert len(found) == 1, (family, labels, self.families[family].samples)
        return found[0]

    def by(self, family: str, label: str) -> dict[str, float]:
        """Every sample of `family` by the value of `label`."""
        return {s.labels[label]: s.value for s in self.families[family].samples}


def wait_written(server: Server) -> Scrape:
    """Scrape until the writer thread has nothing queued (at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        scrape = Scrape(server)
        if scrape.value("ppc_pending_writes") == 0 or time.monotonic() > deadline:
            return scrape
        time.sleep(0.1)


def cached(response) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def read_bounds(restored: list[int]) -> tuple[int, int]:
    """The block bytes restores of these token counts read: at least their tokens, at
    most up to the end of the block each ends in."""
    return TOKEN_BYTES * sum(restored), TOKEN_BYTES * sum((n // BLOCK + 1) * BLOCK for n in restored)


def check_reasons(scrape: Scrape, misses: dict[str, int], short: dict[str, int]) -> None:
    assert scrape.by("ppc_misses", "reason") == {r: float(misses.get(r, 0)) for r in MISS_REASONS}
    assert scrape.by("ppc_short_hits", "reason") == {r: float(short.get(r, 0)) for r in MISS_REASONS}


def test_metrics_count_what_the_requests_did(serve_model_dir, tmp_path):
    store = tmp_path / "store"
    extra = ("--prompt-cache-bytes", str(BUDGET))
    with Server(serve_model_dir, store, tmp_path / "first.log", *extra) as server:
        before = Scrape(server)  # the store opens at the first request: the server's part only
        assert set(before.families) == SERVER_FAMILIES
        assert before.by("ppc_server_prompt_tokens", "source") == {"memory": 0, "store": 0, "computed": 0}
        assert before.value("ppc_server_memory_budget_bytes") == BUDGET
        first = server.chat(FIRST)  # unseen: a miss
        other = server.chat(OTHER)  # shares the system prompt: a short hit from RAM
        again = server.chat(FIRST)  # seen: all but the last token from RAM
        unseen = server.complete(UNSEEN, max_tokens=2)  # a miss
        requests = [first, other, again, unseen]
        scrape = wait_written(server)
        # Every other path behaves as before.
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url("/metricsx"), timeout=30)
        assert info.value.code == 404 and info.value.read() == b"Not Found"
        with urllib.request.urlopen(server.url("/health"), timeout=30) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        assert server.stop() == 0, server.log()
    log = server.log()

    prompts = sum(r["usage"]["prompt_tokens"] for r in requests)
    hits = [cached(other), cached(again)]
    assert cached(first) == cached(unseen) == 0 and 0 < hits[0] < other["usage"]["prompt_tokens"] - 1
    assert hits[1] == again["usage"]["prompt_tokens"] - 1
    assert set(scrape.families) == SERVER_FAMILIES | HANDLE_FAMILIES | STORE_FAMILIES  # no remote: none of its
    # The server's tokens: from memory (the LRU keeps nothing the store took), the store, computed.
    assert scrape.by("ppc_server_prompt_tokens", "source") == {
        "memory": 0, "store": sum(hits), "computed": prompts - sum(hits)
    }  # fmt: skip
    sequences = scrape.by("ppc_server_inserted_sequences", "fate")
    assert sequences["memory_only"] == 0 and sequences["stored"] >= len(requests)
    # The handle: two hits, both from the RAM tier; two misses and one short hit, never stored.
    assert scrape.by("ppc_hits", "tier") == {"ram": 2, "disk": 0, "remote": 0}
    assert scrape.by("ppc_tokens_restored", "tier") == {"ram": sum(hits), "disk": 0, "remote": 0}
    assert scrape.value("ppc_tokens_recomputed") == prompts - sum(hits)
    check_reasons(scrape, misses={"never_stored": 2}, short={"never_stored": 1})
    assert scrape.by("ppc_restore_decisions", "decision") == {"all": 2, "ram_only": 0, "shorter": 0,
                                                               "skipped_slower": 0}  # fmt: skip
    read = scrape.by("ppc_read_bytes", "tier")
    low, high = read_bounds(hits)
    assert set(read) == {"ram", "disk"} and read["disk"] == 0 and low <= read["ram"] <= high
    assert read["ram"] % TOKEN_BYTES == 0
    written = scrape.by("ppc_written_bytes", "tier")
    # Every byte of the segment files the store names was written by this server (and merges more).
    assert set(written) == {"disk"} and written["disk"] >= scrape.value("ppc_store_file_bytes") > 0
    assert scrape.value("ppc_write_amplification") == written["disk"] / read["ram"]
    # ppc serve writes every insert (admit="always"): the admission rule left nothing out.
    assert scrape.value("ppc_not_admitted_blocks") == scrape.value("ppc_not_admitted_tokens") == 0
    assert scrape.by("ppc_evictions", "tier") == {"disk": 0, "ram": 0}
    assert scrape.value("ppc_damaged_blocks") == scrape.value("ppc_write_errors") == 0
    # Memory: the RAM tier is all the server holds, within the budget it was given.
    assert scrape.value("ppc_ram_tier_budget_bytes") == scrape.value("ppc_server_memory_budget_bytes") == BUDGET
    assert 0 < scrape.value("ppc_ram_tier_bytes") == scrape.value("ppc_server_memory_bytes")
    assert scrape.value("ppc_server_memory_peak_bytes") >= scrape.value("ppc_server_memory_bytes")
    # The store: what the index holds; a default disk budget.
    assert scrape.value("ppc_store_blocks") > 0 and scrape.value("ppc_store_block_bytes") % TOKEN_BYTES == 0
    assert scrape.value("ppc_store_budget_bytes") >= scrape.value("ppc_store_block_bytes")
    assert scrape.value("ppc_store_damaged_blocks") == 0
    # The log says why each request the store did not serve whole stopped.
    assert len(re.findall(r"Restored none of \d+ prompt tokens .*: never_stored\n", log)) == 2, log
    assert re.search(rf"Restored {hits[0]} of \d+ .* ms\); stopped: never_stored\n", log), log
    assert re.search(rf"Restored {hits[1]} of \d+ .* ms\)\n", log), log

    with Server(serve_model_dir, store, tmp_path / "restarted.log", *extra) as server:
        again = server.chat(FIRST)  # seen before the restart: from disk
        scrape = wait_written(server)
        assert server.stop() == 0, server.log()
    restored = cached(again)
    assert restored == again["usage"]["prompt_tokens"] - 1
    assert scrape.by("ppc_server_prompt_tokens", "source") == {"memory": 0, "store": restored, "computed": 1}
    assert scrape.by("ppc_hits", "tier") == {"ram": 0, "disk": 1, "remote": 0}
    assert scrape.by("ppc_tokens_restored", "tier") == {"ram": 0, "disk": restored, "remote": 0}
    assert scrape.value("ppc_tokens_recomputed") == 1
    check_reasons(scrape, misses={}, short={})
    read = scrape.by("ppc_read_bytes", "tier")
    low, high = read_bounds([restored])
    assert read["ram"] == 0 and low <= read["disk"] <= high
    # The first server's fetches were committed when it stopped.
    assert scrape.by("ppc_store_queries", "outcome")["miss"] == 2
    assert scrape.value("ppc_store_tokens_restored") >= sum(hits)

    # The store they left, as a textfile collector reads it: every fetch committed now.
    run = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store),
                          "--prometheus"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    stats = {f.name: f for f in parser.text_string_to_metric_families(run.stdout)}
    queries = {s.labels["outcome"]: s.value for s in stats["ppc_store_queries"].samples}
    assert queries == {"hit": 3, "miss": 2}
    assert stats["ppc_store_tokens_restored"].samples[0].value == sum(hits) + restored
    # SSD wear, store-wide: every segment written (merged ones too: more than is left), every byte restored.
    assert stats["ppc_store_written_bytes"].samples[0].value >= stats["ppc_store_file_bytes"].samples[0].value > 0
    assert 0 < stats["ppc_store_restored_bytes"].samples[0].value
    assert stats["ppc_store_file_bytes"].samples[0].value == sum(
        p.stat().st_size for p in (store / "segments").rglob("*.seg")
    )


@pytest.mark.parametrize("rule", ["seen", "reuse"])
def test_admit_writes_a_one_off_prompt_at_its_second_request(serve_model_dir, tmp_path, rule):
    # `ppc serve --admit seen|reuse`: mlx-lm 0.32's batched server inserts a request's
    # cache twice (the prompt but its last token, then the prompt and the reply); one
    # request is one sighting, so the store holds nothing of a prompt after its first
    # request, and its blocks after its second.
    prompt = " ".join(["zebra quartz harbour lantern"] * 12)

    def after_inserts(server: Server, n: int) -> Scrape:
        # The server inserts a request's cache after its reply is sent: wait for the n-th
        # insert the store took, then for the writer (at most 30 s each).
        deadline = time.monotonic() + 30
        while Scrape(server).by("ppc_server_inserted_sequences", "fate")["stored"] < n:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        return wait_written(server)

    with Server(serve_model_dir, tmp_path / "store", tmp_path / "serve.log", "--admit", rule) as server:
        first = server.complete(prompt, max_tokens=1)
        once = after_inserts(server, 1)
        blocks = first["usage"]["prompt_tokens"] // BLOCK
        assert blocks >= 4 and once.value("ppc_not_admitted_blocks") >= blocks
        assert once.value("ppc_store_blocks") == 0
        server.complete(prompt, max_tokens=1)
        twice = after_inserts(server, 2)
        assert twice.value("ppc_store_blocks") >= blocks
        assert server.stop() == 0, server.log()

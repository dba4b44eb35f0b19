"""The Prometheus text the library writes (`metrics`): read back by prometheus_client's own
parser, equal to what prometheus_client writes for the same families, and ``ppc stats
--prometheus`` against the store it describes."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
from helpers import BLOCK, prefill, random_tokens

from persistent_prefix_cache import PersistentPrefixCache
from persistent_prefix_cache.core.counters import MISS_REASONS
from persistent_prefix_cache.metrics import Families, exposition, handle_metrics, store_metrics

parser = pytest.importorskip("prometheus_client.parser")
prometheus_client = pytest.importorskip("prometheus_client")


def parsed(text: str) -> dict[str, tuple[str, str, list]]:
    """Family name -> (type, help, sorted samples as (name, labels, value)); NaN as a string."""
    out = {}
    for family in parser.text_string_to_metric_families(text):
        samples = sorted(
            (s.name, tuple(sorted(s.labels.items())), "NaN" if math.isnan(s.value) else s.value) for s in family.samples
        )
        out[family.name] = (family.type, family.documentation, samples)
    return out


def theirs(families: Families) -> str:
    """The same families written by prometheus_client."""
    from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            for f in families:
                names = list(f.samples[0][0]) if f.samples else []
                kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
                family = kind(f.name, f.help, labels=names)
                for labels, value in f.samples:
                    family.add_metric([labels[n] for n in names], value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return prometheus_client.generate_latest(registry).decode()


def test_the_text_reads_back_and_matches_prometheus_clients(store_dir, model):
    tokens = random_tokens(4 * BLOCK, seed=1)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        store.store(tokens, prefill(model, tokens)[1])
        store.flush()
        store.fetch(tokens)
        store.fetch(random_tokens(3 * BLOCK, seed=2))
        stats = store.stats()
    families = Families()
    # Label values that need escaping: a quote, a backslash, a line break, and not ASCII.
    handle_metrics(families, stats, model='a "quoted" \\ model\nname', namespace="tenant-ü")
    store_metrics(families, stats, store=str(store_dir))
    ours = exposition(families)
    assert parsed(ours) == parsed(theirs(families))
    got = parsed(ours)
    labels = (("model", 'a "quoted" \\ model\nname'), ("namespace", "tenant-ü"))
    assert ("ppc_hits_total", labels + (("tier", "ram"),), 1.0) in got["ppc_hits"][2]
    assert ("ppc_misses_total", labels + (("reason", "never_stored"),), 1.0) in got["ppc_misses"][2]
    assert {s[1][-1][1] for s in got["ppc_misses"][2]} == set(MISS_REASONS)
    amplification = got["ppc_write_amplification"][2][0][2]
    assert amplification == (stats["bytes_written"] + stats["bytes_rewritten"]) / stats["bytes_restored_ram"]
    assert ("ppc_store_blocks", (("store", str(store_dir)),), 4.0) in got["ppc_store_blocks"][2]


def test_values_are_spelled_as_prometheus_reads_them():
    families = Families()
    for value in (0, 3, 2.5, 1e300, 2**60, math.inf, -math.inf, math.nan, -7):
        families.gauge("ppc_value", "values", {"v": repr(value)}, value)
    families.gauge("ppc_declared_only", "a family with no sample (an unbounded budget)", {}, None)
    ours = exposition(families)
    assert parsed(ours) == parsed(theirs(families))
    assert 'ppc_value{v="3"} 3\n' in ours and 'ppc_value{v="inf"} +Inf\n' in ours and 'v="nan"} NaN' in ours
    assert "# TYPE ppc_declared_only gauge\n" in ours


def test_ppc_stats_prometheus_parses_and_matches_the_store(store_dir, model, other_model):
    tokens = random_tokens(3 * BLOCK, seed=1)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK, model_name="tiny") as store:
        store.store(tokens, prefill(model, tokens)[1])
        store.flush()
        store.fetch(tokens)
        store.fetch(random_tokens(2 * BLOCK, seed=2))
    with PersistentPrefixCache(store_dir, other_model, namespace="t2") as store:
        store.store(tokens[:BLOCK], prefill(other_model, tokens[:BLOCK])[1])
        store.flush()
        stats, unnamed = store.stats(), store.fingerprint[:16]
    run = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store_dir), "--prometheus"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = parsed(run.stdout)
    at = (("store", str(store_dir)),)
    assert got["ppc_store_blocks"][2] == [("ppc_store_blocks", at, 4.0)]
    assert got["ppc_store_block_bytes"][2] == [("ppc_store_block_bytes", at, float(stats["block_bytes"]))]
    assert got["ppc_store_file_bytes"][2] == [("ppc_store_file_bytes", at, float(stats["bytes_on_disk"]))]
    # The first handle's fetches were committed at its close: one hit, one miss.
    assert got["ppc_store_queries"][2] == [
        ("ppc_store_queries_total", (("outcome", "hit"),) + at, 1.0),
        ("ppc_store_queries_total", (("outcome", "miss"),) + at, 1.0),
    ]
    assert got["ppc_store_tokens_restored"][2] == [("ppc_store_tokens_restored_total", at, 47.0)]
    # A model stored without a name is labelled by its fingerprint.
    models = {dict(s[1])["namespace"]: (dict(s[1])["model"], s[2]) for s in got["ppc_store_model_blocks"][2]}
    assert models == {"": ("tiny", 3.0), "t2": (unnamed, 1.0)}


def test_ppc_stats_prometheus_refuses_json(store_dir, model):
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK):
        pass
    run = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "stats", "--store", str(store_dir), "--prometheus", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--prometheus" in run.stderr


def test_a_restore_counts_the_bytes_of_blocks_not_yet_written(store_dir, model):
    """`ppc_read_bytes` (and the cost model, from the same sizes) counts what a restore
    took from the RAM tier whether or not the writer has committed those blocks yet:
    a block's size is known from the moment it is cut."""
    tokens = random_tokens(4 * BLOCK, seed=3)
    with PersistentPrefixCache(store_dir, model, block_size=BLOCK) as store:
        cache = prefill(model, tokens)[1]
        release = threading.Event()
        try:
            assert store.hold_writer(release).wait(30)
            store.store(tokens, cache)  # queued behind the held writer: in the RAM tier only
            assert store.stats()["pending_writes"] > 0
            assert store.fetch(tokens)[0] is not None
            pending = store.stats()["bytes_restored_ram"]
        finally:
            release.set()  # never leave the writer held: close() would wait for it
        store.flush()
        assert store.fetch(tokens)[0] is not None
        written = store.stats()["bytes_restored_ram"] - pending
    assert written > 0 and pending == written

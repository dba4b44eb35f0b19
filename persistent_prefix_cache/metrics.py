"""Prometheus metrics: what ``ppc serve`` answers at ``GET /metrics`` and what ``ppc stats
--prometheus`` prints for a textfile collector, in Prometheus' text exposition format
(version 0.0.4).

The families are built from counters the library keeps anyway (a handle's `stats()`,
`PersistentLRUPromptCache.persistent_stats()`, `StoreAdmin.summary()`), at scrape time:
nothing is counted for them on a request's path. Their names, labels and meanings are
in docs/serve.md#metrics.

The text is written here (`exposition`), not by ``prometheus_client``: the format is a
few lines of rules (HELP and TYPE lines, escaped label values, Go's float spellings),
and writing it keeps ``/metrics`` working on every install without an extra package or
a process-wide registry. ``tests/test_metrics.py`` parses it with ``prometheus_client``'s
own parser and compares it with that library's output for the same families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from .core.counters import MISS_REASONS, write_amplification

# The HTTP Content-Type of `exposition`'s text.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TIERS = ("ram", "disk", "remote")
DECISIONS = {"all": "restored_all", "ram_only": "restored_ram_only", "shorter": "restored_shorter",
             "skipped_slower": "skipped_slower"}  # fmt: skip


@dataclass
class Family:
    """One metric: its name (a counter's without ``_total``), type, help and samples.

    Attributes:
        name: The metric's name; a counter's samples are named ``<name>_total``.
        kind: ``"counter"`` or ``"gauge"``.
        help: One line saying what it counts.
        samples: ``(labels, value)`` pairs.
    """

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


class Families:
    """Families gathered by name, in the order they were first added."""

    def __init__(self) -> None:
        self.by_name: dict[str, Family] = {}

    def add(self, name: str, kind: str, help: str, labels: dict[str, str], value: float | None) -> None:
        """Add one sample (None: no sample, the family is still declared)."""
        family = self.by_name.setdefault(name, Family(name, kind, help))
        if value is not None:
            family.samples.append((labels, float(value)))

    def counter(self, name: str, help: str, labels: dict[str, str], value: float | None) -> None:
        """Add a counter's sample."""
        self.add(name, "counter", help, labels, value)

    def gauge(self, name: str, help: str, labels: dict[str, str], value: float | None) -> None:
        """Add a gauge's sample."""
        self.add(name, "gauge", help, labels, value)

    def __iter__(self):
        return iter(self.by_name.values())


def handle_metrics(families: Families, stats: dict[str, Any], *, model: str, namespace: str) -> None:
    """A handle's families (labels ``model`` and ``namespace``) from its `stats()`."""
    at = {"model": model, "namespace": namespace}
    c, g = families.counter, families.gauge
    for tier in TIERS:
        c("ppc_hits", "Fetches that restored a prefix, by the deepest tier they read", {**at, "tier": tier},
          stats[f"hits_{tier}"])  # fmt: skip
    for tier in TIERS:
        c("ppc_tokens_restored", "Prompt tokens restored by hits, by the deepest tier each read", {**at, "tier": tier},
          stats[f"tokens_saved_{tier}"])  # fmt: skip
    c("ppc_tokens_recomputed", "Prompt tokens the fetches left to compute (a miss: all of its prompt)", at,
      stats["tokens_recomputed"])  # fmt: skip
    for reason in MISS_REASONS:
        c("ppc_misses", "Fetches that restored nothing, by why", {**at, "reason": reason}, stats[f"miss_{reason}"])
    for reason in MISS_REASONS:
        c("ppc_short_hits", "Hits that restored part of the prompt (short of all but its last token), by why they "
          "stopped", {**at, "reason": reason}, stats[f"short_{reason}"])  # fmt: skip
    for decision, key in DECISIONS.items():
        c("ppc_restore_decisions", "The cost model's decision for each fetch that found blocks",
          {**at, "decision": decision}, stats[key])  # fmt: skip
    remote = stats.get("remote") is not None
    read = {"ram": stats["bytes_restored_ram"], "disk": stats["bytes_restored_disk"] + stats["memory_warmed_bytes"],
            "remote": stats["remote_bytes_read"] if remote else None}  # fmt: skip
    for tier, value in read.items():
        c("ppc_read_bytes", "Block bytes read: from the RAM tier and segment files by restores (disk: and by "
          "background fills of the RAM tier), from the remote tier", {**at, "tier": tier}, value)  # fmt: skip
    written_disk = stats["bytes_written"] + stats["bytes_rewritten"]
    written = {"disk": written_disk, "remote": stats["remote_bytes_published"] if remote else None}
    for tier, value in written.items():
        c("ppc_written_bytes", "Bytes written: segment files of new blocks and of merges (disk), values published "
          "(remote)", {**at, "tier": tier}, value)  # fmt: skip
    amplification = write_amplification(stats)
    g("ppc_write_amplification", "Disk bytes written per block byte restored (NaN until a restore)", at,
      math.nan if amplification is None else amplification)  # fmt: skip
    c("ppc_not_admitted_blocks", "New blocks the admission rule left unwritten (a block deferred twice counts "
      "twice)", at, stats["blocks_not_admitted"])  # fmt: skip
    c("ppc_not_admitted_tokens", "Tokens of the blocks the admission rule left unwritten", at,
      stats["tokens_not_admitted"])  # fmt: skip
    for tier, key in (("disk", "budget_evictions"), ("ram", "memory_evictions")):
        c("ppc_evictions", "Blocks evicted: from the store under its disk budget by this handle's writer (disk), "
          "from the RAM tier under its budget (ram: the blocks stay on disk)", {**at, "tier": tier},
          stats[key])  # fmt: skip
    if stats.get("namespace_quota") is not None:  # a tenant's handle (ppc serve --tenants): bytes against its quota
        g("ppc_namespace_bytes", "Bytes of the blocks its namespace holds for this model (shared prefixes not "
          "counted)", at, stats["namespace_bytes"])  # fmt: skip
        g("ppc_namespace_quota_bytes", "The namespace's quota", at, stats["namespace_quota"])
        c("ppc_quota_evictions", "Blocks of the namespace evicted under its quota (never another namespace's)", at,
          stats["quota_evictions"])  # fmt: skip
    c("ppc_damaged_blocks", "Damaged blocks and index pages met (each a miss, dropped)", at, stats["corrupt"])
    c("ppc_write_errors", "Block writes that failed (the blocks stay unstored)", at, stats["write_errors"])
    g("ppc_ram_tier_bytes", "Bytes of blocks held in the RAM tier", at, stats["bytes_in_memory"])
    g("ppc_ram_tier_budget_bytes", "The RAM tier's budget", at, stats["memory_budget"])
    g("ppc_pending_writes", "Jobs queued for or running on the writer thread", at, stats["pending_writes"])
    if remote:
        c("ppc_remote_errors", "Round trips to the remote tier that failed", at, stats["remote_errors"])
        c("ppc_remote_skipped", "Remote reads skipped while the server backs off", at, stats["remote_skipped"])
        for why in ("corrupt", "unauthenticated"):
            c("ppc_remote_rejected", "Values read from the remote that failed their checks", {**at, "why": why},
              stats[f"remote_{why}"])  # fmt: skip
        for why, key in (("dropped", "remote_dropped"), ("failed", "remote_publish_failed")):
            c("ppc_remote_publish_lost", "Blocks not published: the queue was full (dropped), the server failed "
              "(failed)", {**at, "why": why}, stats[key])  # fmt: skip


def store_metrics(families: Families, stats: dict[str, Any], *, store: str) -> None:
    """A store's own families (label ``store``), from a `stats()` or a
    `StoreAdmin.summary()`: what the index holds, over every process."""
    at = {"store": store}
    c, g = families.counter, families.gauge
    g("ppc_store_blocks", "Blocks the store holds", at, stats["blocks"])
    g("ppc_store_block_bytes", "Bytes of the blocks the store holds (what its disk budget bounds)", at,
      stats["block_bytes"])  # fmt: skip
    g("ppc_store_file_bytes", "Bytes of the store's segment files (space not yet reclaimed included)", at,
      stats["bytes_on_disk"])  # fmt: skip
    if "disk_budget" in stats:  # a handle's: the budget it evicts to (none: unbounded)
        g("ppc_store_budget_bytes", "The disk budget of the blocks' bytes (absent: unbounded)", at,
          stats["disk_budget"])  # fmt: skip
    prefix = "store_" if "store_hits" in stats else ""  # a handle's stats() prefixes the store's counters
    for outcome, key in (("hit", "hits"), ("miss", "misses")):
        c("ppc_store_queries", "Fetches over every process since the store was made, as far as committed",
          {**at, "outcome": outcome}, stats[prefix + key])  # fmt: skip
    c("ppc_store_tokens_restored", "Tokens restored over every process since the store was made", at,
      stats[prefix + "tokens_saved"])  # fmt: skip
    c("ppc_store_damaged_blocks", "Damaged blocks met over every process since the store was made", at,
      stats[prefix + "corrupt"])  # fmt: skip
    c("ppc_store_written_bytes", "Segment bytes written over every process (stores, merges, imports)", at,
      stats[prefix + "written_bytes"])  # fmt: skip
    c("ppc_store_restored_bytes", "Block bytes fetches restored over every process", at,
      stats[prefix + "restored_bytes"])  # fmt: skip


def summary_metrics(summary: dict[str, Any]) -> Families:
    """``ppc stats --prometheus``: a store's families from `StoreAdmin.summary()` (the
    index only: no handle, so no RAM tier, budget or per-handle counter), and each model's
    blocks and bytes (labels ``model`` and ``namespace``)."""
    families = Families()
    store_metrics(families, summary, store=summary["store"])
    for m in summary["models"]:
        at = {"store": summary["store"], "model": model_label(m.get("name"), m.get("fingerprint")),
              "namespace": m.get("namespace") or ""}  # fmt: skip
        families.gauge("ppc_store_model_blocks", "Blocks the store holds for a model and namespace", at, m["blocks"])
        families.gauge("ppc_store_model_bytes", "Bytes of those blocks", at, m["bytes"])
        families.gauge("ppc_store_model_restored_bytes", "Bytes fetches restored from those blocks, over every "
                       "process, as far as committed (blocks evicted since: not counted)", at,
                       m["bytes_restored"])  # fmt: skip
        families.gauge("ppc_store_model_never_restored_bytes", "Bytes of those blocks that no fetch restored yet "
                       "(written, never read back)", at, m["never_restored_bytes"])  # fmt: skip
    return families


def server_metrics(persistent: dict[str, Any]) -> Families:
    """``ppc serve``'s ``/metrics``: from `PersistentLRUPromptCache.persistent_stats()`,
    the server's prompt tokens and memory, each open store handle's families and each
    store's own (once per store)."""
    families = Families()
    c, g = families.counter, families.gauge
    for source, key in (("memory", "memory_tokens"), ("store", "restored_tokens"), ("computed", "computed_tokens")):
        c("ppc_server_prompt_tokens", "Prompt tokens of the server's requests by where they came from: its "
          "in-memory cache, the store, or computed", {"source": source}, persistent[key])  # fmt: skip
    for fate, key in (("stored", "stored_sequences"), ("memory_only", "store_skipped")):
        c("ppc_server_inserted_sequences", "Caches the server inserted: written through to the store, or kept in "
          "memory only (the store refused them)", {"fate": fate}, persistent[key])  # fmt: skip
    g("ppc_server_memory_bytes", "KV held in memory: the server's prompt cache and the RAM tiers together", {},
      persistent["memory_bytes"])  # fmt: skip
    g("ppc_server_memory_peak_bytes", "The most KV held in memory so far", {}, persistent["memory_peak_bytes"])
    g("ppc_server_memory_budget_bytes", "The in-memory budget (absent: unbounded)", {}, persistent["memory_budget"])
    stores_seen = set()
    for entry in persistent["stores"]:
        stats = entry["stats"]
        handle_metrics(families, stats, model=model_label(entry.get("name"), entry.get("fingerprint")),
                       namespace=entry.get("namespace") or "")  # fmt: skip
        if entry["path"] not in stores_seen:
            stores_seen.add(entry["path"])
            store_metrics(families, stats, store=entry["path"])
    return families


def model_label(name: str | None, fingerprint: str | None) -> str:
    """The ``model`` label: the model's folder or hub id, else its fingerprint's first 16
    characters (a store filled by a library call without a name)."""
    return name or (fingerprint or "?")[:16]


def exposition(families: Iterable[Family]) -> str:
    """Prometheus' text exposition (version 0.0.4) of `families`."""
    lines = []
    for family in families:
        name = family.name + "_total" if family.kind == "counter" else family.name
        lines.append(f"# HELP {name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {name} {family.kind}")
        for labels, value in family.samples:
            if labels:
                inside = ",".join(f'{key}="{_escape_value(str(v))}"' for key, v in labels.items())
                lines.append(f"{name}{{{inside}}} {_number(value)}")
            else:
                lines.append(f"{name} {_number(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """A sample's value as Prometheus spells it (Go's +Inf, -Inf, NaN); integers exact."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)

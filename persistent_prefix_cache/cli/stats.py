"""``ppc stats``: totals and hit counters of a store."""

from __future__ import annotations

import time

from .common import (
    add_json_option,
    add_remote_option,
    add_store_option,
    emit,
    make_parser,
    remote_options,
    run,
    short_fingerprint,
    store_path,
    table,
)
from ..disk.maintenance import StoreAdmin


def _render(s: dict) -> str:
    rows = [
        ("store", s["store"]),
        ("schema version", s["schema_version"]),
        ("block size (tokens)", s["block_size"]),
        ("blocks", s["blocks"]),
        ("bytes on disk", s["bytes_on_disk"]),
        ("bytes of the blocks", s["block_bytes"]),
        ("models", len(s["models"])),
        # Per fetch (a query): did it restore a prefix? `ppc inspect` counts per block.
        ("query hits", s["hits"]),
        ("query misses", s["misses"]),
        ("hit rate", "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f} %"),
        ("tokens saved", s["tokens_saved"]),
        ("corrupt blocks met", s["corrupt"]),
    ]
    remote = s.get("remote")
    if remote is not None:
        rows.append(("remote", remote["url"]))
        if not remote["reachable"]:
            rows.append(("remote reachable", f"no: {remote['error']}"))
        else:
            secret = remote.get("secret")
            rows.append(("remote secret", f"key id {secret}" if secret else
                         "none (--remote-insecure: whoever can write to the server is trusted)"))  # fmt: skip
            rows.append(("blocks on the remote", remote["blocks"]))
            if remote.get("other_secrets"):
                others = f"{remote['other_secrets']} (not this host's: another secret, or none)"
                rows.append(("  under other secrets", others))
            for n in remote["nodes"]:
                if "error" in n:
                    rows.append((f"  {n['node']}", f"error: {n['error']}"))
                    continue
                figures = f"used {n['used_memory']:,} B of {n['maxmemory'] or 'unbounded'}, {n['maxmemory_policy']}, {n['evicted_keys']:,} evicted"
                rows.append((f"  {n['node']}", figures))
    out = table(rows)
    if s["models"]:
        models = [
            (m["root"][:12], m.get("name") or "(unnamed)", short_fingerprint(m["fingerprint"]), m["blocks"], m["bytes"],
             _when(m["last_used"]))
            for m in sorted(s["models"], key=lambda m: -m["last_used"])
        ]  # fmt: skip
        out += "\n\n" + table(models, header=("model", "name", "fingerprint", "blocks", "bytes", "last used"))
    return out


def _when(ns: int) -> str:
    """A last-use time in UTC, to the minute ("-" if never)."""
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ns / 1e9)) if ns else "-"


def main(argv: list[str]) -> int:
    """Print a store's totals and counters (all processes, since it was made), and with
    ``--remote`` what the server holds for the store's models."""
    parser = make_parser("stats", "Totals and hit counters of a store.")
    add_store_option(parser)
    add_remote_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        options = remote_options(args)
        with StoreAdmin(store_path(args, must_exist=True), readonly=True) as admin:
            summary = admin.summary()
        if options:
            from ..remote_sync import remote_summary
            from ..tiers.remote_client import redact

            roots = [bytes.fromhex(m["root"]) for m in summary["models"]]
            found = remote_summary(options["remote"], roots, options["remote_secret"])
            summary["remote"] = {"url": redact(options["remote"]), **found}
        emit(summary, args.json, _render)
        return 0

    return run(work)

"""``ppc stats``: totals and hit counters of a store (``--prometheus``: as metrics for a
textfile collector, `metrics.summary_metrics`)."""

from __future__ import annotations

import time

from .common import (
    UserError, add_json_option, add_remote_option, add_store_option, make_parser, remote_options, run, store_path,
)  # fmt: skip
from .output import emit, short_fingerprint, table
from ..admin import StoreAdmin
from ..metrics import exposition, summary_metrics


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
        # SSD wear: what the blocks held were read back for, and those never read back.
        ("bytes restored (blocks held)", s["bytes_restored"]),
        ("restored per byte held", "-" if not s["block_bytes"] else f"{s['bytes_restored'] / s['block_bytes']:.2f}"),
        ("blocks never restored", s["never_restored_blocks"]),
        ("bytes never restored", s["never_restored_bytes"]),
        # Over every process, evicted blocks included (counted from 2026-12-05 on).
        ("bytes written", s["written_bytes"]),
        ("bytes restored by fetches", s["restored_bytes"]),
        ("written per byte restored", "-" if s["write_amplification"] is None else f"{s['write_amplification']:.2f}"),
    ]
    out = table(rows)
    if s.get("remote") is not None:
        out += "\n\n" + _render_remote(s["remote"])
    if s["models"]:
        models = [
            (m["root"][:12], m.get("name") or "(unnamed)", short_fingerprint(m["fingerprint"]), m["blocks"], m["bytes"],
             _when(m["last_used"]))
            for m in sorted(s["models"], key=lambda m: -m["last_used"])
        ]  # fmt: skip
        out += "\n\n" + table(models, header=("model", "name", "fingerprint", "blocks", "bytes", "last used"))
    return out


def _render_remote(remote: dict) -> str:
    """The remote's part: its URL, this host's key space and the others apart (blocks
    this host cannot authenticate are never counted as its own), then one row per node."""
    rows = [("remote", remote["url"])]
    if not remote["reachable"]:
        rows.append(("reachable", f"no: {remote['error']}"))
        return table(rows)
    secret = remote.get("secret")
    verified = "failed" in remote  # --verify: every value of this host's key space read and checked
    if secret:
        rows += [
            ("secret", f"key id {secret}"),
            ("blocks under this secret" + (", verified" if verified else "'s key id"), remote["blocks"]),
        ]
    else:
        rows += [
            ("secret", "none (--remote-insecure: whoever can write to the server is trusted)"),
            ("blocks without a secret" + (", intact" if verified else ""), remote["blocks"]),
        ]
    if verified:
        rows.append(("  failing their checks", remote["failed"]))
    rows.append(("blocks under other secrets or none" if secret else "blocks under secrets", remote["other_secrets"]))
    out = table(rows)
    if secret:
        out += "\n(blocks under other secrets, or none, are not used here: this host cannot authenticate them)"
    else:
        out += "\n(blocks under secrets are not used here: this host holds no secret to read them)"
    if secret and not verified:
        out += "\n(a value under this key id that this secret did not make is a miss when read: --verify counts them)"
    nodes, errors = [], []
    for n in remote["nodes"]:
        if "error" in n:
            errors.append(f"{n['node']}: {n['error']}")
            nodes.append((n["node"], "-", "-", "-", "-"))
        else:
            nodes.append((n["node"], n["used_memory"], n["maxmemory"] or "unbounded", n["maxmemory_policy"],
                          n["evicted_keys"]))  # fmt: skip
    header = ("node", "memory used (bytes)", "maxmemory", "policy", "evicted keys")
    out += "\n\n" + table(nodes, header=header)
    return "\n".join([out, *errors])


def _when(ns: int) -> str:
    """A last-use time in UTC, to the minute ("-" if never)."""
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ns / 1e9)) if ns else "-"


def main(argv: list[str]) -> int:
    """Print a store's totals and counters (all processes, since it was made), and with
    ``--remote`` what the server holds for the store's models."""
    parser = make_parser("stats", "Totals and hit counters of a store.")
    add_store_option(parser)
    add_remote_option(parser)
    parser.add_argument(
        "--verify", action="store_true",
        help="with --remote: read every value under this host's secret and count only those that pass "
        "the checks of a read (MAC, checksum); reads every byte of them",
    )  # fmt: skip
    add_json_option(parser)
    parser.add_argument(
        "--prometheus", action="store_true",
        help="print the store's metrics in Prometheus' text format (for node_exporter's textfile collector; "
        "the same names as ppc serve's /metrics)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    def work() -> int:
        options = remote_options(args)
        if args.verify and not options:
            raise UserError("--verify checks the values on the remote: give --remote URL (or set $PPC_REMOTE)")
        if args.prometheus and (args.json or options):
            raise UserError("--prometheus prints the store's own metrics: leave out --json and --remote")
        with StoreAdmin(store_path(args, must_exist=True), readonly=True) as admin:
            summary = admin.summary()
        if args.prometheus:
            print(exposition(summary_metrics(summary)), end="")
            return 0
        if options:
            from ..admin import remote_summary
            from ..tiers.remote_client import redact

            roots = [bytes.fromhex(m["root"]) for m in summary["models"]]
            found = remote_summary(options["remote"], roots, options["remote_secret"], verify=args.verify)
            summary["remote"] = {"url": redact(options["remote"]), **found}
        emit(summary, args.json, _render)
        return 0

    return run(work)

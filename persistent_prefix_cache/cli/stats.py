"""``ppc stats``: totals and hit counters of a store."""

from __future__ import annotations

from .common import add_json_option, add_store_option, emit, make_parser, run, store_path, table
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
        ("tokens saved", s["tokens_saved"]),
        ("corrupt blocks met", s["corrupt"]),
    ]
    return table(rows)


def main(argv: list[str]) -> int:
    """Print a store's totals and counters (all processes, since it was made)."""
    parser = make_parser("stats", "Totals and hit counters of a store.")
    add_store_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        with StoreAdmin(store_path(args, must_exist=True), readonly=True) as admin:
            emit(admin.summary(), args.json, _render)
        return 0

    return run(work)

"""``ppc gc --max-bytes N``: evict least recently used blocks down to a budget (of the
blocks' bytes; segment files that became mostly dead are compacted)."""

from __future__ import annotations

from .common import add_json_option, add_store_option, emit, make_parser, parse_size, run, store_path

def main(argv: list[str]) -> int:
    """Evict least recently used leaves until the block files fit the budget."""
    parser = make_parser("gc", "Evict least recently used blocks (leaves first) down to a byte budget.")
    add_store_option(parser)
    parser.add_argument(
        "--max-bytes", required=True, type=parse_size, help="budget for block files, e.g. 500M or 2G (binary units)"
    )
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from ..disk.maintenance import StoreAdmin

        budget = args.max_bytes
        with StoreAdmin(store_path(args, must_exist=True)) as admin:
            before = admin.summary()
            removed = admin.gc(budget)
            after = admin.summary()
        result = {
            "max_bytes": budget,
            "removed_blocks": len(removed),
            "removed_bytes": sum(n.size for n in removed),
            "block_bytes_before": before["block_bytes"],
            "block_bytes_after": after["block_bytes"],
            "bytes_before": before["bytes_on_disk"],
            "bytes_after": after["bytes_on_disk"],
            "blocks_after": after["blocks"],
        }
        emit(result, args.json, lambda r: (
            f"removed {r['removed_blocks']:,} block(s), {r['removed_bytes']:,} bytes; "
            f"{r['block_bytes_after']:,} bytes in {r['blocks_after']:,} block(s) remain (budget {r['max_bytes']:,}), "
            f"{r['bytes_after']:,} bytes of segment files"
        ))  # fmt: skip
        return 0

    return run(work)

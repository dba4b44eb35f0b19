"""``ppc gc --max-bytes N``: evict least recently used blocks down to a budget."""

from __future__ import annotations

from ..cliutil import UserError, add_json_option, add_store_option, emit, make_parser, run, store_path

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    """``123``, ``64K``, ``512M``, ``2G`` (binary units; a trailing ``B``/``iB`` is allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise UserError(f"--max-bytes {text!r}: expected a size like 500M or 2G") from None
    if value < 0:
        raise UserError(f"--max-bytes {text!r}: must not be negative")
    return int(value * _UNITS[unit])


def main(argv: list[str]) -> int:
    """Evict least recently used leaves until the block files fit the budget."""
    parser = make_parser("gc", "Evict least recently used blocks (leaves first) down to a byte budget.")
    add_store_option(parser)
    parser.add_argument("--max-bytes", required=True, help="budget for block files, e.g. 500M or 2G")
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from ..maintenance import StoreAdmin

        budget = parse_bytes(args.max_bytes)
        with StoreAdmin(store_path(args, must_exist=True)) as admin:
            before = admin.index.totals()
            removed = admin.gc(budget)
            after = admin.index.totals()
        result = {
            "max_bytes": budget,
            "removed_blocks": len(removed),
            "removed_bytes": sum(n.size for n in removed),
            "bytes_before": before[0],
            "bytes_after": after[0],
            "blocks_after": after[1],
        }
        emit(result, args.json, lambda r: (
            f"removed {r['removed_blocks']:,} block(s), {r['removed_bytes']:,} bytes; "
            f"{r['bytes_after']:,} bytes in {r['blocks_after']:,} block(s) remain (budget {r['max_bytes']:,})"
        ))  # fmt: skip
        return 0

    return run(work)

"""``ppc gc``: remove blocks by model (``--model``), by age (``--unused-for``) and down to
a budget (``--max-bytes``: least recently used leaves first); segment files that became
mostly dead are compacted. Options that would remove every block ask first on a terminal
and need ``--yes`` elsewhere."""

from __future__ import annotations

import argparse
import re
import sys

from ..errors import EmptiesStoreError
from .common import (
    SIZE_UNITS_HELP, UserError, add_json_option, add_store_option, make_parser, parse_size, run, store_path,
)  # fmt: skip
from .output import emit

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``3600s``, ``2w`` or plain seconds, as seconds.

    Raises:
        argparse.ArgumentTypeError: If `text` is not such a duration.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (expected e.g. 30d, 12h, 90m or 3600)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _render(r: dict) -> str:
    return (
        f"removed {r['removed_blocks']:,} block(s), {r['removed_bytes']:,} bytes; "
        f"{r['block_bytes_after']:,} bytes in {r['blocks_after']:,} block(s) remain"
        + (f" (budget {r['max_bytes']:,})" if r["max_bytes"] is not None else "")
        + f", {r['bytes_after']:,} bytes of segment files"
    )


def main(argv: list[str]) -> int:
    """Remove blocks by model, by age and down to a budget."""
    parser = make_parser(
        "gc",
        "Remove blocks: every block of one model (--model), blocks unused for a while "
        "(--unused-for), then least recently used leaves down to a budget (--max-bytes).",
    )
    add_store_option(parser)
    parser.add_argument(
        "--max-bytes", type=parse_size, default=None, metavar="SIZE",
        help=f"budget of the blocks' bytes, e.g. 500M or 2G ({SIZE_UNITS_HELP}); 0 removes every block",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="remove every block of this model: folder, hub id or hash prefix")
    parser.add_argument(
        "--unused-for", type=parse_duration, default=None, metavar="DURATION",
        help="remove blocks not stored or restored for this long, e.g. 30d, 12h",
    )  # fmt: skip
    parser.add_argument(
        "--yes", action="store_true",
        help="remove every block without asking when the options select them all (else asked on a terminal, "
        "refused elsewhere)",
    )  # fmt: skip
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.max_bytes is None and args.model is None and args.unused_for is None:
        parser.error("say what to remove: --max-bytes, --model and/or --unused-for")

    def work() -> int:
        from ..admin import StoreAdmin

        with StoreAdmin(store_path(args, must_exist=True)) as admin:
            before = admin.summary()
            options = dict(model=args.model, unused_for=args.unused_for)
            try:
                removed = admin.gc(args.max_bytes, **options, empty_ok=args.yes)
            except EmptiesStoreError as exc:
                if not confirmed(exc):
                    return 1
                removed = admin.gc(args.max_bytes, **options)
            after = admin.summary()
        result = {
            "max_bytes": args.max_bytes,
            "model": args.model,
            "unused_for_s": args.unused_for,
            "removed_blocks": len(removed),
            "removed_bytes": sum(n.size for n in removed),
            "block_bytes_before": before["block_bytes"],
            "block_bytes_after": after["block_bytes"],
            "bytes_before": before["bytes_on_disk"],
            "bytes_after": after["bytes_on_disk"],
            "blocks_after": after["blocks"],
        }
        emit(result, args.json, _render)
        return 0

    return run(work)


def confirmed(refusal: EmptiesStoreError) -> bool:
    """Whether the user, asked on the terminal, wants every block removed (said "y").

    Raises:
        UserError: Without a terminal to ask on (pass ``--yes``).
    """
    if not sys.stdin.isatty():
        raise UserError(f"{refusal.message}: pass --yes to remove them all; nothing was removed")
    print(f"{refusal.message}. Remove them all? [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline().strip().lower()
    if answer in ("y", "yes"):
        return True
    print("nothing was removed", file=sys.stderr)
    return False

"""``ppc push``: publish a local store (a precomputed one, say) to the fleet's remote tier."""

from __future__ import annotations

import os
import sys

from .common import (
    UserError, add_json_option, add_remote_option, add_store_option, make_parser, remote_options, run, store_path,
)  # fmt: skip
from .output import emit, table


def progress_line(verb: str, enabled: bool):
    """A progress callback ``(done, total)`` drawing one line on a terminal's stderr."""
    if not enabled or not sys.stderr.isatty():
        return None

    def draw(done: int, total: int) -> None:
        sys.stderr.write(f"\r{verb} {done:,}/{total:,} blocks")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def require_remote(args) -> dict:
    """The remote options, or a UserError when no remote was given."""
    options = remote_options(args)
    if not options:
        raise UserError("no remote given: pass --remote URL or set PPC_REMOTE")
    return options


def _render(s: dict) -> str:
    rows = [(k.replace("_", " "), v) for k, v in s.items() if k not in ("store", "remote")]
    return f"store {s['store']} -> {s['remote']}\n" + table(rows)


def main(argv: list[str]) -> int:
    """Publish every block of a store to the remote (blocks it holds already are skipped)."""
    parser = make_parser("push", "Publish a local store's blocks to the fleet's remote tier (safe to re-run).")
    add_store_option(parser)
    add_remote_option(parser)
    parser.add_argument("--ttl", type=float, default=None, help="seconds the blocks live on the server")
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress line")
    parser.add_argument("--replace-unauthenticated", action="store_true",
                        help="read the values the server already holds for this store's blocks and write over those "
                        "that fail their checks (another secret's MAC, forged or damaged)")  # fmt: skip
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from ..admin import push_store
        from ..tiers.remote_client import redact

        path = store_path(args, must_exist=True)
        options = require_remote(args)
        if args.ttl is not None and not args.ttl > 0:
            raise UserError(f"--ttl must be a number of seconds > 0, got {args.ttl}")
        out = push_store(
            path, options["remote"], secret=options["remote_secret"], ttl=args.ttl,
            progress=progress_line("pushed", not args.no_progress), replace_unauthenticated=args.replace_unauthenticated,
        )  # fmt: skip
        why = out.pop("why", None)
        emit({"store": os.path.abspath(path), "remote": redact(options["remote"]), **out}, args.json, _render)
        if out["failed"] or out["damaged"]:
            said = f" ({why})" if why else ""
            remedy = "run ppc push again"
            if why and "maxmemory" in why:  # full, and evicting nothing: a re-run would fail the same way
                remedy = "the server is full and evicts nothing: set its maxmemory-policy to allkeys-lru"
            parts = [f"{out['failed']} blocks not taken by the server{said}; {remedy}"] if out["failed"] else []
            if out["damaged"]:
                parts.append(f"{out['damaged']} blocks damaged here, not sent; see ppc check")
            print("error: " + "; ".join(parts), file=sys.stderr)
            return 1
        return 0

    return run(work)

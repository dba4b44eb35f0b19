"""``ppc migrate [--dry-run]``: apply pending schema migrations to a store."""

from __future__ import annotations

import os

from .common import add_json_option, add_store_option, emit, make_parser, run, store_path
from ..disk.index import Index
from ..disk.schema import check_schema
from ..admin import WRITE_HINT
from ..disk.store_dir import require_writable, unwritable_part


def main(argv: list[str]) -> int:
    """Show (--dry-run) or apply the migrations a store needs, in one transaction."""
    parser = make_parser("migrate", "Apply pending schema migrations (all in one transaction).")
    add_store_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="list the pending migrations only")
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        path = store_path(args, must_exist=True, any_schema=True)
        # A store this user cannot write is read: "nothing to do" needs no write access.
        writable = not args.dry_run and unwritable_part(path) is None
        index = Index(os.path.join(path, "index"), readonly=not writable, migrate=False)
        try:
            version = index.version()
            check_schema(path, version, migrate=True)  # a newer store: upgrade the library
            pending = [{"version": m.VERSION, "description": m.DESCRIPTION} for m in index.pending_migrations()]
            applied = []
            if pending and not args.dry_run:
                # One line naming the remedy, not LMDB's "Read-only file system" traceback.
                require_writable(path, hint=f"{WRITE_HINT}; `ppc migrate --dry-run` only reads it")
                applied = index.apply_migrations({"block_size": index.block_size})
            result = {"store": path, "from_version": version, "to_version": index.version(),
                      "pending": pending, "applied": applied, "dry_run": args.dry_run}  # fmt: skip
        finally:
            index.close()

        def render(r):
            if not r["pending"]:
                return f"store {r['store']} is at schema v{r['from_version']}: nothing to do"
            lines = [f"  v{p['version']}: {p['description']}" for p in r["pending"]]
            verb = "would apply" if r["dry_run"] else f"applied (now v{r['to_version']})"
            return "\n".join([f"{verb}:"] + lines)

        emit(result, args.json, render)
        return 0

    return run(work)

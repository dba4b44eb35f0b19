"""``ppc migrate [--dry-run]``: apply pending schema migrations to a store."""

from __future__ import annotations

from ..admin import migrate_store
from .common import add_json_option, add_store_option, make_parser, run, store_path
from .output import emit


def main(argv: list[str]) -> int:
    """Show (--dry-run) or apply the migrations a store needs, in one transaction."""
    parser = make_parser("migrate", "Apply pending schema migrations (all in one transaction).")
    add_store_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="list the pending migrations only")
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        path = store_path(args, must_exist=True, any_schema=True)
        result = migrate_store(path, dry_run=args.dry_run)

        def render(r):
            if not r["pending"]:
                return f"store {r['store']} is at schema v{r['from_version']}: nothing to do"
            lines = [f"  v{p['version']}: {p['description']}" for p in r["pending"]]
            verb = "would apply" if r["dry_run"] else f"applied (now v{r['to_version']})"
            return "\n".join([f"{verb}:"] + lines)

        emit(result, args.json, render)
        return 0

    return run(work)

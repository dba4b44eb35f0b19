"""``ppc check [--fix]``: verify every block file and the index's invariants."""

from __future__ import annotations

from ..disk.store_dir import describe_finding, permissions_finding
from .common import (
    add_json_option, add_store_option, add_store_shared_option, emit, make_parser, run, store_path, table,
)  # fmt: skip
from ..disk.maintenance import StoreAdmin


def _render(r: dict) -> str:
    lines = [f"{r['nodes']:,} blocks, {r['files_verified']:,} files verified"]
    if r["problems"]:
        lines.append(table([(p["kind"], p["detail"]) for p in r["problems"]], header=("problem", "where")))
    lines.append("clean" if r["clean"] else f"{len(r['problems'])} problem(s)")
    if r["fixed"]:
        lines.append(f"fixed: removed {r['removed_nodes']} block(s) from the index and {r['removed_files']} file(s)")
    elif not r["clean"]:
        lines.append("run again with --fix to repair")
    lines += describe_finding(r["permissions"])
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Verify a store; exit 0 if clean (or repaired with --fix), 1 if problems remain."""
    parser = make_parser("check", "Verify every block file's checksum and the index's invariants.")
    add_store_option(parser)
    parser.add_argument(
        "--fix", action="store_true", help="drop what is broken, sweep leftover files, make the store private"
    )
    parser.add_argument("--grace", type=float, default=60.0,
                        help="leave unreferenced files younger than this many seconds (default: %(default)s)")  # fmt: skip
    add_store_shared_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.grace < 0:
        parser.error("--grace must not be negative")

    def work() -> int:
        path = store_path(args, must_exist=True)
        with StoreAdmin(path, readonly=not args.fix) as admin:
            report = admin.check(fix=args.fix, grace=args.grace)
        # Who else can read the prompts: a warning (exit status unchanged); --fix makes it private.
        permissions = permissions_finding(path, fix=args.fix, shared=args.store_shared)
        result = {**report.to_dict(), "permissions": permissions}
        emit(result, args.json, _render)
        return 0 if report.clean or report.fixed else 1

    return run(work)

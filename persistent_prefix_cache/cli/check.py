"""``ppc check [--fix]``: verify the index (walked in a child process), every segment file
and the index's invariants; ``--fix`` rebuilds a damaged index from the segment files.

Exit codes: 0 clean (or repaired with ``--fix``), 1 problems remain (run ``--fix``; or
found again after it, listed as ``not fixed``),
2 an error line (no store, the store is open elsewhere during a rebuild, not writable).
"""

from __future__ import annotations

from ..admin import check_store, describe_entries, describe_finding, permissions_finding
from .common import add_json_option, add_store_option, add_store_shared_option, make_parser, run, store_path
from .output import emit, table


def _render(r: dict) -> str:
    lines = [f"{r['blocks_verified']:,} of {r['nodes']:,} blocks verified in {r['segments_verified']:,} segment files"]
    if r["problems"]:
        lines.append(table([(p["kind"], p["detail"]) for p in r["problems"]], header=("problem", "where")))
    lines.append("clean" if r["clean"] else f"{len(r['problems'])} problem(s)")
    lines += [f"note: {n}" for n in r["notes"]]
    b = r["rebuild"]
    if b is not None and b["resumed"]:
        lines.append("rebuilt: finished the swap of an interrupted rebuild")
    elif b is not None:
        lines.append(
            f"rebuilt the index from {b['segments']} segment file(s): {b['blocks']} block(s) of "
            f"{b['models']} model(s); recency and hit counts were reset"
        )
        if b.get("converted"):
            lines.append(
                f"rewrote {b['converted']} segment file(s) of format v4 as v5 (checksums bound to their blocks)"
            )
        if b["dropped"]:
            lines.append(f"left out {b['dropped']} intact block(s) whose earlier blocks are missing")
        for u in b["unusable"]:
            lines.append(f"set aside {u['file']}: {u['why']}")
    if b is not None and b["aside"]:
        lines.append(f"the damaged index was kept in {b['aside']} (delete it when you like)")
    if r["fixed"]:
        lines.append(f"fixed: removed {r['removed_nodes']} block(s) from the index and {r['removed_files']} file(s)")
        for p in r["remaining"]:  # looked at again after the fix: what --fix cannot settle
            lines.append(f"not fixed: {p['kind']}: {p['detail']}")
    elif not r["clean"]:
        lines.append("run again with --fix to repair")
    lines += describe_entries(r["unfixed"])
    lines += describe_finding(r["permissions"])
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Verify a store; exit 0 if clean (or repaired with --fix), 1 if problems remain."""
    parser = make_parser("check", "Verify every segment file's checksums and the index's invariants.")
    add_store_option(parser)
    parser.add_argument(
        "--fix", action="store_true",
        help="rebuild a damaged index from the segment files, drop what is broken, sweep leftovers, "
        "make the store private",
    )  # fmt: skip
    parser.add_argument("--grace", type=float, default=60.0,
                        help="leave unreferenced files younger than this many seconds (default: %(default)s)")  # fmt: skip
    add_store_shared_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.grace < 0:
        parser.error("--grace must not be negative")

    def work() -> int:
        path = store_path(args, walk=False)
        report = check_store(path, fix=args.fix, grace=args.grace)
        # Who else can read the prompts: a warning (exit status unchanged); --fix makes it private.
        permissions = permissions_finding(path, fix=args.fix, shared=args.store_shared)
        emit({**report.to_dict(), "permissions": permissions}, args.json, _render)
        return 0 if (report.clean or report.fixed) and not report.unfixed and not report.remaining else 1

    return run(work)

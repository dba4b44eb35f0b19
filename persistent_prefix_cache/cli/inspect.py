"""``ppc inspect``: the models in a store and its longest stored prefixes."""

from __future__ import annotations

from datetime import datetime

from .common import add_json_option, add_store_option, make_parser, run, store_path
from .output import emit, short_fingerprint, table
from ..admin import StoreAdmin


def _render(s: dict) -> str:
    out = [f"store {s['store']}: {s['blocks']:,} blocks, {s['bytes_on_disk']:,} bytes, "
           f"block size {s['block_size']}", "", "models:"]  # fmt: skip
    out.append(
        table(
            [
                (
                    m["root"][:12],
                    short_fingerprint(m["fingerprint"]),
                    m.get("name") or "(unnamed)",
                    m["namespace"] or "-",
                    m["blocks"],
                    m["bytes"],
                    m["block_hits"],
                    m["layout"],
                )
                for m in s["models"]
            ],  # fmt: skip
            header=("model", "fingerprint", "name", "namespace", "blocks", "bytes", "block hits", "layout"),
        )
    )
    out += ["", "longest stored prefixes:"]
    out.append(
        table(
            [
                (
                    p["model"],
                    p["tokens"],
                    "yes" if p["resumable"] else "no",
                    p["block_hits"],
                    datetime.fromtimestamp(p["last_access"] / 1e9).strftime("%Y-%m-%d %H:%M:%S"),
                )
                for p in s["longest_prefixes"]
            ],  # fmt: skip
            header=("model", "tokens", "resumable", "block hits", "last used"),
        )
        or "(none)"
    )
    out += ["", "fingerprints remembered by model folder (`ppc forget` forgets them):"]
    out.append(
        table(
            [
                (
                    r.get("folder")
                    or (
                        f"(weights hashed {str(r['alias_of'])[:20]})"
                        if r.get("alias_of")
                        else "(unknown: remembered before verification)"
                    ),
                    short_fingerprint(r.get("fingerprint")),
                    "yes" if r.get("sample") or r.get("alias_of") else "no",
                )
                for r in s.get("remembered", [])
            ],  # fmt: skip
            header=("folder", "fingerprint", "verified"),
        )
        or "(none)"
    )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """Print the models (fingerprint and name), the longest prefixes stored and the
    fingerprints remembered by model folder."""
    parser = make_parser("inspect", "Models, fingerprints and the longest stored prefixes.")
    add_store_option(parser)
    parser.add_argument("--top", type=int, default=10, help="how many prefixes to list (default: %(default)s)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error("--top must be at least 1")

    def work() -> int:
        with StoreAdmin(store_path(args, must_exist=True), readonly=True) as admin:
            summary = admin.summary(longest=args.top)
            summary["remembered"] = [
                {k: r.get(k) for k in ("folder", "fingerprint", "sample", "signature", "alias_of")}
                for r in admin.index.remembered_fingerprints()
            ]
            emit(summary, args.json, _render)
        return 0

    return run(work)

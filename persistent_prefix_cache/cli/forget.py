"""``ppc forget``: forget the model fingerprints a store remembers by model folder.

A store remembers each model folder's fingerprint (keyed by its files' path, size,
mtime and inode, with a sample of the weights it was computed from) so that opening
the same model again hashes nothing. Forgetting costs one hash of the weights at each
model's next open; no block is removed.
"""

from __future__ import annotations

from .common import add_json_option, add_store_option, make_parser, path_arg, run, store_path
from .output import emit


def main(argv: list[str]) -> int:
    """Forget the remembered fingerprints of one model folder, or all of them."""
    parser = make_parser(
        "forget",
        "Forget the fingerprints a store remembers by model folder (the next open hashes the weights again; "
        "no block is removed). `ppc inspect` lists them.",
    )
    add_store_option(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-path", type=path_arg, metavar="DIR", help="forget what is remembered for this folder")
    which.add_argument("--all", action="store_true", help="forget every remembered fingerprint")
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from ..admin import StoreAdmin
        from ..fingerprint import forget_fingerprints

        with StoreAdmin(store_path(args, must_exist=True)) as admin:
            forgotten = forget_fingerprints(admin.index, args.model_path)
        result = {"forgotten": forgotten, "model_path": args.model_path}
        emit(result, args.json, lambda r: (
            f"forgot {r['forgotten']} remembered fingerprint(s)"
            + (f" of {r['model_path']}" if r["model_path"] else "")
            + ("; the next open of that model hashes its weights" if r["forgotten"] else "")
        ))  # fmt: skip
        return 0

    return run(work)

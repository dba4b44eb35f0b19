"""``ppc import``: load a file written by ``ppc export`` into a store."""

from __future__ import annotations

import os

from .common import (
    UserError, add_json_option, add_store_option, add_store_shared_option, emit, make_parser, path_arg, run, store_path,
)  # fmt: skip
from ..disk.maintenance import StoreAdmin


def main(argv: list[str]) -> int:
    """Add the blocks of an export to a store (created if missing); present ones are skipped."""
    parser = make_parser("import", "Load a file written by `ppc export` into a store.")
    add_store_option(parser)
    parser.add_argument("input", type=path_arg, help="a file written by `ppc export`")
    add_store_shared_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        if not os.path.isfile(args.input):
            raise UserError(f"{args.input}: no such file")
        path = store_path(args)
        block_size = _block_size_of(args.input)
        # A file, a folder of other files, a store or a place this user cannot write:
        # StoreAdmin says so in one line (exit 2), before anything is created.
        with StoreAdmin(path, create=True, block_size=block_size, shared=args.store_shared) as admin:
            result = admin.import_pack(args.input)
        emit(result, args.json, lambda r: (
            f"imported {r['added']:,} block(s), {r['bytes']:,} bytes; {r['skipped']:,} already present"
        ))  # fmt: skip
        return 0

    return run(work)


def _block_size_of(path: str) -> int:
    # A new store takes the export's block size; an existing one must match it.
    import json
    import tarfile

    try:
        with tarfile.open(path, "r") as tar:
            member = tar.extractfile("manifest.json")
            return int(json.loads(member.read())["block_size"])
    except (tarfile.TarError, KeyError, ValueError, TypeError, AttributeError, OSError):
        raise UserError(f"{path} is not a ppc export") from None

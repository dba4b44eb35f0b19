"""``ppc export``: pack a store, or one model's part of it, into one file, signed by the
store (and by ``$PPC_PACK_SECRET`` / ``--secret-file`` if given)."""

from __future__ import annotations

from .common import (
    add_json_option, add_pack_secret_option, add_store_option, emit, make_parser, pack_secret, path_arg, run, store_path,
)  # fmt: skip
from ..disk.maintenance import StoreAdmin


def main(argv: list[str]) -> int:
    """Write a store (or the part for one model) to one tar file."""
    parser = make_parser("export", "Pack a store, or the part for one model, into one file.")
    add_store_option(parser)
    parser.add_argument("output", type=path_arg, help="the file to write (e.g. prompts.ppc.tar)")
    parser.add_argument("--model", help="one model: its folder or hub id, or a prefix of its hash (see `ppc inspect`)")
    add_pack_secret_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        secret = pack_secret(args)
        with StoreAdmin(store_path(args, must_exist=True), readonly=True) as admin:
            result = admin.export_pack(args.output, model=args.model, secret=secret)
        signed = " and ".join({"store": "this store", "secret": "your secret"}[k] for k in result["signed_by"])
        emit(result, args.json, lambda r: (
            f"exported {r['blocks']:,} block(s) of {r['models']} model(s), {r['bytes']:,} bytes, to {args.output}; "
            + (f"signed by {signed}" if signed else "not signed (this user cannot write the store's key: "
               "give a secret, $PPC_PACK_SECRET)")
        ))  # fmt: skip
        return 0

    return run(work)

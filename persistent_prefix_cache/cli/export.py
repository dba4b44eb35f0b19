"""``ppc export``: pack a store, or one model's part of it, into one file, signed by the
store (and by ``$PPC_PACK_SECRET`` / ``--secret-file`` if given); ``-`` writes the pack
to stdout, and then the summary goes to stderr."""

from __future__ import annotations

import json
import os
import sys

from .common import (
    UserError, add_json_option, add_pack_secret_option, add_store_option, make_parser, pack_secret, path_arg, run,
    store_path,
)  # fmt: skip
from ..admin import StoreAdmin

#: The output name that writes the pack to stdout (``ppc export --store S - | ssh host ppc import ... -``).
STDOUT = "-"


def check_output(name: str) -> None:
    """Say before anything is read what would stop the pack from being written to `name`.

    Raises:
        UserError: If `name` is ``-`` and stdout is a terminal, a folder, or a file in a
            folder that is missing or that this user cannot write.
    """
    if name == STDOUT:
        if sys.stdout.isatty():
            raise UserError(
                "- writes the pack to stdout, which is a terminal: redirect it (ppc export ... - > pack.tar)"
            )
        return
    if os.path.isdir(name):
        raise UserError(f"{name} is a directory: name the file to write (e.g. {os.path.join(name, 'prompts.ppc.tar')})")
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {name}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {name}: permission denied: this user cannot write in {folder}")


def main(argv: list[str]) -> int:
    """Write a store (or the part for one model) to one tar file."""
    parser = make_parser("export", "Pack a store, or the part for one model, into one file.")
    add_store_option(parser)
    parser.add_argument(
        "output", type=path_arg, help="the file to write (e.g. prompts.ppc.tar; -: stdout, the summary then on stderr)"
    )
    parser.add_argument("--model", help="one model: its folder or hub id, or a prefix of its hash (see `ppc inspect`)")
    add_pack_secret_option(parser)
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        check_output(args.output)
        secret = pack_secret(args)
        to_stdout = args.output == STDOUT
        with StoreAdmin(store_path(args, must_exist=True), readonly=True) as admin:
            result = admin.export_pack(
                args.output, model=args.model, secret=secret, stream=sys.stdout.buffer if to_stdout else None
            )
        signed = " and ".join({"store": "this store", "secret": "your secret"}[k] for k in result["signed_by"])
        where = "stdout" if to_stdout else args.output
        text = json.dumps(result, indent=2) if args.json else (
            f"exported {result['blocks']:,} block(s) of {result['models']} model(s), {result['bytes']:,} bytes, "
            f"to {where}; "
            + (f"signed by {signed}" if signed else "not signed (this user cannot write the store's key: "
               "give a secret, $PPC_PACK_SECRET)")
        )  # fmt: skip
        print(text, file=sys.stderr if to_stdout else sys.stdout)  # stdout holds the pack alone
        return 0

    return run(work)

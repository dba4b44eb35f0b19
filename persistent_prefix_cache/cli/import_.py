"""``ppc import``: load a file written by ``ppc export`` into a store.

A pack signed by this store (exported from it) or with the secret given
(``$PPC_PACK_SECRET``, ``--secret-file``) is imported as it is; any other pack proves
itself against the model (``--model M``: its blocks' model recomputed from the weights,
chains of its blocks computed again, `pack_check`), or is imported unverified only when
asked (``--trust``).
"""

from __future__ import annotations

import os

from .common import (
    UserError, add_json_option, add_pack_secret_option, add_store_option, add_store_shared_option, emit, load_model,
    make_parser, pack_secret, path_arg, positive_int, run, store_path,
)  # fmt: skip
from ..disk.maintenance import StoreAdmin
from ..disk.pack_members import block_size_of
from ..disk.store_dir import store_exists, undo_creation
from ..errors import PrefixCacheError


def _chains(text: str) -> int | None:
    import argparse

    try:
        return None if text == "all" else positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 'all' or an integer >= 1, got {text!r}") from None


def main(argv: list[str]) -> int:
    """Add the blocks of an export to a store (created if missing); present ones are skipped."""
    parser = make_parser("import", "Load a file written by `ppc export` into a store.")
    add_store_option(parser)
    parser.add_argument("input", type=path_arg, help="a file written by `ppc export`")
    add_store_shared_option(parser)
    add_pack_secret_option(parser)
    parser.add_argument("--model", default=None,
                        help="check a pack this store or your secret did not sign against this model "
                        "(a folder or hub id) before anything is written")  # fmt: skip
    parser.add_argument("--check-chains", type=_chains, default=8, metavar="N",
                        help="with --model: chains of blocks checked, sampled at random (default 8; 'all')")  # fmt: skip
    parser.add_argument("--trust", action="store_true",
                        help="import a pack that nothing verifies (another store's, an older version's) "
                        "unchecked")  # fmt: skip
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        if not os.path.isfile(args.input):
            raise UserError(f"{args.input}: no such file")
        if args.trust and args.model is not None:
            raise UserError("--trust and --model contradict each other: --trust checks nothing")
        path = store_path(args)
        secret = pack_secret(args)
        block_size = block_size_of(args.input)
        check = None
        if args.model is not None:
            from ..pack_check import model_check

            check = model_check(load_model(args.model)[0], chains=args.check_chains)
        existed, made_folder = store_exists(path), not os.path.isdir(path)
        # A file, a folder of other files, a store or a place this user cannot write:
        # StoreAdmin says so in one line (exit 2), before anything is created.
        try:
            with StoreAdmin(path, create=True, block_size=block_size, shared=args.store_shared) as admin:
                result = admin.import_pack(args.input, secret=secret, trust=args.trust, check=check)
        except PrefixCacheError:
            if not existed:  # a refused pack leaves no empty store behind
                undo_creation(path, made_folder=made_folder)
            raise
        emit(result, args.json, _render)
        return 0

    return run(work)


def _render(r: dict) -> str:
    how = {
        "store": "signed by this store", "secret": "signed with your secret", "trust": "not verified (--trust)",
    }.get(r["verified"])  # fmt: skip
    if how is None:
        c = r["checked"]
        how = (f"checked against the model: {c['chains']} of {c['of']} chain(s), {c['blocks']:,} of the new blocks, "
               f"largest relative difference {c['difference']:.2g} (tolerance {c['tolerance']:g})")  # fmt: skip
    return f"imported {r['added']:,} block(s), {r['bytes']:,} bytes; {r['skipped']:,} already present\n{how}"

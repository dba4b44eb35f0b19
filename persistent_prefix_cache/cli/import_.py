"""``ppc import``: load a file written by ``ppc export`` into a store.

A pack signed by this store (exported from it) or with the secret given
(``$PPC_PACK_SECRET``, ``--secret-file``) is imported as it is; any other pack proves
itself against the model (``--model M``: its blocks' model recomputed from the weights,
chains of its blocks computed again, `pack_check`), or is imported unverified only when
asked (``--trust``).
"""

from __future__ import annotations

import sys

from .common import (
    UserError, add_json_option, add_pack_secret_option, add_store_option, add_store_shared_option, load_model,
    make_parser, pack_secret, path_arg, positive_int, run, store_path,
)  # fmt: skip
from .output import emit
from ..admin import PackReader, StoreAdmin
from ..disk.store_dir import missing_folders, store_exists, undo_creation

#: The input name that reads the pack from stdin (``ppc export --store S - | ppc import ... -``).
STDIN = "-"


def _chains(text: str) -> int | None:
    import argparse

    try:
        return None if text == "all" else positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 'all' or an integer >= 1, got {text!r}") from None


def open_pack(name: str) -> PackReader:
    """The pack `name` names: a file, or stdin for ``-`` (``./-`` is a file of that name).

    Raises:
        UserError: If ``-`` is given while stdin is a terminal.
        InvalidArgumentError: If the file cannot be read (missing, a folder, permissions)
            or is not a pack (see `PackReader`).
    """
    if name != STDIN:
        return PackReader(name)
    if sys.stdin.isatty():
        raise UserError("- reads a pack from stdin, which is a terminal: pipe one in (ppc import ... - < pack.tar)")
    return PackReader("stdin", stream=sys.stdin.buffer)


def main(argv: list[str]) -> int:
    """Add the blocks of an export to a store (created if missing); present ones are skipped."""
    parser = make_parser("import", "Load a file written by `ppc export` into a store.")
    add_store_option(parser)
    parser.add_argument("input", type=path_arg, help="a file written by `ppc export` (-: read it from stdin)")
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
        if args.trust and args.model is not None:
            raise UserError("--trust and --model contradict each other: --trust checks nothing")
        path = store_path(args)
        secret = pack_secret(args)
        with open_pack(args.input) as reader:
            block_size = reader.manifest()["block_size"]  # a new store takes the pack's
            check = None
            if args.model is not None:
                from ..admin import model_check

                check = model_check(load_model(args.model)[0], chains=args.check_chains)
            existed, made = store_exists(path), missing_folders(path)
            # A file, a folder of other files, a store or a place this user cannot write:
            # StoreAdmin says so in one line (exit 2), before anything is created.
            try:
                with StoreAdmin(path, create=True, block_size=block_size, shared=args.store_shared) as admin:
                    result = admin.import_pack(reader.path, reader=reader, secret=secret, trust=args.trust, check=check)
            except BaseException:
                if not existed:  # a refused or damaged pack leaves nothing behind that was not there
                    undo_creation(path, made_folder=bool(made), parents=made[1:])
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

"""``ppc pull``: fill a local store from the fleet's remote tier, for given prompts or a model."""

from __future__ import annotations

import sys

from .common import add_json_option, add_model_option, add_remote_option, add_store_option, load_model, make_parser, run
from .output import emit, table
from .prompting import (
    add_block_size_option, add_template_options, check_store_path, check_text_options, open_checked_store, template_kwargs,
)  # fmt: skip
from .push import progress_line, require_remote


def _render(s: dict) -> str:
    rows = [(k.replace("_", " "), v) for k, v in s.items() if k not in ("store", "remote")]
    return f"store {s['store']} <- {s['remote']}\n" + table(rows)


def main(argv: list[str]) -> int:
    """Pull the blocks of given prompts (or, without inputs, all of a model's) from the remote."""
    parser = make_parser(
        "pull",
        "Fill a local store from the fleet's remote tier: the stored prefixes of the prompts "
        "in INPUT files (text or JSONL, as ppc precompute reads them), or, without inputs, "
        "every block the server holds for the model. Safe to re-run.",
    )
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="text or JSONL files of prompts")
    add_model_option(parser)
    add_store_option(parser)
    add_remote_option(parser)
    add_block_size_option(parser)
    parser.add_argument("--format", choices=["auto", "text", "jsonl"], default="auto", help="how to read inputs")
    add_template_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress line")
    add_json_option(parser)
    args = parser.parse_args(argv)

    def work() -> int:
        from ..admin import BULK_TIMEOUT, count_unauthenticated, pull_model, reach, remote_key_spaces
        from .precompute import read_inputs, tokenize

        options = require_remote(args)
        check_store_path(args)
        check_text_options(args, "system_prompt", "chat_template_config")
        kwargs = template_kwargs(args)
        prompts = read_inputs(args.inputs, args.format) if args.inputs else []
        # Pulling needs the server: one that cannot be reached, or refuses the URL, is
        # an error before the model is loaded.
        reach(options["remote"], "nothing was pulled", max(options.get("remote_timeout", 0), BULK_TIMEOUT))
        model, tokenizer, local_path = load_model(args.model)
        store = open_checked_store(args, model, local_path, need_write=True)
        with store:
            count_unauthenticated(store)  # said below, with the count
            if prompts:
                draw = progress_line("pulled prompts:", not args.no_progress)
                restored = 0
                for i, prompt in enumerate(prompts):
                    ids = tokenize(prompt, tokenizer, args, kwargs)
                    restored += len(ids) - len(store.fetch(ids)[1])
                    if draw:
                        draw(i + 1, len(prompts))
                store.flush()
                st = store.stats()
                out = {"prompts": len(prompts), "tokens_restored": restored, "blocks_pulled": st["remote_blocks"]}
                if not restored and not st["remote_errors"]:  # nothing here: is it under another secret?
                    spaces = remote_key_spaces(store)
                    out["other_secrets"] = sum(len(v) for k, v in spaces.items() if k != st["remote_key_id"])
            else:
                out = pull_model(store, progress_line("pulled", not args.no_progress))
                st = store.stats()
            out.update(
                blocks_in_store=st["blocks"], rejected=st["remote_corrupt"] + st["remote_unauthenticated"],
                remote_errors=st["remote_errors"],
            )  # fmt: skip
            emit({"store": store.path, "remote": st["remote"], **out}, args.json, _render)
        return 1 if _say_failures(out, st) else 0

    return run(work)


def _say_failures(out: dict, st: dict) -> bool:
    """One ``error:`` line per kind of failure of a pull; whether there was one."""
    said = []
    bad = st["remote_unauthenticated"]
    if bad:
        said.append(f"{bad} block{'s' * (bad != 1)} under your secret's key id failed authentication: written with "
                    "another secret (forged) or damaged, not by a host holding yours; `ppc push "
                    "--replace-unauthenticated` from a host that holds them writes over them")  # fmt: skip
    if out.get("other_secrets") and not out.get("found", out.get("tokens_restored")):
        said.append(f"the server holds {out['other_secrets']} block(s) of this model written with other secrets (or "
                    "none) and none under yours: your $PPC_REMOTE_SECRET differs from the writers'")  # fmt: skip
    if out.get("unread"):
        said.append(f"the server stopped answering: {out['unread']} of the {out['found']} blocks found were not read "
                    f"({out['waiting']} more wait for them); {out['pulled']} pulled; run ppc pull again")  # fmt: skip
    elif out["remote_errors"]:
        said.append(f"{out['remote_errors']} round trips to the server failed; run ppc pull again")
    for line in said:
        print(f"error: {line}", file=sys.stderr)
    return bool(said)

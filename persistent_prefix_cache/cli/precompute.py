"""``ppc precompute``: fill a store from prompts ahead of time, offline.

Inputs are plain text files (one prompt each), JSONL files with one
``{"prompt": ...}`` or ``{"messages": [...]}`` object per line, or standard input
(``-``, or no inputs with a pipe). Prompts go through the model's chat template the
way ``mlx_lm.cache_prompt`` does: as an open message that a later prompt continues.

Prompts are sorted by their tokens, so prompts that share a beginning (a system
prompt, a document) run one after the other and each restores what the previous one
stored: a shared prefix is computed and written once. Each prompt is prefilled with
`prefill`, which stores as it goes, so models with recurrent or sliding-window layers
can resume at every block boundary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from .common import (
    UserError, add_json_option, add_model_option, add_remote_option, add_store_option, load_model, make_parser,
    path_arg, run,
)  # fmt: skip
from .output import emit, table
from .progress import Progress, Terminated, sigterm_raises
from .prompting import (
    CountingStore, add_block_size_option, add_prefill_option, precompute_step, add_template_options, blocks_of,
    check_positive, check_store_path, encode_raw, STDIN, check_text_options, kv_quantization_errors, open_checked_store,
    prompt_of, read_text, render_chat, template_kwargs, uses_chat_template,
)  # fmt: skip

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class PromptInput:
    """One prompt as read, before tokenization.

    Attributes:
        where: Names it in messages: a file, ``file:line``, or ``<stdin>``.
        text: A plain prompt (None for a chat).
        messages: Chat messages (None for a plain prompt).
    """

    where: str
    text: str | None = None
    messages: list | None = None


# -- reading inputs -----------------------------------------------------------------------


def _looks_like_jsonl(text: str) -> bool:
    """Whether piped input is JSONL: its first non-blank line is a prompt object."""
    for line in text.splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                return False
            return isinstance(row, dict) and ("prompt" in row or "messages" in row)
    return False


def _parse_row(line: str, where: str) -> PromptInput:
    """One JSONL line as a prompt.

    Raises:
        UserError: Naming the line, if it is not a valid prompt object.
    """
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise UserError(f"{where}: invalid JSON ({why}); each line must be one JSON object") from None
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise UserError(
            f'{where}: expected an object with either "prompt" or "messages", '
            f'e.g. {{"prompt": "..."}} or {{"messages": [{{"role": "user", "content": "..."}}]}}'
        )
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise UserError(f'{where}: "prompt" must be a non-empty string')
        return PromptInput(where, text=row["prompt"])
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of messages')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(
                f'{where}: message {i} must be an object with a "role" string, '
                'e.g. {"role": "system", "content": "..."}'
            )
    return PromptInput(where, messages=messages)


def read_inputs(paths: list[str], fmt: str) -> list[PromptInput]:
    """Read every prompt of `paths` (``-`` is stdin).

    Args:
        paths: Files, or ``-``; none means stdin when it is piped.
        fmt: ``auto`` (JSONL by a .jsonl/.ndjson suffix, or for stdin when its first
            line is a prompt object), ``text`` or ``jsonl``.

    Returns:
        The prompts, in input order.

    Raises:
        UserError: On a missing or unreadable file, an invalid JSONL line, or no prompt.
    """
    if not paths:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no inputs: give text or JSONL files, or pipe prompts on stdin (see ppc precompute --help)")
        paths = [STDIN]
    if paths.count(STDIN) > 1:
        raise UserError("'-' (stdin) is given more than once; stdin can be read only once")
    prompts: list[PromptInput] = []
    for path in paths:
        name = "<stdin>" if path == STDIN else path
        if path != STDIN and os.path.isdir(path):
            raise UserError(f"{path}: is a directory; pass the files in it (e.g. {path}/*.txt)")
        text = read_text(path, name)
        if fmt == "auto":
            is_jsonl = _looks_like_jsonl(text) if path == STDIN else path.endswith(JSONL_SUFFIXES)
        else:
            is_jsonl = fmt == "jsonl"
        if not is_jsonl:
            # As every command reads a prompt file: like "$(cat file)", so a precomputed
            # file is a token prefix of the same text given as --prompt "$(cat file)".
            prompts.append(PromptInput(name, text=prompt_of(text, name)))
            continue
        text = text.removeprefix("\ufeff")  # a byte-order mark is no part of JSONL's rows
        rows = [_parse_row(line, f"{name}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not rows:
            raise UserError(f"{name}: no JSONL rows; nothing to precompute")
        prompts.extend(rows)
    return prompts


# -- tokenizing ---------------------------------------------------------------------------


def tokenize(prompt: PromptInput, tokenizer, args, kwargs: dict) -> list[int]:
    """The tokens of one prompt, as ``mlx_lm.cache_prompt`` would build them.

    A plain prompt becomes a user message (after ``--system-prompt``, if given); the
    last message is left open (``continue_final_message``) so that the stored prefix
    is a prefix of any later prompt that continues or closes it.

    Raises:
        UserError: If a chat cannot be rendered, or the prompt has no tokens.
    """
    if uses_chat_template(tokenizer, args):
        messages = prompt.messages
        if messages is None:
            messages = [{"role": "user", "content": prompt.text}]
            if args.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": args.system_prompt})
        ids = render_chat(
            tokenizer,
            messages,
            add_generation_prompt=False,
            continue_final_message=True,
            kwargs=kwargs,
            where=prompt.where,
        )
    elif prompt.text is None:  # a chat: its messages need the template
        why = "--ignore-chat-template was given" if args.ignore_chat_template else "it has none"
        raise UserError(
            f"{prompt.where}: a messages row needs the tokenizer's chat template, but {why}; "
            'use {"prompt": ...} rows instead'
        )
    else:
        ids = encode_raw(tokenizer, prompt.text, prompt.where)
    if not ids:
        raise UserError(f"{prompt.where}: the prompt has no tokens")
    return ids


# -- the command --------------------------------------------------------------------------


REMOTE_SUMMARY = ("remote", "remote_blocks", "remote_published", "remote_already", "remote_dropped",
                  "remote_publish_failed", "remote_errors")  # fmt: skip


# How a run that did not finish ended: (summary's "stopped", exit status).
ENDINGS = {"write_failed": ("a block write failed", 1), "interrupted": ("interrupted", 130),
           "terminated": ("terminated", 143)}  # fmt: skip


class _WriteFailed(Exception):
    """A block write of this run failed (a full disk, say): computing on stores nothing."""


def _render(summary: dict) -> str:
    done, total = summary["prompts_done"], summary["prompts"]
    rows = [
        ("prompts", total if done == total else f"{done:,} of {total:,}"),
        ("duplicates skipped", summary["duplicates"]),
        ("tokens in the prompts", summary["tokens"]),
        # What the store holds of these prompts now, whoever wrote it: less than the
        # prompts' tokens where a write failed, the run stopped or eviction took some.
        ("tokens stored", summary["tokens_stored"]),
        ("tokens restored", summary["tokens_restored"]),
        ("tokens computed", summary["tokens_computed"]),
        # Written counts every block record this run committed, a prompt's partial last
        # block included, which the store replaces once a longer prompt fills that block
        # (and, for a cache with snapshots, once the whole prompt is stored after its
        # last token): so the store can grow by fewer blocks than were written
        # (eviction, too). Blocks
        # another process committed first are not this run's.
        ("blocks written (this run)", summary["blocks_written"]),
        ("bytes written (this run)", summary["bytes_written"]),
        ("blocks reused", summary["blocks_reused"]),
        # The store's totals count every writer's blocks, other processes' too.
        ("blocks in store (all writers)", f"{summary['blocks_in_store_before']:,} -> {summary['blocks_in_store']:,}"),
        ("bytes on disk (all writers)", summary["bytes_on_disk"]),
        ("seconds", f"{summary['seconds']:.2f}"),
        ("tokens/s computed", round(summary["tokens_per_second"])),
    ]
    if summary.get("remote"):
        rows += [(k.replace("_", " "), summary[k]) for k in REMOTE_SUMMARY]
    return f"store {summary['store']} (block size {summary['block_size']})\n" + table(rows)


def _stopped_line(summary: dict) -> str:
    """The one line on stderr after the summary of a run that did not finish."""
    what = ENDINGS[summary["stopped"]][0]
    kept = (
        f"{summary['prompts_done']:,} of {summary['prompts']:,} prompts done; the store keeps the "
        f"{summary['blocks_written']:,} blocks this run wrote ({summary['tokens_stored']:,} of the prompts' "
        f"{summary['tokens']:,} tokens are stored)"
    )
    if summary["stopped"] == "write_failed":
        return (f"error: {what} (see above), so the run stopped: {kept}; free space or fix the cause, "
                "then run the same command again: it resumes from what is stored")  # fmt: skip
    return f"{what}: {kept}; run the same command again to resume from them"


def _precompute(args) -> int:
    check_positive("--block-size", args.block_size)
    check_positive("--prefill-step-size", args.prefill_step_size)
    check_text_options(args, "system_prompt", "chat_template_config")
    kwargs = template_kwargs(args)
    if args.system_prompt is not None and args.ignore_chat_template:
        print("note: --system-prompt is only used with the chat template", file=sys.stderr)
    # Read and check every input before loading the model: a typo fails in a second.
    check_store_path(args)
    inputs = read_inputs(args.inputs, args.format)
    model, tokenizer, local_path = load_model(args.model)
    seen: dict[tuple, str] = {}
    for prompt in inputs:
        seen.setdefault(tuple(tokenize(prompt, tokenizer, args, kwargs)), prompt.where)
    # Lexicographic order puts prompts with a shared prefix next to each other, so each
    # one restores the prefix the previous one has just stored (from the RAM tier).
    order = sorted(seen)

    from ..layers import all_sliced
    from ..prefill import prefill

    store = open_checked_store(args, model, local_path, need_write=True)
    with store:
        at_start = store.stats()
        bs = store.block_size
        step = precompute_step(store, args.prefill_step_size)
        total = sum(map(len, order))
        progress = Progress(len(order), total, enabled=not args.no_progress)
        restored = computed = reused = 0
        partial = 0  # tokens of the current prompt computed so far
        details = []
        counting = CountingStore(store)

        def check_writes() -> None:
            # A failed write (a full disk) shows in the handle's counters; stop at once
            # rather than compute what cannot be stored.
            if store.stats()["write_errors"] > at_start["write_errors"]:
                raise _WriteFailed()

        def report(done: int, _total: int) -> None:
            nonlocal partial
            # Tokens/s counts what the model ran, not what the store restored.
            partial = max(0, done - counting.restored)
            progress.update(done, computed + partial, restoring=counting.fetch_seconds)
            check_writes()

        stopped = None
        start = time.perf_counter()
        with sigterm_raises():  # SIGTERM ends the run as Ctrl-C does: what was kept is said
            try:
                for ids in order:
                    counting.reset()
                    partial = 0
                    with kv_quantization_errors(args):
                        cache, _ = prefill(model, list(ids), counting, prefill_step_size=step, progress=report)
                    # prefill stored up to its last token where a layer is not sliced along
                    # the sequence (where an identical prompt resumes): the whole prompt is
                    # stored here too, for prompts that extend it. A sliced cache it stored
                    # whole, or (on a GPU, beside its last forward) all but the last token:
                    # storing again would write that last block twice for one token.
                    if not all_sliced(cache):
                        counting.store(list(ids), cache)
                    details.append(
                        {"input": seen[ids], "tokens": len(ids), "restored": counting.restored,
                         "new_blocks": counting.new_blocks}
                    )  # fmt: skip
                    restored += counting.restored
                    computed += len(ids) - counting.restored
                    reused += blocks_of(counting.restored, bs)
                    partial = 0
                    progress.prompt_done(len(ids))
                    check_writes()
                store.flush()
                check_writes()
            except _WriteFailed:
                stopped = "write_failed"
            except KeyboardInterrupt:
                stopped = "interrupted"
            except Terminated:
                stopped = "terminated"
            finally:
                progress.close()
        computed += partial  # the prompt a stop cut short
        store.flush()  # what was handed to the store is on disk (or failed) before it is counted
        seconds = time.perf_counter() - start
        stats = store.stats()
        if stopped is None and stats["write_errors"] > at_start["write_errors"]:
            stopped = "write_failed"
        # What the store holds of each prompt now: one token more is asked for, since a
        # lookup keeps one back from a whole prompt (for its logits).
        held = [min(store.peek(list(ids) + [ids[-1]]), len(ids)) for ids in order]
        for entry, tokens in zip(details, held):  # the prompts done, in order
            entry["stored"] = tokens
        stored = sum(held)
    summary = {
        "store": store.path,
        "block_size": bs,
        "prompts": len(order),
        "prompts_done": len(details),
        "duplicates": len(inputs) - len(order),
        "tokens": total,
        "tokens_stored": stored,
        "tokens_restored": restored,
        "tokens_computed": computed,
        "blocks_written": stats["blocks_written"],
        "bytes_written": stats["bytes_written"],
        "blocks_reused": reused,
        "blocks_in_store_before": at_start["blocks"],
        "blocks_in_store": stats["blocks"],
        "bytes_on_disk": stats["bytes_on_disk"],
        "write_errors": stats["write_errors"],
        "stopped": stopped,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(computed / seconds, 1) if seconds > 0 else 0.0,
        "per_prompt": details,
    }
    if stats["remote"] is not None:
        summary.update({k: stats[k] for k in REMOTE_SUMMARY})
    emit(summary, args.json, _render)
    if stopped is not None:
        print(_stopped_line(summary), file=sys.stderr)
        return ENDINGS[stopped][1]
    return 0


def build_parser():
    """The argument parser of ``ppc precompute``."""
    parser = make_parser(
        "precompute",
        "Fill a store from prompts ahead of time, offline: text files, JSONL or stdin.",
    )
    parser.add_argument(
        "inputs",
        nargs="*",
        type=path_arg,
        metavar="INPUT",
        help="text file (one prompt), JSONL file ({'prompt': ...} or {'messages': [...]} "
        "per line), or '-' for stdin (default: stdin when piped)",
    )
    add_model_option(parser)
    add_store_option(parser)
    add_remote_option(parser)
    add_block_size_option(parser)
    parser.add_argument(
        "--format",
        choices=["auto", "text", "jsonl"],
        default="auto",
        help="how to read inputs (default: auto: JSONL for .jsonl/.ndjson files, and for "
        "stdin when its first line is a JSON prompt object; text otherwise)",
    )
    add_template_options(parser)
    add_prefill_option(parser, precompute=True)
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress line")
    add_json_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ppc precompute``.

    Args:
        argv: The arguments after ``precompute`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 on a user error, 1 if block writes failed.
    """
    args = build_parser().parse_args(argv)
    return run(lambda: _precompute(args))


if __name__ == "__main__":
    sys.exit(main())

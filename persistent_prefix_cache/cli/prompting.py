"""Private helpers shared by the commands that take prompts (``ppc precompute``,
``generate``, ``pull``, ``import-mlx``, ``export-mlx``).

They read a prompt from a file or stdin one way (`read_text`, `read_prompt_file`: UTF-8,
trailing newlines dropped as ``"$(cat file)"`` drops them), hold text from the command
line to the same rule (`check_text`), turn text into tokens the way mlx-lm's own tools do
(so that a prompt precomputed here and a prompt typed into ``ppc generate`` share their
token prefix), open the store with checks that turn a mismatched store into a clear
message, and count what the store restored and wrote during a `prefill`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Iterator, Sequence

from ..disk.store_dir import check_location, require_writable
from .common import UserError, add_disk_budget_option, add_store_shared_option, open_store, store_path
from .output import short_fingerprint

# Tokens per forward pass for models whose every layer is sliceable (mlx-lm's default).
DEFAULT_PREFILL_STEP_SIZE = 2048


# -- options ------------------------------------------------------------------------------


def add_block_size_option(parser: argparse.ArgumentParser) -> None:
    """``--block-size N``: tokens per block of a new store (an existing store keeps its own);
    with ``--store-shared``, the other option of a new store."""
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block when the store is created (default: 64); "
        "an existing store must be given its own value or none",
    )
    add_store_shared_option(parser)
    add_disk_budget_option(parser)


def add_template_options(parser: argparse.ArgumentParser) -> None:
    """The chat-template options of ``mlx_lm.generate``."""
    parser.add_argument("--system-prompt", default=None, help="system prompt to be used for the chat template")
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    parser.add_argument(
        "--chat-template-config",
        default=None,
        help="additional keyword arguments for apply_chat_template, as a JSON object",
    )


def add_prefill_option(parser: argparse.ArgumentParser, *, precompute: bool = False) -> None:
    """``--prefill-step-size N``: tokens per forward pass while prefilling (for
    `precompute`, one block by default on models with recurrent or sliding-window layers:
    see `precompute_step`)."""
    where = (
        "one block for models with recurrent or sliding-window layers, so that a store built "
        "ahead of time resumes at every block boundary"
        if precompute
        else "models with recurrent or sliding-window layers resume only where a forward ended: "
        "theirs end on block boundaries, as often as the model's measured cost per call allows"
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=None,
        help=f"most prompt tokens per forward pass (default: {DEFAULT_PREFILL_STEP_SIZE}, as mlx_lm; {where})",
    )


def precompute_step(store: Any, requested: int | None) -> int | None:
    """The forward size `precompute` gives `prefill`: what was asked for, else one block
    for a model with recurrent or sliding-window layers (a store built ahead of time is
    worth a snapshot at every block boundary, where prompts sharing its start can resume),
    else `prefill`'s own default (None)."""
    from ..layers import all_sliced

    if requested is not None or all_sliced(store.make_cache()):
        return requested
    return store.block_size


def template_kwargs(args: argparse.Namespace) -> dict:
    """The parsed ``--chat-template-config``.

    Raises:
        UserError: If it is not a JSON object.
    """
    if args.chat_template_config is None:
        return {}
    try:
        value = json.loads(args.chat_template_config)
    except json.JSONDecodeError as exc:
        raise UserError(f"--chat-template-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UserError("--chat-template-config must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def check_positive(name: str, value: int | None) -> None:
    """Raise a `UserError` unless `value` is None or at least 1."""
    if value is not None and value < 1:
        raise UserError(f"{name} must be at least 1, got {value}")


# -- reading prompts ----------------------------------------------------------------------

STDIN = "-"
_ICONV = "convert it first, e.g. with iconv -t UTF-8"


def decode_text(data: bytes, where: str) -> str:
    """Bytes as text, by the one rule every prompt is read with: UTF-8, strictly (nothing
    is dropped or replaced, a byte-order mark included: it is what ``"$(cat file)"`` gives).

    Args:
        data: The bytes of a file, of stdin, or of a command-line argument.
        where: Names the input in the message (a file, ``<stdin>``, ``--prompt``).

    Raises:
        UserError: ``<where>: not UTF-8 text (bad byte at offset N)``, if they are not.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: not UTF-8 text (bad byte at offset {exc.start}); {_ICONV}") from None


def check_text(text: str, where: str, *, argument: bool = True) -> str:
    """`text` if it is text the tokenizer can take, held to `decode_text`'s rule.

    Python hands a command-line argument that is not UTF-8 over with its bad bytes
    escaped as lone surrogates; a JSON string can spell a lone surrogate (``"\\udc80"``).
    Neither encodes as UTF-8, and the tokenizer would fail with a traceback.

    Args:
        text: An argument's value, or a string parsed from JSON.
        where: Names it in the message.
        argument: `text` came from the command line, so a surrogate stands for a byte
            (the message gives its offset, as for a file); False for a JSON string.

    Returns:
        `text`, unchanged.

    Raises:
        UserError: If it holds a lone surrogate (for an argument: the byte offset, as
            for a file).
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as exc:
        bad = exc.start
    if argument:  # its bytes, as the file or pipe they came from would hold them
        try:
            decode_text(text.encode("utf-8", "surrogateescape"), where)
        except UnicodeEncodeError:
            pass
    raise UserError(f"{where}: not valid text (a lone surrogate {text[bad]!a} at character {bad}); {_ICONV}")


def check_text_options(args: argparse.Namespace, *names: str) -> None:
    """`check_text` for each text option of `args` in `names` that was given
    (``prompt`` is ``--prompt``), before the model loads: a bad byte fails at once."""
    for name in names:
        value = getattr(args, name, None)
        for text in [value] if isinstance(value, str) else value if isinstance(value, (list, tuple)) else ():
            check_text(text, "--" + name.replace("_", "-"))


def read_text(path: str, where: str | None = None) -> str:
    """The whole text of a file, or of stdin for ``-``, decoded by `decode_text`.

    Args:
        path: A file, or ``-``.
        where: Names it in messages (default: the path, or ``<stdin>``).

    Raises:
        UserError: If the file is missing, a folder or unreadable, or the text is not UTF-8.
    """
    if where is None:
        where = "<stdin>" if path == STDIN else path
    try:
        if path == STDIN:
            data = sys.stdin.buffer.read() if sys.stdin is not None else b""
        else:
            with open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise UserError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{where}: is a directory; give a file") from None
    except PermissionError:
        raise UserError(f"{where}: permission denied; check the file's permissions") from None
    return decode_text(data, where)


def prompt_of(text: str, where: str) -> str:
    """A prompt read from a file or stdin, as ``"$(cat file)"`` passes it: trailing
    newlines dropped (``\\n`` only: a ``\\r`` before them stays, as the shell keeps it).

    Raises:
        UserError: If nothing but white space is left.
    """
    text = text.rstrip("\n")
    if not text.strip():
        raise UserError(f"{where}: empty; give the prompt's text")
    return text


def read_prompt_file(path: str, where: str | None = None) -> str:
    """`read_text`, then `prompt_of`: what every command's ``--prompt-file`` and
    ``--prompt -`` read, so that ``--prompt-file F`` equals ``--prompt "$(cat F)"``."""
    if where is None:
        where = "<stdin>" if path == STDIN else path
    return prompt_of(read_text(path, where), where)


# -- prompts to tokens --------------------------------------------------------------------


def uses_chat_template(tokenizer: Any, args: argparse.Namespace) -> bool:
    """Whether prompts go through the chat template (as in ``mlx_lm.generate``)."""
    return not args.ignore_chat_template and bool(getattr(tokenizer, "has_chat_template", False))


def render_chat(
    tokenizer: Any,
    messages: list,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict,
    where: str,
) -> list[int]:
    """Apply the chat template to `messages` and tokenize the text as mlx-lm does.

    Args:
        tokenizer: The mlx-lm tokenizer wrapper.
        messages: Chat messages (dicts with ``role`` and ``content``).
        add_generation_prompt: Append the assistant header (a prompt to answer).
        continue_final_message: Leave the last message open (a prefix to extend).
        kwargs: Extra keyword arguments for ``apply_chat_template``.
        where: Names the input in error messages.

    Returns:
        The token ids.

    Raises:
        UserError: If the template cannot render the messages.
    """
    for text in _strings(messages):  # arguments were checked as such, before the model loaded
        check_text(text, where, argument=False)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # jinja and transformers raise many kinds; all mean "bad input"
        raise UserError(f"{where}: the chat template cannot render it: {exc}") from None
    # The template already wrote any special tokens: do not let the tokenizer add a BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))


def _strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value (a chat's messages: contents, roles, parts);
    iterative, so a value nested as deep as the parser allows is walked too."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def encode_raw(tokenizer: Any, text: str, where: str = "the prompt") -> list[int]:
    """Tokenize text without a chat template (the tokenizer adds its BOS, as mlx-lm does).

    Raises:
        UserError: If `text` is not valid text (`check_text`).
    """
    return list(tokenizer.encode(check_text(text, where, argument=False)))


# -- the store ----------------------------------------------------------------------------


def check_store_path(args: argparse.Namespace, *, walk: bool = True) -> str:
    """The ``--store`` path, if it is a store or a place where one can be made.

    Called before the model loads, so a wrong path fails at once (and, with `walk`, a
    damaged index: see `common.store_path`).

    Raises:
        UserError: If no store was given.
        StorePathError: If the path is a file, or a folder with other files in it (a
            store is never created among unrelated files).
        StoreNotWritableError: If there is no store and none can be created there.
    """
    path = store_path(args, walk=walk)
    check_location(path, what="--store")  # the library's rule: one line, exit 2
    return path


def open_checked_store(args: argparse.Namespace, model: Any, local_path: str | None, *, need_write: bool, **kwargs):
    """Open ``--store`` for `model`, refusing a store that cannot be meant for it.

    A store directory may hold several models. What is refused: a folder that is not
    a store but already has files in it, a ``--block-size`` other than the store's,
    and a store that holds this very model only under another KV layout (a
    ``--kv-bits``/``--kv-group-size`` that differs from the one it was filled with).
    A store that holds only other models opens, with a note on stderr; so does a store
    this process cannot write to, unless `need_write`.

    Args:
        args: Parsed options (``--store``, ``--block-size``, ``--namespace``, ``--kv-bits``...).
        model: The loaded model.
        local_path: The model folder, so the fingerprint is remembered by the store.
        need_write: Refuse a store this process cannot write to (else it serves hits only).
        kwargs: More keyword arguments for `PersistentPrefixCache`.

    Returns:
        The open `PersistentPrefixCache`.

    Raises:
        UserError: If the store does not fit the options (see above).
    """
    path = check_store_path(args, walk=False)  # walked before the model loaded
    exists = os.path.isdir(os.path.join(path, "index"))
    # An existing store keeps its block size: compare rather than pass it, so the
    # message can name the option the user typed.
    block_size = None if exists else getattr(args, "block_size", None)
    with warnings.catch_warnings(record=True) as caught:
        # The store warns (e.g. "not writable: serving hits only"); say it as one line.
        warnings.simplefilter("always")
        store = open_store(args, model, local_path, block_size=block_size, **kwargs)
    notes: list[str | None] = [str(w.message) for w in caught]
    try:
        if need_write and store.readonly:
            # Say why (a read-only file system, another user's files), in one line.
            require_writable(store.path, hint="give a store directory you can write to, or fix its permissions")
            raise UserError(f"store {store.path} is not writable; give a store directory you can write to")
        wanted = getattr(args, "block_size", None)
        if wanted is not None and wanted != store.block_size:
            raise UserError(
                f"store {store.path} uses --block-size {store.block_size}, not {wanted}: "
                "omit --block-size, or use another store directory"
            )
        notes.append(_check_models(store))
    except BaseException:
        store.close()
        raise
    for note in filter(None, notes):
        print(f"note: {note}", file=sys.stderr)
    return store


def _kv_options(signature: str) -> str:
    """The ``--kv-bits`` options a layout signature was made with, for messages."""
    from ..layers import kv_quantization

    quantized = kv_quantization(signature)
    if quantized:
        return f"--kv-bits {quantized[0]} --kv-group-size {quantized[1]}"
    return "no --kv-bits"


# What a derived fingerprint's words stand for (`ppc generate` makes them; `ppc serve` too).
_VARIANTS = {"quantize-activations": "--quantize-activations", "with-draft": "a --draft-model"}


def _variant(fingerprint: Any) -> tuple[str, frozenset[str]]:
    """(the model's own fingerprint, the options it was derived for) of a stored fingerprint:
    ``quantize-activations:<fp>`` is the model of ``<fp>`` with ``-qa``."""
    parts = str(fingerprint).split(":")
    words = frozenset(p for p in parts if p in _VARIANTS)
    return next((p for p in parts if p not in _VARIANTS), ""), words


def _folder(name: Any) -> str | None:
    """The model folder (or hub id) a stored name starts with (``<folder> + adapter ...``)."""
    return name.split(" + ", 1)[0] if isinstance(name, str) and name else None


def _check_models(store: Any) -> str | None:
    """Compare the models stored with the one opened; raise on a KV-layout mismatch.

    Returns:
        A note for stderr when the store holds nothing of this model, else None.
    """
    stored = store.stored_models()
    ours = store.this_model()["root"]
    if any(d["root"] == ours for d in stored):
        return None  # this model, layout and namespace already have blocks
    others = [d for d in stored if d["root"] != ours]
    if not others:
        return None
    layout = store.this_model()["layout"]
    same_model = [d for d in others if d.get("fingerprint") == store.fingerprint]
    for desc in same_model:
        if desc.get("namespace") == store.namespace and desc.get("layout") != layout:
            their_kv, my_kv = _kv_options(desc.get("layout", "")), _kv_options(layout)
            if their_kv == my_kv:
                their_kv, my_kv = desc.get("layout"), layout
            raise UserError(
                f"store {store.path} holds this model's KV made with {their_kv}, but this run "
                f"asks for {my_kv}: pass the same options it was filled with, "
                "or use another store directory"
            )
    if same_model:
        spaces = sorted({repr(d.get("namespace", "")) for d in same_model})
        return (
            f"store {store.path} holds this model only under --namespace "
            f"{', '.join(spaces)} (this run: {store.namespace!r}); nothing will be restored"
        )
    # This model (its own fingerprint, or its folder) under options that change the KV:
    # not another model, and the note says which option differs.
    base, mine = _variant(store.fingerprint)
    folder = _folder(store.model_name)
    variants = [
        _variant(d.get("fingerprint"))[1] for d in others
        if _variant(d.get("fingerprint"))[0] == base or (folder and _folder(d.get("name")) == folder)
    ]  # fmt: skip
    differing = [theirs for theirs in variants if theirs != mine]
    if differing:
        differ = sorted({o for theirs in differing for o in theirs ^ mine})

        def made(options: frozenset[str]) -> str:  # the options that differ, with or without
            return " and ".join(("with " if o in options else "without ") + _VARIANTS[o] for o in differ)

        return (
            f"store {store.path} holds this model's KV only as made {'; or '.join(sorted(set(map(made, differing))))}; "
            f"this run is {made(mine)}, which changes the KV (the store keeps them apart): nothing will be restored"
        )
    if variants:  # the same options, another fingerprint: the folder's weights changed, or another draft
        what = "another --draft-model" if "with-draft" in mine else "other weights"
        return f"store {store.path} holds KV of {folder or 'this model'} only with {what}; nothing will be restored"
    names = sorted({d.get("name") or f"fingerprint {short_fingerprint(d.get('fingerprint'))}" for d in others})
    return (
        f"store {store.path} holds KV of {len(others)} other model(s) ({', '.join(names)}) and none of "
        "--model; nothing will be restored (is --model the one the store was filled with?)"
    )


@contextlib.contextmanager
def kv_quantization_errors(args: argparse.Namespace) -> Iterator[None]:
    """Turn MLX's refusal of a ``--kv-bits``/``--kv-group-size`` into a `UserError`.

    MLX only finds out that a group size does not divide the model's head dimension
    when it first quantizes a key, deep inside a forward pass.
    """
    try:
        yield
    except ValueError as exc:
        if getattr(args, "kv_bits", None) is not None and "quantiz" in str(exc).lower():
            raise UserError(
                f"--kv-bits {args.kv_bits} --kv-group-size {args.kv_group_size} does not fit "
                f"this model ({exc}); try --kv-group-size 32"
            ) from None
        raise


class CountingStore:
    """A stand-in for the store that `prefill` talks to, counting restored tokens and
    new blocks (prefill returns only the cache and logits).

    Args:
        store: The `PersistentPrefixCache` to forward to.
    """

    def __init__(self, store: Any):
        self._store = store
        self.block_size = store.block_size
        self.restored = 0
        self.new_blocks = 0
        self.tiers = {"ram": 0, "disk": 0, "remote": 0}
        self.fetch_seconds = 0.0  # spent restoring, every prompt's: no part of the compute rate

    def reset(self) -> None:
        """Zero the counters (before the next prompt)."""
        self.restored = 0
        self.new_blocks = 0
        self.tiers = {"ram": 0, "disk": 0, "remote": 0}

    def fetch(self, tokens: Any):
        """`PersistentPrefixCache.fetch`, remembering how many tokens it restored and
        which tier served its blocks (`tiers`: see `tier_report.blocks_by_tier`)."""
        from ..core.tier_report import blocks_by_tier

        started = time.perf_counter()
        before = self._store.stats()
        cache, remaining = self._store.fetch(tokens)
        self.restored = len(tokens) - len(remaining) if cache is not None else 0
        self.tiers = blocks_by_tier(before, self._store.stats())
        self.fetch_seconds += time.perf_counter() - started
        return cache, remaining

    def store(self, tokens: Any, cache: Sequence[Any]) -> int:
        """`PersistentPrefixCache.store`, adding up the new blocks."""
        new = self._store.store(tokens, cache)
        self.new_blocks += new
        return new

    def make_cache(self) -> list:
        """`PersistentPrefixCache.make_cache`."""
        return self._store.make_cache()

    def observe_prefill(self, tokens: int, seconds: float, **where: Any) -> None:
        """`PersistentPrefixCache.observe_prefill`."""
        self._store.observe_prefill(tokens, seconds, **where)

    def resumable_step(self) -> int | None:
        """`PersistentPrefixCache.resumable_step`."""
        return self._store.resumable_step()


def blocks_of(tokens: int, block_size: int) -> int:
    """How many blocks `tokens` positions touch."""
    return math.ceil(tokens / block_size)

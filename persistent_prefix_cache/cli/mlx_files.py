"""``ppc import-mlx``, ``ppc export-mlx`` and ``ppc generate --prompt-cache-file``: mlx-lm's prompt-cache files.

``mlx_lm.cache_prompt`` writes one file per prompt, without its tokens. ``import-mlx``
stores such a file's cache under the prompt's tokens (given again, tokenized as
cache_prompt does), after checking that the file is whole, of a layout we read (mlx-lm
0.31 or 0.32), as long as the prompt, that its layers fit the model, and that the model
computes the same KV for the prompt where some spans are computed again from the file's
own prefix (`layers.recompute`); a bad file is one ``error:`` line and the store is not touched. ``export-mlx`` writes the store's KV
of a prompt as a file the installed mlx-lm opens (``load_prompt_cache``,
``mlx_lm generate --prompt-cache-file``). ``ppc generate --prompt-cache-file`` does what
``mlx_lm generate --prompt-cache-file`` does, with files of either layout.
"""

from __future__ import annotations

import argparse
import json
import os

from .common import (
    UserError, add_json_option, add_model_option, add_store_option, load_model, make_parser, path_arg, positive_int,
    run, store_path,
)  # fmt: skip
from .output import emit
from .prompting import (
    STDIN, add_block_size_option, check_store_path, check_text, check_text_options, encode_raw, open_checked_store, prompt_of, read_text,
    render_chat,
)  # fmt: skip

# mlx_lm.generate's default for --quantized-kv-start (mlx_lm/generate.py), restated to keep --help light.
MLX_QUANTIZED_KV_START = 5000
MLX_PREFILL_STEP_SIZE = 2048


# -- prompts as mlx_lm.cache_prompt tokenizes them ------------------------------------------


def _add_prompt_options(parser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--prompt", help="the prompt given to mlx_lm.cache_prompt ('-' reads stdin, as --prompt-file does)"
    )
    group.add_argument("--prompt-file", type=path_arg,
                       help='a UTF-8 file holding that prompt, read as --prompt "$(cat FILE)" passes it')  # fmt: skip
    group.add_argument(
        "--tokens-file", type=path_arg, help="the token ids instead: a JSON list or whitespace-separated"
    )


def _token_file(path: str, vocab_size: int) -> list[int]:
    text = read_text(path, f"--tokens-file {path}").strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except (ValueError, RecursionError):
        raise UserError(f"--tokens-file {path}: not a JSON list or whitespace-separated integers") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UserError(f"--tokens-file {path}: holds no token ids (a list of integers)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(
            f"--tokens-file {path}: token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})"
        )
    return ids


def _prompt_text(args) -> tuple[str, str, str | None]:
    """(the prompt, where it came from, the text as read where that differs: a file's or
    stdin's before its trailing newlines were dropped)."""
    if args.prompt_file is not None:
        where = f"--prompt-file {args.prompt_file}"
        raw = read_text(args.prompt_file, where)
    elif args.prompt == STDIN:
        where = "--prompt - (stdin)"
        raw = read_text(STDIN, where)
    else:
        if not args.prompt:
            raise UserError("--prompt is empty")
        return check_text(args.prompt, "--prompt"), "--prompt", None
    text = prompt_of(raw, where)
    return text, where, (raw if raw != text else None)


def _tokens_of(text: str, where: str, tokenizer) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": text}]
        ids = render_chat(tokenizer, messages, add_generation_prompt=False, continue_final_message=True,
                          kwargs={}, where=where)  # fmt: skip
    else:
        ids = encode_raw(tokenizer, text, where)
    if not ids:
        raise UserError(f"{where} has no tokens")
    return ids


def cache_prompt_tokens(args, tokenizer, vocab_size: int, *, length: int | None = None) -> list[int]:
    """The tokens ``mlx_lm.cache_prompt`` feeds for the prompt of `args`.

    cache_prompt takes the prompt as it is (no ``\\n`` unescaping); with a chat template
    it renders one user message left open (no generation prompt,
    ``continue_final_message``), else it encodes the text with the tokenizer's BOS.
    ``--prompt-file F`` and ``--prompt -`` are read as every command reads a prompt file:
    as ``--prompt "$(cat F)"`` passes it, trailing newlines dropped.

    Args:
        args: The parsed options (``--prompt``, ``--prompt-file``, ``--tokens-file``).
        tokenizer: The model's tokenizer.
        vocab_size: The model's vocabulary (bounds ``--tokens-file``'s ids).
        length: The file's recorded length, on import: where the prompt without its
            trailing newlines does not have that length but the text as read does (a
            file made with ``cache_prompt --prompt - < F``, which keeps them), the text
            as read is the prompt (the recompute then checks it like any other).

    Raises:
        UserError: If the prompt is empty, unreadable, or the template cannot render it.
    """
    if args.tokens_file is not None:
        return _token_file(args.tokens_file, vocab_size)
    text, where, as_read = _prompt_text(args)
    ids = _tokens_of(text, where, tokenizer)
    if length is not None and len(ids) != length and as_read is not None:
        whole = _tokens_of(as_read, where, tokenizer)
        if len(whole) == length:
            return whole
    return ids


def _vocab_size(model) -> int:
    # Where the model says it (most do, as args.vocab_size); else any id the tokenizer gave.
    return int(getattr(getattr(model, "args", None), "vocab_size", None) or 1 << 31)


def _same_model(recorded: str | None, given: str) -> bool:
    if not recorded or recorded == given:
        return True
    both_folders = os.path.isdir(recorded) and os.path.isdir(given)
    return both_folders and os.path.realpath(recorded) == os.path.realpath(given)


def _check_recorded_model(file, given: str, path: str, allow: bool) -> None:
    recorded = file.metadata.get("model")
    if allow or _same_model(recorded, given):
        return
    from ..errors import PromptCacheFileError

    raise PromptCacheFileError(
        f"{path} was written for model {recorded!r}, not {given!r}",
        hint="pass that --model, or --ignore-recorded-model if it is the same model moved (its KV is still "
        "checked against the model); nothing was written",
    )


# -- import-mlx --------------------------------------------------------------------------------


def _fit(file, model, path: str, args) -> list:
    """Check that the file's layers are what `model` builds (classes, heads, head dims, dtypes);
    sets ``args.kv_bits``/``kv_group_size`` from a quantized file. Returns the model's template."""
    import mlx.core as mx

    from ..errors import PromptCacheFileError
    from ..layers import kv_quantization, model_cache, signature_of, template_cache
    from ..layers.mlx_files import shapes_and_dtypes

    theirs = signature_of(file.cache)
    quant = kv_quantization(theirs)
    if quant is not None:
        bits, group = quant
        if args.kv_bits is not None and (args.kv_bits, args.kv_group_size) != (bits, group):
            raise UserError(f"{path} holds KV quantized to {bits} bits in groups of {group}, not --kv-bits "
                            f"{args.kv_bits} --kv-group-size {args.kv_group_size}: omit them")  # fmt: skip
        args.kv_bits, args.kv_group_size = bits, group
    elif args.kv_bits is not None:
        raise UserError(f"{path} holds KV that is not quantized: omit --kv-bits")
    template = template_cache(model, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    ours = signature_of(template)
    sizes = [getattr(layer, "max_size", None) for layer in file.cache]
    if theirs != ours and sizes[0] and theirs == signature_of(model_cache(model, max_kv_size=sizes[0])):
        raise PromptCacheFileError(
            f"{path} was written with --max-kv-size (rotating layers where this model has full ones)",
            hint="ppc import-mlx stores the model's own layout only; write the file without --max-kv-size",
        )
    if theirs != ours:
        raise PromptCacheFileError(f"{path}: its layers ({_short(theirs)}) are not the ones this model builds "
                                   f"({_short(ours)}): another model's file")  # fmt: skip
    model(mx.array([[0]]), cache=template)  # one token: the shapes and dtypes the model's layers hold
    want, got = shapes_and_dtypes(template), shapes_and_dtypes(file.cache)
    for leaf, spec in want.items():
        if got.get(leaf) != spec:
            raise PromptCacheFileError(f"{path}: layer {leaf} holds {got.get(leaf)}, this model's holds {spec} "
                                       "(class, per tensor: shape without the sequence axis, dtype): another model's file")  # fmt: skip
    return template


def _short(signature: str) -> str:
    parts = signature.split("|")
    return signature if len(parts) <= 3 else f"{len(parts)} layers: {'|'.join(parts[:2])}|..."


def _import(args) -> int:
    from ..errors import InvalidArgumentError, PromptCacheFileError
    from ..layers import cache_length
    from ..layers.mlx_files import read_prompt_cache

    check_text_options(args, "prompt")
    file = read_prompt_cache(args.file)  # a bad file fails here, before anything loads or opens
    try:
        length = cache_length(file.cache)
    except InvalidArgumentError as exc:
        raise PromptCacheFileError(f"{args.file}: {exc.message}") from None
    check_store_path(args)
    _check_recorded_model(file, args.model, args.file, args.ignore_recorded_model)
    model, tokenizer, local_path = load_model(args.model)
    tokens = cache_prompt_tokens(args, tokenizer, _vocab_size(model), length=length)
    if length is not None and length != len(tokens):
        raise PromptCacheFileError(
            f"{args.file} holds the KV of {length} tokens, the prompt has {len(tokens)}: not this prompt's file",
            hint="give the prompt exactly as mlx_lm.cache_prompt got it (or --tokens-file); nothing was written",
        )
    _fit(file, model, args.file, args)
    checked = _recompute(file, model, tokens, args)
    with open_checked_store(args, model, local_path, need_write=True) as store:
        added = store.store(tokens, file.cache)
        store.flush()
        stats = store.stats()
    result = {
        "file": args.file, "layout": f"mlx-lm {file.layout}", "tokens": len(tokens), "new_blocks": added,
        "blocks_in_store": stats["blocks"], "bytes_on_disk": stats["bytes_on_disk"], "store": store.path,
        "checked": {"spans": checked.spans, "full_recompute": checked.full, "difference": checked.error,
                    "tolerance": checked.tolerance},
    }  # fmt: skip
    emit(result, args.json, lambda r: (
        f"imported {r['file']} ({r['layout']} layout): {r['tokens']:,} tokens, "
        f"{r['new_blocks']:,} new block(s); the store holds {r['bytes_on_disk']:,} bytes\n"
        f"checked against the model: {checked.describe()}"
    ))  # fmt: skip
    return 0


def _recompute(file, model, tokens: list[int], args):
    """Compute spans of the prompt again from the file's own prefix (`layers.recompute`):
    another prompt's or another model's KV differs there. Returns the `CacheCheck`.

    Raises:
        PromptCacheFileError: If the KV differs from the model's beyond the tolerance.
    """
    from ..errors import PromptCacheFileError
    from ..layers.recompute import check_cache

    checked = check_cache(model, tokens, file.cache, block_size=args.block_size or 64, spans=args.check_spans)
    if not checked.passed:
        raise PromptCacheFileError(
            f"{args.file} is not this model's KV of this prompt: computed again from the file's own prefix, "
            f"{checked.where} differs by {checked.error:.2g} (the right prompt and model stay within "
            f"{checked.tolerance:g})",
            hint="give the prompt exactly as mlx_lm.cache_prompt got it (or --tokens-file) and the model it was "
            "written with; nothing was written",
        )
    return checked


def import_main(argv: list[str]) -> int:
    """Entry point of ``ppc import-mlx FILE --store DIR --model M (--prompt | --prompt-file | --tokens-file)``.

    Returns:
        The exit code: 0 on success, 2 on a user error (nothing written).
    """
    parser = make_parser("import-mlx", "Store the cache of an mlx_lm.cache_prompt file under its prompt's tokens.")
    parser.add_argument("file", type=path_arg, help="a file written by mlx_lm.cache_prompt (mlx-lm 0.31 or 0.32)")
    add_model_option(parser)
    add_store_option(parser)
    add_block_size_option(parser)
    _add_prompt_options(parser)
    parser.add_argument("--ignore-recorded-model", action="store_true",
                        help="accept a file whose recorded model differs from --model (a moved folder)")  # fmt: skip
    parser.add_argument("--check-spans", type=positive_int, default=4, metavar="N",
                        help="spans of the prompt computed again and compared with the file (default: 4: the first "
                        "block, the last, two between); a model whose layers cannot be cut back computes it all")  # fmt: skip
    # Once needed for recurrent-only files (they record no length); the recompute checks them now.
    parser.add_argument("--unchecked-length", action="store_true", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args(argv)
    return run(lambda: _import(args))


# -- export-mlx --------------------------------------------------------------------------------


def _stored_cache(store, model, tokens: list[int], stored_only: bool):
    """(cache covering all `tokens`, tokens restored from the store)."""
    from ..layers import cache_length, can_trim, trim
    from ..prefill import prefill

    # One token more than the prompt: `fetch` keeps one token back from a full hit (for
    # the logits), and the token after the prompt is never fed, so any id serves.
    cache, remaining = store.fetch(tokens + [tokens[-1]])
    restored = len(tokens) + 1 - len(remaining) if cache is not None else 0
    if restored > len(tokens):  # a longer stored prompt went on with that very id
        if can_trim(cache):
            trim(cache, restored - len(tokens))
            restored = len(tokens)
        else:
            cache, restored = None, 0
    if restored == len(tokens) and cache_length(cache) in (None, len(tokens)):
        return cache, restored
    if stored_only:
        raise UserError(f"the store holds {restored:,} of the prompt's {len(tokens):,} tokens "
                        "(omit --stored-only to compute the rest)")  # fmt: skip
    cache, _ = prefill(model, tokens, store)
    store.store(tokens, cache)  # prefill stores up to the last token; the file covers that one too
    return cache, restored


def _export(args) -> int:
    from ..layers.mlx_files import write_prompt_cache

    check_text_options(args, "prompt")
    if not args.out.endswith(".safetensors"):
        raise UserError(f"{args.out}: the name must end in .safetensors (mlx-lm's loader picks the format by it)")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        raise UserError(f"{args.out}: no folder {folder}")
    store_path(args, must_exist=True)
    model, tokenizer, local_path = load_model(args.model)
    tokens = cache_prompt_tokens(args, tokenizer, _vocab_size(model))
    with open_checked_store(args, model, local_path, need_write=False) as store:
        cache, restored = _stored_cache(store, model, tokens, args.stored_only)
        store.flush()
    # What mlx_lm.cache_prompt records: mlx_lm generate compares "model" with its --model.
    metadata = {"model": args.model, "tokenizer_config": json.dumps({"trust_remote_code": False})}
    size = write_prompt_cache(args.out, cache, metadata)
    import mlx_lm

    result = {
        "file": args.out, "tokens": len(tokens), "restored_tokens": restored,
        "computed_tokens": len(tokens) - restored, "bytes": size, "mlx_lm": mlx_lm.__version__,
    }  # fmt: skip
    emit(result, args.json, lambda r: (
        f"wrote {r['file']}: {r['tokens']:,} tokens ({r['restored_tokens']:,} from the store, "
        f"{r['computed_tokens']:,} computed), {r['bytes']:,} bytes, for mlx-lm {r['mlx_lm']}"
    ))  # fmt: skip
    return 0


def export_main(argv: list[str]) -> int:
    """Entry point of ``ppc export-mlx OUT --store DIR --model M (--prompt | --prompt-file | --tokens-file)``.

    Returns:
        The exit code: 0 on success, 2 on a user error.
    """
    parser = make_parser("export-mlx", "Write the stored KV of a prompt as an mlx-lm prompt-cache file.")
    parser.add_argument("out", type=path_arg, help="the file to write (NAME.safetensors)")
    add_model_option(parser)
    add_store_option(parser)
    _add_prompt_options(parser)
    parser.add_argument("--stored-only", action="store_true",
                        help="fail unless the store holds the whole prompt (default: compute the rest and store it)")  # fmt: skip
    add_json_option(parser)
    args = parser.parse_args(argv)
    return run(lambda: _export(args))


# -- ppc generate --prompt-cache-file --------------------------------------------------------


def suffix_tokens(prompt: str, tokenizer, args) -> list[int]:
    """The tokens mlx_lm.generate feeds after a prompt-cache file's: with a chat template,
    the rendered conversation from the user's message on (the file holds what came
    before it), encoded without special tokens; without one, the prompt with its BOS."""
    from .prompting import template_kwargs, uses_chat_template

    use_template = uses_chat_template(tokenizer, args)
    if use_template:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        options = dict(tokenize=False, continue_final_message=has_prefill, add_generation_prompt=not has_prefill)
        try:
            text = tokenizer.apply_chat_template(messages, **options, **template_kwargs(args))
            messages[-1]["content"] = "<query>"
            probe = tokenizer.apply_chat_template(messages, **options)
        except Exception as exc:  # jinja and transformers raise many kinds; all mean "bad input"
            raise UserError(f"--prompt: the chat template cannot render it: {exc}") from None
        prompt = text[probe.index("<query>") :]
    return list(tokenizer.encode(prompt, add_special_tokens=not use_template))


def generate_from_file(args, prompt: str) -> int:
    """``ppc generate --prompt-cache-file FILE``: mlx_lm generate's run with that file.

    The model must be the one the file records (or the same folder); the prompt given is
    appended to the cached one; KV quantization must match the file's. The store is not
    used. Output is mlx_lm.generate's own.

    Raises:
        PromptCacheFileError: If the file cannot be read or is not this model's.
        UserError: If the options contradict the file.
    """
    import mlx.core as mx

    from ..layers import kv_quantization, signature_of
    from ..layers.mlx_files import read_prompt_cache

    if args.image:
        raise UserError(
            "--image is not supported with --prompt-cache-file: use mlx_lm generate for prompts with images"
        )
    file = read_prompt_cache(args.prompt_cache_file)
    quant = kv_quantization(signature_of(file.cache[:1]))
    if quant is not None:  # mlx_lm generate's checks, on its first layer
        if args.kv_bits is not None and args.kv_bits != quant[0]:
            raise UserError("--kv-bits does not match the kv cache loaded from --prompt-cache-file")
        if args.kv_group_size != quant[1]:
            raise UserError("--kv-group-size does not match the kv cache loaded from --prompt-cache-file")
    _check_recorded_model(file, args.model, args.prompt_cache_file, False)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer, _ = load_model(
        args.model, adapter_path=args.adapter_path, trust_remote_code=args.trust_remote_code
    )
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    ids = suffix_tokens(prompt, tokenizer, args)
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler

    draft = load_model(args.draft_model, what="--draft-model")[0] if args.draft_model is not None else None
    sampler = make_sampler(
        args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k,
        xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )  # fmt: skip
    verbose = args.verbose and not args.quiet and not args.json
    text = generate(
        model, tokenizer, ids, max_tokens=args.max_tokens, verbose=verbose, sampler=sampler,
        max_kv_size=args.max_kv_size, prefill_step_size=args.prefill_step_size or MLX_PREFILL_STEP_SIZE,
        prompt_cache=file.cache, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
        quantized_kv_start=MLX_QUANTIZED_KV_START if args.quantized_kv_start is None else args.quantized_kv_start,
        draft_model=draft, num_draft_tokens=args.num_draft_tokens,
    )  # fmt: skip
    if args.json:
        emit({"text": text, "prompt_tokens": len(ids), "prompt_cache_file": args.prompt_cache_file,
              "layout": f"mlx-lm {file.layout}"}, True, str)  # fmt: skip
    elif not verbose:
        print(text)
    return 0

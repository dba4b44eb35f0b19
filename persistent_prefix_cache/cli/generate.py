"""``ppc generate``: generate text with a warm start from the store.

The options follow ``mlx_lm.generate``. The prompt is built the same way (chat
template, system prompt, ``--prompt -`` for stdin); the longest stored prefix of its
tokens is restored instead of computed, the rest is prefilled (and stored as it goes),
and the text is printed as it is generated. Afterwards the prompt and the generated
tokens that the cache covers are stored, so the next turn of a conversation starts
warm too. Standard output is mlx_lm.generate's: the text between two ``==========``
lines, then its summary lines (prompt and generation tokens per second, peak memory);
how many prompt tokens came from the store and the time to first token go to stderr
(or into ``--json``). ``--seed`` seeds before the model is loaded, as mlx-lm does, so
the same flags sample the same text.

mlx_lm.generate's model options work as there: ``--adapter-path`` (the adapted weights
are hashed for the store's fingerprint: an adapter changes the KV without changing the
model folder), ``--trust-remote-code``, ``--max-kv-size`` (mlx-lm's rotating cache;
its layout is part of the store's key, so such KV is stored and restored apart from
the full cache's), ``--draft-model``/``--num-draft-tokens`` (speculative decoding: the
store holds the model's and the draft's layers together, as ``ppc serve`` does) and
``--verbose``.
"""

from __future__ import annotations

import argparse
import sys
import time

from .common import (
    UserError,
    path_arg,
    add_json_option,
    add_model_option,
    add_remote_option,
    add_store_option,
    load_model,
    make_parser,
    run,
)
from .output import emit, table
from .prompting import (
    STDIN,
    CountingStore,
    add_block_size_option,
    add_prefill_option,
    add_template_options,
    check_positive,
    check_store_path,
    check_text,
    check_text_options,
    encode_raw,
    kv_quantization_errors,
    open_checked_store,
    read_prompt_file,
    render_chat,
    template_kwargs,
    uses_chat_template,
)

# mlx_lm.generate's defaults (mlx_lm/generate.py), restated to keep --help free of MLX imports.
DEFAULT_MAX_TOKENS = 100
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
DEFAULT_TOP_K = 0


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text of ``--prompt`` or ``--prompt-file``.

    ``--prompt`` is read as ``mlx_lm.generate`` reads it: escaped ``\\n``/``\\t`` become
    newlines and tabs. ``--prompt -`` (stdin) and ``--prompt-file F`` are read as every
    command reads a prompt file (`prompting.read_prompt_file`: UTF-8, trailing newlines
    dropped as ``"$(cat F)"`` drops them).

    Raises:
        UserError: If the prompt is not UTF-8 text, cannot be read, or is empty.
    """
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file, f"--prompt-file {args.prompt_file}")
    prompt = check_text(args.prompt, "--prompt").replace("\\n", "\n").replace("\\t", "\t")
    if prompt == STDIN:
        return read_prompt_file(STDIN, "--prompt - (stdin)")
    if not prompt.strip():
        raise UserError("--prompt is empty; give the text to answer")
    return prompt


def prompt_tokens(prompt: str, tokenizer, args) -> list[int]:
    """Tokens of the prompt, built exactly as ``mlx_lm.generate`` builds them.

    Raises:
        UserError: If the chat template cannot render it, or it has no tokens.
    """
    if uses_chat_template(tokenizer, args):
        messages = []
        if args.system_prompt is not None:
            messages.append({"role": "system", "content": args.system_prompt})
        messages.append({"role": "user", "content": prompt})
        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        ids = render_chat(
            tokenizer,
            messages,
            add_generation_prompt=not has_prefill,
            continue_final_message=has_prefill,
            kwargs=template_kwargs(args),
            where="--prompt",
        )
    else:
        ids = encode_raw(tokenizer, prompt, "--prompt")
    if not ids:
        raise UserError("--prompt has no tokens")
    return ids


class StoreModel:
    """The model as the store sees it with ``--max-kv-size`` or ``--draft-model``.

    Its cache is what mlx-lm's generator uses then: rotating layers of
    ``--max-kv-size``, and the draft model's layers after the model's (the split
    ``speculative_generate_step`` makes at ``len(model.layers)``). Calling it runs both
    models on their parts of the cache and returns the model's logits, so `prefill`
    fills both and the store keeps them together.
    """

    def __init__(self, model, draft=None, max_kv_size: int | None = None):
        self.model, self.draft, self.max_kv_size = model, draft, max_kv_size

    def make_cache(self) -> list:
        from ..layers import model_cache

        cache = model_cache(self.model, max_kv_size=self.max_kv_size)
        return cache + (model_cache(self.draft) if self.draft is not None else [])

    def __call__(self, inputs, cache=None):
        n = len(self.model.layers)
        out = self.model(inputs, cache=cache[:n])
        if self.draft is not None:
            self.draft(inputs, cache=cache[n:])
        return out


def _check_model_options(args) -> None:
    """Refuse the combinations that cannot work with a restored cache, in one sentence."""
    check_positive("--max-kv-size", args.max_kv_size)
    check_positive("--num-draft-tokens", args.num_draft_tokens)
    if args.max_kv_size is not None and args.draft_model is not None:
        raise UserError(
            "--max-kv-size cannot be combined with --draft-model: speculative decoding "
            "trims the cache after rejected drafts, which a rotating cache cannot do once "
            "it wraps (mlx_lm.generate ignores --max-kv-size there)"
        )
    if args.max_kv_size is not None and args.kv_bits is not None:
        raise UserError("--max-kv-size cannot be combined with --kv-bits: mlx-lm does not quantize its rotating cache")
    if args.quantized_kv_start is not None and args.quantized_kv_start != 0:
        raise UserError(
            "--quantized-kv-start: only 0 is supported: the store keeps one layout per "
            "model, so with --kv-bits the KV is quantized from the first token "
            "(mlx_lm generate --quantized-kv-start 0 does the same)"
        )
    if args.image:
        raise UserError(
            "--image is not supported: the store holds text prompts' KV only; use "
            "mlx_lm generate for prompts with images"
        )


def _max_kv_size_applies(model, max_kv_size: int) -> bool:
    """Whether mlx-lm builds a different cache for `model` with `max_kv_size` (a model
    with its own ``make_cache``, llama's for one, ignores the size)."""
    from ..layers import model_cache, signature_of

    return signature_of(model_cache(model, max_kv_size=max_kv_size)) != signature_of(model_cache(model))


def _even(cache: list) -> list:
    """Trim every layer to the shortest one (after speculative decoding the model's and
    the draft's layers may end a token apart); the common prefix is a valid cache."""
    from ..layers import cache_length

    lengths = [cache_length([layer]) for layer in cache]
    known = [n for n in lengths if n is not None]
    if len(set(known)) > 1:
        shortest = min(known)
        for layer, n in zip(cache, lengths):
            if n is not None and n > shortest:
                layer.trim(n - shortest)
    return cache


def _summary(result: dict) -> str:
    """mlx_lm.generate's summary lines (its ``--verbose`` output, after the text's frame)."""
    return "\n".join(
        [
            f"Prompt: {result['prompt_tokens']} tokens, {result['prompt_tps']:.3f} tokens-per-sec",
            f"Generation: {result['generation_tokens']} tokens, {result['generation_tps']:.3f} tokens-per-sec",
            f"Peak memory: {result['peak_memory_gb']:.3f} GB",
        ]
    )


def _render(result: dict) -> str:
    from ..core.tier_report import describe_tiers

    rows = [
        ("prompt tokens", result["prompt_tokens"]),
        ("restored from the store", result["restored_tokens"]),
        ("served by", describe_tiers(result["restored_blocks"])),
        ("prompt tokens computed", result["prompt_tokens"] - result["restored_tokens"]),
        (
            "time to first token",
            f"{result['ttft_s']:.3f} s" if result["ttft_s"] is not None else "-",
        ),
        ("generated tokens", result["generation_tokens"]),
        ("generation tokens/s", round(result["generation_tps"])),
        ("new blocks stored", result["new_blocks"]),
        ("bytes on disk", result["bytes_on_disk"]),
    ]
    return table(rows)


def _generate(args) -> int:
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise UserError(f"--max-tokens must be at least 1 (or -1 for no limit), got {args.max_tokens}")
    check_positive("--block-size", args.block_size)
    check_positive("--prefill-step-size", args.prefill_step_size)
    # Text options held to the rule prompt files are read by, before anything loads.
    check_text_options(args, "system_prompt", "prefill_response", "chat_template_config", "extra_eos_token")
    template_kwargs(args)  # fail on a bad --chat-template-config before loading anything
    if args.prompt_cache_file is not None:  # mlx_lm generate's way: that file, not the store
        from .mlx_files import generate_from_file

        return generate_from_file(args, read_prompt(args))
    _check_model_options(args)
    check_store_path(args)
    prompt = read_prompt(args)
    if args.seed is not None:
        # Before loading, as mlx_lm.generate does: building the model draws from the
        # global PRNG, so the same seed then samples the same text as mlx-lm.
        import mlx.core as mx

        mx.random.seed(args.seed)
    model, tokenizer, local_path = load_model(
        args.model,
        adapter_path=args.adapter_path,
        trust_remote_code=args.trust_remote_code,
        model_config={"quantize_activations": True} if args.quantize_activations else None,
    )
    draft = None
    if args.draft_model is not None:
        draft, draft_tokenizer, _ = load_model(args.draft_model, what="--draft-model")
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise UserError("--draft-model: its tokenizer does not match the model's")

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..layers import cache_length
    from ..prefill import prefill

    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    ids = prompt_tokens(prompt, tokenizer, args)
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )

    from ..fingerprint import fingerprint_model
    from ..weights_hash import XXH3

    max_kv_size = args.max_kv_size
    if max_kv_size is not None and not _max_kv_size_applies(model, max_kv_size):
        # mlx-lm's make_prompt_cache defers to a model's own make_cache and drops the size.
        print(
            f"note: --max-kv-size has no effect on this model: it builds its own cache "
            f"({type(model).__module__.rsplit('.', 1)[-1]}), as in mlx_lm.generate",
            file=sys.stderr,
        )
        max_kv_size = None
    stored_model, options = model, {}
    if args.quantize_activations:
        # Activation quantization changes the KV but neither the weights nor the
        # model's config: keep its blocks apart from the plain model's.
        options["fingerprint"] = f"quantize-activations:{fingerprint_model(model, scheme=XXH3)}"
        local_path = None
    if draft is not None or max_kv_size is not None:
        stored_model = StoreModel(model, draft, max_kv_size)
        # The same fingerprint `ppc serve` gives a model with a draft; with a rotating
        # cache only the layout differs, and the layout is part of the store's key.
        options.setdefault("fingerprint", fingerprint_model(model, scheme=XXH3))
        if draft is not None:
            options["fingerprint"] = f"with-draft:{options['fingerprint']}:{fingerprint_model(draft, scheme=XXH3)}"
        local_path = None
    mx.reset_peak_memory()
    store = open_checked_store(args, stored_model, local_path, need_write=False, **options)
    with store:
        counting = CountingStore(store)
        start = time.perf_counter()
        # Prefill all but the last prompt token through the store; mlx-lm's generator
        # feeds the last one, so its sampling and stopping rules apply unchanged.
        with kv_quantization_errors(args):
            if len(ids) > 1:
                cache, _ = prefill(stored_model, ids[:-1], counting, prefill_step_size=args.prefill_step_size)
            else:
                cache = store.make_cache()
            generated, logprobs, pieces, ttft, last = [], [], [], None, None
            framed = not args.json and not args.quiet and args.verbose
            if framed:  # mlx_lm.generate's frame: scripts cut the text out between the lines
                print("=" * 10, flush=True)
            speculative = {}
            if draft is not None:
                speculative = {"draft_model": draft, "num_draft_tokens": args.num_draft_tokens}
            for response in stream_generate(
                model,
                tokenizer,
                ids[-1:],
                max_tokens=args.max_tokens,
                sampler=sampler,
                prompt_cache=cache,
                **speculative,
            ):
                if ttft is None:
                    ttft = time.perf_counter() - start
                generated.append(response.token)
                logprobs.append(response.logprobs[response.token].item())
                pieces.append(response.text)
                if not args.json:
                    print(response.text, end="", flush=True)
                last = response
        if not args.json:
            print(flush=True)
        if framed:
            print("=" * 10, flush=True)

        # mlx-lm's generator feeds each token before handing it out, so the cache covers
        # the prompt and every generated token (an end-of-sequence token included).
        fed = ids + generated
        covered = cache_length(_even(cache))
        covered = len(fed) if covered is None else covered
        new_after = store.store(fed[:covered], cache) if covered <= len(fed) else 0
        store.flush()
        stats = store.stats()

    result = {
        "text": "".join(pieces),
        "tokens": generated,
        # float32 log-probabilities of the chosen tokens: two runs that agree on these agree
        # on the logits, not only on the argmax.
        "logprobs": logprobs,
        "finish_reason": last.finish_reason if last is not None else None,
        "prompt_tokens": len(ids),
        "restored_tokens": counting.restored,
        "restored_blocks": counting.tiers,  # by the tier that served them: ram, disk, remote
        "ttft_s": round(ttft, 4) if ttft is not None else None,
        "generation_tokens": len(generated),
        # Rates as measured (not rounded): the summary prints them as mlx-lm does, to 3 decimals.
        "generation_tps": last.generation_tps if last is not None else 0.0,
        # As mlx-lm counts it: the whole prompt over the time to its first token (here
        # restoring, prefilling and the last token's forward pass).
        "prompt_tps": len(ids) / ttft if ttft else 0.0,
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
        # Handed to the store; where writes failed (a damaged index, a full disk), committed.
        "new_blocks": stats["blocks_written"] if stats.get("write_errors") else counting.new_blocks + new_after,
        "blocks_in_store": stats["blocks"],
        "bytes_on_disk": stats["bytes_on_disk"],
        "store": store.path,
    }
    if args.json:
        emit(result, True, str)
    elif framed:
        if not generated:
            print("No text generated for this prompt")
        print(_summary(result), flush=True)
        print(_render(result), file=sys.stderr)
    return 0


def _str2bool(text: str) -> bool:
    # mlx_lm.generate's --verbose takes True/T/False/F (any case).
    value = text.strip().lower()
    if value in ("true", "t", "yes", "1"):
        return True
    if value in ("false", "f", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use True or False)")


def _mlx_lm_has(option: str) -> bool:
    """Whether the installed ``mlx_lm generate`` takes `option` (versions differ)."""
    from mlx_lm.generate import setup_arg_parser

    return option in setup_arg_parser()._option_string_actions


def build_parser():
    """The argument parser of ``ppc generate`` (mlx_lm.generate's options, plus the store's)."""
    from ..layers.mlx_lm_versions import generate_default

    parser = make_parser(
        "generate",
        "Generate text like mlx_lm.generate, restoring the prompt's stored prefix first.",
    )
    add_model_option(parser)
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="enable trusting remote code for the tokenizer"
    )
    parser.add_argument(
        "--adapter-path", type=path_arg, default=None, help="LoRA adapter weights to apply to the model"
    )
    parser.add_argument(
        "--draft-model", type=path_arg, default=None,
        help="a model for speculative decoding (the store keeps its KV beside the model's)",
    )  # fmt: skip
    parser.add_argument(
        "--num-draft-tokens", type=int, default=3, help="tokens to draft per step (default: %(default)s)"
    )
    parser.add_argument(
        "--max-kv-size", type=int, default=None,
        help="keep at most this many positions per layer (mlx-lm's rotating cache; stored apart)",
    )  # fmt: skip
    add_store_option(parser)
    add_remote_option(parser)
    add_block_size_option(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        "-p",
        help="message to be processed by the model ('-' reads stdin, as --prompt-file does)",
    )
    prompt.add_argument(
        "--prompt-file", type=path_arg, metavar="FILE",
        help="read the message from a UTF-8 file, as --prompt \"$(cat FILE)\" passes it (trailing newlines dropped)",
    )  # fmt: skip
    add_template_options(parser)
    parser.add_argument("--prefill-response", default=None, help="prefill response to be used for the chat template")
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="maximum number of tokens to generate (-1: no limit; default: %(default)s)",
    )
    parser.add_argument("--temp", type=float, default=DEFAULT_TEMP, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="sampling top-p")
    parser.add_argument("--min-p", type=float, default=DEFAULT_MIN_P, help="sampling min-p")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="sampling top-k")
    parser.add_argument(
        "--min-tokens-to-keep",
        type=int,
        default=1,
        help="minimum tokens to keep for min-p sampling",
    )
    parser.add_argument("--xtc-probability", type=float, default=0.0, help="probability of XTC sampling at each token")
    parser.add_argument(
        "--xtc-threshold", type=float, default=generate_default("xtc_threshold", 0.1),
        help="probability threshold of XTC sampling's candidates (default: %(default)s, as mlx_lm.generate's)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="PRNG seed")
    parser.add_argument(
        "--quantized-kv-start", type=int, default=None, metavar="0",
        help="with --kv-bits the store quantizes from the first token: only 0 is accepted",
    )  # fmt: skip
    parser.add_argument(
        "--use-default-chat-template", action="store_true",
        help="accepted as by mlx_lm.generate, which ignores it too",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-cache-file", type=path_arg, default=None,
        help="an mlx_lm.cache_prompt file (mlx-lm 0.31 or 0.32): as mlx_lm generate, the prompt continues it; no store",
    )  # fmt: skip
    parser.add_argument("--image", nargs="+", default=(), help="refused: the store holds text prompts only")
    if _mlx_lm_has("--quantize-activations"):
        parser.add_argument(
            "--quantize-activations", "-qa", action="store_true",
            help="quantize activations with the layers' quantization config (as mlx_lm.generate)",
        )  # fmt: skip
    parser.set_defaults(quantize_activations=False)
    parser.add_argument(
        "--extra-eos-token",
        nargs="+",
        default=(),
        help="add tokens to the list of end-of-sequence tokens that stop generation",
    )
    add_prefill_option(parser)
    parser.add_argument("--quiet", "-q", action="store_true", help="print only the generated text (no stats)")
    parser.add_argument(
        "--verbose", type=_str2bool, default=True, metavar="BOOL",
        help="as mlx_lm.generate: 'False' prints only the generated text (same as --quiet)",
    )  # fmt: skip
    add_json_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ppc generate``.

    Args:
        argv: The arguments after ``generate`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, 2 on a user error.
    """
    args = build_parser().parse_args(argv)
    return run(lambda: _generate(args))


if __name__ == "__main__":
    sys.exit(main())

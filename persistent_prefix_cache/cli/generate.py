"""``ppc generate``: generate text with a warm start from the store.

The options follow ``mlx_lm.generate``. The prompt is built the same way (chat
template, system prompt, ``--prompt -`` for stdin); the longest stored prefix of its
tokens is restored instead of computed, the rest is prefilled (and stored as it goes),
and the text is printed as it is generated. Afterwards the prompt and the generated
tokens that the cache covers are stored, so the next turn of a conversation starts
warm too. How many prompt tokens came from the store and the time to first token go
to stderr (or into ``--json``).
"""

from __future__ import annotations

import sys
import time

from .common import (
    UserError,
    add_json_option,
    add_model_option,
    add_remote_option,
    add_store_option,
    emit,
    load_model,
    make_parser,
    run,
    table,
)
from .prompting import (
    CountingStore,
    add_block_size_option,
    add_prefill_option,
    add_template_options,
    check_positive,
    check_store_path,
    encode_raw,
    kv_quantization_errors,
    open_checked_store,
    prefill_step_blocks,
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


def read_prompt(raw: str) -> str:
    """The prompt text of ``--prompt`` as ``mlx_lm.generate`` reads it.

    Escaped ``\\n``/``\\t`` become newlines and tabs; ``-`` reads stdin.

    Raises:
        UserError: If stdin is not UTF-8, or the prompt is empty.
    """
    prompt = raw.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        try:
            prompt = sys.stdin.read() if sys.stdin is not None else ""
        except UnicodeDecodeError as exc:
            raise UserError(
                f"--prompt -: stdin is not UTF-8 text (bad byte at offset {exc.start})"
            ) from None
        where = "--prompt - (stdin)"
    else:
        where = "--prompt"
    if not prompt.strip():
        raise UserError(f"{where} is empty; give the text to answer")
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
        ids = encode_raw(tokenizer, prompt)
    if not ids:
        raise UserError("--prompt has no tokens")
    return ids


def _render(result: dict) -> str:
    rows = [
        ("prompt tokens", result["prompt_tokens"]),
        ("restored from the store", result["restored_tokens"]),
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
        raise UserError(
            f"--max-tokens must be at least 1 (or -1 for no limit), got {args.max_tokens}"
        )
    check_positive("--block-size", args.block_size)
    check_positive("--prefill-step-size", args.prefill_step_size)
    template_kwargs(args)  # fail on a bad --chat-template-config before loading anything
    check_store_path(args)
    prompt = read_prompt(args.prompt)
    model, tokenizer, local_path = load_model(args.model)

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..layers import cache_length
    from ..prefill import prefill

    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    ids = prompt_tokens(prompt, tokenizer, args)
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
    )

    store = open_checked_store(args, model, local_path, need_write=False)
    with store:
        counting = CountingStore(store)
        start = time.perf_counter()
        # Prefill all but the last prompt token through the store; mlx-lm's generator
        # feeds the last one, so its sampling and stopping rules apply unchanged.
        with kv_quantization_errors(args):
            if len(ids) > 1:
                blocks = prefill_step_blocks(store, args.prefill_step_size)
                cache, _ = prefill(model, ids[:-1], counting, blocks_per_chunk=blocks)
            else:
                cache = store.make_cache()
            generated, logprobs, pieces, ttft, last = [], [], [], None, None
            for response in stream_generate(
                model,
                tokenizer,
                ids[-1:],
                max_tokens=args.max_tokens,
                sampler=sampler,
                prompt_cache=cache,
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

        # mlx-lm's generator feeds each token before handing it out, so the cache covers
        # the prompt and every generated token (an end-of-sequence token included).
        fed = ids + generated
        covered = cache_length(cache)
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
        "ttft_s": round(ttft, 4) if ttft is not None else None,
        "generation_tokens": len(generated),
        "generation_tps": round(last.generation_tps, 1) if last is not None else 0.0,
        "new_blocks": counting.new_blocks + new_after,
        "blocks_in_store": stats["blocks"],
        "bytes_on_disk": stats["bytes_on_disk"],
        "store": store.path,
    }
    if args.json:
        emit(result, True, str)
    elif not args.quiet:
        print(_render(result), file=sys.stderr)
    return 0


def build_parser():
    """The argument parser of ``ppc generate`` (mlx_lm.generate's options, plus the store's)."""
    parser = make_parser(
        "generate",
        "Generate text like mlx_lm.generate, restoring the prompt's stored prefix first.",
    )
    add_model_option(parser)
    add_store_option(parser)
    add_remote_option(parser)
    add_block_size_option(parser)
    parser.add_argument(
        "--prompt",
        "-p",
        required=True,
        help="message to be processed by the model ('-' reads from stdin)",
    )
    add_template_options(parser)
    parser.add_argument(
        "--prefill-response", default=None, help="prefill response to be used for the chat template"
    )
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
    parser.add_argument("--seed", type=int, default=None, help="PRNG seed")
    parser.add_argument(
        "--extra-eos-token",
        nargs="+",
        default=(),
        help="add tokens to the list of end-of-sequence tokens that stop generation",
    )
    add_prefill_option(parser)
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="print only the generated text (no stats)"
    )
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

"""The warm-start demo: a cold run stores its prompt, a new process restores it.

Two real processes share one store directory. The first prefills a long prompt from
nothing, generates, and stores what it computed; the second opens the store, restores
the prefix, and generates again. The table compares time to first token and checks
that the second process generated the same tokens.

Run it as ``ppc demo`` (or ``python -m persistent_prefix_cache demo``); with no
``--model`` it writes a tiny random-weight model and needs no network.

The demo keeps ``store/`` (and ``tiny-model/``) in its ``--workdir`` and replaces its own
store at every run; a folder there that it did not make (no `MARKER` file in it) is
never touched: the demo refuses to run instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import time

from .common import UserError, make_parser, path_arg, run

DEFAULT_WORKDIR = ".demo"
# What the demo writes into each folder it makes, and looks for before it reuses or
# replaces one: a folder without it is somebody else's.
MARKER = "made-by-ppc-demo.txt"
MARKER_TEXT = "ppc demo made this folder and replaces it at its next run (remove this file to keep it).\n"


def _prompt_tokens(tokenizer, n_tokens: int) -> list[int]:
    from ..tiny_model import DEMO_TEXT

    text = DEMO_TEXT
    ids = tokenizer.encode(text)
    while len(ids) < n_tokens:
        text += "\n" + DEMO_TEXT
        ids = tokenizer.encode(text)
    return ids[:n_tokens]


def _run_phase(phase: str, model: str, store: str, n_prompt: int, max_tokens: int) -> dict:
    """One side of the demo, in this process; returns what it measured."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from ..layers import model_cache
    from ..store import PersistentPrefixCache

    loaded = load(model)
    model_obj, tokenizer = loaded[0], loaded[1]  # (a third item, the config, only when asked)
    prompt = _prompt_tokens(tokenizer, n_prompt)
    model_path = model if os.path.isdir(model) else None
    with PersistentPrefixCache(store, model_obj, model_path=model_path) as cache_store:
        start = time.perf_counter()
        if phase == "cold":
            cache, remaining = model_cache(model_obj), prompt
        else:
            found, remaining = cache_store.fetch(prompt)
            cache = found if found is not None else model_cache(model_obj)
        generated, ttft = [], None
        steps = generate_step(mx.array(remaining), model_obj, prompt_cache=cache, max_tokens=max_tokens)
        for token, _ in steps:
            if ttft is None:
                ttft = time.perf_counter() - start
            generated.append(int(token))
        new_blocks = 0
        if phase == "cold":
            # The cache now covers the prompt and the generated tokens fed back so far.
            covered = cache[0].offset
            new_blocks = cache_store.store((prompt + generated)[:covered], cache)
        cache_store.flush()
        stats = cache_store.stats()
    return {
        "phase": phase,
        "prompt_tokens": len(prompt),
        "restored_tokens": len(prompt) - len(remaining),
        "ttft_s": ttft,
        "generated": generated,
        "text": tokenizer.decode(generated),
        "new_blocks": new_blocks,
        "bytes_on_disk": stats["bytes_on_disk"],
        "blocks": stats["blocks"],
    }


def _spawn(phase: str, args: argparse.Namespace, store: str) -> dict:
    cmd = [
        sys.executable, "-m", "persistent_prefix_cache.cli.demo", "--phase", phase,
        "--model", args.model, "--store", store,
        "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"demo: the {phase} process failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(cold: dict, warm: dict) -> str:
    rows = [
        ("", "cold process", "warm process"),
        ("prompt tokens", cold["prompt_tokens"], warm["prompt_tokens"]),
        ("tokens restored from the store", cold["restored_tokens"], warm["restored_tokens"]),
        ("time to first token", f"{cold['ttft_s']:.3f} s", f"{warm['ttft_s']:.3f} s"),
        ("blocks / bytes on disk", f"{cold['blocks']} / {cold['bytes_on_disk']:,}", f"{warm['blocks']} / {warm['bytes_on_disk']:,}"),
    ]  # fmt: skip
    width = [max(len(str(r[i])) for r in rows) for i in range(3)]
    lines = [
        "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, width)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    same = cold["generated"] == warm["generated"]
    lines += [
        "",
        f"speed-up of time to first token: {cold['ttft_s'] / warm['ttft_s']:.1f}x",
        f"generated tokens identical ({len(warm['generated'])} tokens): {'yes' if same else 'NO'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ppc demo``."""
    parser = make_parser("demo", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=path_arg, help="a local model folder or hub id (default: a tiny random model, no network)"
    )
    parser.add_argument(
        "--workdir",
        type=path_arg,
        default=DEFAULT_WORKDIR,
        help="where the demo keeps its model and store; it replaces only what it made there itself (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=1536, help="prompt length in tokens (default: %(default)s)"
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("--phase", choices=["cold", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--store", type=path_arg, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prompt_tokens < 2 or args.max_tokens < 1:
        parser.error("--prompt-tokens must be at least 2 and --max-tokens at least 1")

    if args.phase:
        print(json.dumps(_run_phase(args.phase, args.model, args.store, args.prompt_tokens, args.max_tokens)))
        return 0
    return run(lambda: _demo(args))


def is_demos_own(path: str) -> bool:
    """Whether `path` is a folder `ppc demo` made: a real folder (not a link) holding the
    demo's `MARKER` file, a regular file with the demo's text."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(MARKER_TEXT) + 1) == MARKER_TEXT.encode()
    finally:
        os.close(fd)


def _mark(path: str) -> None:
    # Exclusive and never through a link: the folder was made by this run a moment ago.
    fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(MARKER_TEXT)


def _refuse_foreign(workdir: str, names: list[str]) -> None:
    """Raise `UserError` if one of `names` exists in `workdir` and the demo did not make it
    (checked for every name before anything is written)."""
    for name in names:
        path = os.path.join(workdir, name)
        if os.path.lexists(path) and not is_demos_own(path):
            raise UserError(
                f"{path} exists and is not marked as the demo's (no {MARKER} in it): ppc demo deletes and "
                "reuses only what it made; move it away (or remove an older demo's), or pass another --workdir"
            )


def _demo(args: argparse.Namespace) -> int:
    if os.path.lexists(args.workdir) and not os.path.isdir(args.workdir):
        raise UserError(f"--workdir {args.workdir}: is a file, not a folder")
    if args.model is not None and not os.path.exists(args.model) and os.sep in args.model:
        raise UserError(f"--model {args.model}: no such folder")
    _refuse_foreign(args.workdir, ["store"] + (["tiny-model"] if args.model is None else []))
    os.makedirs(args.workdir, exist_ok=True)
    if args.model is None:
        from ..tiny_model import write_tiny_model

        args.model = os.path.join(args.workdir, "tiny-model")
        if not os.path.isdir(args.model):
            os.mkdir(args.model)
            _mark(args.model)  # first: an interrupted write is still the demo's to finish
        if not os.path.exists(os.path.join(args.model, "model.safetensors")):
            print(f"writing a tiny random-weight model to {args.model}", file=sys.stderr)
            write_tiny_model(args.model, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512)
    store = os.path.join(args.workdir, "store")
    if os.path.lexists(store):
        shutil.rmtree(store)  # the demo's own (checked above): the cold run starts from nothing
    _new_store(store)

    print(f"cold process: prefill {args.prompt_tokens} tokens, generate, store ...", file=sys.stderr)
    cold = _spawn("cold", args, store)
    print("warm process: a new process restores the prefix and generates ...", file=sys.stderr)
    warm = _spawn("warm", args, store)
    if args.json:
        print(json.dumps({"cold": cold, "warm": warm}, indent=2))
    else:
        print(f"model: {args.model}    store: {store}\n")
        print(_table(cold, warm))
    return 0 if cold["generated"] == warm["generated"] else 1


def _new_store(path: str) -> None:
    """An empty store at `path`, marked as the demo's (a store must exist before a file
    of ours may sit beside its index: a folder of other files is never made a store)."""
    from ..admin import StoreAdmin

    with StoreAdmin(path, create=True):
        pass
    _mark(path)


if __name__ == "__main__":
    sys.exit(main())

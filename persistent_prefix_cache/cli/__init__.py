"""The ``ppc`` command line: ``ppc <command> [options]``; ``ppc <command> --help``."""

from __future__ import annotations

import difflib
import importlib
import sys

# name -> (module in persistent_prefix_cache/cli/ [":function", default main], one-line summary)
COMMANDS = {
    "demo": ("demo", "warm-start demo on a tiny model (no network)"),
    "precompute": ("precompute", "fill a store from prompts, offline"),
    "generate": ("generate", "generate with a warm start from the store"),
    "serve": ("serve", "mlx_lm.server with a persistent prompt cache"),
    "stats": ("stats", "counters and totals of a store"),
    "inspect": ("inspect", "models, fingerprints and the longest stored prefixes"),
    "check": ("check", "verify every segment file and the index (--fix repairs)"),
    "gc": ("gc", "remove blocks by model, by age, or down to a byte budget"),
    "forget": ("forget", "forget the model fingerprints remembered by folder (--model-path DIR | --all)"),
    "migrate": ("migrate", "apply pending schema migrations"),
    "export": ("export", "pack a store (or one model's part) into one file"),
    "import": ("import_", "load a packed file into a store"),
    "push": ("push", "publish a store's blocks to the fleet's remote tier"),
    "pull": ("pull", "fill a store from the fleet's remote tier"),
    "import-mlx": ("mlx_files:import_main", "store an mlx_lm.cache_prompt file under its prompt's tokens"),
    "export-mlx": ("mlx_files:export_main", "write a stored prompt's KV as an mlx-lm prompt-cache file"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: ppc <command> [options]   (ppc <command> --help for details; ppc --version)",
        "",
        "commands:",
    ]
    lines += [f"  {name.ljust(width)}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(_usage(), flush=True)
            return 0 if argv else 2
        if argv[0] in ("-V", "--version"):
            from .. import __version__

            print(f"ppc (persistent-prefix-cache) {__version__}", flush=True)
            return 0
        name, rest = argv[0], argv[1:]
        if name not in COMMANDS:
            near = difflib.get_close_matches(name, COMMANDS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            print(f"ppc: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
            return 2
        module_name, _, function = COMMANDS[name][0].partition(":")
        module = importlib.import_module(f"persistent_prefix_cache.cli.{module_name}")
        code = getattr(module, function or "main")(rest)
        sys.stdout.flush()  # a reader gone by now is still a broken pipe, caught below
        return code
    except BrokenPipeError:  # `ppc inspect | head`: the reader stopped early
        from .common import broken_pipe

        return broken_pipe()

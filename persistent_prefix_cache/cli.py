"""The ``ppc`` command line."""

from __future__ import annotations

import argparse
import sys

_COMMANDS = {
    "demo": ("the warm-start demo on a tiny model (no network)", "persistent_prefix_cache.demo"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``ppc <command> [options]``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="ppc", description="A persistent prefix (KV) cache for mlx-lm."
    )
    parser.add_argument("command", choices=sorted(_COMMANDS), help="; ".join(f"{k}: {v[0]}" for k, v in _COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    module = __import__(_COMMANDS[args.command][1], fromlist=["main"])
    return module.main(argv[1:])

"""``ppc serve``: mlx-lm's OpenAI-compatible server with a persistent prompt cache.

This runs mlx-lm's own ``mlx_lm.server`` (every option of it works, and is passed
through), with one change: the in-memory ``LRUPromptCache`` it builds is replaced by a
`PersistentLRUPromptCache`, so prompt caches are also written to the store and a
restarted server restores shared prefixes (system prompts, chat histories) from disk.
How the class gets into the server: `compat.server_patch`.

What is persisted: every cache the server inserts (system-prompt segments, finished
prompts with their generated tokens), on both its batched and its sequential path.
Caches the store cannot hold stay in memory only, with one warning: KV the server has
quantized (``--kv-bits`` past ``--quantized-kv-start``) and prompts with images.

A store the server could not use (a file, a damaged index, another block size, not
writable) stops ``ppc serve`` before the server starts, with exit code 2;
``--store-optional`` serves without a persistent cache instead, after one warning.

Memory: the KV held in memory (the server's LRU entries and the store's RAM tier
together) stays within one budget, ``--prompt-cache-bytes`` when given, else 1/8 of
the memory MLX computes in (`memory_budget`); a cache the store took lives once, as blocks in the RAM tier
(see `compat.lru_prompt_cache` and docs/serve.md). Startup says the budget in one line.

One behaviour differs from a stock server on purpose: an exact in-memory hit is served
as all but the last token (``keep_last_token``), because mlx-lm 0.32.2's batched path
stops its generation thread on an empty rest.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from ..core.admission import ADMIT_RULES
from ..errors import PrefixCacheError
from ..core.tier_report import describe_decisions
from .common import (
    Parser, UserError, add_disk_budget_option, add_remote_option, add_store_option, add_store_shared_option,
    disk_budget_option, model_folder, parse_size, path_arg, remote_options, run, store_path, unknown_option,
)  # fmt: skip

log = logging.getLogger("persistent_prefix_cache.serve")


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ppc serve",
        description=(
            "Run mlx_lm.server with its prompt cache kept in a store, so a restarted "
            "server restores shared prefixes from disk. Options not listed here go to "
            "mlx_lm.server (--model, --host, --port, --prompt-cache-size, ...)."
        ),
        usage="ppc serve --model M --store S [store options] [mlx_lm.server options]",
        add_help=False,
        # Never let a prefix of one of our options swallow an mlx_lm.server option.
        allow_abbrev=False,
        passthrough=True,  # mlx_lm.server's options: `_check_passthrough` checks them against both parsers
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument("--model", type=path_arg, metavar="M", help="model folder or hub id (passed to mlx_lm.server)")
    add_store_option(parser)
    parser.add_argument("--namespace", default="", metavar="NAME", help="tenant or cache salt (default: none); "
                        "with --tenants, where the shared prefixes are stored")  # fmt: skip
    parser.add_argument(
        "--tenants",
        type=path_arg,
        metavar="FILE",
        default=None,
        help="serve tenants: a JSON or TOML file of API key digests, quotas and shared prefixes (docs/serve.md); a "
        "request's Authorization: Bearer key picks its namespace, an unknown or missing key gets 401",
    )
    parser.add_argument(
        "--tenant-header",
        metavar="NAME",
        default=None,
        help="the header a trusted proxy sets to the request's tenant, instead of the API key; only behind a proxy "
        "that removes the client's own copy of it",
    )
    parser.add_argument(
        "--store-memory-bytes",
        type=parse_size,
        metavar="SIZE",
        default=None,
        help="most of the in-memory budget (--prompt-cache-bytes, else 1/8 of the GPU's memory or RAM) the store's "
        "RAM tier may take (default: all of it; 0 turns the tier off: the server's LRU keeps every cache)",
    )
    add_disk_budget_option(parser)
    parser.add_argument(
        "--store-block-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens per block of a new store",
    )
    parser.add_argument("--store-readonly", action="store_true", help="restore from the store, never write it")
    parser.add_argument(
        "--admit",
        choices=ADMIT_RULES,
        default="always",
        help="what the store writes of a request (docs/wear.md): always (default: every prompt, warm after a "
        "restart from its first sighting), seen (a prompt's blocks at their second sighting), reuse (seen, and a "
        "chat's next turn at first sight)",
    )
    add_store_shared_option(parser)
    parser.add_argument(
        "--store-optional",
        action="store_true",
        help="if the store cannot be used (damaged index, another block size, not a store "
        "folder, not writable), warn and serve with mlx-lm's in-memory cache only, instead "
        "of exiting with status 2",
    )
    add_remote_option(parser)
    return parser


def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"namespace": args.namespace, "readonly": args.store_readonly, **remote_options(args)}
    options["shared"] = args.store_shared
    if args.store_memory_bytes is not None:
        options["memory_bytes"] = args.store_memory_bytes
    options.update(disk_budget_option(args))
    if args.store_block_size is not None:
        options["block_size"] = args.store_block_size
    return options


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    print("\nmlx_lm.server options (passed through):\n")
    sys.stdout.flush()
    saved = sys.argv
    sys.argv = ["ppc serve", "--help"]
    try:
        from mlx_lm import server

        server.main()
    except SystemExit:
        pass
    finally:
        sys.argv = saved
    return 0


def _serve(args: argparse.Namespace, server_argv: list[str]) -> int:
    found = store_path(args, walk=False)
    path: str | None = found  # None: serving without a store (--store-optional)
    if args.model is not None:
        model_folder(args.model)  # what mlx-lm would fail every request on: said now
        server_argv = ["--model", args.model, *server_argv]
    try:
        store_path(args)  # the index walked in a child process: damage is an error, not an abort
        _check_store(found, args)  # fail now, not at the first request
    except (UserError, PrefixCacheError) as exc:
        if not args.store_optional:
            raise
        log.warning("--store-optional: serving without a persistent cache: %s", exc)
        path = None
    options = _store_options(args)
    tenants = _tenants(args)
    if path is not None:
        _reach_remote(options)  # the store opens at the first request: say it now

    from mlx_lm import server

    from ..compat.server_patch import ProviderStores, check_server, patched_server

    check_server(server)  # before importing our class, which needs the same mlx-lm
    carried = None
    if tenants is not None:
        from ..compat.server_patch import check_tenant_server
        from ..compat.tenants import RequestTenants

        check_tenant_server(server)
        carried = RequestTenants()

    from ..compat.lru_prompt_cache import PersistentLRUPromptCache

    def make_cache(provider, max_size, max_bytes):
        budget, said = memory_budget(provider)
        options["memory_bytes"] = budget if args.store_memory_bytes is None else min(args.store_memory_bytes, budget)
        log.info(
            "in-memory KV at most %.1f MB (%s): the server's prompt cache and the store's RAM tier together",
            budget / 1e6, said,
        )  # fmt: skip
        return PersistentLRUPromptCache(
            ProviderStores(path, options, None if path is None else provider, tenants),
            max_size=max_size,
            max_bytes=budget,
            keep_last_token=True,  # an exact hit would stop mlx-lm 0.32's batched path
            admit=args.admit,
            tenants=carried,
        )

    # mlx_lm.server stops cleanly (stops its generation thread) on KeyboardInterrupt;
    # make SIGTERM do the same so pending block writes are flushed on `kill`.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    saved_argv = sys.argv
    sys.argv = ["ppc serve", *server_argv]
    try:
        with patched_server(server, make_cache, tenants=tenants, carried=carried) as built:
            try:
                server.main()
            finally:
                cache = built.get("cache")
                if cache is not None:
                    stats = cache.persistent_stats()
                    cache.close()  # waits for pending block writes
                    log.info(  # tests read this line: keep its wording stable
                        "in-memory KV peaked at %d bytes of a %d-byte budget",
                        stats["memory_peak_bytes"], stats["memory_budget"],
                    )  # fmt: skip
                    for opened in stats["stores"]:  # why restores missed, for whoever reads the log
                        log.info("store %s: %s", opened["path"], describe_decisions(opened["stats"]))
                    if args.store_readonly:
                        log.info(
                            "persistent prompt cache closed (read-only): %d prompts restored from the "
                            "store (%d tokens), 0 written",
                            stats["store_hits"],
                            stats["restored_tokens"],
                        )
                    else:
                        log.info(
                            "persistent prompt cache closed: %d prompts restored from the store "
                            "(%d tokens), %d written, %d kept in memory only",
                            stats["store_hits"],
                            stats["restored_tokens"],
                            stats["stored_sequences"],
                            stats["store_skipped"],
                        )
    except SystemExit as exc:  # mlx_lm.server's argparse: usage already printed
        return exc.code if isinstance(exc.code, int) else 2
    except OSError as exc:  # mlx_lm.server could not listen: a port taken, an address not this host's
        print(f"error: ppc serve cannot listen: {exc.strerror or exc} (another process holds the port? "
              "pass another --port)", file=sys.stderr, flush=True)  # fmt: skip
        # Its generation thread, started before it listened, never stops on its own: the
        # process would hang at exit. The store was closed above.
        _exit_now(1)
    finally:
        sys.argv = saved_argv
        signal.signal(signal.SIGTERM, previous)
    if built.get("cache") is not None:
        _exit_now(0)
    return 0


def _tenants(args: argparse.Namespace) -> Any:
    """The server's tenants (`compat.tenants.Tenants`) from ``--tenants`` and
    ``--tenant-header``; None without either.

    Raises:
        UserError: A malformed file or header name, or a combination not supported.
    """
    if args.tenants is None and args.tenant_header is None:
        return None
    header = args.tenant_header
    if header is not None and (not header or not all(c.isascii() and (c.isalnum() or c == "-") for c in header)):
        raise UserError(f"--tenant-header {header!r}: a header name is letters, digits and '-'")
    if header is not None and header.lower() == "authorization":
        raise UserError("--tenant-header Authorization: that header carries API keys; name the proxy's own header")
    from ..compat.tenants import Tenants

    if args.tenants is None:
        tenants = Tenants([], header=header, reserved=[args.namespace])  # the proxy names any tenant but that
    else:
        from .tenants_file import load_tenants

        tenants = load_tenants(args.tenants, header=header, shared_namespace=args.namespace)
    if tenants.shared and args.remote is not None:
        raise UserError("--tenants with shared prefixes and --remote: not supported yet; drop one")
    log.info(
        "tenants: %d declared, %s; %d shared prefixes; a request without one %s",
        len(tenants.by_name), f"named by the {header} header" if header else "by API key", len(tenants.shared),
        f"is served as {tenants.default!r}" if tenants.default else "gets 401",
    )  # fmt: skip
    return tenants


def memory_budget(provider: Any) -> tuple[int, str]:
    """The bytes of KV ``ppc serve`` holds in memory, and where the figure comes from.

    ``--prompt-cache-bytes`` (read from the server's parsed options,
    ``provider.cli_args``) when given, else 1/8 of the memory MLX computes in: the GPU's
    where MLX reports it (a CUDA device's own, Apple's unified memory), else the
    machine's physical memory (512 MiB where neither can be read).

    Args:
        provider: mlx_lm.server's ``ModelProvider`` (None: the default).

    Returns:
        ``(bytes, a few words saying where they come from)``.
    """
    from ..device.target import device_memory

    given = getattr(getattr(provider, "cli_args", None), "prompt_cache_bytes", None)
    if given is not None:
        return max(0, int(given)), "--prompt-cache-bytes"
    memory = device_memory()
    if memory <= 0:
        return 512 << 20, "default; set --prompt-cache-bytes"
    return memory // 8, "default: 1/8 of the memory MLX computes in; set --prompt-cache-bytes"


def _reach_remote(options: dict[str, Any]) -> None:
    """Talk to ``--remote`` before serving: a URL the server refuses (a db it lacks, a
    wrong password) stops ``ppc serve`` (exit 2); a server that cannot be reached is
    said once, and requests are served from the local store (and from the server once
    it answers).

    Raises:
        RemoteConfigError: If the server refuses the URL.
    """
    if not options.get("remote"):
        return
    from ..tiers.remote_client import redact

    if options.get("remote_insecure"):  # the operator's choice, said once where the server logs
        log.warning("remote tier %s without a secret (--remote-insecure): whoever can write to the server is trusted",
                    redact(options["remote"]))  # fmt: skip
    from ..errors import RemoteUnreachableError
    from ..tiers.remote import LOCAL_ONLY, PUBLISH_TIMEOUT
    from ..tiers.remote_client import Voice, contact, shown

    try:
        contact(options["remote"], timeout=max(options.get("remote_timeout", 0), PUBLISH_TIMEOUT))
    except RemoteUnreachableError as exc:
        Voice.failed(shown(options["remote"]), exc.message, LOCAL_ONLY)


def _exit_now(code: int) -> None:
    """Leave the process without interpreter teardown, once the server has stopped.

    mlx_lm.server (0.32.2 with mlx 0.32.4, measured here: 8 of 15 clean SIGINT stops of
    a stock server) often dies in native code during interpreter teardown ("terminate
    called without an active exception", SIGABRT), after all its work is done. The
    stores are closed by now, so skipping the teardown loses nothing and keeps the exit
    code meaningful for supervisors.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_store(path: str, args: argparse.Namespace) -> None:
    """Refuse, before the server starts, a store the server could not use.

    The store itself opens at the first request (it needs the loaded model); what can
    be known without the model is checked here: the path, the index (readable, of this
    schema version), the block size and whether it can be written.

    Raises:
        UserError, PrefixCacheError: Saying what is wrong and what to do.
    """
    from ..admin import StoreAdmin
    from ..disk.store_dir import check_location, create_root
    from ..options import existing_but_not_writable

    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--store {path}: is a file, not a store directory; give a folder")
    if not os.path.isdir(os.path.join(path, "index")):
        if args.store_readonly:
            raise UserError(f"--store-readonly: no store at {path}")
        check_location(path, what="--store")  # other files, an unwritable place: the library's rule
        try:
            create_root(path, shared=args.store_shared)  # private (or the group's), whatever the umask
        except OSError as exc:
            raise UserError(f"--store {path}: {exc.strerror or exc}") from None
        return
    with StoreAdmin(path, readonly=True) as admin:  # a damaged or newer index raises here
        block_size = admin.index.block_size
    if args.store_block_size is not None and args.store_block_size != block_size:
        raise UserError(
            f"--store-block-size {args.store_block_size}: the store at {path} uses "
            f"{block_size}-token blocks; omit --store-block-size or give another --store"
        )
    if not args.store_readonly and existing_but_not_writable(path):
        raise UserError(
            f"--store {path}: the store is not writable by this user; pass --store-readonly to serve its hits only"
        )


class _Captured(Exception):
    """Raised out of mlx_lm.server's ``main`` once it has built its parser."""


def _server_parser() -> argparse.ArgumentParser | None:
    """mlx_lm.server's own option parser (it builds it inside ``main``), or None if the
    installed version builds it some other way."""
    from mlx_lm import server

    built: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):
        built.append(self)
        raise _Captured

    saved = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        server.main()
    except _Captured:
        pass
    except Exception:  # another structure: leave the options to the server itself
        return None
    finally:
        argparse.ArgumentParser.parse_args = saved  # type: ignore[method-assign]
    return built[0] if built else None


def _check_passthrough(ours: argparse.ArgumentParser, rest: list[str]) -> None:
    """Name an option that neither ``ppc serve`` nor mlx_lm.server knows, before anything
    else is checked (``--stor x`` is a typo, not a missing ``--store``).

    Raises:
        UserError: For the first unknown option, with the nearest known one.
    """
    theirs = _server_parser()
    if theirs is None:
        return
    known = set(ours._option_string_actions) | set(theirs._option_string_actions)
    for word in rest:
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        if name in known or any(k.startswith(name) for k in theirs._option_string_actions):
            continue  # mlx_lm.server accepts unambiguous prefixes of its options
        raise UserError(unknown_option(name, known, prog=ours.prog))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ppc serve``.

    Args:
        argv: Our options and mlx_lm.server's (default: ``sys.argv[1:]``).

    Returns:
        The exit code, when the server could not start (bad options, a store that cannot
        be opened). Once the server has run and stopped, the process exits here (code 0)
        without interpreter teardown: see `_exit_now`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.help:
        return _print_help(parser)

    def work() -> int:
        _check_passthrough(parser, rest)
        return _serve(args, rest)

    return run(work)


if __name__ == "__main__":
    sys.exit(main())

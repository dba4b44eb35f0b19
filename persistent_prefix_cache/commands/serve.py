"""``ppc serve``: mlx-lm's OpenAI-compatible server with a persistent prompt cache.

This runs mlx-lm's own ``mlx_lm.server`` (every option of it works, and is passed
through), with one change: the in-memory ``LRUPromptCache`` it builds is replaced by a
`PersistentLRUPromptCache`, so prompt caches are also written to the store and a
restarted server restores shared prefixes (system prompts, chat histories) from disk.

How the patch works. ``mlx_lm.server.main`` parses its options and calls the module's
``run(host, port, model_provider)``, which builds ``LRUPromptCache(prompt_cache_size)``
and hands it to the ``ResponseGenerator``. Before calling ``main`` we replace two names
in the ``mlx_lm.server`` module: ``run`` by a wrapper that notes the ``ModelProvider``
and calls the original, and ``LRUPromptCache`` by a factory of our class. The server
keys caches by ``model_provider.model_key`` and loads one model at a time; our class
opens one store handle per model key (all in the ``--store`` directory, told apart by
each model's fingerprint) from the model the provider has loaded. Nothing else in
mlx-lm is touched, and both names are put back when the server returns.

What is persisted: every cache the server inserts (system-prompt segments, finished
prompts with their generated tokens), on both its batched and its sequential path.
With ``--draft-model`` the store holds the model's and the draft's layers together
under a fingerprint of both. Caches the store cannot hold stay in memory only, with one
warning: KV the server has quantized (``--kv-bits`` past ``--quantized-kv-start``) and
prompts with images. With ``--adapter-path`` the weights are hashed at every start
(an adapter changes the KV without changing the model folder the hash is remembered by).

One behaviour differs from a stock server on purpose: an exact in-memory hit is served
as all but the last token (``keep_last_token``), because mlx-lm 0.32.2's batched path
stops its generation thread on an empty rest.

Checked against the source of mlx-lm 0.31.3, 0.32.0, 0.32.1 and 0.32.2 (tested on
0.32.2). Versions up to 0.31.1 defined a different ``LRUPromptCache`` (no
``cache_type``); `check_server` refuses any server whose structure differs from what the
patch relies on, with a message, instead of running uncached.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import signal
import sys
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator

from ..cliutil import UserError, add_store_option, run, store_path

log = logging.getLogger("persistent_prefix_cache.serve")

CHECKED_MLX_LM_VERSIONS = ("0.31.3", "0.32.0", "0.32.1", "0.32.2")
_CACHE_METHODS = ("fetch_nearest_cache", "insert_cache", "trim_to", "stats_by_type")
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


# -- the patch -------------------------------------------------------------------------


def check_server(server: Any) -> None:
    """Verify that `server` (the ``mlx_lm.server`` module) has the structure we patch.

    Args:
        server: The imported ``mlx_lm.server`` module.

    Raises:
        UserError: Naming what differs, the installed mlx-lm version and the checked ones.
    """
    problems = []
    for name in ("main", "run", "LRUPromptCache", "ModelProvider", "ResponseGenerator"):
        if not hasattr(server, name):
            problems.append(f"mlx_lm.server has no {name}")
    if not problems:
        cls = server.LRUPromptCache
        # Our class extends mlx_lm.models.cache.LRUPromptCache: it must be the server's.
        from mlx_lm.models import cache as cache_module

        if getattr(cache_module, "LRUPromptCache", None) is not cls:
            problems.append("its LRUPromptCache is not mlx_lm.models.cache.LRUPromptCache")
        missing = [m for m in _CACHE_METHODS if not callable(getattr(cls, m, None))]
        if missing:
            problems.append(f"LRUPromptCache lacks {', '.join(missing)}")
        elif "cache_type" not in inspect.signature(cls.insert_cache).parameters:
            problems.append("LRUPromptCache.insert_cache takes no cache_type")
        if not isinstance(getattr(cls, "nbytes", None), property):
            problems.append("LRUPromptCache.nbytes is not a property")
        params = list(inspect.signature(server.run).parameters)
        if params[:3] != ["host", "port", "model_provider"]:
            problems.append(f"run() takes {params}, not (host, port, model_provider, ...)")
        # Both names are looked up as module globals at call time: that is what we patch.
        if "LRUPromptCache" not in _global_names(server.run):
            problems.append("run() does not build the LRUPromptCache")
        if "run" not in _global_names(server.main):
            problems.append("main() does not call run()")
    if problems:
        raise UserError(
            f"ppc serve cannot patch mlx_lm.server of mlx-lm {_mlx_lm_version()}: "
            + "; ".join(problems)
            + f". It was checked with mlx-lm {', '.join(CHECKED_MLX_LM_VERSIONS)}: install one "
            f"of those (pip install 'mlx-lm=={CHECKED_MLX_LM_VERSIONS[-1]}'), or run "
            "mlx_lm.server without a persistent cache"
        )


def _global_names(fn: Callable) -> set[str]:
    return set(fn.__code__.co_names)


def _mlx_lm_version() -> str:
    try:
        from mlx_lm import __version__

        return __version__
    except ImportError:
        return "(unknown version)"


@contextmanager
def patched_server(
    server: Any, make_cache: Callable[[Any, int, int], Any]
) -> Iterator[dict[str, Any]]:
    """Make ``server.run`` build its prompt cache with `make_cache` while inside.

    Args:
        server: The ``mlx_lm.server`` module (checked with `check_server` first).
        make_cache: ``make_cache(model_provider, max_size, max_bytes)`` returning the
            object the server uses as its prompt cache.

    Yields:
        A dict that gets ``"provider"`` and ``"cache"`` once the server has built them.
    """
    original_run, original_cache_class = server.run, server.LRUPromptCache
    built: dict[str, Any] = {}

    def run_noting_provider(host, port, model_provider, *args, **kwargs):
        built["provider"] = model_provider
        return original_run(host, port, model_provider, *args, **kwargs)

    def build_prompt_cache(max_size: int = 10, max_bytes: int = 1 << 63):
        built["cache"] = make_cache(built.get("provider"), max_size, max_bytes)
        return built["cache"]

    server.run, server.LRUPromptCache = run_noting_provider, build_prompt_cache
    try:
        yield built
    finally:
        server.run, server.LRUPromptCache = original_run, original_cache_class


class ProviderStores:
    """Opens the store handle for a model key from the model the server has loaded.

    Args:
        path: The store directory.
        options: Keyword arguments for `PersistentPrefixCache` (namespace, budgets…).
        provider: The server's ``ModelProvider`` (None: every key stays in memory).
    """

    def __init__(self, path: str, options: dict[str, Any], provider: Any):
        self.path = path
        self.options = options
        self.provider = provider

    def __call__(self, model_key: Hashable):
        """The store for `model_key`, or None if that model is not the loaded one."""
        from ..fingerprint import fingerprint_model
        from ..store import PersistentPrefixCache

        provider = self.provider
        # The server only looks up the model it has loaded; anything else stays in memory.
        if provider is None or provider.model is None or provider.model_key != model_key:
            return None
        model_path, adapter_path, _ = _split_key(model_key)
        model, draft = provider.model, getattr(provider, "draft_model", None)
        options = dict(self.options)
        if draft is not None:
            # The server's caches hold the model's layers, then the draft model's.
            model = _WithDraft(model, draft)
            options["fingerprint"] = "with-draft:%s:%s" % (
                fingerprint_model(provider.model),
                fingerprint_model(draft),
            )
        elif adapter_path is None:
            # Remembering the fingerprint by file stats is only sound for plain weights:
            # an adapter changes the KV without touching the model folder.
            options["model_path"] = _local_folder(model_path)
        store = PersistentPrefixCache(self.path, model, **options)
        log.info(
            "persistent prompt cache for %s: store %s, fingerprint %s",
            model_path,
            store.path,
            store.fingerprint[:16],
        )
        return store


class _WithDraft:
    """A model and its draft model seen as one cache layout (what the server builds)."""

    def __init__(self, model: Any, draft: Any):
        self.model, self.draft = model, draft

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model) + make_prompt_cache(self.draft)


def _split_key(model_key: Any) -> tuple[Any, Any, Any]:
    # mlx-lm's key is (model_path, adapter_path, draft_model_path).
    if isinstance(model_key, tuple) and len(model_key) == 3:
        return model_key
    return model_key, None, None


def _local_folder(model_path: Any) -> str | None:
    """The folder the model's files are in, without touching the network."""
    if not isinstance(model_path, str):
        return None
    if os.path.isdir(model_path):
        return model_path
    try:
        from mlx_lm.utils import hf_repo_to_path

        return str(hf_repo_to_path(model_path))
    except Exception:  # not in the local hub cache: hash the weights instead
        return None


# -- the command -------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """A byte count such as ``512MiB``, ``4GB``, ``1.5G`` or ``1000000``.

    Raises:
        argparse.ArgumentTypeError: If `text` is not a size.
    """
    s = text.strip()
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    unit = s[i:].strip().upper()
    try:
        number = float(s[:i])
    except ValueError:
        number = -1.0
    if unit not in _SIZE_UNITS or number < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 4GB, 1000000)")
    return int(number * _SIZE_UNITS[unit])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument(
        "--model", metavar="M", help="model folder or hub id (passed to mlx_lm.server)"
    )
    add_store_option(parser)
    parser.add_argument(
        "--namespace", default="", metavar="NAME", help="tenant or cache salt (default: none)"
    )
    parser.add_argument(
        "--store-memory-bytes",
        type=parse_size,
        metavar="SIZE",
        default=None,
        help="RAM for the store's block tier, besides the server's own prompt cache "
        "(default: the library's, 512MiB; 0 turns it off)",
    )
    parser.add_argument(
        "--store-disk-bytes",
        type=parse_size,
        metavar="SIZE",
        default=None,
        help="disk budget of the store; least recently used blocks go first "
        "(default: unbounded)",
    )
    parser.add_argument(
        "--store-block-size",
        type=int,
        default=None,
        metavar="N",
        help="tokens per block of a new store",
    )
    parser.add_argument(
        "--store-readonly", action="store_true", help="restore from the store, never write it"
    )
    return parser


def _store_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"namespace": args.namespace, "readonly": args.store_readonly}
    if args.store_memory_bytes is not None:
        options["memory_bytes"] = args.store_memory_bytes
    if args.store_disk_bytes is not None:
        options["disk_bytes"] = args.store_disk_bytes
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
    path = store_path(args)
    if args.store_readonly and not os.path.isdir(os.path.join(path, "index")):
        raise UserError(f"--store-readonly: no store at {path}")
    if args.model is not None:
        if args.model.startswith((".", "/", "~")) and not os.path.isdir(
            os.path.expanduser(args.model)
        ):
            raise UserError(f"--model {args.model}: no such folder")
        server_argv = ["--model", os.path.expanduser(args.model), *server_argv]
    if not args.store_readonly:
        _check_writable(path)  # fail now, not at the first request

    from mlx_lm import server

    check_server(server)  # before importing our class, which needs the same mlx-lm

    from ..lru_prompt_cache import PersistentLRUPromptCache

    options = _store_options(args)

    def make_cache(provider, max_size, max_bytes):
        return PersistentLRUPromptCache(
            ProviderStores(path, options, provider),
            max_size=max_size,
            max_bytes=max_bytes,
            keep_last_token=True,  # an exact hit would stop mlx-lm 0.32's batched path
        )

    # mlx_lm.server stops cleanly (stops its generation thread) on KeyboardInterrupt;
    # make SIGTERM do the same so pending block writes are flushed on `kill`.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    saved_argv = sys.argv
    sys.argv = ["ppc serve", *server_argv]
    try:
        with patched_server(server, make_cache) as built:
            try:
                server.main()
            finally:
                cache = built.get("cache")
                if cache is not None:
                    stats = cache.persistent_stats()
                    cache.close()  # waits for pending block writes
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
    finally:
        sys.argv = saved_argv
        signal.signal(signal.SIGTERM, previous)
    if built.get("cache") is not None:
        _exit_now(0)
    return 0


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


def _check_writable(path: str) -> None:
    # The store opens at the first request; a directory that cannot be created there
    # should stop the server before it starts, with a message.
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--store {path}: {exc.strerror or exc}") from None


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
    return run(lambda: _serve(args, rest))


if __name__ == "__main__":
    sys.exit(main())

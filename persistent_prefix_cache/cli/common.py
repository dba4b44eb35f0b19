"""Pieces every ``ppc`` subcommand shares: options, sizes, model loading, output, errors.

A subcommand module defines ``main(argv) -> int``, builds its parser with
`make_parser`, and wraps its work in `run`, which turns user mistakes (bad paths,
wrong model for a store, unreadable files) into one line on stderr and exit code 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Sequence

from ..disk.store_dir import check_readable
from ..errors import InvalidArgumentError, PrefixCacheError
from ..paths import expand_path

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""


class Parser(argparse.ArgumentParser):
    """The argument parser of every ``ppc`` command: a misspelt option is named before
    anything else is checked (``--stroe x`` is a typo, not a missing ``--store``), with
    the nearest known one, and every mistake is one ``error:`` line and exit status 2,
    never the whole usage (``--help`` shows that).

    Args:
        passthrough: Leave options this parser does not know to the caller (``ppc
            serve`` hands them to mlx_lm.server and checks them against both parsers).
        args, kwargs: As `argparse.ArgumentParser`'s.
    """

    def __init__(self, *args: Any, passthrough: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.passthrough = passthrough

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        """argparse's, after refusing the first option this parser does not know."""
        args = sys.argv[1:] if args is None else list(args)
        if not self.passthrough:
            word = first_unknown_option(args, self._option_string_actions, abbrev=self.allow_abbrev)
            if word is not None:
                shown = [o for a in self._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
                self.error(unknown_option(word, shown, prog=self.prog))
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """Print `message` as one ``error:`` line and exit with status 2.

        A message about the command line as a whole (an argument missing or left over)
        points to ``--help``; one about a given value says all there is to say.
        """
        if not message.startswith(("argument ", "unknown option")):
            message += f" (see `{self.prog} --help`)"
        self.exit(EXIT_USAGE, f"error: {message}\n")


# A word argparse reads as a value although it starts with "-": a negative number.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def first_unknown_option(args: Sequence[str], known: Iterable[str], *, abbrev: bool = True) -> str | None:
    """The first word of `args` that argparse would take for an option none of `known`
    (option strings) is, or None.

    Words after ``--``, ``-`` (stdin), negative numbers and words with a space (values,
    as argparse reads them) are not options; ``--opt=value``, a short option with its
    value attached (``-m5``) and, with `abbrev`, an unambiguous or ambiguous prefix of a
    known option (argparse says which) are known.
    """
    known = set(known)
    for word in args:
        if word == "--":
            return None
        if not word.startswith("-") or word == "-" or word in known:
            continue
        head = word.split("=", 1)[0]
        if head in known or (not word.startswith("--") and word[:2] in known):
            continue
        if (abbrev or not word.startswith("--")) and any(k.startswith(head) for k in known):
            continue
        if _NEGATIVE_NUMBER.match(word) or " " in word:
            continue
        return word
    return None


def unknown_option(word: str, known: Iterable[str], *, prog: str) -> str:
    """The message for an option nobody knows: its name and the nearest of `known` (the
    options ``--help`` shows), else where the options are listed."""
    name = word.split("=", 1)[0]
    near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
    return f"unknown option {name}" + (f" (did you mean {near[0]}?)" if near else f" (see `{prog} --help`)")


def make_parser(command: str, description: str) -> Parser:
    """A parser for ``ppc <command>`` (see `Parser`)."""
    return Parser(prog=f"ppc {command}", description=description)


def path_arg(text: str) -> str:
    """An argparse ``type=`` for paths: ``~`` and ``$VARS`` expanded (see `expand_path`;
    ``--store=~/kv`` arrives with its ``~``).

    Raises:
        argparse.ArgumentTypeError: If the path names an environment variable that is
            not set (argparse puts the option's name before the message).
    """
    try:
        return expand_path(text, what="")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).lstrip()) from None


#: The variable ``--store`` defaults to.
STORE_ENV = "PPC_STORE"


def add_store_option(parser: argparse.ArgumentParser) -> None:
    """``--store DIR``, defaulting to ``$PPC_STORE`` (read and expanded by `store_path`,
    so a mistake in the variable is said of the variable, not of ``--store``)."""
    parser.add_argument("--store", type=path_arg, default=None, help=f"store directory (default: ${STORE_ENV})")


def add_store_shared_option(parser: argparse.ArgumentParser) -> None:
    """``--store-shared``: make a new store for a group (folders 2770, files 0660)."""
    parser.add_argument(
        "--store-shared",
        action="store_true",
        help="make a new store for a group: folders 2770 (setgid), files 0660, instead of "
        "private to you (0700/0600); an existing store keeps its mode (ppc check --fix "
        "--store-shared turns one into a group store)",
    )


DISK_BUDGET_HELP = (
    "budget of the store's blocks; least recently used blocks go first past it "
    "(default: what the store holds plus half the disk space free at start; 'unlimited': no budget)"
)
#: What ``--store-disk-bytes`` takes for "no budget" (0 is zero bytes, as in every size option).
UNLIMITED = "unlimited"


def add_disk_budget_option(parser: argparse.ArgumentParser) -> None:
    """``--store-disk-bytes SIZE`` (``unlimited``: no budget; default: the library's ``"auto"``)."""
    parser.add_argument(
        "--store-disk-bytes", type=parse_disk_budget, metavar="SIZE", default=None, help=DISK_BUDGET_HELP
    )


def parse_disk_budget(text: str) -> int | str:
    """``--store-disk-bytes``: a size (`parse_size`) above 0, or `UNLIMITED`.

    Raises:
        argparse.ArgumentTypeError: If `text` is 0 (a budget that keeps no block) or not a size.
    """
    if text.strip().lower() == UNLIMITED:
        return UNLIMITED
    value = parse_size(text)
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"0 would keep no block on disk: give a budget such as 20G, or {UNLIMITED!r} for none "
            "(ppc gc --max-bytes 0 empties a store)"
        )
    return value


def disk_budget_option(args: argparse.Namespace) -> dict[str, Any]:
    """``disk_bytes`` for the store from ``--store-disk-bytes`` (none given: the default)."""
    value = getattr(args, "store_disk_bytes", None)
    return {} if value is None else {"disk_bytes": None if value == UNLIMITED else value}


def add_model_option(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--model PATH_OR_ID`` and the options that shape the store's layout."""
    parser.add_argument("--model", type=path_arg, required=required, help="local model folder or hub id")
    parser.add_argument("--namespace", default="", help="tenant or cache salt (default: none)")
    parser.add_argument("--kv-bits", type=int, default=None, help="quantize the stored KV (as mlx-lm)")
    parser.add_argument("--kv-group-size", type=int, default=64, help="group size for --kv-bits")


def add_remote_option(parser: argparse.ArgumentParser) -> None:
    """``--remote URL``, defaulting to ``$PPC_REMOTE``; the secret comes from
    ``$PPC_REMOTE_SECRET`` only (a command line is visible to every user), and a remote
    without one needs ``--remote-insecure``."""
    parser.add_argument(
        "--remote",
        default=os.environ.get("PPC_REMOTE") or None,
        metavar="URL",
        help="the fleet's shared block tier: redis://host:port, rediss://..., unix:///path or "
        "redis+cluster://h:p,h:p (default: $PPC_REMOTE; secret: $PPC_REMOTE_SECRET)",
    )
    parser.add_argument(
        "--remote-insecure", action="store_true",
        help="share blocks on --remote without a secret: whoever can write to the server is trusted",
    )  # fmt: skip


def add_pack_secret_option(parser: argparse.ArgumentParser) -> None:
    """``--secret-file F``: a pack secret from a file (``$PPC_PACK_SECRET`` otherwise)."""
    parser.add_argument(
        "--secret-file", type=path_arg, default=None,
        help="a file holding the secret packs are signed with (default: $PPC_PACK_SECRET; never on the command line)",
    )  # fmt: skip


def pack_secret(args: argparse.Namespace) -> bytes | None:
    """The pack secret: ``--secret-file``'s, else ``$PPC_PACK_SECRET``'s, else None."""
    from ..admin import SECRET_ENV, read_secret_file

    if args.secret_file is not None:
        return read_secret_file(args.secret_file)
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """``remote``, ``remote_secret`` (``$PPC_REMOTE_SECRET``), ``remote_insecure``
    (``--remote-insecure``) and ``remote_timeout`` (``$PPC_REMOTE_TIMEOUT``, seconds) for
    `PersistentPrefixCache` from ``--remote`` and the environment (empty without a remote).

    Raises:
        InvalidArgumentError: If the URL is malformed (exit 2, one line).
        UserError: If there is neither a secret nor ``--remote-insecure``, or both.
    """
    url = getattr(args, "remote", None)
    if not url:
        return {}
    from ..tiers.remote_client import parse_url

    parse_url(url)
    secret = os.environ.get("PPC_REMOTE_SECRET") or None
    insecure = bool(getattr(args, "remote_insecure", False))
    if secret is None and not insecure:
        raise UserError(
            "--remote without $PPC_REMOTE_SECRET would trust whoever can write to the server: set "
            "$PPC_REMOTE_SECRET to the fleet's secret, or pass --remote-insecure to share blocks without one"
        )
    if secret is not None and insecure:
        raise UserError("--remote-insecure and $PPC_REMOTE_SECRET contradict each other: give one")
    options = {"remote": url, "remote_secret": secret, "remote_insecure": insecure}
    timeout = os.environ.get("PPC_REMOTE_TIMEOUT")
    if timeout:
        try:
            options["remote_timeout"] = float(timeout)
        except ValueError:
            raise UserError(f"PPC_REMOTE_TIMEOUT={timeout!r} is not a number of seconds") from None
    return options


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``: machine-readable output."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


# Binary units for bare letters (``2G`` = 2 * 2**30), as ``ppc gc`` always took them;
# ``GB`` and friends are decimal, ``GiB`` and friends binary.
SIZE_UNITS_HELP = "K, M, G, T binary: 2G = 2*2**30 bytes; KB, MB, GB, TB decimal: 500KB = 500,000"
_SIZE_UNITS = {"": 1, "B": 1}
for _i, _letter in enumerate("KMGT", start=1):
    _SIZE_UNITS[_letter] = _SIZE_UNITS[_letter + "IB"] = 2 ** (10 * _i)
    _SIZE_UNITS[_letter + "B"] = 10 ** (3 * _i)


def parse_size(text: str) -> int:
    """A byte count such as ``1000000``, ``512M``, ``2G`` (binary: 2 * 2**30), ``4GB``
    (decimal: 4 * 10**9), ``512MiB`` (binary) or ``1.5G``; for argparse's ``type=``.

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
    if unit not in _SIZE_UNITS or not number >= 0:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (expected a size like 500M, 2G, 4GB, 512MiB or 1000000)"
        )
    return int(number * _SIZE_UNITS[unit])


def positive_int(text: str) -> int:
    """An integer >= 1, for argparse's ``type=``.

    Raises:
        argparse.ArgumentTypeError: If `text` is not one.
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def store_path(
    args: argparse.Namespace, *, must_exist: bool = False, walk: bool = True, any_schema: bool = False
) -> str:
    """The store directory from ``--store``/``$PPC_STORE``; an existing index is walked
    in a child process first (`walk`), so that a damaged page is one error line, never
    an LMDB abort of this process, and a store of another schema is refused there, by
    every command alike (`any_schema`: ``ppc migrate``, whose work that is).

    Raises:
        UserError: If none was given, or (with `must_exist`) there is no store there.
        StoreNotWritableError: If (with `must_exist`) the folder is one this user cannot open.
        StoreCorruptError: If the index is damaged (the hint: what ``ppc check --fix``
            will do).
        StoreVersionError: If (with `walk`) the store is older than this version (the
            hint: ``ppc migrate``) or newer.
    """
    path = getattr(args, "store", None)
    if path is None and os.environ.get(STORE_ENV):
        path = expand_path(os.environ[STORE_ENV], what=f"${STORE_ENV}")
    if not path:
        raise UserError(f"no store given: pass --store DIR or set {STORE_ENV}")
    path = expand_path(path, what="--store")
    if must_exist:
        check_readable(path, what="--store")  # another user's private store: say so
    if must_exist and not os.path.isdir(os.path.join(path, "index")):
        from ..disk.store_guard import check_no_pending_repair

        check_no_pending_repair(path)  # a repair stopped mid-swap: say how to finish it
        from ..disk.store_dir import segment_file_count
        from ..disk.store_guard import corrupt_index

        held = segment_file_count(path)
        if held:  # a store that lost its index: the segments still hold its blocks
            raise corrupt_index(os.path.abspath(path), f"index/ is missing, but {held} segment file(s) hold blocks")
        raise UserError(f"no store at {path} (expected {os.path.join(path, 'index')})")
    if walk and os.path.isdir(os.path.join(path, "index")):
        from ..admin import probe_index
        from ..disk.schema import check_schema
        from ..disk.store_guard import corrupt_index

        health = probe_index(os.path.join(path, "index"), trial_write=False)
        if health.refused:  # a link or a special file among LMDB's: not damage, nothing opened
            raise UserError(health.refused)
        if health.damaged:
            raise corrupt_index(os.path.abspath(path), health.damaged)
        if not any_schema and health.version is not None:
            # One behaviour for an older store: no command migrates it on the side (a
            # migration rewrites every segment; a read-only command must not write).
            check_schema(os.path.abspath(path), health.version, shown=path)
    return path


def model_folder(spec: str, *, what: str = "--model") -> str | None:
    """The local folder `spec` names, checked to hold what ``mlx_lm.load`` reads
    (``config.json`` and ``model*.safetensors``), or None for a hub id. Every command
    that takes a model checks it before anything starts (``ppc serve`` before the
    server does: it would otherwise fail every request).

    Raises:
        UserError: If `spec` names a folder that does not exist or is not a model's.
    """
    local = expand_path(spec, what=what)
    if not (os.path.exists(local) or spec.startswith((".", "/", "~", "$")) or local != spec):
        return None  # a hub id (org/name): mlx-lm finds it in the hub's cache
    if not os.path.isdir(local):
        raise UserError(f"{what} {spec}: no such folder")
    if not os.path.isfile(os.path.join(local, "config.json")):
        raise UserError(f"{what} {spec}: no config.json in that folder (not an mlx-lm model folder)")
    if not glob.glob(os.path.join(glob.escape(local), "model*.safetensors")):
        raise UserError(f"{what} {spec}: no model*.safetensors weights in that folder (not an mlx-lm model folder)")
    return local


def load_model(
    spec: str,
    *,
    with_tokenizer: bool = True,
    adapter_path: str | None = None,
    trust_remote_code: bool = False,
    model_config: dict | None = None,
    what: str = "--model",
):
    """Load a model (and tokenizer) with mlx-lm, as ``(model, tokenizer, local_path)``.

    Args:
        spec: A model folder or hub id.
        with_tokenizer: Load the tokenizer too.
        adapter_path: LoRA adapters to apply (``mlx_lm.generate --adapter-path``);
            `local_path` is then None, so the store hashes the adapted weights
            instead of remembering the fingerprint by the model folder.
        trust_remote_code: Let the tokenizer run code from the model folder.
        model_config: Overrides of the model's config (``mlx_lm.load``'s).
        what: The option that named the model, for messages.

    Raises:
        UserError: If the model cannot be found or loaded.
    """
    folder = model_folder(spec, what=what)
    local, looks_local = (folder, True) if folder is not None else (spec, False)
    if adapter_path is not None and not os.path.isdir(adapter_path):
        raise UserError(f"--adapter-path {adapter_path}: no such folder")
    try:
        from mlx_lm import load
        from mlx_lm.utils import load_model as load_weights

        from ..layers.mlx_lm_versions import load_options

        if with_tokenizer:
            loaded = load(
                local if looks_local else spec,
                adapter_path=adapter_path,
                model_config=model_config or {},
                **load_options(trust_remote_code),  # what the installed mlx-lm takes
            )
            model, tokenizer = loaded[0], loaded[1]  # (a third item, the config, only when asked)
        else:
            model, tokenizer = load_weights(Path(local))[0], None
    except Exception as exc:  # mlx-lm raises many kinds; all mean "cannot load this"
        first_line = (str(exc).strip().splitlines() or [""])[0]
        hint = "" if looks_local else " (not a local folder; a hub id needs the network or a local copy)"
        raise UserError(f"cannot load model {spec!r}: {type(exc).__name__}: {first_line}{hint}") from None
    return model, tokenizer, (local if looks_local and adapter_path is None else None)


def open_store(args: argparse.Namespace, model: Any, local_path: str | None, **kwargs):
    """Open the store of ``--store`` for `model` with the layout options of `args`."""
    from ..store import PersistentPrefixCache

    return PersistentPrefixCache(
        store_path(args, walk=False),  # the callers walked the index before the model loaded
        model,
        model_path=local_path,
        model_name=_model_name(args, local_path),
        namespace=getattr(args, "namespace", ""),
        kv_bits=getattr(args, "kv_bits", None),
        kv_group_size=getattr(args, "kv_group_size", 64),
        shared=getattr(args, "store_shared", False),
        **{**remote_options(args), **disk_budget_option(args), **kwargs},
    )


def _model_name(args: argparse.Namespace, local_path: str | None) -> str | None:
    # The name `ppc inspect` shows: the folder (absolute, also where the fingerprint is not
    # remembered by it) or the hub id as given, and what else changes the KV, as serve says it.
    spec, adapter = getattr(args, "model", None), getattr(args, "adapter_path", None)
    if not isinstance(spec, str):
        return None
    folder = local_path if local_path is not None else spec if os.path.isdir(spec) else None
    name = os.path.abspath(folder) if folder is not None else spec
    if adapter:
        name += f" + adapter {os.path.abspath(adapter) if os.path.isdir(adapter) else adapter}"
    if getattr(args, "quantize_activations", False):
        name += " + quantized activations"
    return name + (" + draft model" if getattr(args, "draft_model", None) else "")


#: The exit status of a process killed by SIGPIPE (what ``yes | head`` leaves ``yes``).
EXIT_BROKEN_PIPE = 128 + 13


def broken_pipe() -> int:
    """End quietly after the reader of stdout went away (``ppc inspect | head``).

    Python turns SIGPIPE into `BrokenPipeError`; the output nobody reads is dropped and
    stdout pointed at the null device, so that the interpreter's last flush at exit
    does not fail a second time.

    Returns:
        `EXIT_BROKEN_PIPE`.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file: nothing will flush it at exit either
    return EXIT_BROKEN_PIPE


def run(work: Callable[[], int]) -> int:
    """Run a subcommand, turning user-facing failures into a message and exit code 2."""
    try:
        return work()
    except BrokenPipeError:
        return broken_pipe()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except PrefixCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE

"""`expand_path`: the one place a path the user gave gets its ``~`` and ``$VARS`` expanded.

A shell expands ``~`` only at the start of a word, so ``--store=~/kv``, ``$PPC_STORE``
set to ``~/kv`` and ``PersistentPrefixCache("~/kv", ...)`` all arrive here with a
literal ``~``; taken as is, they would create a folder named ``~`` in the current
directory. Every path the library and ``ppc`` take goes through `expand_path`.
"""

from __future__ import annotations

import os
import re

from .errors import InvalidArgumentError

# What os.path.expandvars leaves behind when a variable is not set: $NAME or ${NAME}.
_UNSET = re.compile(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def expand_path(path: str | os.PathLike, *, what: str = "path") -> str:
    """`path` with ``~``/``~user`` and ``$NAME``/``${NAME}`` expanded (not made absolute).

    Args:
        path: A path as the user wrote it.
        what: Names the argument in the error message (e.g. ``"--store"``).

    Returns:
        The expanded path as a str.

    Raises:
        InvalidArgumentError: If `path` is not a str or path-like, is empty, or names an
            environment variable that is not set (rather than creating a folder
            literally named ``$NAME``).
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a str or os.PathLike, got {type(path).__name__}") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise InvalidArgumentError(f"{what} is empty")
    expanded = os.path.expanduser(os.path.expandvars(text))
    unset = _UNSET.search(expanded)
    if unset is not None:
        raise InvalidArgumentError(
            f"{what} {text!r} names an environment variable that is not set: {unset.group(0)}",
            hint="set the variable, or write the path out",
        )
    return expanded

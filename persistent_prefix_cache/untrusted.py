"""Parsing what comes from outside (a pack's manifest, an mlx-lm file's header): sizes and
nesting bounded before anything is built, so a hostile input is one error, never a
`RecursionError`, a `MemoryError` or a hang."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 32  # what our own JSON nests (a pack's manifest: 4) with room to spare


def load_json(data: bytes | str, *, what: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON whose size and nesting are bounded.

    Args:
        data: The text.
        what: What it is, for the message ("manifest.json of pack.tar").
        max_bytes: The largest size accepted.
        max_depth: The deepest nesting of lists and objects accepted.

    Returns:
        The parsed value.

    Raises:
        ValueError: If `data` is larger, nests deeper, or is not JSON (one line saying which).
    """
    if len(data) > max_bytes:
        raise ValueError(f"{what} is {len(data):,} bytes, more than the {max_bytes:,} accepted")
    try:
        value = json.loads(data)
    except RecursionError:  # the C parser guards its own recursion: deeper than Python's limit
        raise ValueError(f"{what} nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    # Iterative, so a value nested just under the parser's limit is measured without recursion.
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    raise ValueError(f"{what} nests deeper than {max_depth} levels")
                stack.append((child, depth + 1))
    return value


def dotted_depth(names: Any, *, what: str, max_depth: int = MAX_DEPTH) -> None:
    """Check that no dotted name (``"3.1.0"``: a path in a tree) has more than `max_depth` parts.

    Raises:
        ValueError: Naming the first name that does.
    """
    for name in names:
        if str(name).count(".") >= max_depth:
            raise ValueError(f"{what} names {str(name)[:40]}...: a path of more than {max_depth} parts")

"""What ``ppc`` prints: aligned tables, JSON, and model fingerprints shortened for both."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence


def short_fingerprint(fingerprint: Any) -> str:
    """A model fingerprint as ``ppc``'s tables show it: 16 hex digits of a plain one; a
    derived one (``quantize-activations:<hex>``, ``with-draft:<hex>:<hex>``) keeps its
    words whole and 16 digits of its hash (8 of each of two)."""
    parts = str(fingerprint).split(":")
    hashes = sum(map(_is_hex, parts))
    return ":".join(p[: 16 if hashes < 2 else 8] if _is_hex(p) else p for p in parts)


def _is_hex(text: str) -> bool:
    return len(text) >= 16 and all(c in "0123456789abcdef" for c in text)


def table(rows: Sequence[Sequence[Any]], *, header: Sequence[str] | None = None) -> str:
    """Rows as aligned text columns.

    Under a header, numbers are right-aligned in their column. Without one (a list of
    ``label  value`` rows), the numbers of a column end at one edge, a unit after a
    number (``0.015 s``, ``50.0 %``) hanging past it, and text starts where the column
    starts, so that one long value (a path) does not push the numbers away.
    """
    text = [list(map(_cell, r)) for r in rows]
    if not header:
        text = [[_hang(c, _number_width(text, i)) for i, c in enumerate(r)] for r in text]
    if header:
        text.insert(0, list(header))
    if not text:
        return ""
    widths = [max(len(r[i]) for r in text) for i in range(len(text[0]))]
    lines = []
    for n, r in enumerate(text):
        # Without a header the numbers were aligned above: every cell is padded on the right.
        cells = [c.rjust(w) if header and n and _is_number(c) else c.ljust(w) for c, w in zip(r, widths)]
        lines.append("  ".join(cells).rstrip())
        if header and n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# A number and, after a space, a short unit: "0.015 s", "50.0 %", "1.2 GB/s".
_WITH_UNIT = re.compile(r"^(-?[\d,]+(?:\.\d+)?)( (?:%|[A-Za-z/]{1,8}))$")


def _number_width(rows: list[list[str]], column: int) -> int:
    """How wide the numbers of a column are (their unit left out)."""
    found = [len(m.group(1)) if (m := _WITH_UNIT.match(r[column])) else len(r[column])
             for r in rows if _is_number(r[column]) or _WITH_UNIT.match(r[column])]  # fmt: skip
    return max(found, default=0)


def _hang(cell: str, width: int) -> str:
    """A number right-aligned to `width`, its unit after it; text as it is."""
    m = _WITH_UNIT.match(cell)
    if m:
        return m.group(1).rjust(width) + m.group(2)
    return cell.rjust(width) if _is_number(cell) else cell


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _is_number(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()


def emit(data: Any, as_json: bool, render: Callable[[Any], str]) -> None:
    """Print `data` as JSON or through `render`."""
    print(json.dumps(data, indent=2, default=str) if as_json else render(data))

"""The benchmark of the paths users run: `tools/user_paths.py --smoke --json` reports
every row of issue 28's list, each with a finite positive figure, baseline and ratio.

No timing is asserted (a test never decides by timing): only that each row is there,
its numbers are finite and positive, the restarted chat restored what was stored (with
the cost model off, so no timing decides it), and the scratch folder and every process
the tool started are gone afterwards.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "user_paths.py"

# (row, words of the description that name it): every figure issue 28 asks for.
EXPECTED = [
    (1, "1st run, empty store"),
    (1, "2nd run, a new process"),
    (2, "prefill() ÷ mlx-lm prefill"),
    (3, "1st prefill() in a new process"),
    (3, "2nd prefill() in a new process"),
    (3, "3rd prefill() in a new process"),
    (4, "stored every turn ÷ stored at once"),
    (4, "stored every turn ÷ recomputing it"),
    (4, "prefill() of the chat (default options)"),
    (4, "stored block by block ÷ at once"),
    (5, "seen-before ÷ never-seen"),
    (5, "seen-before, asked again"),
    (5, "never-seen ÷ mlx_lm server"),
    (6, "cold store"),
    (6, "2nd run, warm store"),
    (7, "÷ the disk's limit"),
    (7, "÷ min(prefill alone, the disk's limit)"),
    (7, "÷ prefill + save_prompt_cache + fsync"),
]


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _servers_of(scratch: Path) -> list[str]:
    """Command lines of live processes that name a path under `scratch`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        # As bytes: another test's process may name a path that is not UTF-8.
        if os.fsencode(scratch) in cmdline:
            found.append(os.fsdecode(cmdline))
    return found


@pytest.mark.slow
def test_user_paths_smoke_reports_every_row(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--smoke", "--json", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    rows = result["rows"]

    for row, words in EXPECTED:
        matching = [r for r in rows if r["row"] == row and words in r["what"]]
        assert matching, (row, words, [r["what"] for r in rows])
    assert {r["row"] for r in rows} == set(range(1, 8))
    for r in rows:
        for key in ("figure", "baseline", "ratio"):
            assert positive(r[key]), (r["what"], key, r[key])
        assert r["target"], r["what"]
    # The table names every row too.
    assert proc.stderr.count("\n") > len(rows)

    # The chat's restores (cost_model=False: whatever is stored is restored, no timing
    # decides) in a new process, from stores an earlier process wrote: every token but
    # the last, the one prefill() feeds for the logits, whichever way it was stored.
    (chat,) = [r for r in rows if r["row"] == 4 and "restored_tokens" in r["detail"]]
    n = chat["detail"]["tokens"]
    assert chat["detail"]["restored_tokens"] == {"turns": [n - 1], "once": [n - 1], "blocks": [n - 1]}
    # The restarted server's replies counted their prompts (the figures are real requests).
    (serve,) = [r for r in rows if r["row"] == 5 and "seen-before ÷" in r["what"]]
    usage = serve["detail"]["usage_prompt_and_cached_tokens"]
    assert all(prompt > 0 for name in ("seen", "unseen", "mlx", "again") for prompt, _ in usage[name]), usage

    # The scratch folder is removed and no process it started is left.
    assert not list(tmp_path.glob("ppc-user-paths-*"))
    assert not _servers_of(tmp_path)

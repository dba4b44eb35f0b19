"""``tools/soak.py`` runs end to end: a few seconds of workers hammering one store while
the supervisor SIGKILLs and restarts them, then check, fix, check and a verify pass.

The long run (minutes) is a manual job: ``python tools/soak.py --seconds 300``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SOAK = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "soak.py")


@pytest.mark.slow
def test_soak_runs_with_kills(tmp_path, tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, SOAK, "--seconds", "8", "--procs", "2", "--threads", "2"]
        # Counts, not the clock, decide what the assertions below need: on a loaded
        # machine a worker may spend its whole life importing MLX.
        + ["--kill-every", "1.5", "--min-kills", "1", "--min-ops", "2", "--seed", "1", "--json"]
        + ["--store", str(tmp_path / "store"), "--model", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["ok"], summary
    assert summary["kills"] >= 1 and summary["restarts"] >= 1
    assert summary["operations"] > 0 and summary["corrupt_served"] == 0
    assert summary["errors"] == 0 and summary["workers_crashed"] == 0
    assert summary["check"]["clean_after_fix"]
    assert summary["verify"]["wrong"] == 0


@pytest.mark.slow
def test_soak_refuses_bad_arguments():
    # Refused by the parser (exit 2) before any work starts.
    proc = subprocess.run([sys.executable, SOAK, "--procs", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--procs" in proc.stderr

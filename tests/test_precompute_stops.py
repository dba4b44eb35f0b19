"""How ``ppc precompute`` ends when it does not finish (issue 31, items 5 and 8).

- On a full disk it stops at the first failed block write, and its summary counts what
  the store holds (``tokens stored``), which a rerun then restores.
- Ctrl-C (SIGINT) and ``kill`` (SIGTERM) end the same way: the progress line ended, the
  summary, and one line saying what was kept and that a rerun resumes.
- After a resume, the time left is at the rate of computed tokens, not of restored ones.

Every run is a real ``ppc`` process; the full disk is a real tmpfs (skipped where it
cannot be mounted); signals are real signals; the progress line is drawn on a real pty.
"""

from __future__ import annotations

import json
import math
import os
import pty
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from persistent_prefix_cache.cli.progress import eta
from persistent_prefix_cache.tiny_model import TEST_MODEL, write_tiny_model

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
PROGRESS = re.compile(r"\] (\d+)/(\d+) prompts\s+([\d,]+)/([\d,]+) tokens\s+([\d,]+) tok/s\s+ETA (\S+)")


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
    out["HF_HUB_OFFLINE"] = "1"
    return out


def command(model: Path, store: Path, prompts: list[Path], *extra) -> list[str]:
    return [sys.executable, "-m", "persistent_prefix_cache", "precompute", "--model", str(model), "--store",
            str(store), *map(str, prompts), *map(str, extra)]  # fmt: skip


def run_json(argv: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env(), timeout=300,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("stops_model"), seed=0, **TEST_MODEL)


def write_prompts(folder: Path, count: int, words: int, seed: int = 0) -> list[Path]:
    """`count` text files of `words` random words each, no two alike from their first word."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"p{i:02d}.txt"
        path.write_text(f"prompt {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n")
        paths.append(path)
    return paths


class Pty:
    """A process whose stderr is a terminal (so the progress line is drawn), read as it comes."""

    def __init__(self, argv: list[str]):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                                     env=env(), text=True)  # fmt: skip
        os.close(slave)
        self._master, self._chunks = master, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            self._chunks.append(data)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace").replace("\r\n", "\n")

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert self.proc.poll() is None, f"ended before {pattern!r}: {self.text()}"
            assert time.monotonic() < end, f"no {pattern!r} in {self.text()!r}"
            time.sleep(0.02)

    def finish(self) -> tuple[int, str, str]:
        stdout, _ = self.proc.communicate(timeout=300)
        self._reader.join(timeout=30)
        os.close(self._master)
        return self.proc.returncode, stdout, self.text()


# -- the time left ------------------------------------------------------------------------


def test_eta_is_time_left_at_the_computed_rate():
    assert eta(10_000, 2_000.0) == "0:05"
    assert eta(7_200_000, 1_000.0) == "2:00:00"
    assert eta(5, 0.0) == "-"  # only restored so far: no rate to go by


@pytest.mark.slow
def test_after_a_resume_the_eta_counts_computed_tokens_only(model, tmp_path):
    """The first prompts are restored in no time; the ETA still is the tokens left at the
    computed rate, as the line itself shows them (the restored ones once made it ~10x low)."""
    store = tmp_path / "store"
    kept = write_prompts(tmp_path / "in", 8, 420)
    first, summary = run_json(command(model, store, kept))  # what a killed run kept
    assert first.returncode == 0 and summary["tokens_stored"] == summary["tokens"]
    # Enough prompts more for ~6 s of computing on this machine, whatever its speed.
    per_prompt = summary["tokens"] / len(kept)
    more = min(60, max(4, math.ceil(6 * summary["tokens_per_second"] / per_prompt)))
    texts = [p.read_text() for p in kept]
    prompts = write_prompts(tmp_path / "in", len(kept) + more, 420)
    assert [p.read_text() for p in prompts[: len(kept)]] == texts  # the kept ones, and more
    run = Pty(command(model, store, prompts))
    code, _, shown = run.finish()
    assert code == 0, shown
    lines = [PROGRESS.search(part) for part in shown.split("\r")]
    checked = 0
    for m in filter(None, lines):
        done, total, rate, left = (
            int(m[3].replace(",", "")),
            int(m[4].replace(",", "")),
            int(m[5].replace(",", "")),
            m[6],
        )
        if left == "-":  # no rate yet: restored prompts compute a token or two each
            continue
        minutes, seconds = map(int, left.split(":")[-2:])
        # The line rounds the rate to a token/s and the time to a second.
        low, high = (total - done) / (rate + 0.5) - 0.5, (total - done) / max(rate - 0.5, 1e-9) + 0.5
        assert low - 0.01 <= minutes * 60 + seconds <= high + 0.01, m[0]
        checked += low >= 3  # where counting restored tokens as speed would show far less
    assert checked >= 1, shown


# -- Ctrl-C and kill ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig, word, code", [(signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "terminated", 143)])
def test_a_signal_ends_the_line_says_what_was_kept_and_a_rerun_resumes(model, tmp_path, sig, word, code):
    prompts = write_prompts(tmp_path / "in", 16, 420, seed=1)
    store = tmp_path / "store"
    run = Pty(command(model, store, prompts, "--json"))
    run.wait_for(r"\] [1-9]\d*/16 prompts")  # at least one prompt done
    run.proc.send_signal(sig)
    rc, stdout, shown = run.finish()
    assert rc == code, shown
    assert "Traceback" not in shown
    summary = json.loads(stdout)
    assert summary["stopped"] == word and 1 <= summary["prompts_done"] < summary["prompts"] == 16
    assert summary["blocks_written"] > 0 and 0 < summary["tokens_stored"] < summary["tokens"]
    # The progress line is ended before the one closing line; nothing follows that line.
    last = shown.rstrip("\n").split("\n")[-1]
    assert re.search(r"ETA \S+ *\n" + word + ": ", shown), shown[-400:]
    assert last == (
        f"{word}: {summary['prompts_done']} of 16 prompts done; the store keeps the {summary['blocks_written']:,} "
        f"blocks this run wrote ({summary['tokens_stored']:,} of the prompts' {summary['tokens']:,} tokens are "
        "stored); run the same command again to resume from them"
    )
    # The same command again restores what was kept, and finishes.
    again, rerun = run_json(command(model, store, prompts))
    assert again.returncode == 0, again.stderr
    assert rerun["stopped"] is None and rerun["tokens_stored"] == rerun["tokens"]
    # A whole prompt restores all but its last token (fed for the logits).
    assert rerun["tokens_restored"] >= summary["tokens_stored"] - summary["prompts"]


# -- a full disk ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_the_summary_counts_what_was_stored(model, small_tmpfs, tmp_path):
    # ~7.9 MB of KV (512 bytes a token) for a 1 MiB disk: it fills within the first prompts.
    subprocess.run(["mount", "-o", "remount,size=1M", str(small_tmpfs)], check=True, timeout=30)
    prompts = write_prompts(tmp_path / "in", 20, 200, seed=2)
    store = small_tmpfs / "store"
    argv = command(model, store, prompts, "--store-disk-bytes", "unlimited")  # no budget: the disk fills
    proc, summary = run_json(argv)
    assert proc.returncode == 1, proc.stderr
    assert summary["stopped"] == "write_failed" and summary["write_errors"] >= 1
    # It stopped at the first failure, not after computing everything.
    assert summary["prompts_done"] <= summary["prompts"] - 5
    assert summary["tokens_computed"] < summary["tokens"] / 2
    assert 0 < summary["tokens_stored"] < summary["tokens"]
    # Each prompt done says what the store holds of it; the last may have lost its write.
    assert all(0 <= p["stored"] <= p["tokens"] for p in summary["per_prompt"])
    assert sum(p["stored"] for p in summary["per_prompt"]) <= summary["tokens_stored"]
    lines = proc.stderr.strip().splitlines()
    assert "No space left on device" in proc.stderr and len(lines) <= 3, proc.stderr  # the cause, said once or twice
    assert lines[-1] == (
        f"error: a block write failed (see above), so the run stopped: {summary['prompts_done']} of 20 prompts "
        f"done; the store keeps the {summary['blocks_written']:,} blocks this run wrote ({summary['tokens_stored']:,} "
        f"of the prompts' {summary['tokens']:,} tokens are stored); free space or fix the cause, then run the same "
        "command again: it resumes from what is stored"
    )
    assert sum(line.startswith("error:") for line in lines) == 1
    # The table says the same: prompts done of all, tokens stored beside the prompts' tokens.
    table = subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=300, stdin=subprocess.DEVNULL)
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.stdout.splitlines()[1:])
    assert table.returncode == 1 and re.fullmatch(r"\d+ of 20", rows["prompts"]), table.stdout
    assert int(rows["tokens stored"].replace(",", "")) < int(rows["tokens in the prompts"].replace(",", ""))
    # With room again, the same command resumes: what was stored is restored, the rest computed.
    subprocess.run(["mount", "-o", "remount,size=64M", str(small_tmpfs)], check=True, timeout=30)
    again, rerun = run_json(argv)
    assert again.returncode == 0, again.stderr
    assert rerun["stopped"] is None and rerun["tokens_stored"] == rerun["tokens"]
    # A whole prompt restores all but its last token (fed for the logits).
    assert rerun["tokens_restored"] >= summary["tokens_stored"] - summary["prompts"]

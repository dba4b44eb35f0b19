"""Is the index damaged? Asked in a child process, where a crash cannot hurt.

LMDB trusts its pages: on a damaged one it may raise, abort the process (an
``mdb_assert``), or die of SIGBUS/SIGSEGV. `probe_index` runs `index.walk_index` (every
record read and decoded, then a trial write that is never committed) in a fresh
interpreter and turns whatever happens there (an LMDB error, a record that does not
decode, death by a signal, a walk that never ends) into an `IndexHealth` a report can
show. ``python -m persistent_prefix_cache.admin.index_probe INDEX [--write]`` is the
child; it prints one JSON line per finding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

# Seconds the walk may take: generous (a big index on a slow disk), never forever.
PROBE_TIMEOUT = 120.0


@dataclass
class IndexHealth:
    """What `probe_index` found.

    Attributes:
        damaged: A description of the damage, or None if every page read and decoded
            (and, where tried, the trial write went through).
        problems: The records that did not decode (the first 20).
        records: Records read (when the walk finished).
        block_size: The block size stamped in the index, if it could be read.
        version: The schema version stamped in the index, if it could be read.
        notes: What was not checked, and why (a read-only store skips the trial write;
            a writer holding LMDB's write lock made it wait too long).
        refused: The index was not opened: one of its files is a link, a special file or
            a foreign one (the error's text, with its hint: ``ppc check --fix``).
    """

    damaged: str | None = None
    refused: str | None = None
    problems: list[str] = field(default_factory=list)
    records: int = 0
    block_size: int | None = None
    version: int | None = None
    notes: list[str] = field(default_factory=list)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def probe_index(index_path: str, *, trial_write: bool = True, timeout: float | None = None) -> IndexHealth:
    """Walk a whole index in a child process and say whether it is damaged.

    Args:
        index_path: The store's ``index/`` folder.
        trial_write: Also try a write (never committed), where the store is writable.
        timeout: Seconds before the walk counts as hung (default `PROBE_TIMEOUT`).

    Returns:
        An `IndexHealth`; never raises for damage, whatever form it takes.
    """
    health = IndexHealth()
    if not os.path.isdir(index_path):
        health.damaged = f"{index_path} is missing"
        return health
    write = os.access(index_path, os.W_OK) and os.access(os.path.join(index_path, "data.mdb"), os.W_OK)
    if trial_write and not write:
        health.notes.append("the store is not writable: no trial write")
    cmd = [sys.executable, "-m", __name__, index_path] + (["--write"] if write and trial_write else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or PROBE_TIMEOUT)
        out, rc = proc.stdout, proc.returncode
        err = proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err, rc = "", None
    except OSError as exc:  # no child can be started (this user cannot run the interpreter's
        # path, say): the walk is a safety net, not a gate; say so and go on unwalked
        health.notes.append(f"the index was not walked: no child process could start ({exc.strerror})")
        return health
    stage, done = "start", None
    for line in out.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if "stage" in item:
            stage = item["stage"]
        elif "problem" in item:
            health.problems.append(item["problem"])
        elif "refused" in item:
            health.refused = item["refused"]
        elif "error" in item:
            # Every page read fine, but a write would fail (the free list, say).
            health.damaged = ("a write would fail: " if stage == "write" else "") + item["error"]
        elif item.get("done"):
            done = item
    if health.refused is not None:
        return health  # not damage: nothing was read
    if done is not None:
        health.records, health.block_size, health.version = done["records"], done["block_size"], done.get("version")
    if rc is None:
        if stage == "write_wait":  # another process holds LMDB's write lock: not damage
            health.notes.append("another process held the index's write lock: no trial write")
            if done is None and health.damaged is None:
                return health
        else:
            health.damaged = f"reading the index did not finish in {timeout or PROBE_TIMEOUT:.0f} s ({stage})"
    elif rc < 0:
        health.damaged = f"reading the index killed the process with {_signal_name(-rc)} ({stage}: a damaged page)"
    elif health.damaged is None and (rc != 0 or done is None):
        last = err.strip().splitlines()[-1:] or ["no output"]
        health.damaged = f"the index walk failed ({stage}): {last[0]}"
    if health.damaged is None and health.problems:
        health.damaged = f"{done['problems'] if done else len(health.problems)} record(s) do not decode"
    return health


def _main(argv: list[str]) -> int:
    from ..errors import PrefixCacheError
    from ..disk.index import walk_index

    def say(item: dict) -> None:
        print(json.dumps(item), flush=True)

    try:
        walk_index(argv[0], trial_write="--write" in argv[1:], say=say)
    except PrefixCacheError as exc:
        if "index damaged: " in exc.message:
            say({"error": exc.message.split("index damaged: ", 1)[-1]})
        else:  # an entry that is not the store's: LMDB was never given it
            say({"refused": str(exc)})
    except Exception as exc:  # an LMDB error (CorruptedError, PageNotFoundError, ...) is the finding
        say({"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""The index is a cache of the segments: damage to it is a finding, and ``--fix``
rebuilds it from the segment files.

- The sweep: a store of 24 prompts (stored one at a time), then for every 4 KiB page of
  ``index/data.mdb``, on a fresh copy, that page overwritten with random bytes; ``ppc
  check`` and ``ppc check --fix`` run as real subprocesses (no traceback, no death by a
  signal, exit codes as documented), then every prompt restores fully and bitwise equal
  to the cache it was stored from, and a new write goes through.
- A rebuild killed (SIGKILL) at each of its steps: the store says what to run, and a
  rerun finishes it.
- Other processes: a repair refuses to start while the store is open elsewhere; an open
  during a repair gets `StoreBusyError`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import BLOCK, prefill, random_tokens, run_python

from persistent_prefix_cache import PersistentPrefixCache

HERE = Path(__file__).parent
PAGE = 4096


def _prompts() -> list[list[int]]:
    """24 prompts of 1-4 blocks and a partial tail, half sharing a prefix of 1-2 blocks."""
    base = random_tokens(2 * BLOCK, seed=300, first=1)
    out = []
    for i in range(24):
        shared = base[: BLOCK * (i % 3)] if i % 2 else []
        out.append(shared + random_tokens(BLOCK * (1 + i % 4) + 3 * (i % 5), seed=310 + i, first=2 + i))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_dir):
    """The store (24 prompts, one `store()` each) and the original KV of each prompt."""
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(tiny_model_dir)
    root = tmp_path_factory.mktemp("damage")
    prompts = _prompts()
    originals = {}
    with PersistentPrefixCache(root / "store", model, block_size=BLOCK) as store:
        for i, tokens in enumerate(prompts):
            cache = prefill(model, tokens)[1]
            store.store(tokens, cache)
            for j, layer in enumerate(cache):
                keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
                originals[f"{i}.{j}.k"], originals[f"{i}.{j}.v"] = np.array(keys), np.array(values)
    np.savez(root / "originals.npz", **originals)
    return {"root": root, "store": root / "store", "prompts": prompts, "originals": root / "originals.npz"}


def test_every_damaged_index_page_is_found_and_rebuilt(source, tiny_model_dir, tmp_path):
    pages = os.path.getsize(source["store"] / "index" / "data.mdb") // PAGE
    spec = {
        "store": str(source["store"]),
        "work": str(tmp_path),
        "model": str(tiny_model_dir),
        "prompts": source["prompts"],
        "originals": str(source["originals"]),
        "pages": pages,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    lines, first = [], 0
    while first < pages:  # one worker for many pages; restarted after a page it died on
        proc = subprocess.run(
            [sys.executable, str(HERE / "damage_worker.py"), str(tmp_path / "spec.json"), str(first)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        lines += done
        first += len(done)
        if first < pages:
            assert proc.returncode != 0, proc.stderr[-2000:]
            lines.append({"page": first, "worker_died": proc.returncode, "stderr": proc.stderr[-500:]})
            first += 1
    runs = [r for line in lines if "check" in line for r in (line["check"], line["fix"])]
    figures = {
        "pages": pages,
        "found_damaged": sum(1 for line in lines if "check" in line and line["check"]["rc"] == 1),
        "rebuilt": sum(1 for line in lines if line.get("fix", {}).get("rebuilt")),
        "tracebacks": sum(r["traceback"] for r in runs),
        "aborts": sum(r["signal"] is not None for r in runs) + sum("worker_died" in line for line in lines),
        "opens_after_fix": sum(1 for line in lines if line.get("opens")),
        "prompts_restored": sum(line.get("restored", 0) for line in lines),
        "prompts": pages * len(source["prompts"]),
    }
    print("index damage sweep:", json.dumps(figures))
    bad = [line for line in lines if "worker_died" in line or line["failures"] or not line["opens"]]
    assert not bad, bad[:3]
    assert figures["tracebacks"] == 0 and figures["aborts"] == 0
    for line in lines:
        # check: 0 clean, 1 damage found; check --fix: 0 (clean or repaired)
        assert line["check"]["rc"] in (0, 1), line
        assert line["fix"]["rc"] == 0, line
        assert line["check"]["clean"] == (line["check"]["rc"] == 0), line
        # Whatever check found, --fix repaired by a rebuild (the damage was the index's).
        assert line["fix"]["rebuilt"] == (line["check"]["rc"] == 1), line
    assert figures["opens_after_fix"] == pages
    assert figures["prompts_restored"] == figures["prompts"]
    # The sweep means something: most pages in use are found damaged (the rest are free).
    assert figures["found_damaged"] >= pages // 3

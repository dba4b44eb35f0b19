"""One model folder under options that change its KV (issue 31, item 10): ``ppc generate -qa``
(quantized activations) on an unquantized model keeps its blocks apart from the plain model's,
and says so as what it is: the same folder with another option, not "another model".
``ppc inspect`` and ``ppc stats`` show the derived fingerprint with its words whole, and
every name absolute. Real ``ppc`` processes on a tiny model folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from persistent_prefix_cache.cli.output import short_fingerprint
from persistent_prefix_cache.cli.generate import _mlx_lm_has
from persistent_prefix_cache.tiny_model import TEST_MODEL, write_tiny_model

FP = "d95e9cea97717ee8c00dc5ec3953bd9d"


def test_short_fingerprints_keep_their_words():
    assert short_fingerprint(FP) == FP[:16]
    assert short_fingerprint(f"quantize-activations:{FP}") == f"quantize-activations:{FP[:16]}"
    assert short_fingerprint(f"with-draft:{FP}:{FP[::-1]}") == f"with-draft:{FP[:8]}:{FP[::-1][:8]}"
    assert short_fingerprint(None) == "None"


def ppc(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PPC_")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "persistent_prefix_cache", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc


def note(proc: subprocess.CompletedProcess) -> str:
    return next(line for line in proc.stderr.splitlines() if line.startswith("note: "))


@pytest.mark.slow
@pytest.mark.skipif(not _mlx_lm_has("--quantize-activations"), reason="this mlx-lm has no --quantize-activations")
def test_quantized_activations_are_the_same_folder_with_another_option(tmp_path):
    write_tiny_model(tmp_path / "model", seed=0, **TEST_MODEL)
    folder = str(tmp_path / "model")
    generate = ["generate", "--model", "model", "--prompt", "Why keep the books near the door?", "-m", "3"]

    def made(option: str, run: str) -> str:
        return (f"note: store {tmp_path / '{}'} holds this model's KV only as made {option} --quantize-activations; "
                f"this run is {run} --quantize-activations, which changes the KV (the store keeps them apart): "
                "nothing will be restored")  # fmt: skip

    ppc(*generate, "--store", "plain", cwd=tmp_path)  # relative paths: the names are absolute all the same
    qa = ppc(*generate, "--store", "plain", "-qa", cwd=tmp_path)
    assert note(qa) == made("without", "with").format("plain")
    assert "other model" not in qa.stderr
    ppc(*generate, "--store", "qa", "-qa", cwd=tmp_path)
    plain = ppc(*generate, "--store", "qa", cwd=tmp_path)
    assert note(plain) == made("with", "without").format("qa")

    # Both rows: the folder's absolute name (the -qa one says so), the fingerprint's words whole.
    inspect = ppc("inspect", "--store", "plain", cwd=tmp_path).stdout
    rows = inspect.split("models:\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    cells = sorted(re.split(r"\s{2,}", row)[1:3] for row in rows)
    assert len(cells) == 2
    (fp, name), (qa_fp, qa_name) = cells
    assert re.fullmatch(r"[0-9a-f]{16}", fp) and name == folder
    assert qa_fp == f"quantize-activations:{fp}" and qa_name == f"{folder} + quantized activations"
    stats = ppc("stats", "--store", "plain", cwd=tmp_path).stdout
    assert f"{folder} + quantized activations  quantize-activations:{fp}" in stats
    assert f"{folder}  " in stats and "quantize-activat " not in stats

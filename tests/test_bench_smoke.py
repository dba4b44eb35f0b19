"""The benchmark runs end to end: `tools/bench.py --smoke --json` reports every figure.

No timing is asserted (speed is the benchmark's business, not a test's): only that each
figure and ratio is present, finite and positive.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench.py"


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """``tools/<name>`` run in a process of its own; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / name), *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def phases_of(line: str) -> dict[str, float]:
    """A tool's ``... phases (ms): name ms, name ms, ...`` line as a dict."""
    return {k: float(v) for k, v in (p.rsplit(" ", 1) for p in line.split("(ms): ", 1)[1].split(", "))}


CASE_FIGURES = [
    "limit_read_warm",
    "limit_write_fsync",
    "limit_memcpy",
    "limit_read_warm_threads",
    "peer_mlx_save_fsync",
    "peer_mlx_load_warm",
    "ours_store_sync",
    "ours_store_async_caller",
    "ours_store_async_total",
    "ours_fetch_disk_warm",
    "ours_fetch_ram",
    "ours_fetch_fresh_2nd",
    "ours_fetch_fresh_3rd",
    "ours_fetch_fresh_filled",
    "ours_fetch_skipped",
    "peer_mlx_load_warm_step",
    "ours_fetch_disk_warm_step",
]
COLD_FIGURES = ["limit_read_cold", "peer_mlx_load_cold", "ours_fetch_disk_cold"]
CASE_RATIOS = [
    "disk_warm_vs_raw_read",
    "ram_vs_memcpy",
    "fresh_3rd_vs_raw_read",
    "fresh_2nd_vs_disk_warm",
    "fresh_filled_vs_raw_read",
    "disk_warm_step_vs_mlx_load_warm_step",
    "store_sync_vs_raw_write_fsync",
    "store_async_caller_vs_sync",
    "disk_warm_vs_mlx_load_warm",
    "store_sync_vs_mlx_save_fsync",
]
COLD_RATIOS = ["disk_cold_vs_raw_cold_read", "disk_cold_vs_mlx_load_cold"]
FIGURE_FIELDS = ["median_s", "min_s", "max_s", "gbps", "gbps_min", "gbps_max", "bytes"]


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_bench_smoke_reports_every_figure(tmp_path):
    plot = tmp_path / "restore.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--smoke",
            "--json",
            "--dir",
            str(tmp_path),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)

    cold = hasattr(os, "posix_fadvise")
    figures = CASE_FIGURES + (COLD_FIGURES if cold else [])
    ratios = CASE_RATIOS + (COLD_RATIOS if cold else [])
    assert [case["name"] for case in result["cases"]] == ["float16", "bfloat16"]
    for case in result["cases"]:
        for name in figures:
            figure = case["figures"][name]
            for field in FIGURE_FIELDS:
                assert positive(figure[field]), (case["name"], name, field, figure)
            assert figure["min_s"] <= figure["median_s"] <= figure["max_s"]
        for name in ratios:
            assert positive(case["ratios"][name]["value"]), (case["name"], name)

    lookup = result["lookup"]
    for field in ("median_s", "min_s", "max_s", "blocks_in_store", "matched_tokens"):
        assert positive(lookup[field]), (field, lookup)
    assert lookup["blocks_in_store"] >= result["config"]["lookup_blocks"]

    shared = result["shared_prefix"]
    for field in ("distinct_kv_bytes", "ours_bytes", "ours_block_file_bytes", "mlx_lm_files_bytes"):
        assert positive(shared[field]), (field, shared)
    for name in ("lookup_ms", "shared_prefix_vs_distinct_kv", "mlx_lm_files_vs_ours"):
        assert positive(result["ratios"][name]["value"]), name

    precompute = result["precompute"]  # prefill + store against the disk's limit
    for name in ("prefill", "ours", "mlx_save", "disk_limit"):
        assert positive(precompute[f"{name}_s"]) and positive(precompute[f"{name}_tokens_per_s"]), name
    for name in ("precompute_vs_disk_limit", "precompute_vs_attainable", "precompute_vs_mlx_save_fsync",
                 "model_store_sync_vs_raw_write_fsync"):  # fmt: skip
        assert positive(result["ratios"][name]["value"]), name

    sweep = result["sweep"]
    assert sweep["tokens"] == result["config"]["sweep"]
    for key in ("ours_fetch_disk_warm_gbps", "ours_fetch_ram_gbps", "peer_mlx_load_warm_gbps"):
        assert len(sweep[key]) == len(sweep["tokens"]) and all(positive(v) for v in sweep[key])

    remote = result.get("remote")
    if remote is None:  # no redis-server or redis-py here: said in a note
        assert any("remote tier is not measured" in note for note in result["notes"])
    else:
        for name in ("ours_fetch_remote", "ours_fetch_disk_warm", "ours_store_async_caller",
                     "ours_store_async_caller_remote"):  # fmt: skip
            for field in FIGURE_FIELDS:
                assert positive(remote["figures"][name][field]), (name, field)
        for name in ("remote_vs_disk_warm", "probe_32k_ms", "store_publish_caller_vs_async"):
            assert positive(remote["ratios"][name]["value"]), name
        assert remote["probe_32k"]["blocks"] == 32768 // result["config"]["block_size"]
        assert remote["batch_bytes"] > 0 and remote["batch_blocks"] >= 1
        assert all(positive(v) for v in remote["batch_sweep_gbps"].values())

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any("matplotlib" in note for note in result["notes"])
    else:
        assert plot.stat().st_size > 0
    # The scratch folder is removed.
    assert not list(tmp_path.glob("ppc-bench-*"))


@pytest.mark.slow
def test_gpu_case_reports_the_restarted_rows():
    """`tools/gpu_bench.py --small` (the GPU case's script, on whatever device is here)
    reports the fresh handle's 1st/2nd/3rd fetch against the cold prefill, the 3rd
    served from the RAM tier."""
    proc = run_tool("gpu_bench.py", "--small", "--tokens", "256", "--repeat", "1", "--json")
    (case,) = json.loads(proc.stdout)["cases"]
    for which in ("1st", "2nd", "3rd"):
        value = case[f"ours_fresh_{which}_forward_vs_cold"]
        assert math.isfinite(value) and value > 0
    assert case["fresh_3rd_restored_tokens"] == 256
    assert case["fresh_blocks_served_from_ram"] == 4  # 256 tokens in blocks of 64
    assert "3rd / cold prefill" in proc.stderr


def test_prefill_pieces_phases_report_what_each_store_calls():
    """``tools/prefill_pieces.py --phases`` wraps what `store()` calls on the caller's thread
    (methods, a static method and functions imported by name) and reports each: every
    line names the outer call, and an inner call never takes longer than the store it ran in."""
    proc = run_tool("prefill_pieces.py", "--small", "--tokens", "64", "--rounds", "2", "--phases")
    lines = [line for line in proc.stdout.splitlines() if "phases (ms):" in line]
    assert [line.split(", phases")[0].strip() for line in lines] == [
        "store() on a new handle",
        "store() 1 of 3 in a row",
        "store() 2 of 3 in a row",
        "store() 3 of 3 in a row",
    ]
    for line in lines:
        spent = phases_of(line)
        for inner in ("Layout.new_blocks", "Layout.evaluate", "MemoryTier.put", "WriteBack.write", "chain_keys"):
            assert 0 <= spent[inner] <= spent["Storer.store"], (inner, line)


def test_cuda_probes_say_off_cuda_that_they_need_it():
    from persistent_prefix_cache.device import cuda

    if cuda.on_cuda():
        pytest.skip("a CUDA device: the probes run")
    tool = BENCH.parent / "cuda_probes.py"
    for probe in ("link", "stage", "alloc"):
        proc = subprocess.run([sys.executable, str(tool), probe], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and not proc.stdout, proc.stderr


def test_admit_cost_times_the_admission_inside_each_fetch():
    """``tools/admit_cost.py`` fetches one prompt three times per handle: the 2nd disk hit
    admits (its phases name `join_admitted` and `_copies`, each inside the fetch's restore),
    the 3rd comes from the RAM tier and admits nothing."""
    proc = run_tool("admit_cost.py", "--tokens", "256", "--rounds", "1")
    lines = proc.stdout.splitlines()
    heads = [line.split(":")[0] for line in lines if line.startswith("round")]
    assert heads == ["round 1, fetch 1 (from disk)", "round 1, fetch 2 (from disk)", "round 1, fetch 3 (from ram)"]
    spent = [phases_of(line) for line in lines if "phases (ms):" in line]
    assert 0 <= spent[1]["_copies"] <= spent[1]["join_admitted"] <= spent[1]["restore"]
    assert "_copies" not in spent[2] and spent[2]["restore"] > 0


def test_first_restore_checks_each_fetch_bitwise_and_times_its_phases():
    """``tools/first_restore.py --small ... after+step+check+phases``: every fetch restores
    mlx-lm's prefill bit for bit, and its phases sit inside its restore."""
    proc = run_tool("first_restore.py", "--small", "--tokens", "64,192", "after+step+check+phases")
    assert "failed" not in proc.stdout, proc.stdout[-3000:]
    fetches = [line for line in proc.stdout.splitlines() if " tokens: " in line and "from " in line]
    assert len(fetches) == 5 and all(line.endswith("bitwise True") for line in fetches), fetches
    assert "its next token" in proc.stdout
    for line in [line for line in proc.stdout.splitlines() if "phases (ms):" in line]:
        spent = phases_of(line)
        assert 0 <= spent["read_path"] <= spent["restore"], line


def test_store_turns_stores_every_new_block_of_each_prompt_and_turn():
    """``tools/store_turns.py``: a prompt of 130 tokens is 3 blocks, stored on 3 handles'
    3 stores (27); a chat of 512 tokens in turns of 128 stores 2 new blocks a turn (8 a round)."""
    proc = run_tool("store_turns.py", "--tokens", "130", "--chat", "512", "--turn", "128", "--rounds", "3")
    lines = proc.stdout.splitlines()
    prompt = next(line for line in lines if line.startswith("prompt"))
    assert prompt.endswith("(27 blocks stored)"), prompt
    chat = next(line for line in lines if line.startswith("chat, all"))
    assert chat.startswith("chat, all 4 turns:") and chat.endswith("(24 blocks stored)"), chat

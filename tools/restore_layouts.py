#!/usr/bin/env python3
"""How a restore after a restart depends on how the prompt's KV lies on disk, and where
`prefill()`'s resume spends its time (a diagnostic for row 4 of `tools/user_paths.py`).

Builds stores of one prompt (mlx-lm's prefill of a random 8B-shaped llama; ``--small``: 4
layers, for a CPU), each holding the same KV laid out another way:

- ``once``: `prefill()` on an empty store (one segment; its forwards teach the costs);
- ``tail``: the prompt less its last ``--tail`` tokens, then all of it: two segments, the
  second small (row 4's prompt stored block by block ended so on H100s, [488, 24] MiB);
- ``halves``, ``quarters``: 2 and 4 equal segments (the writer's merges off while built);
- ``blocks``: one `store()` per block, back to back (segments as the writer leaves them).

Then ``--rounds`` new processes. Each first prefills other tokens of the prompt's length
(kernels warm for both sides), then times, synchronized:

1. ``prefill()`` of the prompt with default options, as row 4's resume, on ``once`` and
   on ``tail`` (each on a new handle, their order alternating by round: which is the
   process's first restore), with its phases (`RESUME_PHASES`, the caller's thread);
2. mlx-lm's prefill of the prompt (the recompute row 4 compares with);
3. a fetch of each layout on a new handle (``cost_model=False``), in rotated order, with
   `first_restore.FETCH_PHASES`.

Prints each layout's segments (MiB) and medians (ms), phases included.

``--keep-gil on`` (``both``: each round once with, once without) sets
`device.cuda_driver.ENQUEUE_KEEPS_GIL` in the restarted processes.

    python3 tools/restore_layouts.py [--tokens 4096] [--tail 192] [--rounds 3] [--keep-gil off|on|both] [--small]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from first_restore import FETCH_PHASES  # noqa: E402
from user_paths_bench import Phases, clock, mlx_prefill, prompt_ids  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache, prefill  # noqa: E402
from persistent_prefix_cache.device import cuda_driver  # noqa: E402
from persistent_prefix_cache.disk import compaction  # noqa: E402

LAYOUTS = ["once", "tail", "halves", "quarters", "blocks"]
# What `prefill()`'s resume is timed in, beyond a fetch's phases (module, attribute path).
RESUME_PHASES = [
    ("persistent_prefix_cache.store", "PersistentPrefixCache.fetch"),
    ("persistent_prefix_cache.core.cost_model", "CostModel.cut"),
    ("persistent_prefix_cache.core.cost_model", "CostModel.timed"),
    ("persistent_prefix_cache.core.cost_model", "CostModel.save_soon"),
    *FETCH_PHASES,
    ("mlx_lm.models.llama", "Model.__call__"),
    ("persistent_prefix_cache.store", "PersistentPrefixCache.observe_prefill"),
    ("persistent_prefix_cache.store", "PersistentPrefixCache.store"),
]


def build(model, root: Path, n: int, tail: int) -> dict[str, list[float]]:
    """Every layout's store under `root`; returns each one's segment sizes."""
    ids = prompt_ids(model.args.vocab_size, n, seed=n)
    with PersistentPrefixCache(root / "once", model) as store:
        prefill(model, ids, store)
    cache = mlx_prefill(model, ids)  # a sliced cache may hold more than the tokens stored from it
    ratios = compaction.MERGE_RATIO, compaction.TIDY_RATIO
    for name in LAYOUTS[1:]:
        if name != "blocks":  # fixed cuts, each its own segment: no merge may join them (the close's neither)
            compaction.MERGE_RATIO = compaction.TIDY_RATIO = 0.0
        try:
            with PersistentPrefixCache(root / name, model) as store:
                bs = store.block_size
                parts = {"tail": [n - tail], "halves": [n // 2], "quarters": [n // 4, n // 2, 3 * n // 4]}
                for end in parts.get(name, range(bs, n, bs)):
                    store.store(ids[:end], cache)
                    if name != "blocks":
                        store.flush()
                store.store(ids, cache)
        finally:
            compaction.MERGE_RATIO, compaction.TIDY_RATIO = ratios
    return {name: sorted(round(f.stat().st_size / 2**20, 1) for f in (root / name).rglob("*.seg")) for name in LAYOUTS}


# What the cost model knew when it chose to resume (`PersistentPrefixCache.stats`), printed
# per round: a resume that cost more than the recompute says which figure misled it.
COST_FIGURES = ("prefill_tokens_per_s", "prefill_per_forward_s", "restore_bytes_per_s_disk", "restore_fixed_s_disk",
                "first_restore_s_disk", "first_forward_s_per_token", "skipped_slower")  # fmt: skip


def child(model, root: Path, n: int, round_: int) -> dict:
    """One restarted process's figures (see the module's docstring)."""
    phaser = Phases(RESUME_PHASES)
    ids = prompt_ids(model.args.vocab_size, n, seed=n)
    mlx_prefill(model, [(t + 1) % model.args.vocab_size for t in ids])
    out: dict = {"resume": {}, "fetch": {}}

    def timed(fn) -> tuple[float, dict]:
        phaser.take()
        phaser.on = True
        try:
            seconds = clock(fn)[0]
        finally:
            phaser.on = False
        return seconds * 1000, {k: round(v, 2) for k, v in phaser.take().items()}

    order = ["once", "tail"] if round_ % 2 == 0 else ["tail", "once"]
    for name in order:
        with PersistentPrefixCache(root / name, model) as store:
            ms, phases = timed(lambda: prefill(model, ids, store))
            stats = store.stats()
            out["resume"][name] = {"ms": ms, "phases": phases, "saved": stats["tokens_saved"],
                                   "costs": {k: stats.get(k) for k in COST_FIGURES}}  # fmt: skip
    out["recompute_ms"] = clock(lambda: mlx_prefill(model, ids))[0] * 1000
    shift = round_ % len(LAYOUTS)
    for name in LAYOUTS[shift:] + LAYOUTS[:shift]:
        with PersistentPrefixCache(root / name, model, cost_model=False) as store:

            def fetch() -> None:
                cache, _ = store.fetch(ids)
                mx.eval([c.state for c in cache])

            ms, phases = timed(fetch)
            out["fetch"][name] = {"ms": ms, "phases": phases}
    return out


def _figure(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def show(label: str, rows: list[dict]) -> None:
    """Medians of the rows' ms and of each phase (ms)."""
    names = [path for _, path in RESUME_PHASES if any(path in r["phases"] for r in rows)]
    med = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in names}
    ms = statistics.median(r["ms"] for r in rows)
    each = ", ".join(f"{r['ms']:.0f}" for r in rows)
    print(f"  {label}: {ms:.1f} ms ({each})")
    print("    " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))


def report(results: list[dict], segments: dict[str, list[float]], label: str) -> None:
    """The rounds' medians: the resumes, then each layout's fetch."""
    print(f"{label}mlx-lm's prefill (recompute): {statistics.median(r['recompute_ms'] for r in results):.1f} ms")
    print("prefill() resuming (default options; tokens restored: "
          + ", ".join(f"{k} {sorted({r['resume'][k]['saved'] for r in results})}" for k in ("once", "tail")) + ")")  # fmt: skip
    for name in ("once", "tail"):
        show(name, [r["resume"][name] for r in results])
        for i, r in enumerate(results):
            figures = ", ".join(f"{k} {_figure(v)}" for k, v in r["resume"][name]["costs"].items())
            print(f"    round {i + 1}, after it: {figures}")
        show(f"{name}, when the process's first", [r["resume"][name] for i, r in enumerate(results)
                                                   if (i % 2 == 0) == (name == "once")])  # fmt: skip
    print("fetch on a new handle (cost_model=False):")
    for name in LAYOUTS:
        show(f"{name} {segments[name]} MiB", [r["fetch"][name] for r in results])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="the prompt's length (default 4096)")
    p.add_argument("--tail", type=int, default=192, help="tokens of the small second segment (default 192)")
    p.add_argument("--rounds", type=int, default=3, help="restarted processes (default 3)")
    p.add_argument("--small", action="store_true", help="a 4-layer model (to check the tool on a CPU)")
    p.add_argument(
        "--keep-gil", choices=["off", "on", "both"], default="off",
        help="device.cuda_driver.ENQUEUE_KEEPS_GIL in the restarted processes (both: each round once with, once without)",
    )  # fmt: skip
    p.add_argument("--child", nargs=3, metavar=("DIR", "ROUND", "KEEP_GIL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 0 < args.tail < args.tokens:
        p.error("--tail must be between 1 and --tokens")
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    if args.child:
        cuda_driver.ENQUEUE_KEEPS_GIL = args.child[2] == "on"
        print("RESULT", json.dumps(child(model, Path(args.child[0]), args.tokens, int(args.child[1]))))
        return 0
    root = Path(tempfile.mkdtemp(prefix="ppc-restore-layouts-"))
    try:
        segments = build(model, root, args.tokens, args.tail)
        del model
        mx.clear_cache()  # the children load a model of their own
        modes = ["off", "on"] if args.keep_gil == "both" else [args.keep_gil]
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        for r in range(args.rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                command = [sys.executable, __file__, "--tokens", str(args.tokens), "--child", str(root), str(r), mode]
                done = subprocess.run(command + (["--small"] if args.small else []), capture_output=True, text=True)
                got = [line[len("RESULT ") :] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not got:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                results[mode].append(json.loads(got[-1]))
        print(f"{args.tokens} tokens, {args.rounds} restarted processes; mlx {mx.__version__} on {mx.default_device()}")
        for mode, rows in results.items():
            report(rows, segments, f"ENQUEUE_KEEPS_GIL {mode}: " if len(modes) > 1 else "")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The measuring kit of the benchmark of the paths users run (`tools/user_paths.py`, whose
rows 1 and 5-7 are in `tools/user_paths_cli.py`): the modes' plans, the clock, interleaved
rounds, the no-cache prefill every ratio is taken against, and `Bench`, one run's rows.
Both row modules import it; it imports neither (only `Bench.run_child` names
``user_paths.py``, the script a restarted process runs)."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

SCRIPT = Path(__file__).resolve().parent / "user_paths.py"  # what ``--child`` runs

# The small model: a llama the 2-core VM prefills 2k tokens of in ~3 s (4 KiB of KV a token).
SMALL_SHAPE = dict(family="llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4, vocab_size=512)
# The serve rows' model on a GPU: a 3B-shaped llama folder (the lent H200's recipe uses this shape).
SHAPE_3B = dict(family="llama", hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                intermediate_size=8192, dtype="bfloat16")  # fmt: skip
ROW_NAMES = {
    1: "README library example",
    2: "prefill() on an empty store",
    3: "prefill() after a restart",
    4: "a chat of 8 turns, restored after a restart",
    5: "ppc serve restarted",
    6: "ppc generate",
    7: "ppc precompute",
}


@dataclass
class Plan:
    """The sizes of one mode (tokens are prompt lengths)."""

    prefill_tokens: list[int]  # rows 2 and 3
    chat_turns: int
    chat_user: int  # tokens a turn's user text adds
    chat_answer: int  # and its answer
    # Fresh handles per store in each restarted process. On the CPU a restore of row 4's chat
    # takes ~3 ms, spread ±30 % between handles: 3 a process left row 4's restore-speed ratio
    # between 0.83 and 1.07 over runs of an unchanged store (docs/performance.md).
    chat_rounds: int
    serve_tokens: list[int]
    generate_tokens: int
    generate_max_tokens: int
    precompute_prompts: int
    precompute_tokens: int
    repeat: int
    warmup: int
    # Row 1's rounds (0: `repeat`): it times whole processes, whose wall time varies more
    # than 3 rounds hold to 5 % on the 2-core VM (docs/performance.md, fifth day).
    readme_repeat: int = 0
    # Row 2's rounds (0: `repeat`): on a GPU its calls take 25-700 ms and mlx-lm's own
    # spread 23-29 ms at 256 tokens in one call, more than the 5 % the row asks of us; on
    # the 2-core VM 3 rounds put the same code at 0.93-1.09 at 256 tokens in three runs.
    prefill_repeat: int = 0


PLANS = {
    "cpu": Plan([256, 1024, 2048], 8, 160, 96, 12, [512, 2048], 1024, 8, 4, 1024, repeat=3, warmup=1, readme_repeat=5,
                prefill_repeat=7),
    "smoke": Plan([128], 3, 48, 32, 1, [128], 128, 2, 2, 128, repeat=1, warmup=0),
    "gpu": Plan([256, 512, 1024, 4096, 16384], 8, 384, 128, 3, [2048, 8192], 4096, 8, 8, 4096, repeat=2, warmup=1,
                prefill_repeat=5),
}  # fmt: skip


# -- measuring ------------------------------------------------------------------------------


class Phases:
    """Seconds spent in each of `phases` while `on`, on the thread that made it only (the
    caller's: what a user waits for), each function summed over the calls.

    Args:
        phases: ``(module, attribute path)`` pairs, each wrapped in place for the process
            (a function imported by name elsewhere is wrapped where it is called from).
    """

    def __init__(self, phases: list[tuple[str, str]]) -> None:
        self.on, self.spent = False, defaultdict(float)
        self._main = threading.get_ident()
        for module, path in phases:
            owner: object = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            wrapped = self._wrap(path, getattr(owner, name))
            static = isinstance(inspect.getattr_static(owner, name), staticmethod)
            setattr(owner, name, staticmethod(wrapped) if static else wrapped)

    def _wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on or threading.get_ident() != self._main:
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] += time.perf_counter() - started

        return timed

    def take(self) -> dict[str, float]:
        """The sums since the last take (ms), and zero them."""
        out = {k: v * 1000 for k, v in self.spent.items()}
        self.spent.clear()
        return out


def threads_seconds(work: Callable[[], None], threads: int) -> float:
    """Seconds `threads` threads take to run `work` each, started together, all joined."""
    workers = [threading.Thread(target=work) for _ in range(threads)]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - started


def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds `fn` takes (the device synchronized on both sides), and what it returned."""
    mx.synchronize()
    started = time.perf_counter()
    out = fn()
    mx.synchronize()
    return time.perf_counter() - started, out


def interleave(ops: dict[str, Callable[[], dict[str, float]]], repeat: int, warmup: int) -> dict[str, list[float]]:
    """Run `ops` round after round, each round in another order (rotated); seconds by name.

    Each op times itself (its setup is not timed) and returns ``{figure: seconds}``: one
    op may time several figures that must run in sequence (a cold run, then a warm one).
    The first `warmup` rounds are dropped.
    """
    names = list(ops)
    out: dict[str, list[float]] = {}
    for round_ in range(warmup + repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            figures = ops[name]()
            if round_ >= warmup:
                for key, seconds in figures.items():
                    out.setdefault(key, []).append(seconds)
    return out


def per_round(num: list[float], den: list[float]) -> float:
    """Median over rounds of num / den within a round."""
    return statistics.median(a / b for a, b in zip(num, den))


def median(values: list[float]) -> float:
    return statistics.median(values)


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """`n` token ids drawn at random (seeded): a prompt no other seed shares a block with."""
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def mlx_prefill(model: Any, ids: list[int]) -> list:
    """No cache: mlx-lm's own prefill (``generate_step``, 2048-token steps, as ``mlx_lm
    generate`` runs it) up to the first token's logits; returns the cache it filled."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache):
        pass  # max_tokens=0: the prompt and its first token are evaluated, nothing yielded
    return cache


def kv_bytes(cache: list) -> int:
    """Bytes of KV a llama's cache holds for its tokens (its buffers may be longer)."""
    return sum(c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes for c in cache)


# -- the model a row runs --------------------------------------------------------------------


def load_library_model(spec: dict) -> tuple[Any, dict]:
    """The model of rows 2-4 and the options a user passes with it (`model_path` for a folder).

    Args:
        spec: ``{"folder": path}`` (loaded with ``mlx_lm.load``) or ``{"shape": "SHAPE_8B"}``
            (``tools/gpu_bench.py``: random weights, seeded, so every process builds the same).
    """
    if "folder" in spec:
        from mlx_lm import load

        model, _ = load(spec["folder"])
        return model, {"model_path": spec["folder"]}
    import gpu_bench

    return gpu_bench.build(getattr(gpu_bench, spec["shape"])), {}


class Bench:
    """One run: its mode and plan, scratch folders, models, and the rows measured."""

    def __init__(self, args: argparse.Namespace, work: Path):
        self.args = args
        self.mode = "gpu" if args.gpu else "smoke" if args.smoke else "cpu"
        self.small = bool(args.small)  # --gpu's paths with small shapes and sizes (to check them on a CPU)
        plan = PLANS["smoke" if self.small else self.mode]
        if args.tokens:
            plan = replace(plan, prefill_tokens=[int(t) for t in args.tokens.split(",")])
        if args.repeat:
            plan = replace(plan, repeat=args.repeat, readme_repeat=0, prefill_repeat=0)
        self.plan = plan
        self.work = work
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self._counter = 0
        self._folder: Path | None = None
        self._library: tuple[Any, dict, dict] | None = None
        self.prefilled: dict[int, Path] = {}  # stores row 2 left, filled by prefill() (for row 3)

    def scratch(self, name: str) -> Path:
        self._counter += 1
        return self.work / f"{name}-{self._counter}"

    def log(self, text: str) -> None:
        print(f"user_paths: {text}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.log(text)

    @property
    def folder(self) -> Path:
        """The model folder of the subprocess rows (1, 5-7); also rows 2-4's model off the GPU."""
        if self._folder is None:
            from persistent_prefix_cache.tiny_model import write_tiny_model

            shape = SHAPE_3B if self.mode == "gpu" and not self.small else SMALL_SHAPE
            self.log(f"writing a model folder {shape} ...")
            self._folder = write_tiny_model(self.work / "model", seed=0, **shape)
        return self._folder

    def library(self) -> tuple[Any, dict, dict]:
        """(model, open options, spec) of rows 2-4."""
        if self._library is None:
            if self.mode == "gpu":  # built in-process: no folder, so the default fingerprint (weights hashed)
                spec = {"shape": "SMALL" if self.small else "SHAPE_8B"}
            else:
                spec = {"folder": str(self.folder)}
            self.log(f"loading the library rows' model {spec} ...")
            model, options = load_library_model(spec)
            self._library = (model, options, spec)
        return self._library

    def add(self, row: int, what: str, figure: float, baseline: float, ratio: float, target: str, *,
            unit: str = "s", baseline_is: str = "", **detail: Any) -> None:  # fmt: skip
        """Record one row: ours (`figure`), no cache (`baseline`), their `ratio` (per round)."""
        entry = {"row": row, "path": ROW_NAMES[row], "what": what, "figure": figure, "baseline": baseline,
                 "ratio": ratio, "target": target, "unit": unit, "baseline_is": baseline_is, "detail": detail}  # fmt: skip
        self.rows.append(entry)
        self.log(
            f"row {row} {what}: {fmt_value(figure, unit)} vs {fmt_value(baseline, unit)}, ratio {ratio:.3f} ({target})"
        )

    def run_child(self, spec: dict, name: str) -> dict:
        """Run ``user_paths.py --child`` (a new process: a restart) on `spec`; its JSON."""
        path = self.scratch(name).with_suffix(".json")
        path.write_text(json.dumps(spec))
        log = path.with_suffix(".log")
        # This process's freed buffers stay in MLX's cache (up to most of the device): give
        # them back, or a child loading a second copy of an 8B model ran out of an H100's 80 GB.
        mx.clear_cache()
        with open(log, "w") as err:
            proc = subprocess.run([sys.executable, str(SCRIPT), "--child", str(path)], stdout=subprocess.PIPE,
                                  stderr=err, text=True, timeout=900)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"child {name} exited {proc.returncode}: {log.read_text()[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f} s"
    return f"{value:,.0f} {unit.replace('tokens', 'tok')}"

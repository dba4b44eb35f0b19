#!/usr/bin/env python3
"""Which part of a store makes prefill() slower than mlx-lm's prefill (a diagnostic).

Times, per length and interleaved round by round (the first round dropped), the same
prompt through variants that add one part of the store at a time: mlx-lm's prefill;
the same loop by hand, on the default stream and on a stream of its own (as
``generate_step``); `prefill()` with a store that does nothing; with a handle open
beside it; with a real handle whose `store()` does nothing (its fetch and cost model
run), and with the cost model off; with the real `store()` (RAM tier off, on, on a
stream of its own, and right after another prompt's `prefill()` on the same handle: its
writer busy during the timed call, where every other variant's writes are flushed before
the next call; that with the writer flushed first, and with Python's thread switch
interval at 0.2 ms instead of 5); and on a handle opened just before each call (its fingerprint hashed),
without and with ``mx.clear_cache()`` after the open, with its fingerprint's lane sums
reduced in small pieces and MLX's buffer cache left as it was, hashed by MLX ops where
CUDA takes the lane kernel, with its fingerprint given
(nothing hashed at the open), and that with the cache cleared after the open. ``--only`` keeps the variants whose names hold one of its
words. Each line: the median, its ratio to mlx-lm's prefill, every round.

    python tools/prefill_variants.py [--small] [--tokens 256,4096,16384] [--rounds 5] [--only "opened,back"]

``--small`` runs a 4-layer model (to check the tool on a CPU); the default is the 8B
shape of ``tools/gpu_bench.py`` in bf16 (a GPU).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from user_paths_bench import mlx_prefill, prompt_ids  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache, prefill  # noqa: E402
from persistent_prefix_cache import weights_hash  # noqa: E402


class NullStore:
    """A store that holds nothing and learns nothing: prefill()'s own loop alone."""

    block_size = 64

    def __init__(self, model: Any):
        self.model = model

    def fetch(self, ids):
        return None, ids

    def make_cache(self):
        return make_prompt_cache(self.model)

    def observe_prefill(self, *args, **kwargs) -> None:
        pass

    def store(self, *args, **kwargs) -> int:
        return 0

    def resumable_step(self):
        return None


class NoStore:
    """A real handle whose `store()` does nothing (its fetch and cost model run)."""

    def __init__(self, real: PersistentPrefixCache):
        self.real, self.block_size = real, real.block_size

    def store(self, *args, **kwargs) -> int:
        return 0

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def by_hand(model: Any, ids: list[int], stream=None) -> None:
    """mlx-lm's prefill loop written out: 2048-token steps, then the last token."""
    cache = make_prompt_cache(model)

    def body() -> None:
        pos = 0
        while len(ids) - pos > 1:
            end = min(pos + 2048, len(ids) - 1)
            model(mx.array(ids[pos:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            pos = end
            mx.clear_cache()
        mx.eval(model(mx.array(ids[pos:])[None], cache=cache)[:, -1, :])

    if stream is None:
        body()
    else:
        with mx.stream(stream):
            body()


def variants(model: Any, work: Path) -> tuple[dict[str, Callable[[list[int]], Any]], dict]:
    """The variants by name; each returns its own timing (seconds) or None (timed outside)."""
    opened: dict[str, PersistentPrefixCache] = {}
    stream = mx.new_stream(mx.default_device())
    count = [0]

    def handle(name: str, **options: Any) -> PersistentPrefixCache:
        if name not in opened:
            opened[name] = PersistentPrefixCache(work / name, model, **options)
        return opened[name]

    def in_stream(ids: list[int]) -> None:
        with mx.stream(stream):
            prefill(model, ids, handle("real-stream"))

    def timed_prefill(store: PersistentPrefixCache, ids: list[int]) -> float:
        """Seconds of `prefill()` of `ids` on `store`, the device synchronized on both sides."""
        mx.synchronize()
        started = time.perf_counter()
        prefill(model, ids, store)
        mx.synchronize()
        return time.perf_counter() - started

    def back_to_back(flushed: bool = False, switch: float | None = None) -> Callable[[list[int]], float]:
        # As a program that prefills prompt after prompt: the call before (untimed, another
        # prompt) leaves its writer copying and writing while the timed call computes.
        # ``flushed``: the writer done first (what is left is the call before's MLX state);
        # ``switch``: Python's thread switch interval meanwhile (5 ms by default: a thread
        # holding the GIL keeps a caller back from its next kernel launch that long).
        def run(ids: list[int]) -> float:
            store = handle(f"back-to-back{'-flushed' if flushed else ''}{'' if switch is None else f'-{switch}'}")
            before = sys.getswitchinterval()
            if switch is not None:
                sys.setswitchinterval(switch)
            try:
                prefill(model, [(t + 1) % model.args.vocab_size for t in ids], store)
                if flushed:
                    store.flush()
                return timed_prefill(store, ids)
            finally:
                sys.setswitchinterval(before)

        return run

    def fresh(clear: bool, fingerprint: str | None = None, hashing: dict | None = None) -> Callable[[list[int]], float]:
        def run(ids: list[int]) -> float:
            count[0] += 1
            path = work / f"fresh-{count[0]}"
            with weights_hash.lane_settings(hashing or {}):
                store = PersistentPrefixCache(path, model, fingerprint=fingerprint)
            if clear:
                mx.clear_cache()
            seconds = timed_prefill(store, ids)
            store.close()
            shutil.rmtree(path, ignore_errors=True)
            return seconds

        return run

    table: dict[str, Callable[[list[int]], Any]] = {
        "mlx-lm prefill": lambda ids: mlx_prefill(model, ids),
        "by hand": lambda ids: by_hand(model, ids),
        "by hand, own stream": lambda ids: by_hand(model, ids, stream),
        "prefill(), null store": lambda ids: prefill(model, ids, NullStore(model)),
        "... a handle open beside": lambda ids: (handle("idle"), prefill(model, ids, NullStore(model)))[1],
        "real handle, store() off": lambda ids: prefill(model, ids, NoStore(handle("no-store"))),
        "... cost model off too": lambda ids: prefill(model, ids, NoStore(handle("no-cost", cost_model=False))),
        "real store(), RAM tier off": lambda ids: prefill(model, ids, handle("ram-off", memory_bytes=0)),
        "real store()": lambda ids: prefill(model, ids, handle("real")),
        "real store(), own stream": in_stream,
        "real store(), back to back": back_to_back(),
        "... writer flushed between": back_to_back(flushed=True),
        "... thread switch 0.2 ms": back_to_back(switch=0.0002),
        "handle opened before": fresh(False),
        "... and MLX cache cleared": fresh(True),
        # Given, the fingerprint is not hashed at open (on a GPU: lane sums of every weight).
        "... fingerprint given": fresh(False, "given-" + "0" * 26),
        "... given, MLX cache cleared": fresh(True, "given-" + "0" * 26),
        # The lane sums reduced 1M words a call, MLX's cache left as it was (the same value).
        "... hashed in small pieces": fresh(False, hashing=weights_hash.SMALL_PIECES),
        # By MLX ops where CUDA would use the lane kernel (the same value; its cache cleared).
        "... hashed by MLX ops": fresh(False, hashing={"DEVICE_KERNEL": False}),
    }
    return table, opened  # handles open as the variants first use them


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a 4-layer model (to check the tool on a CPU)")
    p.add_argument("--tokens", default="256,4096,16384", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="rounds per length (the first is dropped)")
    p.add_argument("--only", help="the variants whose names hold one of these, comma-separated (mlx-lm's always)")
    args = p.parse_args()
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    work = Path(tempfile.mkdtemp(prefix="ppc-prefill-variants-"))
    table, opened = variants(model, work)
    if args.only:
        # Fewer variants, fewer handles holding prompts: all of them at 16k ran an H100 out of memory.
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        table = {k: v for k, v in table.items() if k == "mlx-lm prefill" or any(w in k for w in words)}
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    try:
        for n in (int(t) for t in args.tokens.split(",")):
            times: dict[str, list[float]] = {name: [] for name in table}
            for r in range(args.rounds):
                ids = prompt_ids(model.args.vocab_size, n, seed=1000 * n + r)
                names = list(table)
                names = names[r % len(names) :] + names[: r % len(names)]
                for name in names:
                    mx.synchronize()
                    started = time.perf_counter()
                    own = table[name](ids)
                    mx.synchronize()
                    seconds = own if isinstance(own, float) else time.perf_counter() - started
                    if r:
                        times[name].append(seconds)
                    for store in opened.values():
                        store.flush()
            base = statistics.median(times["mlx-lm prefill"])
            for name, values in times.items():
                mid = statistics.median(values)
                rounds = [round(v * 1000) for v in values]
                print(f"{n:>6} {name:28s} {mid * 1000:8.1f} ms  {mid / base:5.2f}  {rounds}", flush=True)
    finally:
        for store in opened.values():
            store.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

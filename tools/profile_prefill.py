#!/usr/bin/env python3
"""Where prefill()'s time goes on this device (a diagnostic, not a benchmark row).

For each length: mlx-lm's prefill, then prefill() on an empty store with each store call
timed (wall, the device synchronized after), the store's writes switched off (to isolate
them), and a cProfile of one call; then a second handle on the filled store (a restart's
fetch decisions) in the same process.

    python tools/profile_prefill.py [--small] [--tokens 256,4096,16384]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from user_paths_bench import clock, mlx_prefill, prompt_ids  # noqa: E402

from persistent_prefix_cache import PersistentPrefixCache, prefill  # noqa: E402


class Timed:
    """Wraps a store's methods: wall seconds per method (device synchronized after)."""

    def __init__(self, store, names):
        self.store, self.spent = store, {}
        for name in names:
            real = getattr(store, name)

            def wrapper(*a, _real=real, _name=name, **k):
                t = time.perf_counter()
                out = _real(*a, **k)
                mx.synchronize()
                self.spent[_name] = self.spent.get(_name, 0.0) + time.perf_counter() - t
                return out

            setattr(store, name, wrapper)


class Model:
    def __init__(self, model):
        self.model, self.spent, self.calls = model, 0.0, 0

    def __call__(self, *a, **k):
        t = time.perf_counter()
        out = self.model(*a, **k)  # lazy: prefill() evaluates what it needs (timing the graph's build)
        self.spent += time.perf_counter() - t
        self.calls += 1
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


class TimedCalls:
    """Stands in for a module (``mx``, ``np``) or wraps an object's methods: seconds per
    named function, the device synchronized after each."""

    def __init__(self, target, names, spent):
        self._target, self._names, self._spent = target, set(names), spent

    def __getattr__(self, name):
        real = getattr(self._target, name)
        if name not in self._names:
            return real

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = real(*a, **k)
            mx.synchronize()
            self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t
            return out

        return wrapper


class Timed1:
    """A callable (a type) timed, without a device synchronization."""

    def __init__(self, real, name, spent):
        self.real, self.name, self.spent = real, name, spent

    def __call__(self, *a, **k):
        t = time.perf_counter()
        out = self.real(*a, **k)
        self.spent[self.name] = self.spent.get(self.name, 0.0) + time.perf_counter() - t
        return out


def store_parts(model, ids, work) -> dict:
    """One store() of `ids`'s cache on an empty store, its parts timed."""
    from persistent_prefix_cache.layers import layout as layout_mod
    from user_paths_bench import mlx_prefill as run

    cache = run(model, ids)
    spent: dict = {}
    real_mx, real_np = layout_mod.mx, layout_mod.np
    layout_mod.mx = TimedCalls(real_mx, ["contiguous", "eval", "split"], spent)
    layout_mod.np = TimedCalls(real_np, ["asarray"], spent)
    Layout = layout_mod.Layout
    saved = {n: Layout.__dict__[n] for n in ("cut", "flags", "learn_fields", "evaluate")}
    for n, f in saved.items():

        def w(*a, _f=f, _n=n, **k):
            t = time.perf_counter()
            out = (_f.__func__ if isinstance(_f, staticmethod) else _f)(*a, **k)
            spent["Layout." + _n] = spent.get("Layout." + _n, 0.0) + time.perf_counter() - t
            return out

        setattr(Layout, n, staticmethod(w) if n == "evaluate" else w)
    # Calls of types (cProfile counts them as the caller's own time) and the collector's pauses.
    for name, real in (("memoryview", memoryview), ("Node", layout_mod.Node), ("BlockBits", layout_mod.BlockBits),
                       ("WholeBits", layout_mod.WholeBits), ("ViewPath", layout_mod.ViewPath)):  # fmt: skip
        setattr(layout_mod, name, Timed1(real, name, spent))
    paused = []

    def collector(phase, info):
        paused.append((phase, time.perf_counter(), info.get("generation")))

    gc.callbacks.append(collector)
    try:
        store = PersistentPrefixCache(Path(tempfile.mkdtemp(dir=work)), model)
        t, _ = clock(lambda: store.store(ids, cache))
        spent["store_total"] = t
        starts = [w for phase, w, _ in paused if phase == "start"]
        stops = [w for phase, w, _ in paused if phase == "stop"]
        spent["gc"] = sum(b - a for a, b in zip(starts, stops))
        spent["gc_runs"] = [g for phase, _, g in paused if phase == "start"]
        spent["flush"] = clock(store.flush)[0]
        store.close()
    finally:
        gc.callbacks.remove(collector)
        del layout_mod.memoryview
        for name in ("Node", "BlockBits", "WholeBits", "ViewPath"):
            setattr(layout_mod, name, getattr(layout_mod, name).real)
        layout_mod.mx, layout_mod.np = real_mx, real_np
        for n, f in saved.items():
            setattr(Layout, n, f)
    return spent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true")
    p.add_argument("--tokens", default="256,4096,16384")
    args = p.parse_args()
    model = gpu_bench.build(gpu_bench.SMALL if args.small else gpu_bench.SHAPE_8B)
    vocab = model.args.vocab_size
    work = Path(tempfile.mkdtemp(prefix="ppc-profile-"))
    mlx_prefill(model, prompt_ids(vocab, 2048, 7))
    report = {}
    for n in [int(x) for x in args.tokens.split(",")]:
        ids = prompt_ids(vocab, n, n)
        r = report[n] = {}
        r["plain_s"] = statistics.median(clock(lambda: mlx_prefill(model, ids))[0] for _ in range(3))
        r["store_parts"] = [store_parts(model, ids, work) for _ in range(3)]

        # prefill()'s own loop with a store that does nothing (fetch misses, nothing kept).
        class Null:
            block_size = 64

            def fetch(self, toks):
                return None, toks

            def make_cache(self):
                return __import__("mlx_lm.models.cache", fromlist=["x"]).make_prompt_cache(model)

            def store(self, toks, cache):
                return 0

            def observe_prefill(self, *a, **k):
                pass

            def resumable_step(self):
                return None

        r["null_store_s"] = statistics.median(clock(lambda: prefill(model, ids, Null()))[0] for _ in range(3))
        runs = []
        for rep in range(3):
            path = work / f"s{n}-{rep}"
            t_open, store = clock(lambda: PersistentPrefixCache(path, model))
            timed = Timed(store, ["fetch", "store", "observe_prefill", "make_cache", "resumable_step"])
            proxy = Model(model)
            total, _ = clock(lambda: prefill(proxy, ids, store))
            t_flush, _ = clock(store.flush)
            t_close, _ = clock(store.close)
            runs.append(
                dict(
                    total=total,
                    forwards=proxy.spent,
                    calls=proxy.calls,
                    open=t_open,
                    flush=t_flush,
                    close=t_close,
                    **timed.spent,
                )
            )
            if rep < 2:
                shutil.rmtree(path)
        r["prefill_runs"] = runs
        # prefill()'s evaluations timed (the device's work and the waits for it), a fresh handle each.
        from persistent_prefix_cache import prefill as prefill_mod_fn  # noqa: F401

        prefill_mod = sys.modules["persistent_prefix_cache.prefill"]
        evals = []
        for rep in range(2):
            spent: dict = {}
            real = prefill_mod.mx
            prefill_mod.mx = TimedCalls(real, ["eval"], spent)
            try:
                store = PersistentPrefixCache(work / f"e{n}-{rep}", model)
                spent["total"] = clock(lambda: prefill(model, ids, store))[0]
                store.close()
            finally:
                prefill_mod.mx = real
            evals.append(spent)
        r["evals"] = evals
        # Without the cost model (nothing observed, nothing saved), and one handle for 3 prompts.
        r["no_cost_model_s"] = []
        for rep in range(2):
            store = PersistentPrefixCache(work / f"c{n}-{rep}", model, cost_model=False)
            r["no_cost_model_s"].append(clock(lambda: prefill(model, ids, store))[0])
            store.close()
        store = PersistentPrefixCache(work / f"h{n}", model)
        r["one_handle_s"] = [clock(lambda: prefill(model, prompt_ids(vocab, n, 1000 + k), store))[0] for k in range(3)]
        store.close()
        # The store's writes off: what prefill() costs without them.
        path = work / f"nostore{n}"
        store = PersistentPrefixCache(path, model)
        store.store = lambda toks, cache: 0
        r["no_store_s"] = statistics.median(clock(lambda: prefill(model, ids, store))[0] for _ in range(2))
        store.close()
        # cProfile of one call on an empty store.
        path = work / f"prof{n}"
        store = PersistentPrefixCache(path, model)
        prof = cProfile.Profile()
        mx.synchronize()
        prof.enable()
        prefill(model, ids, store)
        mx.synchronize()
        prof.disable()
        store.close()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(28)
        r["profile"] = out.getvalue()[-6000:]
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        r["profile_tottime"] = out.getvalue()[-4000:]
        # New handles on the filled store: a restart's fetch (3 handles, 2 calls each).
        filled = work / f"s{n}-2"
        handles = []
        for h in range(3):
            store = PersistentPrefixCache(filled, model)
            timed = Timed(store, ["fetch", "store"])
            calls = []
            for c in range(2):
                before = store.stats()["tokens_saved"]
                proxy = Model(model)
                t, _ = clock(lambda: prefill(proxy, ids, store))
                calls.append(
                    dict(
                        total=t,
                        restored=store.stats()["tokens_saved"] - before,
                        forwards=proxy.spent,
                        calls=proxy.calls,
                    )
                )
            st = store.stats()
            handles.append(
                dict(
                    calls=calls,
                    spent=timed.spent,
                    decisions={
                        k: st[k] for k in ("restored_all", "restored_ram_only", "restored_shorter", "skipped_slower")
                    },
                    first_restore=[st.get("first_restore_s_ram"), st.get("first_restore_s_disk")],
                )
            )
            store.close()
        r["handles"] = handles
        print(json.dumps({n: {k: v for k, v in r.items() if not k.startswith("profile")}}, default=str), flush=True)
        print(r["profile"], flush=True)
        print(r["profile_tottime"], flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

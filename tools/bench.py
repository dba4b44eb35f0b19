#!/usr/bin/env python3
"""Benchmark of persistent_prefix_cache against the machine's limits and its peers.

One run measures, on the same synthetic mlx-lm caches (``KVCache`` layers filled the way
a one-shot prefill fills them):

- the limits: a raw sequential read of the same number of bytes from one file (page
  cache warm, and dropped from the page cache), a raw write + fsync, and a memcpy;
- the peers: mlx-lm's ``save_prompt_cache`` (+ fsync) and ``load_prompt_cache``, and
  vllm-mlx's SSD tier when vllm-mlx is installed;
- ours: ``store()`` (synchronous, and the caller's cost of an asynchronous one),
  ``fetch()`` from disk (page cache warm and cold) and from the RAM tier, the
  longest-prefix lookup of a long prompt in a store holding many blocks, the bytes
  on disk of many prompts sharing one prefix, and the remote (fleet) tier against a
  loopback redis-server (``tools/bench_remote.py``; ``--no-remote`` skips it).

Every figure is the median of ``--repeat`` runs (min and max beside it). The operations
compared with each other run round-robin (each round runs each once, in a shuffled
order), so that they see the same disk and memory conditions, and every ratio is the
median over rounds of the ratio within a round. Throughput is in GB/s (1e9 bytes per
second) of KV bytes. Restores are timed until every array of the returned cache is
evaluated. Dirty data is flushed before each timed operation, outside the timing.

mlx's buffer cache decides whether a restore reuses freed memory or page-faults fresh
memory (in the Linux CPU build its default limit is 32 MiB, smaller than one restore):
``--mlx-cache-limit auto`` (the default) raises it so that every contender runs in the
steady state, as on Metal; ``--mlx-cache-limit default`` keeps mlx's own.

Examples::

    python tools/bench.py                  # the default run (several minutes)
    python tools/bench.py --llama8b        # add a Llama-8B-shaped case (512 MiB of KV)
    python tools/bench.py --smoke --json   # a tiny run (what CI runs), JSON on stdout
    python tools/bench.py --gpu --json     # the 8B-shaped case on the GPU (tools/gpu_bench.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

try:
    from persistent_prefix_cache import PersistentPrefixCache
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from persistent_prefix_cache import PersistentPrefixCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_remote  # noqa: E402  (tools/bench_remote.py: the remote tier's figures)
import bench_serve  # noqa: E402  (tools/bench_serve.py: RSS of ppc serve beside mlx_lm server)
import bench_precompute  # noqa: E402  (tools/bench_precompute.py: prefill + store vs the disk)

MiB = 1024 * 1024
CHUNK = 16 * MiB  # raw I/O chunk size
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
CAN_DROP_PAGE_CACHE = hasattr(os, "posix_fadvise")

# (ratio, our figure, the figure it is compared with, how, target). "speed": the other's
# time over ours (a throughput ratio); "time": our time over the other's.
CASE_RATIOS = [
    ("disk_warm_vs_raw_read", "ours_fetch_disk_warm", "limit_read_warm", "speed", ">= 0.9"),
    ("disk_cold_vs_raw_cold_read", "ours_fetch_disk_cold", "limit_read_cold", "speed", ">= 0.9"),
    ("ram_vs_memcpy", "ours_fetch_ram", "limit_memcpy", "speed", ">= 0.5"),
    ("store_sync_vs_raw_write_fsync", "ours_store_sync", "limit_write_fsync", "speed", ">= 0.9"),
    ("store_async_caller_vs_sync", "ours_store_async_caller", "ours_store_sync", "time", "<= 0.05"),
    ("fresh_3rd_vs_raw_read", "ours_fetch_fresh_3rd", "limit_read_warm", "speed", ">= 0.9"),
    ("fresh_2nd_vs_disk_warm", "ours_fetch_fresh_2nd", "ours_fetch_disk_warm", "time", None),
    ("fresh_filled_vs_raw_read", "ours_fetch_fresh_filled", "limit_read_warm", "speed", ">= 0.9"),
    ("disk_warm_vs_mlx_load_warm", "ours_fetch_disk_warm", "peer_mlx_load_warm", "speed", ">= 1.0"),
    ("disk_warm_step_vs_mlx_load_warm_step", "ours_fetch_disk_warm_step", "peer_mlx_load_warm_step", "speed", ">= 2"),
    ("disk_cold_vs_mlx_load_cold", "ours_fetch_disk_cold", "peer_mlx_load_cold", "speed", None),
    ("store_sync_vs_mlx_save_fsync", "ours_store_sync", "peer_mlx_save_fsync", "speed", None),
]

LABELS = {
    "limit_read_warm": "limit  raw read, page cache warm",
    "limit_read_cold": "limit  raw read, page cache dropped",
    "limit_write_fsync": "limit  raw write + fsync",
    "limit_memcpy": "limit  memcpy",
    "limit_read_warm_threads": "info   raw read, warm, 2-4 threads",
    "peer_mlx_save_fsync": "peer   mlx-lm save_prompt_cache + fsync",
    "peer_mlx_load_warm": "peer   mlx-lm load_prompt_cache, warm",
    "peer_mlx_load_cold": "peer   mlx-lm load_prompt_cache, cold",
    "peer_vllm_mlx_ssd_save": "peer   vllm-mlx SSD tier write + fsync",
    "peer_vllm_mlx_ssd_load": "peer   vllm-mlx SSD tier read",
    "ours_store_sync": "ours   store(), sync_writes=True",
    "ours_store_async_caller": "ours   store(), async: caller's cost",
    "ours_store_async_total": "ours   store() + flush(), async",
    "ours_fetch_disk_warm": "ours   fetch() from disk, warm",
    "ours_fetch_disk_cold": "ours   fetch() from disk, cold",
    "ours_fetch_ram": "ours   fetch() from the RAM tier",
    "ours_fetch_fresh_2nd": "ours   fresh handle, 2nd fetch (admits)",
    "ours_fetch_fresh_3rd": "ours   fresh handle, 3rd fetch (RAM tier)",
    "ours_fetch_fresh_filled": "ours   fresh handle, fetch after a fill",
    "ours_fetch_skipped": "info   fetch() skipped: its fixed cost",
    "peer_mlx_load_warm_step": "info   mlx-lm load, warm + 1st decode step",
    "ours_fetch_disk_warm_step": "info   ours fetch() warm + 1st decode step",
}


# -- synthetic caches -------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The layout and size of one synthetic KV cache."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPES[self.dtype].size

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def with_tokens(self, tokens: int) -> "Shape":
        return Shape(self.layers, self.kv_heads, self.head_dim, self.dtype, tokens)

    def layout(self) -> str:
        return f"{self.layers} layers x {self.kv_heads} KV heads x head dim {self.head_dim}, {self.dtype}"

    def describe(self) -> str:
        return f"{self.layout()}, {self.tokens} tokens = {self.kv_bytes / MiB:.1f} MiB of KV"


class SyntheticModel:
    """Stands in for an mlx-lm model: the store only asks it for its cache layout
    (``make_prompt_cache`` calls ``make_cache``); the fingerprint is passed explicitly."""

    def __init__(self, layers: int):
        self.layers = [None] * layers

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]


def random_kv(shape: Shape, tokens: int, seed: int) -> list[tuple[mx.array, mx.array]]:
    """Random keys and values, ``[1, heads, tokens, head_dim]`` per layer."""
    key = mx.random.key(seed)
    out = []
    for _ in range(shape.layers):
        key, k1, k2 = mx.random.split(key, 3)
        dims = (1, shape.kv_heads, tokens, shape.head_dim)
        dtype = DTYPES[shape.dtype]
        out.append(
            (
                mx.random.normal(dims, key=k1).astype(dtype),
                mx.random.normal(dims, key=k2).astype(dtype),
            )
        )
    mx.eval(out)
    return out


def make_cache(kv: list[tuple[mx.array, mx.array]]) -> list[KVCache]:
    """mlx-lm caches filled as by a one-shot prefill (step-padded buffers included)."""
    cache = []
    for k, v in kv:
        c = KVCache()
        c.update_and_fetch(k, v)
        cache.append(c)
    mx.eval([x for c in cache for x in (c.keys, c.values)])
    return cache


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array of a cache list's state (what a restore must have evaluated)."""
    return [x for c in cache for x in c.state if isinstance(x, mx.array)]


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 100_000, size=n, dtype=np.int32)


# -- measuring --------------------------------------------------------------------------


@dataclass
class Contender:
    """One timed operation: ``fn(before())`` is timed; `before` and `after` are not."""

    name: str
    fn: Callable[[Any], Any]
    before: Callable[[], Any] | None = None
    after: Callable[[Any], None] | None = None


def contest(contenders: list[Contender], repeat: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run the contenders round-robin, `warmup` + `repeat` rounds; seconds per round.

    Interleaving matters on a shared machine: disk and memory bandwidth drift over
    seconds (write bursts, writeback, neighbours), and every contender of a round sees
    the same conditions, so per-round ratios stay meaningful. The order within a round
    is shuffled (with a fixed seed) so that no contender always follows the same one.
    """
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    order = random.Random(len(contenders))
    for round_ in range(warmup + repeat):
        for c in order.sample(contenders, len(contenders)):
            state = c.before() if c.before else None
            gc.collect()
            t0 = time.perf_counter()
            c.fn(state)
            elapsed = time.perf_counter() - t0
            if c.after:
                c.after(state)
            if round_ >= warmup:
                times[c.name].append(elapsed)
    return times


def summarize(times: list[float], nbytes: int | None = None) -> dict:
    """Median, min and max of run times, plus GB/s when `nbytes` is given."""
    med = statistics.median(times)
    out = {"median_s": med, "min_s": min(times), "max_s": max(times), "runs_s": list(times)}
    if nbytes:
        out.update(
            bytes=nbytes,
            gbps=nbytes / med / 1e9,
            gbps_min=nbytes / max(times) / 1e9,
            gbps_max=nbytes / min(times) / 1e9,
        )
    return out


def paired_ratio(ours: dict, other: dict, how: str) -> float:
    """Median over rounds of ours vs other in the same round: "speed" is other's time
    over ours (a throughput ratio), "time" is ours over other's."""
    pairs = zip(ours["runs_s"], other["runs_s"])
    return statistics.median(b / a if how == "speed" else a / b for a, b in pairs)


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_from_page_cache(paths: list[str]) -> None:
    """Write back and evict each file's pages, so that the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def settle() -> None:
    """Flush all dirty data (and pending deletes) so that none lands inside a timing."""
    os.sync()


def files_under(folder: str | os.PathLike) -> list[str]:
    return sorted(str(p) for p in Path(folder).rglob("*") if p.is_file())


def remove(path: str | os.PathLike) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    settle()


def raw_write(path: str, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, dst: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(dst).cast("B")
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + CHUNK])
            if not n:
                raise RuntimeError(f"{path} is shorter than expected")
            done += n


def raw_read_threads(path: str, dst: np.ndarray, pool: ThreadPoolExecutor, n: int) -> None:
    """`raw_read` split into `n` contiguous ranges read at once (as mx.load does)."""
    view = memoryview(dst).cast("B")
    step = -(-len(view) // n)
    fd = os.open(path, os.O_RDONLY)
    try:

        def part(start: int) -> None:
            done, end = start, min(start + step, len(view))
            while done < end:
                got = os.preadv(fd, [view[done : min(end, done + CHUNK)]], done)
                if not got:
                    raise RuntimeError(f"{path} is shorter than expected")
                done += got

        list(pool.map(part, range(0, len(view), step)))
    finally:
        os.close(fd)


# -- the measurements -------------------------------------------------------------------


class Bench:
    """Runs the measurements of one invocation and collects notes."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.repeat = args.repeat
        self.counter = 0
        self.notes: list[str] = []

    def scratch(self, name: str, *, make: bool = True) -> Path:
        self.counter += 1
        path = self.workdir / f"{self.counter:05d}-{name}"
        if make:
            path.mkdir(parents=True)
        return path

    def open_store(self, path: Path, shape: Shape, **options) -> PersistentPrefixCache:
        store = PersistentPrefixCache(
            path,
            SyntheticModel(shape.layers),
            fingerprint="bench",
            block_size=self.args.block_size,
            **options,
        )
        store.flush()  # the open's sweep runs on the writer thread: keep it out of timings
        return store

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            progress(f"note: {text}")

    # writes: raw write + fsync, mlx-lm save, our store()

    def write_figures(self, shape: Shape, cache: list, tokens: np.ndarray) -> dict:
        src = np.random.default_rng(0).integers(0, 256, size=shape.kv_bytes, dtype=np.uint8)

        def new_file(suffix: str) -> Callable[[], str]:
            def make() -> str:
                settle()
                return str(self.scratch("file", make=False)) + suffix

            return make

        def save_fsync(path: str) -> None:
            save_prompt_cache(path, cache)
            fsync_path(path)

        def new_store(sync: bool) -> Callable[[], PersistentPrefixCache]:
            def make() -> PersistentPrefixCache:
                s = self.open_store(self.scratch("store"), shape, sync_writes=sync)
                settle()
                return s

            return make

        def store(s: PersistentPrefixCache) -> None:
            s.store(tokens, cache)

        def store_flush(s: PersistentPrefixCache) -> None:
            s.store(tokens, cache)
            s.flush()

        def drop_store(s: PersistentPrefixCache) -> None:
            s.close()  # flushes an asynchronous store's writes first
            remove(s.path)

        contenders = [
            Contender("limit_write_fsync", lambda p: raw_write(p, src), new_file(".bin"), remove),
            Contender("peer_mlx_save_fsync", save_fsync, new_file(".safetensors"), remove),
            Contender("ours_store_sync", store, new_store(True), drop_store),
            Contender("ours_store_async_caller", store, new_store(False), drop_store),
            Contender("ours_store_async_total", store_flush, new_store(False), drop_store),
        ]
        contenders += self.vllm_mlx_contenders(cache, tokens, shape.kv_bytes, write=True)
        times = contest(contenders, self.repeat)
        return {name: summarize(t, shape.kv_bytes) for name, t in times.items()}

    # reads: raw read, memcpy, mlx-lm load, our fetch() from disk and from RAM

    def read_figures(self, shape: Shape, cache: list, tokens: np.ndarray, *, cold: bool) -> dict:
        folder = self.scratch("read")
        nbytes = shape.kv_bytes
        src = np.random.default_rng(0).integers(0, 256, size=nbytes, dtype=np.uint8)
        dst = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults inside timings
        raw = str(folder / "raw.bin")
        raw_write(raw, src)
        mlx_file = str(folder / "mlx.safetensors")
        save_prompt_cache(mlx_file, cache)
        store_dir = folder / "store"
        with self.open_store(store_dir, shape, sync_writes=True, memory_bytes=0) as s:
            s.store(tokens, cache)
        blocks = files_under(store_dir / "segments")
        ram = self.open_store(folder / "ram", shape, memory_bytes=2 * nbytes + 64 * MiB)
        ram.store(tokens, cache)
        ram.flush()
        if ram.stats()["bytes_in_memory"] < nbytes:
            raise RuntimeError("the RAM tier does not hold the whole prompt")
        # One token more than stored: a full hit gives back the last token of the query.
        query = np.concatenate([tokens, np.array([7], dtype=np.int32)])

        def fetch(s: PersistentPrefixCache) -> list:
            restored, _ = s.fetch(query)
            mx.eval(cache_arrays(restored))
            return restored

        def load_mlx(_) -> list:
            restored = load_prompt_cache(mlx_file)
            mx.eval(cache_arrays(restored))
            return restored

        def then_step(restore: Callable[[Any], list]) -> Callable[[Any], None]:
            # What generation pays next: the first update_and_fetch of every layer
            # (mlx-lm grows a full buffer by concatenation, i.e. one more copy).
            def run(state) -> None:
                restored = restore(state)
                one = mx.zeros((1, shape.kv_heads, 1, shape.head_dim), DTYPES[shape.dtype])
                mx.eval([c.update_and_fetch(one, one) for c in restored])

            return run

        def disk_store(drop: bool) -> Callable[[], PersistentPrefixCache]:
            def make() -> PersistentPrefixCache:
                s = self.open_store(store_dir, shape, memory_bytes=0)
                if drop:
                    drop_from_page_cache(blocks)
                return s

            return make

        def fresh_handle(fetches: int) -> Callable[[], PersistentPrefixCache]:
            # After a restart: a fresh handle whose RAM tier holds the prompt, after
            # `fetches` fetches of it (the tier admits a prefix on its second hit).
            def make() -> PersistentPrefixCache:
                s = self.open_store(store_dir, shape, memory_bytes=2 * nbytes + 64 * MiB, cost_model=False)
                for _ in range(fetches):
                    fetch(s)
                settle()
                return s

            return make

        # A copy of the store for the handles below: the rates they set are remembered
        # in its costs.json, and the other contenders must not find them.
        skip_dir = folder / "store-skips"
        shutil.copytree(store_dir, skip_dir)

        def disk_loses(s: PersistentPrefixCache) -> PersistentPrefixCache:
            # Rates set as on a fast GPU: a disk read loses to a prefill, the RAM tier wins.
            s.costs.learned.set_prefill(1e9)
            s.costs.learned.set_restore({"ram": 1e15, "disk": 1.0})
            return s

        def skipped(s: PersistentPrefixCache) -> None:
            restored, _ = s.fetch(query)
            assert restored is None  # nothing read: the fixed cost of a fetch alone

        def filled_handle() -> PersistentPrefixCache:
            # After a restart, where the cost model skips the disk: the first fetch
            # leaves the prefix there, a background fill reads it into the RAM tier.
            s = disk_loses(self.open_store(skip_dir, shape, memory_bytes=2 * nbytes + 64 * MiB))
            skipped(s)
            s.flush()  # the fill is done (a request that comes later)
            settle()
            return s

        threads = max(2, min(4, os.cpu_count() or 1))
        pool = ThreadPoolExecutor(threads)

        def drop(paths: list[str]) -> Callable[[], None]:
            return lambda: drop_from_page_cache(paths)

        check = disk_store(False)()
        check_restored(fetch(check), cache, shape.tokens)
        check.close()
        check_restored(fetch(ram), cache, shape.tokens)
        settle()
        close = lambda s: s.close()  # noqa: E731
        warm = [
            Contender("limit_read_warm", lambda _: raw_read(raw, dst)),
            Contender("limit_memcpy", lambda _: np.copyto(dst, src)),
            Contender("limit_read_warm_threads", lambda _: raw_read_threads(raw, dst, pool, threads)),
            Contender("peer_mlx_load_warm", load_mlx),
            Contender("ours_fetch_disk_warm", fetch, disk_store(False), close),
            Contender("ours_fetch_ram", fetch, lambda: ram),
            Contender("ours_fetch_fresh_2nd", fetch, fresh_handle(1), close),
            Contender("ours_fetch_fresh_3rd", fetch, fresh_handle(2), close),
            Contender("ours_fetch_fresh_filled", fetch, filled_handle, close),
            Contender(
                "ours_fetch_skipped",
                skipped,
                lambda: disk_loses(self.open_store(skip_dir, shape, memory_bytes=0)),
                close,
            ),
        ]
        if cold:  # the main cases only: the sweep keeps to restores
            warm += [
                Contender("peer_mlx_load_warm_step", then_step(load_mlx)),
                Contender("ours_fetch_disk_warm_step", then_step(fetch), disk_store(False), close),
            ]
        warm += self.vllm_mlx_contenders(cache, tokens, nbytes, write=False)
        times = contest(warm, self.repeat)
        if cold and CAN_DROP_PAGE_CACHE:
            colds = [
                Contender("limit_read_cold", lambda _: raw_read(raw, dst), drop([raw])),
                Contender("peer_mlx_load_cold", load_mlx, drop([mlx_file])),
                Contender("ours_fetch_disk_cold", fetch, disk_store(True), close),
            ]
            times.update(contest(colds, self.repeat))
        pool.shutdown()
        ram.close()
        remove(folder)
        return {name: summarize(t, nbytes) for name, t in times.items()}

    def vllm_mlx_contenders(self, cache: list, tokens: np.ndarray, nbytes: int, *, write: bool) -> list:
        """vllm-mlx's SSD tier, when installed. It has no stable public API: its private
        write and read methods are driven, after one trial run; a mismatch becomes a note."""
        try:
            from vllm_mlx.ssd_cache import SSDCacheConfig, SSDCacheTier
        except ImportError:
            self.note("vllm-mlx is not installed: its SSD tier is not measured")
            return []
        key = tuple(int(t) for t in tokens)

        def new_tier() -> Any:
            return SSDCacheTier(SSDCacheConfig(cache_dir=str(self.scratch("vllm-mlx"))))

        def save(tier) -> None:
            tier._write_entry(key, cache, nbytes)
            for path in files_under(tier._data_dir):
                fsync_path(path)

        def load(tier) -> None:
            meta = tier.lookup_ssd(key)
            arrays = []
            for layer in tier._read_entry(key, meta["file_path"]):
                if isinstance(layer, dict):
                    arrays += [mx.array(layer["keys"]), mx.array(layer["values"])]
                else:
                    arrays += cache_arrays([layer])
            mx.eval(arrays)

        def drop_tier(tier) -> None:
            tier.close()
            remove(tier._cache_dir)

        try:
            tier = new_tier()
            save(tier)
            load(tier)
        except Exception as exc:  # an API this benchmark does not know
            self.note(f"vllm-mlx is installed but its SSD tier could not be driven: {exc!r}")
            return []
        if write:
            drop_tier(tier)
            return [Contender("peer_vllm_mlx_ssd_save", save, new_tier, drop_tier)]
        return [Contender("peer_vllm_mlx_ssd_load", load, lambda: tier)]

    def case(self, name: str, shape: Shape, seed: int) -> dict:
        progress(f"case {name}: {shape.describe()}")
        tokens = random_tokens(np.random.default_rng(seed), shape.tokens)
        cache = make_cache(random_kv(shape, shape.tokens, seed))
        figures = {}
        figures.update(self.write_figures(shape, cache, tokens))
        figures.update(self.read_figures(shape, cache, tokens, cold=True))
        del cache
        release_memory()
        ratios = {}
        for rname, ours, other, how, target in CASE_RATIOS:
            if ours in figures and other in figures:
                ratios[rname] = ratio(paired_ratio(figures[ours], figures[other], how), target)
        order = [n for n in LABELS if n in figures]
        return {
            "name": name,
            "shape": shape.__dict__,
            "kv_bytes": shape.kv_bytes,
            "figures": {n: figures[n] for n in order},
            "ratios": ratios,
        }

    # precompute: prefill + store against the disk's limit (tools/bench_precompute.py)

    def precompute(self) -> dict:
        """Prefill + store of a small llama (random weights) against prefill alone, mlx-lm's
        save and the disk's limit; on a CPU prefill is what limits it."""
        import gpu_bench

        a = self.args
        progress(f"precompute: {a.precompute_prompts} prompts x {a.precompute_tokens} tokens, small llama")
        return bench_precompute.precompute_figures(
            gpu_bench.build(gpu_bench.SMALL), prompts=a.precompute_prompts, tokens=a.precompute_tokens,
            work=self.scratch("precompute"), repeat=max(1, min(3, self.repeat)), block_size=a.block_size,
        )  # fmt: skip

    # lookup

    def lookup(self) -> dict:
        """Longest-prefix lookup of a long prompt in a store holding many blocks.

        The store is built through ``store()`` with a tiny layout (1 layer, 1 head, head
        dim 8). Prompts branch off earlier ones at random block boundaries, so the trie
        has many children per node. fsync is skipped while building: durability plays no
        part in a lookup, and 100k fsyncs would take minutes.
        """
        args = self.args
        shape = Shape(1, 1, 8, "float16", args.lookup_tokens)
        progress(f"lookup: building a store of {args.lookup_blocks} blocks of {shape.tokens} tokens")
        folder = self.scratch("lookup")
        rng = np.random.default_rng(1)
        cache = make_cache(random_kv(shape, shape.tokens, 1))
        n_blocks = -(-shape.tokens // args.block_size)
        prompts: list[np.ndarray] = []
        total = 0
        started = time.perf_counter()
        with mock.patch("os.fsync", lambda fd: None):
            with self.open_store(folder, shape, memory_bytes=0, sync_writes=True) as s:
                while total < args.lookup_blocks:
                    toks = random_tokens(rng, shape.tokens)
                    if prompts:  # branch off an earlier prompt at a block boundary
                        shared = int(rng.integers(0, n_blocks)) * args.block_size
                        toks[:shared] = prompts[rng.integers(len(prompts))][:shared]
                    total += s.store(toks, cache)
                    prompts.append(toks)
        build_s = time.perf_counter() - started
        settle()
        query = prompts[-1]
        with self.open_store(folder, shape, memory_bytes=0) as s:
            # peek(): the longest-prefix lookup alone, as fetch() does it, loading nothing.
            lookup = s.peek if hasattr(s, "peek") else lambda t: s._lookup(t)[1]
            matched = lookup(query)
            if matched < len(query) - args.block_size:
                raise RuntimeError(f"lookup matched {matched} of {len(query)} tokens")
            times = contest([Contender("lookup", lambda _: lookup(query))], max(self.repeat, 20), 3)
            blocks = s.stats()["blocks"]
        remove(folder)
        out = summarize(times["lookup"])
        out.update(
            blocks_in_store=blocks,
            prompts=len(prompts),
            query_tokens=len(query),
            matched_tokens=matched,
            build_s=build_s,
        )
        return out

    # bytes on disk of prompts sharing a prefix

    def shared_prefix(self, shape: Shape) -> dict:
        args = self.args
        n, prefix, suffix = args.shared_prompts, args.shared_prefix, args.shared_suffix
        progress(f"shared prefix: {n} prompts of {prefix} shared + {suffix} own tokens")
        rng = np.random.default_rng(2)
        head = random_tokens(rng, prefix)
        head_kv = random_kv(shape, prefix, 2)
        folder = self.scratch("shared")
        mlx_file = folder / "mlx.safetensors"
        mlx_bytes = 0
        store_dir = folder / "store"
        with self.open_store(store_dir, shape, memory_bytes=0, sync_writes=True) as s:
            for i in range(n):
                tail_kv = random_kv(shape, suffix, 100 + i)
                kv = [
                    (mx.concatenate([hk, tk], axis=2), mx.concatenate([hv, tv], axis=2))
                    for (hk, hv), (tk, tv) in zip(head_kv, tail_kv)
                ]
                cache = make_cache(kv)
                s.store(np.concatenate([head, random_tokens(rng, suffix)]), cache)
                save_prompt_cache(str(mlx_file), cache)
                mlx_bytes += mlx_file.stat().st_size
                mlx_file.unlink()
        segment_files = files_under(store_dir / "segments")
        index_files = files_under(store_dir / "index")
        block_bytes = sum(os.path.getsize(p) for p in segment_files)
        index_bytes = sum(os.path.getsize(p) for p in index_files)
        allocated = sum(os.stat(p).st_blocks * 512 for p in segment_files + index_files)
        distinct_tokens = prefix + n * suffix
        remove(folder)
        release_memory()
        return {
            "prompts": n,
            "prefix_tokens": prefix,
            "suffix_tokens": suffix,
            "distinct_tokens": distinct_tokens,
            "distinct_kv_bytes": distinct_tokens * shape.bytes_per_token,
            "ours_block_file_bytes": block_bytes,
            "ours_index_bytes": index_bytes,
            "ours_bytes": block_bytes + index_bytes,
            "ours_allocated_bytes": allocated,
            "ours_segment_files": len(segment_files),
            "mlx_lm_files_bytes": mlx_bytes,
        }

    # restore throughput by prompt length (the plot)

    def sweep(self, shape: Shape) -> dict:
        keys = ["ours_fetch_disk_warm", "ours_fetch_ram", "peer_mlx_load_warm", "limit_read_warm"]
        out: dict[str, Any] = {"shape": shape.layout(), "tokens": []}
        out.update({f"{k}_gbps": [] for k in keys})
        for n in self.args.sweep:
            s = shape.with_tokens(n)
            progress(f"sweep: {s.describe()}")
            tokens = random_tokens(np.random.default_rng(n), n)
            cache = make_cache(random_kv(s, n, n))
            figures = self.read_figures(s, cache, tokens, cold=False)
            out["tokens"].append(n)
            for k in keys:
                out[f"{k}_gbps"].append(figures[k]["gbps"])
            del cache
            release_memory()
        return out


def check_restored(restored: list | None, cache: list, tokens: int) -> None:
    """The restored cache must hold exactly the stored KV (checked outside timings)."""
    if restored is None or len(restored) != len(cache):
        raise RuntimeError("fetch() missed a prompt the benchmark had just stored")
    for r, c in zip(restored, cache):
        if r.offset != tokens:
            raise RuntimeError(f"fetch() restored {r.offset} tokens, expected {tokens}")
        for x, y in ((r.keys, c.keys), (r.values, c.values)):
            if not mx.array_equal(x[..., :tokens, :], y[..., :tokens, :]).item():
                raise RuntimeError("fetch() restored different KV than was stored")


def ratio(value: float, target: str | None) -> dict:
    """A ratio with its target (">= 0.9", "<= 0.05", "< 2") and whether it is met."""
    ok = None
    if target is not None:
        op, bound = target.split()
        ok = {">=": value >= float(bound), "<=": value <= float(bound), "<": value < float(bound)}[op]
    return {"value": value, "target": target, "ok": ok}


def set_mlx_cache_limit(option: str, largest: int) -> int:
    """Apply --mlx-cache-limit; returns the limit in force."""
    default = mx.set_cache_limit(0)  # returns the previous (mlx's default) limit
    if option == "default":
        limit = default
    elif option == "auto":
        limit = max(default, 6 * largest + 256 * MiB)
    else:
        limit = int(option)
    mx.set_cache_limit(limit)
    return limit


def release_memory() -> None:
    gc.collect()
    mx.clear_cache()


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


# -- report -----------------------------------------------------------------------------


def machine() -> dict:
    import mlx_lm

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "numpy": np.__version__,
        "device": str(mx.default_device()),
    }


def span(lo: float, hi: float, fmt: str) -> str:
    return f"[{lo:{fmt}} .. {hi:{fmt}}]"


def format_report(result: dict) -> str:
    """The results as a plain-text table."""
    m = result["machine"]
    lines = [
        f"persistent_prefix_cache benchmark: mlx {m['mlx']} ({m['device']}), "
        f"mlx-lm {m['mlx_lm']}, {m['platform']}, {m['cpus']} CPUs",
        f"mlx buffer cache limit: {m['mlx_cache_limit'] / MiB:.0f} MiB (--mlx-cache-limit)",
        f"each figure: median of {result['config']['repeat']} interleaved runs [min .. max]; "
        "GB/s = 1e9 B/s; ratios: median of per-round ratios",
    ]
    head = f"  {'figure':<42} {'median ms':>10} {'[min .. max] ms':>19} {'GB/s':>7}"
    for case in result["cases"]:
        lines += ["", f"== {case['name']}: {Shape(**case['shape']).describe()}"]
        lines.append(f"{head} {'[min .. max] GB/s':>18}")
        for name, f in case["figures"].items():
            ms = span(f["min_s"] * 1e3, f["max_s"] * 1e3, ".1f")
            gbps = span(f["gbps_min"], f["gbps_max"], ".2f")
            label = LABELS.get(name, name)
            lines.append(f"  {label:<42} {f['median_s'] * 1e3:>10.1f} {ms:>19} {f['gbps']:>7.2f} {gbps:>18}")
        lines.append(f"  {'ratio (same run)':<42} {'value':>10} {'target':>10}")
        for name, r in case["ratios"].items():
            line = f"  {name:<42} {r['value']:>10.3f} {r['target'] or '':>10} {verdict(r)}"
            lines.append(line.rstrip())
    if "lookup" in result:
        lk, r = result["lookup"], result["ratios"]["lookup_ms"]
        lines += [
            "",
            f"== lookup: {lk['query_tokens']}-token prompt among {lk['blocks_in_store']} blocks "
            f"({lk['prompts']} prompts, built in {lk['build_s']:.0f} s)",
            f"  longest-prefix lookup: {lk['median_s'] * 1e3:.2f} ms "
            f"{span(lk['min_s'] * 1e3, lk['max_s'] * 1e3, '.2f')}  "
            f"target {r['target']} ms {verdict(r)}",
        ]
    if "shared_prefix" in result:
        sp, r = result["shared_prefix"], result["ratios"]["shared_prefix_vs_distinct_kv"]
        lines += [
            "",
            f"== bytes on disk: {sp['prompts']} prompts sharing a {sp['prefix_tokens']}-token "
            f"prefix, {sp['suffix_tokens']} own tokens each ({sp['distinct_tokens']} distinct)",
        ]
        files = f"{sp['ours_segment_files']} files, index {sp['ours_index_bytes'] / MiB:.2f} MiB"
        rows = [
            ("KV of the distinct tokens", f"{sp['distinct_kv_bytes'] / MiB:.1f} MiB", ""),
            ("ours: segment files + index", f"{sp['ours_bytes'] / MiB:.1f} MiB", files),
            (f"{sp['prompts']} mlx-lm files", f"{sp['mlx_lm_files_bytes'] / MiB:.1f} MiB", ""),
            ("ours / distinct KV", f"{r['value']:.3f}", f"target {r['target']} {verdict(r)}"),
            ("mlx-lm files / ours", f"{result['ratios']['mlx_lm_files_vs_ours']['value']:.2f}", ""),
        ]
        lines += [f"  {a:<30} {b:>12}  {c}".rstrip() for a, b, c in rows]
    if result.get("sweep"):
        sw = result["sweep"]
        lines += ["", f"== restore throughput by prompt length (GB/s): {sw['shape']}"]
        columns = [
            ("ours disk warm", "ours_fetch_disk_warm_gbps"),
            ("ours RAM", "ours_fetch_ram_gbps"),
            ("mlx-lm load", "peer_mlx_load_warm_gbps"),
            ("raw read", "limit_read_warm_gbps"),
        ]
        lines.append(f"  {'tokens':>7}" + "".join(f" {title:>15}" for title, _ in columns))
        for i, n in enumerate(sw["tokens"]):
            lines.append(f"  {n:>7}" + "".join(f" {sw[key][i]:>15.2f}" for _, key in columns))
    lines += bench_precompute.format_precompute(result.get("precompute"))
    lines += bench_remote.format_remote(result.get("remote"))
    lines += bench_serve.format_serve(result.get("serve"))
    lines += [f"note: {text}" for text in result["notes"]]
    return "\n".join(lines)


def verdict(r: dict) -> str:
    return "" if r["ok"] is None else ("ok" if r["ok"] else "MISSED")


def plot(sweep: dict, path: str) -> str | None:
    """Write the restore-throughput plot; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = sweep["tokens"]
    ax.plot(x, sweep["ours_fetch_disk_warm_gbps"], "o-", label="ours: fetch() from disk (warm)")
    ax.plot(x, sweep["ours_fetch_ram_gbps"], "s-", label="ours: fetch() from the RAM tier")
    ax.plot(x, sweep["peer_mlx_load_warm_gbps"], "^-", label="mlx-lm load_prompt_cache (warm)")
    ax.plot(x, sweep["limit_read_warm_gbps"], "k--", label="raw read (warm): the limit")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(n) for n in x])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("restore throughput (GB/s of KV)")
    ax.set_title(f"Restore throughput: {sweep['shape']}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# -- command line -----------------------------------------------------------------------

SMOKE = dict(
    layers=2,
    kv_heads=2,
    head_dim=32,
    tokens=256,
    repeat=2,
    lookup_blocks=600,
    lookup_tokens=2048,
    shared_prompts=4,
    shared_prefix=256,
    shared_suffix=100,
    sweep="64,256",
    precompute_prompts=2,
    precompute_tokens=128,
)
DEFAULTS = dict(
    layers=16,
    kv_heads=8,
    head_dim=64,
    tokens=4096,
    repeat=5,
    lookup_blocks=100_000,
    lookup_tokens=32_768,
    shared_prompts=32,
    shared_prefix=3072,
    shared_suffix=300,
    sweep="512,1024,2048,4096,8192",
    precompute_prompts=4,
    precompute_tokens=1024,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench.py",
        description=__doc__.split("\n\n")[0],
        epilog="Defaults (and --smoke values) of the size options: "
        + ", ".join(f"{k}={v} ({SMOKE[k]})" for k, v in DEFAULTS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--smoke", action="store_true", help="a tiny, fast configuration (CI)")
    p.add_argument("--layers", type=int, help="layers of the synthetic cache")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer")
    p.add_argument("--head-dim", type=int, help="head dimension")
    p.add_argument("--tokens", type=int, help="prompt length of the main cases")
    p.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16, bfloat16, float32")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block of our stores")
    p.add_argument("--llama8b", action="store_true", help="add a Llama-8B-shaped case (32 x 8 x 128, bfloat16)")
    p.add_argument("--repeat", type=int, help="runs per figure (the median is reported)")
    p.add_argument("--lookup-blocks", type=int, help="blocks in the lookup store (0 skips the lookup)")
    p.add_argument("--lookup-tokens", type=int, help="length of the prompt looked up")
    p.add_argument("--shared-prompts", type=int, help="prompts sharing one prefix (0 skips)")
    p.add_argument("--shared-prefix", type=int, help="tokens of the shared prefix")
    p.add_argument("--shared-suffix", type=int, help="tokens of each prompt after the prefix")
    p.add_argument("--precompute-prompts", type=int, help="prompts of the precompute figures (0 skips)")
    p.add_argument("--precompute-tokens", type=int, help="tokens per prompt of the precompute figures")
    p.add_argument("--sweep", help="comma-separated prompt lengths of the plot ('' skips)")
    p.add_argument("--plot", default="bench_restore.png", help="PNG of restore throughput by length")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument(
        "--device", choices=("default", "cpu"), default="default",
        help="cpu: run MLX on the CPU even where it has a GPU (the unified-memory proxy)",
    )  # fmt: skip
    p.add_argument("--no-remote", action="store_true", help="skip the remote tier (a loopback redis-server)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (table on stderr)")
    p.add_argument(
        "--serve", action="store_true",
        help="add the server memory row: ppc serve beside mlx_lm server (tools/bench_serve.py; minutes)",
    )  # fmt: skip
    bench_serve.add_arguments(p, prefix="serve-")
    p.add_argument("--output", help="also write the JSON results to this file")
    p.add_argument("--dir", help="scratch folder (default: the system temp folder)")
    p.add_argument(
        "--mlx-cache-limit",
        default="auto",
        help="mlx's buffer cache limit: 'auto' raises it so that restored arrays reuse freed "
        "buffers (steady state, as on Metal where it defaults to the memory limit); "
        "'default' keeps mlx's own (32 MiB in the Linux CPU build: every larger restore "
        "then page-faults fresh memory); or a number of bytes",
    )
    args = p.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.sweep = [int(n) for n in args.sweep.split(",") if n.strip()]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown or not args.dtypes:
        p.error(f"unknown dtype(s) {unknown}; choose among {', '.join(DTYPES)}")
    if args.mlx_cache_limit not in ("auto", "default") and not args.mlx_cache_limit.isdigit():
        p.error("--mlx-cache-limit takes 'auto', 'default' or a number of bytes")
    if args.repeat < 1 or args.block_size < 1 or args.tokens < 1:
        p.error("--repeat, --block-size and --tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--gpu" in argv:  # the 8B-shaped case on the default device: tools/gpu_bench.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_bench

        return gpu_bench.main([a for a in argv if a != "--gpu"])
    args = parse_args(argv)
    if args.device == "cpu":
        mx.set_default_device(mx.cpu)
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="ppc-bench-", dir=args.dir))
    bench = Bench(args, workdir)
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()},
        "machine": machine(),
        "cases": [],
        "ratios": {},
    }
    try:
        cases = [(f"{d}", Shape(args.layers, args.kv_heads, args.head_dim, d, args.tokens)) for d in args.dtypes]
        if args.llama8b:
            cases.append(("llama8b-bfloat16", Shape(32, 8, 128, "bfloat16", args.tokens)))
        largest = max([s.kv_bytes for _, s in cases] + [cases[0][1].with_tokens(n).kv_bytes for n in args.sweep])
        result["machine"]["mlx_cache_limit"] = set_mlx_cache_limit(args.mlx_cache_limit, largest)
        for i, (name, shape) in enumerate(cases):
            result["cases"].append(bench.case(name, shape, seed=10 + i))
        if not CAN_DROP_PAGE_CACHE:
            bench.note("os.posix_fadvise is missing on this platform: cold figures are skipped")
        first = cases[0][1]
        if args.lookup_blocks > 0:
            result["lookup"] = bench.lookup()
            result["ratios"]["lookup_ms"] = ratio(result["lookup"]["median_s"] * 1e3, "< 2")
        if args.shared_prompts > 0:
            sp = bench.shared_prefix(first)
            result["shared_prefix"] = sp
            result["ratios"]["shared_prefix_vs_distinct_kv"] = ratio(
                sp["ours_bytes"] / sp["distinct_kv_bytes"], "<= 1.05"
            )
            result["ratios"]["mlx_lm_files_vs_ours"] = ratio(sp["mlx_lm_files_bytes"] / sp["ours_bytes"], None)
        if args.precompute_prompts > 0:
            release_memory()
            result["precompute"] = bench.precompute()
            for rname, value in result["precompute"]["ratios"].items():
                result["ratios"][rname] = ratio(value, bench_precompute.TARGETS[rname])
        if not args.no_remote:
            release_memory()
            helpers = dict(
                contest=contest, summarize=summarize, paired_ratio=paired_ratio, ratio=ratio,
                Contender=Contender, random_kv=random_kv, make_cache=make_cache, cache_arrays=cache_arrays,
            )  # fmt: skip
            result["remote"] = bench_remote.remote_figures(bench, first, helpers)
        if args.serve:
            release_memory()
            serve_args = argparse.Namespace(
                prompts=args.serve_prompts, words=args.serve_words, cache_bytes=args.serve_cache_bytes,
                servers=[s.strip() for s in args.serve_servers.split(",")],
            )  # fmt: skip
            result["serve"] = bench_serve.serve_figures(serve_args, workdir)
        if args.sweep:
            result["sweep"] = bench.sweep(first)
            if not args.no_plot:
                missing = plot(result["sweep"], args.plot)
                if missing:
                    bench.note(missing)
                else:
                    result["plot"] = os.path.abspath(args.plot)
                    progress(f"plot written to {result['plot']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["notes"] = bench.notes
    result["elapsed_s"] = time.perf_counter() - started
    report = format_report(result)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(report, file=sys.stderr)
        print(json.dumps(result, indent=2))
    else:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

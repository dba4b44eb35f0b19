"""The remote (fleet) tier in the benchmark: a loopback redis-server started here.

Figures, on the bench's first case (the same synthetic cache):

- ``ours_fetch_remote``: a fetch by a host whose local store is empty, every block on
  the server (probe, pipelined reads, verification, into the RAM tier, restore), timed
  until the cache is evaluated; the local write it starts runs on the writer thread;
- ``ours_fetch_disk_warm``: a fetch of the same blocks from a local store (page cache
  warm), the baseline of the ratio ``remote_vs_disk_warm`` (target >= 0.5);
- ``raw_get`` and ``redis_py_get``: the same values read with bare pipelined GETs in
  batches of the same size, nothing checked or copied after: each value received
  straight into a buffer of its own (``raw_get``, what the server and the socket
  allow), or as redis-py with hiredis returns them (``redis_py_get``, what a caller
  would write); ``remote_vs_raw_get`` says how much of the floor our fetch keeps;
- ``probe_32k``: the probe of a 32k-token prompt whose blocks the server holds (the
  keys' chain and one pipelined EXISTS round trip), target < 5 ms;
- ``ours_store_async_caller`` with and without a remote: the caller's cost of
  ``store()``, ratio ``store_publish_caller_vs_async`` (target <= 1.1: publishing runs
  on threads, the caller pays at most noise);
- a sweep of the pipeline's batch size (bytes per round trip), in GB/s.

Skipped with a note when ``redis-server`` or redis-py is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import Any

import mlx.core as mx
import numpy as np

BATCH_BYTES = (256 << 10, 1 << 20, 2 << 20, 8 << 20, 32 << 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, workdir: str):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        self.client = redis.Redis(port=self.port, socket_timeout=30)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def remote_figures(bench: Any, shape: Any, helpers: dict) -> dict | None:
    """The remote section of the bench's result (None, with a note, when skipped)."""
    if shutil.which("redis-server") is None:
        bench.note("redis-server not found: the remote tier is not measured (apt-get install -y redis-server)")
        return None
    try:
        import redis
    except ImportError:
        bench.note("redis-py not installed: the remote tier is not measured (pip install redis)")
        return None
    from persistent_prefix_cache.tiers import remote as remote_tier
    from persistent_prefix_cache.tiers.remote_replies import read_values

    contest, summarize, paired_ratio, ratio = (helpers[k] for k in ("contest", "summarize", "paired_ratio", "ratio"))
    Contender, random_kv, make_cache, cache_arrays = (
        helpers[k] for k in ("Contender", "random_kv", "make_cache", "cache_arrays")
    )  # fmt: skip
    server = _Server(str(bench.scratch("redis")))
    try:
        cache = make_cache(random_kv(shape, shape.tokens, seed=99))
        tokens = np.random.default_rng(99).integers(0, 32000, shape.tokens).astype(np.int32)
        query = np.concatenate([tokens, np.array([7], dtype=np.int32)])
        big = 2 * shape.kv_bytes + (64 << 20)
        with bench.open_store(
            bench.scratch("publisher"), shape, remote=server.url, remote_secret="bench", remote_timeout=10
        ) as a:
            a.store(tokens, cache)
            a.flush()
            published = a.stats()["remote_published"]
        local = bench.scratch("local")
        with bench.open_store(local, shape, sync_writes=True, memory_bytes=0) as s:
            s.store(tokens, cache)

        def fetch(s) -> None:
            restored, _ = s.fetch(query)
            mx.eval(cache_arrays(restored))
            assert restored is not None and restored[0].offset == shape.tokens

        def fresh_remote():
            # A generous timeout: a stall of this loaded machine must not end a restore
            # (the timeout bounds stalls only; it does not change the throughput).
            return bench.open_store(
                bench.scratch("host"),
                shape,
                remote=server.url,
                remote_secret="bench",
                memory_bytes=big,
                remote_timeout=10,
            )

        def drop(s) -> None:
            s.close()
            shutil.rmtree(s.path, ignore_errors=True)

        check = fresh_remote()
        fetch(check)
        assert check.stats()["remote_blocks"] == published and check.stats()["remote_corrupt"] == 0
        drop(check)
        keys = sorted(server.client.scan_iter(match=b"ppc:*", count=1000))
        per_batch = max(
            1, min(remote_tier.MAX_BATCH_BLOCKS, remote_tier.BATCH_BYTES // (shape.kv_bytes // max(1, len(keys))))
        )
        batches = [keys[i : i + per_batch] for i in range(0, len(keys), per_batch)]

        def raw_get(client) -> None:
            got = sum(len(v) for b in batches for v in read_values(client, b))
            assert got >= shape.kv_bytes

        def redis_py_get(client) -> None:
            got = 0
            for b in batches:
                pipe = client.pipeline(transaction=False)
                for k in b:
                    pipe.get(k)
                got += sum(len(v) for v in pipe.execute())
            assert got >= shape.kv_bytes

        def client():
            return redis.Redis(port=server.port, socket_timeout=30)

        times = contest(
            [
                Contender("raw_get", raw_get, client, lambda c: c.close()),
                Contender("redis_py_get", redis_py_get, client, lambda c: c.close()),
                Contender("ours_fetch_remote", fetch, fresh_remote, drop),
                Contender("ours_fetch_disk_warm", fetch, lambda: bench.open_store(local, shape, memory_bytes=0),
                          lambda s: s.close()),
            ],
            bench.repeat,
        )  # fmt: skip
        figures = {name: summarize(t, shape.kv_bytes) for name, t in times.items()}

        sweep = {}
        chosen = remote_tier.BATCH_BYTES
        block_bytes = shape.kv_bytes // max(1, published)
        try:
            for batch in BATCH_BYTES:
                remote_tier.BATCH_BYTES = batch
                t = contest([Contender(f"batch_{batch}", fetch, fresh_remote, drop)], max(1, bench.repeat // 2))
                sweep[f"{batch >> 10} KiB ({max(1, min(64, batch // block_bytes))} blocks)"] = summarize(
                    t[f"batch_{batch}"], shape.kv_bytes
                )["gbps"]
        finally:
            remote_tier.BATCH_BYTES = chosen

        # The probe of a 32k-token prompt whose every block the server holds.
        bs = bench.args.block_size
        long = np.random.default_rng(5).integers(0, 32000, 32768).astype(np.int32)
        with bench.open_store(
            bench.scratch("probe"), shape, remote=server.url, remote_secret="bench", remote_timeout=10
        ) as p:
            from persistent_prefix_cache.keys import chain_keys

            root = bytes.fromhex(p.this_model()["root"])
            keys = chain_keys(root, long, bs)
            pipe = server.client.pipeline(transaction=False)
            for k in keys:
                pipe.set(p.remote_fill.remote.key(k), b"x")
            pipe.execute()
            data = long.tobytes()
            runs = []
            for _ in range(max(5, bench.repeat) + 1):
                t0 = time.perf_counter()
                found = p.remote_fill.remote.probe(root, 0, data, bs)
                runs.append(time.perf_counter() - t0)
            assert len(found) == len(keys)
            probe = summarize(runs[1:])

        def new_store(remote: bool):
            def make():
                extra = {"remote": server.url, "remote_secret": "bench", "remote_timeout": 10} if remote else {}
                return bench.open_store(bench.scratch("store"), shape, **extra)

            return make

        def store(s) -> None:
            s.store(tokens, cache)

        server.client.flushall()
        times = contest(
            [
                Contender("ours_store_async_caller", store, new_store(False), drop),
                Contender("ours_store_async_caller_remote", store, new_store(True), drop),
            ],
            bench.repeat,
        )  # fmt: skip
        figures.update({name: summarize(t, shape.kv_bytes) for name, t in times.items()})
        f = figures
        return {
            "shape": shape.describe(),
            "blocks": published,
            "batch_bytes": chosen,
            "batch_blocks": max(1, min(64, chosen // block_bytes)),
            "batch_sweep_gbps": sweep,
            "figures": f,
            "probe_32k": {**probe, "blocks": len(keys)},
            "ratios": {
                "remote_vs_disk_warm": ratio(
                    paired_ratio(f["ours_fetch_remote"], f["ours_fetch_disk_warm"], "speed"), ">= 0.5"
                ),
                "raw_get_vs_disk_warm": ratio(paired_ratio(f["raw_get"], f["ours_fetch_disk_warm"], "speed"), None),
                "remote_vs_raw_get": ratio(paired_ratio(f["ours_fetch_remote"], f["raw_get"], "speed"), None),
                "remote_vs_redis_py_get": ratio(paired_ratio(f["ours_fetch_remote"], f["redis_py_get"], "speed"), None),
                "probe_32k_ms": ratio(probe["median_s"] * 1e3, "< 5"),
                "store_publish_caller_vs_async": ratio(
                    paired_ratio(f["ours_store_async_caller_remote"], f["ours_store_async_caller"], "time"), "<= 1.1"
                ),
            },  # fmt: skip
        }
    finally:
        server.stop()


def format_remote(r: dict | None) -> list[str]:
    """Report lines of the remote section."""
    if not r:
        return []
    f = r["figures"]
    lines = [
        "",
        f"remote tier (loopback redis-server; {r['shape']}, {r['blocks']} blocks, "
        f"{r['batch_bytes'] >> 10} KiB = {r['batch_blocks']} blocks per pipelined read)",
    ]
    for name, label in (
        ("raw_get", "raw    pipelined GETs, each value into its own buffer"),
        ("redis_py_get", "redis-py pipelined GETs (hiredis)"),
        ("ours_fetch_remote", "ours   fetch() from the remote, empty local store"),
        ("ours_fetch_disk_warm", "ours   fetch() of the same blocks from disk, warm"),
        ("ours_store_async_caller", "ours   store(), async: caller's cost"),
        ("ours_store_async_caller_remote", "ours   store(), async + publishing: caller's cost"),
    ):
        lines.append(f"  {label:<52} {f[name]['median_s'] * 1e3:9.1f} ms  {f[name]['gbps']:6.2f} GB/s")
    lines.append(f"  {'probe of a 32k-token prompt (' + str(r['probe_32k']['blocks']) + ' blocks)':<52} "
                 f"{r['probe_32k']['median_s'] * 1e3:9.2f} ms")  # fmt: skip
    sweep = ", ".join(f"{b}: {g:.2f}" for b, g in r["batch_sweep_gbps"].items())
    lines.append(f"  batch size sweep (bytes per round trip: GB/s)  {sweep}")
    for name, value in r["ratios"].items():
        target = f" (target {value['target']})" if value.get("target") else ""
        lines.append(f"  {name:<52} {value['value']:9.3f}{target}")
    return lines

#!/usr/bin/env python3
"""Soak test: several processes hammer one store while workers are killed at random.

Each worker process opens the store and runs a few threads. A thread picks a prompt
from a pool whose prompts share prefixes (as-is, cut short, or extended with new
tokens), fetches it, feeds what is left, and compares the next-token logits bit for
bit with a cold prefill the worker computed itself; then it stores the prompt. The
supervisor SIGKILLs a random worker every few seconds (at whatever point of a write
it happens to be) and starts a new one in its place.

At the end: ``ppc check`` (crash leftovers, i.e. unreferenced files and temporary
files of dead writers, are expected; any other problem is a failure), ``check --fix
--grace 0``, a clean ``check``, and a fresh process that verifies every pool prompt
from disk. The exit code is 1 if any wrong KV was served, a worker raised, or the
store is not clean after the fix.

    python tools/soak.py --seconds 300 --procs 4 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from persistent_prefix_cache.tiny_model import TEST_MODEL  # noqa: E402

# Problems a SIGKILL may leave behind by design (README, "Crashes": at most an
# unreferenced file, which the next open or `ppc check --fix` sweeps).
CRASH_LEFTOVERS = {"unreferenced file", "leftover temporary file"}
TINY_MODEL = dict(TEST_MODEL)
COUNTERS = (
    "operations",
    "fetches",
    "full_hits",
    "partial_hits",
    "misses",
    "tokens_restored",
    "tokens_computed",
    "stores",
    "new_blocks",
    "corrupt_served",
    "errors",
)
STORE_COUNTERS = ("corrupt", "write_errors", "evictions")


# -- the prompt pool -----------------------------------------------------------------------


def make_pool(seed: int, size: int, vocab: int) -> list[list[int]]:
    """Prompts built from a few shared prefixes (system prompts, documents) and suffixes."""
    rng = random.Random(seed)
    prefixes = []
    for i in range(max(2, size // 8)):
        head = [rng.randrange(vocab) for _ in range(rng.randint(20, 80))]
        # Some prefixes extend others: nested sharing, not only siblings.
        if prefixes and rng.random() < 0.3:
            head = rng.choice(prefixes) + head[:24]
        prefixes.append(head)
    return [rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(size)]


# -- worker process -----------------------------------------------------------------------------


class _Counters:
    """Thread-safe counters, saved atomically so a SIGKILL loses at most a moment's worth.

    The store's own counters (damaged blocks seen, write errors) are sampled with each
    save, so that a worker that is killed still reports them.
    """

    def __init__(self, path: str):
        self.path = path
        self.values = dict.fromkeys(COUNTERS, 0)
        self.store: dict[str, int] = dict.fromkeys(STORE_COUNTERS, 0)
        self.stats_fn = None
        self.lock = threading.Lock()
        self.saved = 0.0

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, n in deltas.items():
                self.values[name] += n

    def save(self, *, force: bool = False) -> None:
        with self.lock:  # one save at a time, so that a newer one is never overwritten
            now = time.monotonic()
            if not force and now - self.saved < 0.25:
                return
            self.saved = now
            if self.stats_fn is not None:
                try:
                    stats = self.stats_fn()
                    self.store = {k: stats[k] for k in STORE_COUNTERS}
                except Exception:
                    pass  # the store is closing: keep the last sample
            data = json.dumps({"counters": self.values, "store": self.store})
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)


def run_worker(spec: dict) -> int:
    """Hammer the store until the supervisor stops it; see the module docstring."""
    import mlx.core as mx

    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(spec["model"])
    with open(spec["pool"]) as f:
        pool = json.load(f)
    counters = _Counters(spec["counters"])
    cold: dict[tuple, mx.array] = {}
    cold_lock = threading.Lock()

    def feed(cache, tokens):
        logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
        mx.eval(logits, [c.state for c in cache])
        return logits

    def cold_logits(query: list[int]):
        key = tuple(query)
        with cold_lock:
            if key in cold:
                return cold[key]
        logits = feed(store.make_cache(), query)  # computed outside the lock
        with cold_lock:
            return cold.setdefault(key, logits)

    def report_wrong(query, matched, diff) -> None:
        with open(spec["errors"], "a") as f:
            f.write(json.dumps({"wrong_kv": query, "matched": matched, "diff": diff}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def one_op(rng: random.Random) -> None:
        query = list(rng.choice(pool))
        roll = rng.random()
        if roll < 0.25:
            query = query[: rng.randint(1, len(query))]
        elif roll < 0.4:
            query += [rng.randrange(512) for _ in range(rng.randint(1, 8))]
        cache, remaining = store.fetch(query)
        matched = len(query) - len(remaining)
        counters.add(
            operations=1,
            fetches=1,
            full_hits=int(matched == len(query) - 1 and matched > 0),
            partial_hits=int(0 < matched < len(query) - 1),
            misses=int(cache is None),
            tokens_restored=matched,
            tokens_computed=len(remaining),
        )
        if cache is None:
            cache = store.make_cache()
        got = feed(cache, remaining)
        want = cold_logits(query)
        if not mx.array_equal(got, want).item():
            diff = float(mx.abs(got - want).max().item())
            counters.add(corrupt_served=1)
            report_wrong(query, matched, diff)
            counters.save(force=True)
        if rng.random() < 0.8:  # most requests store what they computed
            new = store.store(query, cache)
            counters.add(stores=1, new_blocks=new)
        if rng.random() < 0.05:
            store.flush()

    def thread_main(index: int) -> None:
        rng = random.Random(f"{spec['seed']}-{os.getpid()}-{index}")
        done = 0
        # Run while the supervisor's run file exists (it removes it at the end), and
        # past that until this thread has done its minimum: on a loaded machine a
        # worker may spend most of its time starting up.
        while os.path.exists(spec["run_file"]) or done < spec["min_ops"]:
            done += 1
            try:
                one_op(rng)
            except Exception:
                counters.add(errors=1)
                with open(spec["errors"], "a") as f:
                    f.write(json.dumps({"exception": traceback.format_exc()}) + "\n")
            counters.save()

    store = PersistentPrefixCache(
        spec["store"],
        model,
        block_size=spec["block_size"],
        memory_bytes=spec["memory_bytes"],
        disk_bytes=spec["disk_bytes"],
    )
    counters.stats_fn = store.stats
    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(spec["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    counters.save(force=True)  # with the store's final counters
    counters.stats_fn = None
    store.close()
    return 0


def run_verify(spec: dict) -> int:
    """From a fresh process, disk only: every pool prompt restores exactly (or misses)."""
    import mlx.core as mx

    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(spec["model"])
    with open(spec["pool"]) as f:
        pool = json.load(f)
    out = {"queries": 0, "hits": 0, "tokens_restored": 0, "wrong": 0, "corrupt": 0}
    with PersistentPrefixCache(spec["store"], model, memory_bytes=0) as store:
        for query in pool:
            cache, remaining = store.fetch(query)
            out["queries"] += 1
            out["hits"] += cache is not None
            out["tokens_restored"] += len(query) - len(remaining)
            warm = store.make_cache() if cache is None else cache
            got = model(mx.array(remaining)[None], cache=warm)[0, -1]
            want = model(mx.array(query)[None], cache=store.make_cache())[0, -1]
            out["wrong"] += not mx.array_equal(got, want).item()
        out["corrupt"] = store.stats()["corrupt"]
    print(json.dumps(out))
    return 0


# -- supervisor ------------------------------------------------------------------------------------


def _ppc_check(store: str, *flags: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "persistent_prefix_cache", "check", "--json", "--store", store] + list(flags),
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = {"clean": False, "problems": [{"kind": "check failed", "detail": proc.stderr}]}
    report["exit_code"] = proc.returncode
    return report


class Supervisor:
    def __init__(self, args: argparse.Namespace, workdir: str, model: str, store: str):
        self.args = args
        self.workdir = workdir
        self.model = model
        self.store = store
        self.pool_path = os.path.join(workdir, "pool.json")
        with open(self.pool_path, "w") as f:
            json.dump(make_pool(args.seed, args.pool, TINY_MODEL["vocab_size"]), f)
        self.errors_path = os.path.join(workdir, "errors.jsonl")
        self.incarnations = 0
        self.kills = 0
        self.restarts = 0
        self.crashed = 0  # workers that exited non-zero on their own
        self.counter_files: list[str] = []
        self.counters_of: dict[int, str] = {}  # worker pid -> its counters file
        self.deadline = time.time() + args.seconds
        # Workers run while this file exists: the supervisor alone decides when to stop.
        self.run_file = os.path.join(workdir, "running")
        open(self.run_file, "w").close()

    def spawn(self) -> subprocess.Popen:
        self.incarnations += 1
        n = self.incarnations
        counters = os.path.join(self.workdir, f"counters-{n}.json")
        self.counter_files.append(counters)
        spec = {
            "model": self.model,
            "store": self.store,
            "pool": self.pool_path,
            "counters": counters,
            "errors": self.errors_path,
            "block_size": self.args.block_size,
            "memory_bytes": self.args.memory_bytes,
            "disk_bytes": self.args.disk_bytes,
            "threads": self.args.threads,
            "run_file": self.run_file,
            "min_ops": self.args.min_ops,
            "seed": self.args.seed * 1000 + n,
        }
        spec_path = os.path.join(self.workdir, f"worker-{n}.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        log = open(os.path.join(self.workdir, f"worker-{n}.log"), "w")
        try:
            worker = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", spec_path],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()
        self.counters_of[worker.pid] = counters
        return worker

    def _working(self, worker: subprocess.Popen) -> bool:
        """Whether `worker` is alive and has done an operation (a kill then interrupts
        real work, not an interpreter still importing MLX)."""
        if worker.poll() is not None:
            return False
        try:
            with open(self.counters_of[worker.pid]) as f:
                return json.load(f)["counters"]["operations"] > 0
        except (OSError, ValueError, KeyError):
            return False  # not saved yet

    def _more_kills_needed(self) -> bool:
        return self.args.kill_every > 0 and self.kills < self.args.min_kills

    def run(self) -> None:
        rng = random.Random(self.args.seed)
        workers = [self.spawn() for _ in range(self.args.procs)]
        killed: set[int] = set()  # pids we killed (their slot may stay empty near the end)
        try:
            # Until the deadline, and past it until --min-kills workers were killed at work.
            while True:
                left = self.deadline - time.time()
                if left <= 0 and not self._more_kills_needed():
                    break
                pause = rng.expovariate(1 / self.args.kill_every) if self.args.kill_every > 0 else 0.5
                time.sleep(min(left, pause) if left > 0 else pause)
                if time.time() >= self.deadline and not self._more_kills_needed():
                    break
                for i, w in enumerate(workers):  # a worker that died on its own
                    if w.poll() is not None and w.pid not in killed:
                        self.crashed += w.returncode != 0
                        workers[i] = self.spawn()
                        self.restarts += 1
                if self.args.kill_every > 0:
                    i = rng.randrange(len(workers))
                    if self._working(workers[i]):
                        owed = self._more_kills_needed()
                        workers[i].send_signal(signal.SIGKILL)
                        workers[i].wait(timeout=60)
                        killed.add(workers[i].pid)
                        self.kills += 1
                        # Room for a new one to work (or kills still owed).
                        if self.deadline - time.time() > 3 or owed:
                            workers[i] = self.spawn()
                            self.restarts += 1
            # Workers stop once the run file is gone: give them time to close.
            os.unlink(self.run_file)
            end = time.time() + 120
            for w in workers:
                try:
                    w.wait(timeout=max(1, end - time.time()))
                    self.crashed += w.returncode not in (0, -signal.SIGKILL)
                except subprocess.TimeoutExpired:
                    self.crashed += 1  # hung past the deadline: killed below
        finally:
            if os.path.exists(self.run_file):
                os.unlink(self.run_file)
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait(timeout=60)

    def totals(self) -> dict:
        counters = dict.fromkeys(COUNTERS, 0)
        store = dict.fromkeys(STORE_COUNTERS, 0)
        for path in self.counter_files:
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue  # killed before its first save
            for k in COUNTERS:
                counters[k] += data["counters"][k]
            for k in STORE_COUNTERS:
                store[k] += data["store"][k]
        return {**counters, **{f"store_{k}": v for k, v in store.items()}}

    def verify(self) -> dict:
        spec_path = os.path.join(self.workdir, "verify.json")
        with open(spec_path, "w") as f:
            json.dump({"model": self.model, "store": self.store, "pool": self.pool_path}, f)
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--verify", spec_path],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if proc.returncode != 0:
            return {"failed": proc.stderr[-4000:]}
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _first_errors(path: str, limit: int = 3) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for _, line in zip(range(limit), f)]
    except OSError:
        return []


def _crash_logs(workdir: str, limit: int = 3, tail: int = 2000) -> list:
    """The ends of the worker logs that hold anything (a worker writes there only when it
    dies on its own: its traceback)."""
    out = []
    for name in sorted(os.listdir(workdir)):
        if name.startswith("worker-") and name.endswith(".log") and len(out) < limit:
            with open(os.path.join(workdir, name), errors="replace") as f:
                text = f.read()
            if text.strip():
                out.append({"log": name, "tail": text[-tail:]})
    return out


def supervise(args: argparse.Namespace) -> int:
    workdir = tempfile.mkdtemp(prefix="ppc-soak-")
    model = args.model
    if model is None:
        from persistent_prefix_cache.tiny_model import write_tiny_model

        model = str(write_tiny_model(os.path.join(workdir, "model"), seed=0, **TINY_MODEL))
    store = args.store or os.path.join(workdir, "store")
    sup = Supervisor(args, workdir, model, store)
    started = time.time()
    sup.run()
    ran = time.time() - started
    totals = sup.totals()

    before = _ppc_check(store)
    kinds: dict[str, int] = {}
    for p in before.get("problems", []):
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    unexpected = sorted(set(kinds) - CRASH_LEFTOVERS)
    fixed = _ppc_check(store, "--fix", "--grace", "0") if kinds else None
    after = _ppc_check(store) if kinds else before
    verified = sup.verify()
    blocks_dir = os.path.join(store, "segments")
    sizes = {
        # An index much larger than its blocks means freed pages are not reused (LMDB
        # readers left behind by killed processes pin them).
        "index_bytes": os.path.getsize(os.path.join(store, "index", "data.mdb")),
        "block_bytes": sum(e.stat().st_size for d in os.scandir(blocks_dir) if d.is_dir() for e in os.scandir(d.path)),
    }

    ok = (
        totals["corrupt_served"] == 0
        and totals["errors"] == 0
        and sup.crashed == 0
        and not unexpected
        and after.get("clean", False)
        and verified.get("wrong", 1) == 0
        and verified.get("corrupt", 1) == 0
    )
    summary = {
        "ok": ok,
        "seconds": round(ran, 1),
        "procs": args.procs,
        "threads": args.threads,
        **totals,
        "kills": sup.kills,
        "restarts": sup.restarts,
        "workers_crashed": sup.crashed,
        "check": {
            "blocks": before.get("nodes"),
            "problems_by_kind": kinds,
            "unexpected_problems": unexpected,
            "fix_removed_files": (fixed or {}).get("removed_files", 0),
            "fix_removed_nodes": (fixed or {}).get("removed_nodes", 0),
            "clean_after_fix": after.get("clean", False),
        },
        "verify": verified,
        "sizes": sizes,
        "errors_sample": _first_errors(sup.errors_path),
        "crash_logs": _crash_logs(workdir),
        "workdir": workdir,
        "store": store,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(_render(summary))
    if ok and not args.keep:
        import shutil

        # The work folder (logs, counters, the built model, the default store); a
        # store given with --store lives elsewhere and is the caller's.
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def _render(s: dict) -> str:
    c = s["check"]
    lines = [
        f"soak: {s['seconds']} s, {s['procs']} processes x {s['threads']} threads",
        f"  operations        {s['operations']:,} ({s['full_hits']:,} full hits, "
        f"{s['partial_hits']:,} partial, {s['misses']:,} misses recomputed)",
        f"  tokens            {s['tokens_restored']:,} restored, {s['tokens_computed']:,} computed",
        f"  stores            {s['stores']:,} ({s['new_blocks']:,} new blocks)",
        f"  kills / restarts  {s['kills']} / {s['restarts']}",
        f"  wrong KV served   {s['corrupt_served']}",
        f"  worker errors     {s['errors']} (crashed on their own: {s['workers_crashed']})",
        f"  damaged detected  {s['store_corrupt']}, write errors {s['store_write_errors']}",
        f"  check             {c['blocks']} blocks, problems {c['problems_by_kind'] or 'none'}"
        f"{' UNEXPECTED ' + str(c['unexpected_problems']) if c['unexpected_problems'] else ''}",
        f"  after fix         removed {c['fix_removed_files']} files, "
        f"{'clean' if c['clean_after_fix'] else 'NOT CLEAN'}",
        f"  verify            {s['verify']}",
        f"  on disk           index {s['sizes']['index_bytes']:,} bytes, blocks {s['sizes']['block_bytes']:,} bytes",
        "OK" if s["ok"] else f"FAILED (details in {s['workdir']})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to run (300)")
    parser.add_argument("--procs", type=int, default=4, help="worker processes (4)")
    parser.add_argument("--threads", type=int, default=2, help="threads per worker (2)")
    parser.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between SIGKILLs (3)")
    parser.add_argument("--no-kills", action="store_const", const=0.0, dest="kill_every")
    parser.add_argument(
        "--min-ops", type=int, default=0,
        help="operations every worker thread does at least, past --seconds if need be (0)",
    )  # fmt: skip
    parser.add_argument(
        "--min-kills", type=int, default=0,
        help="SIGKILLs of working workers at least, past --seconds if need be (0)",
    )  # fmt: skip
    parser.add_argument("--store", help="store directory (default: a new temporary one)")
    parser.add_argument("--model", help="tiny model folder (default: build one)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--memory-bytes", type=int, default=1 << 20, help="RAM tier per worker")
    parser.add_argument("--disk-bytes", type=int, default=None, help="disk budget (none)")
    parser.add_argument("--pool", type=int, default=48, help="prompts in the pool (48)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--verify", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for mode, fn in (("worker", run_worker), ("verify", run_verify)):
        path = getattr(args, mode)
        if path:
            with open(path) as f:
                return fn(json.load(f))
    if args.procs < 1 or args.threads < 1 or args.seconds <= 0:
        parser.error("--procs, --threads and --seconds must be positive")
    if args.min_ops < 0 or args.min_kills < 0:
        parser.error("--min-ops and --min-kills must be at least 0")
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())

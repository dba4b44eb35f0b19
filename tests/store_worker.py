"""A store client in its own process, for the crash, concurrency and damage tests.

Run as ``python store_worker.py SPEC.json``. The spec names the model folder, the store
and a list of steps; the worker opens the store, runs the steps in order and prints one
line ``RESULT <json>`` with what each step returned. Steps:

- ``["store", tokens]``: prefill the tokens in one shot, ``store()`` them (new blocks).
- ``["flush"]``, ``["close"]``, ``["stats"]``.
- ``["fetch", tokens]``: fetch, feed the rest, and compare the next-token logits with
  a cold prefill done here (``{"matched": n, "exact": bool}``).
- ``["ready", label]``: print ``READY <label>`` so the test knows the worker got there.
- ``["wait"]``: block until the test writes a line to stdin (or closes it).
- ``["fsize_limit", n]``: cap file writes at ``n`` bytes (RLIMIT_FSIZE) with SIGXFSZ
  ignored, so writes past it fail with EFBIG instead of killing the process.

Options besides the steps: ``block_size``, ``readonly``, ``memory_bytes`` (0 unless
given), ``sync_writes``, ``cost_model``, ``remote``, ``remote_secret``, ``remote_insecure``, ``remote_timeout``,
``initial_map_size`` (the LMDB map a new environment starts with), and ``uid``: drop to that user before opening the store.

Crash tests add the ``pause_at`` / ``pause_file`` test hooks (``PPC_TEST_HOOKS``) to the environment and SIGKILL
the worker where it pauses. The module also holds the test-side helpers that start,
synchronise with and reap such workers.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.abspath(__file__)


# -- worker side ----------------------------------------------------------------------


def _run(spec: dict) -> dict:
    import mlx.core as mx

    sys.path.insert(0, HERE)
    from helpers import cold_logits, prefill, warm_logits

    from persistent_prefix_cache import PersistentPrefixCache
    from persistent_prefix_cache.tiny_model import load_tiny_model

    model = load_tiny_model(spec["model"])
    if spec.get("uid") is not None:
        # Become another user only now: the interpreter and its libraries may live
        # where that user cannot read, but everything the store does runs as them.
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    out: dict = {"pid": os.getpid(), "steps": [], "warnings": []}
    if spec.get("initial_map_size"):  # a small LMDB map, to reach its growth path
        from persistent_prefix_cache.disk import index_env

        index_env.INITIAL_MAP_SIZE = spec["initial_map_size"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = PersistentPrefixCache(
            spec["store"],
            model,
            block_size=spec.get("block_size"),
            readonly=spec.get("readonly", False),
            memory_bytes=spec.get("memory_bytes", 0),
            sync_writes=spec.get("sync_writes", False),
            cost_model=spec.get("cost_model", True),
            **{k: spec[k] for k in ("remote", "remote_secret", "remote_insecure", "remote_timeout") if k in spec},
        )
        for step in spec["steps"]:
            op, args = step[0], step[1:]
            if op == "store":
                _, cache = prefill(model, args[0])
                out["steps"].append(store.store(args[0], cache))
            elif op == "fetch":
                tokens = args[0]
                cache, remaining = store.fetch(tokens)
                got = warm_logits(model, cache, remaining)
                exact = bool(mx.array_equal(got, cold_logits(model, tokens)).item())
                out["steps"].append({"matched": len(tokens) - len(remaining), "exact": exact})
            elif op == "flush":
                store.flush()
                out["steps"].append(None)
            elif op == "stats":
                out["steps"].append(store.stats())
            elif op == "close":
                store.close()
                out["steps"].append(None)
            elif op == "ready":
                print(f"READY {args[0]}", flush=True)
                out["steps"].append(None)
            elif op == "wait":
                sys.stdin.readline()
                out["steps"].append(None)
            elif op == "fsize_limit":
                import resource

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (args[0], args[0]))
                out["steps"].append(None)
            else:
                raise ValueError(f"unknown step {op!r}")
        store.close()
    out["warnings"] = [str(w.message) for w in caught]
    return out


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def main() -> None:
    import faulthandler

    # A test that gives up on a stuck worker asks it for its stacks (SIGUSR1) first.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A worker outlives a test process that was killed (a timeout, say) only until
    # it notices: a worker paused at a pause point would otherwise sleep forever.
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = _run(spec)
    print("RESULT " + json.dumps(result), flush=True)


# -- test side ----------------------------------------------------------------------------


class Worker:
    """A running worker process; always `reap()` it (tests do so in ``finally``).

    Its output is drained by threads, so a chatty worker never blocks on a full pipe
    and every wait here has a deadline.
    """

    def __init__(
        self,
        spec: dict,
        workdir: str,
        *,
        env: dict | None = None,
        name: str = "w",
        wrap: list[str] | None = None,
    ):
        self.spec_path = os.path.join(workdir, f"{name}.json")
        with open(self.spec_path, "w") as f:
            json.dump(spec, f)
        self.proc = subprocess.Popen(
            [*(wrap or []), sys.executable, SCRIPT, self.spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue = queue.Queue()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._drain, args=(self.proc.stdout, self._stdout, True)),
            threading.Thread(target=self._drain, args=(self.proc.stderr, self._stderr, False)),
        ]
        for t in self._threads:
            t.daemon = True
            t.start()

    def _drain(self, pipe, into: list, announce: bool) -> None:
        for line in pipe:
            into.append(line)
            if announce:
                self.lines.put(line)

    def wait_ready(self, label: str, timeout: float = 60) -> None:
        """Block until the worker prints ``READY <label>`` (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            if line.strip() == f"READY {label}":
                return
        self.dump_stacks()
        raise AssertionError(f"worker never got ready ({label}), exit {self.proc.poll()}: {self.stderr()}")

    def go(self) -> None:
        """Release a worker blocked in a ``wait`` step."""
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 60) -> dict:
        """Wait for a clean exit and return the worker's RESULT."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.reap()
            raise AssertionError(f"worker did not finish in time\n{self.stderr()}")
        for t in self._threads:
            t.join(timeout=10)
        assert self.proc.returncode == 0, f"worker exited {self.proc.returncode}\n{self.stderr()}"
        for line in self._stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise AssertionError(f"worker printed no result\n{self.stderr()}")

    def kill(self) -> None:
        """SIGKILL, then wait for the process to be gone."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def reap(self) -> None:
        """Kill if still running and close the pipes (for ``finally``)."""
        self.kill()
        for t in self._threads:
            t.join(timeout=10)
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass  # the worker is gone: nothing reads the pipe any more

    def dump_stacks(self) -> None:
        """Have a stuck worker print its threads' stacks to stderr, for the failure."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGUSR1)
            time.sleep(0.5)
        else:
            self._threads[1].join(timeout=10)

    def stderr(self) -> str:
        return "".join(self._stderr)


def wait_for_pause(marker: str, worker: Worker, point: str, timeout: float = 60) -> None:
    """Block until `worker` wrote `point` into `marker` (it then sleeps there)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(marker):
            with open(marker) as f:
                if f.read() == point:
                    return
        if worker.proc.poll() is not None:
            raise AssertionError(f"worker exited before {point}: {worker.stderr()}")
        time.sleep(0.02)
    raise AssertionError(f"worker never paused at {point}")


if __name__ == "__main__":
    main()

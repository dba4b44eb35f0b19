"""Real server processes for the remote-tier tests: one server, or a 3-node cluster.

Two engines speak the protocol: Redis (``redis-server``) and Valkey (``valkey-server``,
its fork); every remote test runs against each one installed. Each server runs on a
free port of 127.0.0.1 in a temporary directory, without persistence (``--save ''
--appendonly no``), and is stopped by the fixture that made it. When an engine (or
redis-py) is missing its tests skip with a message saying how to install it, unless
the test hook ``PPC_TEST_HOOKS=require=redis:valkey`` (CI), where they fail instead.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time

import pytest

from persistent_prefix_cache.disk.faults import hook

ENGINES = ("redis", "valkey")
HOW_TO_INSTALL = {
    "redis": "apt-get install -y redis-server (make test does it when it can) and pip install redis",
    "valkey": "apt-get install -y valkey-server (Debian 12: from bookworm-backports; Debian 13, Ubuntu 24.04+: main)",
}


def require_engine(engine: str = "redis") -> None:
    """Skip (or, with the test hook ``require=<engine>``, fail) unless `engine`'s server and CLI
    and redis-py exist."""
    missing = [name for name in (f"{engine}-server", f"{engine}-cli") if shutil.which(name) is None]
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py")
    if missing:
        message = f"remote tests on {engine} need {', '.join(missing)}: {HOW_TO_INSTALL[engine]}"
        if engine in (hook("require") or "").split(":"):
            pytest.fail(f"{message} (PPC_TEST_HOOKS has require={hook('require')}: required)")
        pytest.skip(message)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free port below 55536 whose cluster bus port (+10000) is free too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 55000)
        if _bindable(port) and _bindable(port + 10000):
            return port


class PortTaken(RuntimeError):
    """The server could not bind its port: another process took it after `free_port`."""


class RedisServer:
    """One server process (``redis-server`` or ``valkey-server``).

    Args:
        workdir: Its directory (logs, cluster config).
        args: Extra server options, e.g. ``["--maxmemory", "1mb"]``.
        port: The port (a free one if None).
        tls: (certificate, key) files: serve TLS only, on `port`.
        engine: "redis" or "valkey".
    """

    def __init__(
        self, workdir, *, args=(), port: int | None = None, tls: tuple[str, str] | None = None, engine: str = "redis"
    ):
        self.engine = engine
        self.workdir = str(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.args = list(args)
        self.port = port or free_port()
        self._port_chosen = port is None  # ours to change if another process takes it first
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "RedisServer":
        """Start it and wait (bounded) until it answers PING. At its first start, a port
        it chose that another process bound meanwhile (tests run in parallel) is chosen
        again, a few times; a restart keeps its port."""
        for _ in range(4):
            try:
                self._start()
                break
            except PortTaken:
                if not self._port_chosen:
                    raise
                self.port = free_port()
        else:
            self._start()
        self._port_chosen = False
        return self

    def _start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.tls:
            cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]  # fmt: skip
        cmd = [
            f"{self.engine}-server", *ports, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.workdir, "--logfile", f"redis-{self.port}.log",
            "--protected-mode", "no", *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                if "Address already in use" in log:
                    raise PortTaken(f"{self.engine}-server: port {self.port} (or {self.port + 10000}) taken: {log}")
                raise RuntimeError(f"{self.engine}-server exited {self.proc.returncode}: {log}")
            try:
                client = self.client(timeout=1)
                if client.ping() and client.info("server")["process_id"] == self.proc.pid:
                    return
                # Another server answered on this port: this one cannot bind it, and exits.
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.05)
        raise RuntimeError(f"{self.engine}-server on port {self.port} did not answer: {self.log()}")

    def client(self, timeout: float = 10):
        """A redis-py client of this server (for the tests' own inspection)."""
        import redis

        password = None
        if "--requirepass" in self.args:
            password = self.args[self.args.index("--requirepass") + 1]
        tls = {"ssl": True, "ssl_cert_reqs": "none"} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=password, socket_timeout=timeout, **tls)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop it (SIGTERM, SIGKILL after a while)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        path = os.path.join(self.workdir, f"redis-{self.port}.log")
        return open(path).read()[-2000:] if os.path.exists(path) else ""


class RedisCluster:
    """Three cluster-enabled servers joined with ``<engine>-cli --cluster create``.

    ``cluster-require-full-coverage no``: when a node is down the others keep serving
    their slots (what the fleet wants from its cache).
    """

    def __init__(self, workdir, n: int = 3, engine: str = "redis"):
        self.engine = engine
        self.nodes = [
            RedisServer(
                os.path.join(str(workdir), f"node{i}"),
                args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "60000",
                    "--cluster-require-full-coverage",
                    "no",
                ],
                engine=engine,
            )  # fmt: skip
            for i in range(n)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self) -> "RedisCluster":
        for s in self.nodes:
            s.start()
        addresses = [f"127.0.0.1:{s.port}" for s in self.nodes]
        subprocess.run(
            [f"{self.engine}-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = [s.client().execute_command("CLUSTER INFO") for s in self.nodes]
            if all("cluster_state:ok" in str(x) or "'cluster_state': 'ok'" in str(x) for x in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def node_of(self, key: bytes) -> RedisServer:
        """The node that holds `key`'s slot."""
        import redis.crc

        slot = redis.crc.key_slot(key)
        for s in self.nodes:
            try:
                ranges = s.client(timeout=2).execute_command("CLUSTER SLOTS")
            except Exception:  # noqa: BLE001 - a node the test stopped
                continue
            for lo, hi, master, *_ in ranges:
                if lo <= slot <= hi:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError("slot not served")

    def stop(self) -> None:
        for s in self.nodes:
            s.stop()

"""chatd past one node, on one machine: replicas of `chatd serve` sharing one real PostgreSQL
database, behind a real gateway (the SGLang Model Gateway, `smg`, or HAProxy), each process on
127.0.0.1 at a port of its own. A replica keeps its port across a kill -9 and a restart, so the
gateway finds it again. `missing()` says why the cluster cannot run here (a binary or package
lacking), for the tests to skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests import postgres_server

SMG_VERSION = "1.13.0"  # the gateway these tests ran against (pyproject's replicas extra pins it)


def missing(*gateways: str) -> str | None:
    """Why the cluster with these gateways ("smg", "haproxy") cannot be started here, or None."""
    why = postgres_server.missing()
    if why:
        return why
    if "smg" in gateways and smg_binary() is None:
        return f"the SGLang Model Gateway is not installed (pip install smg=={SMG_VERSION})"
    if "haproxy" in gateways and shutil.which("haproxy") is None:
        return "HAProxy is not installed (Debian: apt-get install haproxy)"
    return None


def smg_binary() -> str | None:
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.exists() else shutil.which("smg")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} within {timeout} s")


class Replica:
    """One `chatd serve` process of the cluster: its own folder, log and fixed port."""

    def __init__(self, name: str, root: Path, model_dir: Path, config_text: str) -> None:
        self.name, self.model_dir = name, model_dir
        self.folder = root / name
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "config.toml").write_text(config_text)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for it)."""
        self.starts += 1
        log = open(self.folder / f"serve-{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chatd", "serve", "--model", str(self.model_dir), "--config",
             str(self.folder / "config.toml"), "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env={**_environment(), "CHATD_HOME": str(self.folder / "home")})
        log.close()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until /health says this replica takes traffic (200), or its process ended."""
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited:\n{self.log()}")
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        wait_until(ready, timeout, f"replica {self.name} was not ready")

    def kill(self) -> None:
        """kill -9: no drain, no last writes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return (self.folder / f"serve-{self.starts}.log").read_text()


def replica_config(store_url: str, *, replica_timeout: float = 2.0, extra: str = "") -> str:
    return (f'[store]\nurl = "{store_url}"\nreplica_timeout_seconds = {replica_timeout}\n'
            "[model]\nmax_model_len = 1024\n"
            "[conversations]\nsave_interval_seconds = 0.05\n"
            "[server]\nheartbeat_seconds = 0.5\nshutdown_grace_seconds = 1\n" + extra)


class Gateway:
    """A gateway process in front of the replicas."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log(self) -> str:
        return self.log_path.read_text()


class Smg(Gateway):
    """The SGLang Model Gateway with `policy` (cache_aware, round_robin, ...). Its own history is off
    (`--history-backend none`): Responses chains are chatd's, kept in PostgreSQL. It probes each
    replica's /health every second and drops one after a failed probe."""

    def __init__(self, folder: Path, replicas: list[Replica], policy: str, *extra: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = folder / f"smg-{policy}-{port}.log"
        command = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(port),
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--worker-urls", *[r.url for r in replicas], "--policy", policy, "--history-backend", "none",
                   "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                   "--health-success-threshold", "1", *extra]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self._healthy() == len(replicas), 60, f"smg did not see {len(replicas)} healthy replicas")

    def _healthy(self) -> int:
        if self.proc.poll() is not None:
            raise RuntimeError(f"smg exited:\n{self.log()}")
        workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
        return sum(1 for w in workers if w["is_healthy"])


class HAProxy(Gateway):
    """HAProxy hashing X-Chatd-Routing-Key onto the replicas (consistent hashing: a replica that
    leaves moves only its own keys), probing /health twice a second; a request that cannot connect
    is sent to another replica. Each response says which replica served it (X-Served-By)."""

    def __init__(self, folder: Path, replicas: list[Replica]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = folder / f"haproxy-{port}.log"
        config = folder / f"haproxy-{port}.cfg"
        config.write_text(haproxy_config(port, replicas))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200, 30, "HAProxy did not answer")


def haproxy_config(port: int, replicas: list[Replica]) -> str:
    servers = "".join(f"    server {r.name} 127.0.0.1:{r.port} check\n" for r in replicas)
    return f"""global
    maxconn 512
defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response
frontend chatd
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance hdr(X-Chatd-Routing-Key)
    hash-type consistent
    option httpchk GET /health
    http-check expect status 200
    default-server inter 500ms fall 1 rise 2
    http-response set-header X-Served-By %[srv_name]
{servers}"""


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CHATD_HOME"}

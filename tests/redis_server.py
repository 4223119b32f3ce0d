"""A real redis-server for a test: on a free loopback port, nothing saved to disk, stopped and
started again on the same port (an outage and its end). Tests that need one skip, saying why,
where redis-server or the redis package is missing."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def skip_without_redis() -> None:
    """Skip the calling test unless both a redis-server binary and the redis package are here."""
    pytest.importorskip("redis", reason="the redis package is not installed: pip install 'redis>=5.0.1'")
    if not shutil.which(REDIS_SERVER):
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")


class RedisServer:
    """One redis-server process, its data dir a temporary folder; `url` stays the same across restarts."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="chatd-redis-")
        with socket.socket() as sock:  # a free port; redis-server binds it a moment later
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.01)
        return self

    def answers(self) -> bool:
        """Whether it answers PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not gone within 5 s."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

"""A throwaway PostgreSQL server for tests: initdb in a temporary folder, started on 127.0.0.1 at
a free port with trust auth and fsync off, and removed with everything in it at stop.

PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user (runuser).
`missing()` says what is lacking (the binaries, asyncpg) so that tests skip with that reason
instead of failing. It knows nothing of chatd: databases are made with `createdb`.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Self

SERVER_USER = "postgres"  # who runs the server when the tests run as root


def find_binary(name: str) -> str | None:
    """A PostgreSQL binary on PATH, or in Debian's /usr/lib/postgresql/<version>/bin (newest first)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    return None


def missing() -> str | None:
    """Why a server cannot be started here (a missing binary, package or user), or None."""
    for name in ("initdb", "pg_ctl", "createdb"):
        if find_binary(name) is None:
            return f"PostgreSQL's {name} is not installed (Debian: apt-get install postgresql)"
    if importlib.util.find_spec("asyncpg") is None:
        return "asyncpg is not installed (pip install asyncpg)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root, and there is no {SERVER_USER!r} user to run PostgreSQL as"
    return None


class PostgresServer:
    """A PostgreSQL server of its own, for as long as the `with` block (or start() to stop())."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="chatd-pg-"))
        self.data = self.folder / "data"
        self._as_user = ["runuser", "-u", SERVER_USER, "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        """The server's own database, as the superuser."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def start(self) -> Self:
        if self._as_user:
            shutil.chown(self.folder, SERVER_USER)
        self._run(find_binary("initdb"), "-D", self.data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--no-locale", "--no-sync")
        self.resume()
        return self

    def pause(self) -> None:
        """Stop the server at once, as a crash or an outage would, keeping its data for resume()."""
        self._run(find_binary("pg_ctl"), "-D", self.data, "-m", "immediate", "-w", "stop")

    def resume(self) -> None:
        """Start the server (again) on its port."""
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.folder} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(find_binary("pg_ctl"), "-D", self.data, "-l", self.folder / "server.log", "-w", "-o", options, "start")

    def stop(self) -> None:
        """Stop the server at once and remove its folder."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(find_binary("pg_ctl"), "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def create_database(self, name: str, template: str = "template0") -> str:
        """A new, empty database (a copy of `template`); returns its url."""
        self._client(find_binary("createdb"), "--template", template, name)
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop a database, closing whatever is still connected to it."""
        self._client(find_binary("dropdb"), "--force", name)

    def log(self) -> str:
        """What the server has logged (for a failing test's message)."""
        path = self.folder / "server.log"
        return path.read_text() if path.exists() else ""

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _run(self, *command) -> None:
        done = subprocess.run([*self._as_user, *map(str, command)], capture_output=True, text=True, cwd=self.folder)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{done.stdout}{done.stderr}{self.log()}")

    def _client(self, binary: str, *args: str) -> None:
        done = subprocess.run([binary, "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", *args],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{binary} {' '.join(args)} failed: {done.stderr}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

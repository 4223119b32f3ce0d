"""Start a real `chatd serve` process for a test (a free loopback port, its log in a file), and make API keys."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest


def start_server(root: Path, model_dir: Path, config_text: str,
                 environment: dict[str, str | None] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """Start chatd serve on a free loopback port; return the process, its URL and its log file.
    `environment` sets variables of the server's environment (None: removes one)."""
    config = root / "config.toml"
    config.write_text(config_text)
    env = {**os.environ, "CHATD_HOME": str(root / "home")}  # the store file lands here unless configured
    for name, value in (environment or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    # The log goes to a file, not a pipe: nobody drains a pipe during the tests, and a full pipe
    # would block the server's logging (and with it its event loop).
    log_path = root / "serve.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--config", str(config), "--port", "0"],
            stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"ready: .* (http://127\.0\.0\.1:\d+)", log_path.read_text())
        if match:
            return proc, match.group(1), log_path
        time.sleep(0.1)
    proc.kill()
    pytest.fail("chatd serve did not become ready:\n" + log_path.read_text())


def create_key(config: Path, name: str, tier: str = "paid") -> str:
    """`chatd keys create` for tenant `name` in the store that `config` names; returns the key."""
    done = subprocess.run([sys.executable, "-m", "chatd", "keys", "create", "--name", name, "--tier", tier, "--config", str(config)],
                          capture_output=True, text=True, check=True)
    return re.search(r"chatd_[0-9a-f]{12}_\S+", done.stdout).group(0)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, and the server must exit 0 (a clean shutdown) within 30 s; killed either way."""
    proc.terminate()
    try:
        assert proc.wait(timeout=30) == 0, "chatd serve should exit 0 on SIGTERM"
    finally:
        proc.kill()


# The paid tier (the keys' default here) without its rate limits, bounds and objective: for
# tests about something else that send more than a paid tenant may (a storm of a thousand
# requests). Tests of the limits themselves configure their tiers.
UNLIMITED_PAID = """
[tiers.paid]
requests_per_minute = 0
tokens_per_minute = 0
max_concurrent_requests = 0
max_queued_requests = 0
ttft_p95_seconds = 0
"""


@contextlib.contextmanager
def tenants_server(root: Path, config_text: str = "", names: tuple[str, ...] = ("alice", "bob"),
                   tiers: dict[str, str] | None = None, environment: dict[str, str | None] | None = None):
    """chatd serve on the demo model with auth on, its store at root/chatd.db and a key per tenant
    in `names`, of its tier in `tiers` (else paid, unlimited unless `config_text` has [tiers.paid]);
    yields {"url", "keys", "db", "model_dir", "log", "config"}. `config_text` adds sections;
    `environment`, variables of the server's (as start_server's)."""
    from chatd.engine.models.demo import build_demo_model

    model_dir = build_demo_model(root / "demo")
    db = root / "chatd.db"
    if "[tiers.paid]" not in config_text:
        config_text += UNLIMITED_PAID
    config = f'[store]\ndb_path = "{db}"\n[auth]\nenabled = true\n{config_text}'
    (root / "config.toml").write_text(config)
    keys = {name: create_key(root / "config.toml", name, (tiers or {}).get(name, "paid")) for name in names}
    proc, url, log_path = start_server(root, model_dir, config, environment)
    try:
        yield {"url": url, "keys": keys, "db": db, "model_dir": model_dir, "log": log_path, "config": root / "config.toml"}
    finally:
        stop_server(proc)

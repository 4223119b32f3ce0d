"""`chatd keys create|list|revoke`: the key is printed once, works, and never shows up again;
the command starts without loading the engine, the HTTP server or the load generator."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.cli import main
from chatd.store.db import Store, Tenant

KEY = re.compile(r"chatd_[0-9a-f]{12}_[A-Za-z0-9_-]+")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    return tmp_path


def authenticate(path: Path, key: str) -> Tenant | None:
    async def run() -> Tenant | None:
        async with await Store.open(path) as store:
            return await store.authenticate(key)

    return asyncio.run(run())


def create_key(capsys, name: str, tier: str, *extra: str) -> str:
    assert main(["keys", "create", "--name", name, "--tier", tier, *extra]) == 0
    out = capsys.readouterr().out
    assert "will not be shown again" in out
    [key] = KEY.findall(out)
    return key


def test_a_created_key_authenticates_as_its_tenant(home, capsys):
    key = create_key(capsys, "alice", "premium")
    tenant = authenticate(home / "chatd.db", key)
    assert (tenant.name, tenant.tier) == ("alice", "premium")


def test_list_shows_every_key_but_never_a_secret(home, capsys):
    assert main(["keys", "list"]) == 0
    assert "no API keys yet" in capsys.readouterr().out
    keys = [create_key(capsys, "alice", "free"), create_key(capsys, "bob", "paid")]
    authenticate(home / "chatd.db", keys[0])

    assert main(["keys", "list"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["KEY", "ID", "TENANT", "TIER", "CREATED", "LAST", "USED", "REVOKED"]
    assert [row.split()[:3] for row in rows] == [
        [keys[1].split("_")[1], "bob", "paid"], [keys[0].split("_")[1], "alice", "free"]]
    for key in keys:
        assert key.split("_", 2)[2] not in out


def test_revoke_stops_a_key_and_refuses_unknown_ones(home, capsys):
    key = create_key(capsys, "alice", "paid")
    key_id = key.split("_")[1]
    assert main(["keys", "revoke", key_id]) == 0
    assert f"revoked key {key_id}" in capsys.readouterr().out
    assert authenticate(home / "chatd.db", key) is None

    for unknown in (key_id, "0123456789ab"):  # already revoked, never made
        assert main(["keys", "revoke", unknown]) == 1
        assert f"no live key '{unknown}'" in capsys.readouterr().err


def test_the_config_store_path_decides_where_keys_live(home, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere" / "keys.db"
    config = tmp_path / "config.toml"
    config.write_text(f'[store]\ndb_path = "{elsewhere}"\n')
    key = create_key(capsys, "alice", "free", "--config", str(config))
    assert authenticate(elsewhere, key) is not None
    assert not (home / "chatd.db").exists()


def test_an_unknown_tier_is_refused_before_anything_is_written(home, capsys):
    assert main(["keys", "create", "--name", "alice", "--tier", "gold"]) == 2
    err = capsys.readouterr().err
    assert "tier 'gold' is not defined; defined tiers: free, paid, premium" in err and "[tiers.gold]" in err
    assert not (home / "chatd.db").exists()


def test_a_tier_the_config_defines_is_accepted(home, tmp_path, capsys):
    config = tmp_path / "config.toml"
    config.write_text("[tiers.gold]\nrequests_per_minute = 100\n")
    key = create_key(capsys, "alice", "gold", "--config", str(config))
    tenant = authenticate(home / "chatd.db", key)
    assert (tenant.name, tenant.tier) == ("alice", "gold")


def test_keys_list_loads_neither_the_load_generator_nor_the_engine(home):
    # A fresh interpreter: this test process has long since imported everything.
    script = (
        "import json, sys\n"
        "from chatd.cli import main\n"
        "code = main(['keys', 'list'])\n"
        "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no API keys yet" in run.stdout
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["code"] == 0
    loaded = set(result["modules"])
    for heavy in ("chatd.bench", "aiohttp.client", "chatd.engine", "chatd.http"):
        assert heavy not in loaded, f"`chatd keys list` imported {heavy}"

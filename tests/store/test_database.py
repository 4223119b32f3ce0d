"""The connection's owner (database.py) on a real SQLite file: a new file gets the schema and its
version, a newer or foreign file is refused and left alone, migration steps run once in order, and a
size limit or a full disk fails writes, and the write probe, until there is room."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.store import database
from chatd.store.db import SCHEMA_VERSION, Store, StoreFileError
from tests.store.factories import (MAX_BYTES, TABLES, database_bytes, fill_up, free_up, make_tenant, read_sql,
                                   row_counts, user_version)


# --- the file and its schema version ---

async def test_a_new_file_gets_its_folder_the_schema_and_the_version(tmp_path):
    path = tmp_path / "new" / "home" / "chatd.db"
    async with await Store.open(path):
        tables = {name for (name,) in read_sql(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert set(TABLES) <= tables
        assert user_version(path) == SCHEMA_VERSION == 9
        assert read_sql(path, "PRAGMA journal_mode") == [("wal",)]


async def test_reopening_keeps_the_data_and_changes_nothing(tmp_path):
    path = tmp_path / "chatd.db"
    async with await Store.open(path) as store:
        key, _ = await store.create_key("alice", "free")
    schema = read_sql(path, "SELECT sql FROM sqlite_master ORDER BY name")
    async with await Store.open(path) as store:
        assert (await store.authenticate(key)).name == "alice"
    assert read_sql(path, "SELECT sql FROM sqlite_master ORDER BY name") == schema
    assert user_version(path) == SCHEMA_VERSION


async def test_a_file_from_a_newer_chatd_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "chatd.db"
    async with await Store.open(path):
        pass
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreFileError, match=f"schema version {SCHEMA_VERSION + 1}.*upgrade chatd"):
        await Store.open(path)
    assert user_version(path) == SCHEMA_VERSION + 1


async def test_a_database_that_is_not_chatds_is_refused(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    with pytest.raises(StoreFileError, match="not a chatd database"):
        await Store.open(path)


async def test_migration_steps_run_once_in_order(tmp_path, monkeypatch):
    old, fresh = tmp_path / "old.db", tmp_path / "fresh.db"
    async with await Store.open(old) as store:
        await make_tenant(store)
    monkeypatch.setattr(database, "MIGRATIONS", [
        *database.MIGRATIONS,
        ["ALTER TABLE tenants ADD COLUMN note TEXT"],
        ["UPDATE tenants SET note = 'later'", "CREATE INDEX tenants_by_note ON tenants (note)"],
    ])
    for path in (old, fresh, old):  # an upgrade, a fresh file, and a reopen that has nothing to do
        async with await Store.open(path):
            assert user_version(path) == SCHEMA_VERSION + 2
    assert read_sql(old, "SELECT name, note FROM tenants") == [("alice", "later")]


# --- a full file ---

async def test_a_size_limit_fails_writes_like_a_full_disk_until_rows_are_purged(tmp_path, clock):
    path = tmp_path / "chatd.db"
    async with await Store.open(path, clock=clock, max_bytes=MAX_BYTES) as store:
        alice = await make_tenant(store)
        conversation = await store.create_conversation(alice, model="m")
        await fill_up(store)
        assert MAX_BYTES - 4096 < database_bytes(path) <= MAX_BYTES
        before = row_counts(path)
        # The turn's transaction fails whole, with the error that says why (SQLite has already
        # rolled it back; a second ROLLBACK would have replaced it with "no transaction is active").
        with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
            await store.start_turn(alice, conversation.id, "x" * 3000)
        assert row_counts(path) == before
        await free_up(store)
        await store.start_turn(alice, conversation.id, "x" * 3000)  # freed pages are reused...
        assert database_bytes(path) <= MAX_BYTES  # ...and the file did not grow
    async with await Store.open(path, clock=clock) as store:  # without a limit the file grows again
        await store.start_turn(alice, conversation.id, "x" * 400_000)
        assert database_bytes(path) > MAX_BYTES


async def test_the_write_probe_fails_while_full_and_never_leaves_a_row(tmp_path, clock):
    path = tmp_path / "chatd.db"
    async with await Store.open(path, clock=clock, max_bytes=MAX_BYTES) as store:
        await store.probe_write()
        await fill_up(store)
        size = database_bytes(path)
        for _ in range(2):  # a failed probe leaves the connection as usable as before
            with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
                await store.probe_write()
        await free_up(store)
        await store.probe_write()
        await store.probe_write()
        assert read_sql(path, "SELECT COUNT(*) FROM write_probe") == [(0,)]
        assert database_bytes(path) == size


# Run in a child process: a file-size limit (RLIMIT_FSIZE) makes the disk refuse to grow the
# database and its WAL, as a full disk would, without a disk to fill.
DISK_FULL_SCRIPT = """
import asyncio, resource, signal, sqlite3, sys
from chatd.store.db import Store

async def main(path):
    async with await Store.open(path) as store:
        _, key = await store.create_key("alice", "paid")
        conversation = await store.create_conversation(key.tenant_id, model="m")
        # Past the limit a write fails (EFBIG) instead of the process being killed.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
        try:
            for _ in range(1000):
                await store.start_turn(key.tenant_id, conversation.id, "x" * 3000)
        except sqlite3.OperationalError as exc:
            print("turn:", exc)
        for limit in (None, hard):  # the disk full, then with room again
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            try:
                await store.probe_write()
                print("probe: passed")
            except sqlite3.OperationalError as exc:
                print("probe:", exc)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
def test_the_write_probe_fails_on_a_full_disk_where_a_write_would(tmp_path):
    done = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(tmp_path / "chatd.db")],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    # A probe that only rolled back would pass here: its pages never leave the page cache.
    assert done.stdout.splitlines() == ["turn: disk I/O error", "probe: disk I/O error", "probe: passed"]

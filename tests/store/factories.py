"""What the store's test files share: a clock moved by hand, a tenant and a finished reply in one
line, a full file, and ways to read the database as another process would see it."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from chatd.store.db import Store

START = 1_800_000_000.0  # 2027-01-15T08:00:00Z
TABLES = ("tenants", "api_keys", "conversations", "messages", "usage_events", "responses", "moderation_events")
MAX_BYTES = 64 * 4096  # 64 pages: the schema takes about 20
# A test that keeps PostgreSQL's variant in the fast suite (conftest.py runs it with the slow tests otherwise).
on_both_backends = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
on_postgresql = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)  # PostgreSQL's own behaviour


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def make_tenant(store: Store, name: str = "alice", tier: str = "paid") -> str:
    """A tenant with one key; returns the tenant's id."""
    _, record = await store.create_key(name, tier)
    return record.tenant_id


async def finish(store: Store, tenant_id: str, message_id: str, content: str = "hello", **overrides):
    """Finish a reply as a served turn does: stopped, 12 prompt tokens (4 cached), 3 out, $0.50."""
    values = dict(content=content, status="complete", finish_reason="stop", prompt_tokens=12, cached_tokens=4,
                  completion_tokens=3, cost=0.5, model="m")
    return await store.finish_turn(tenant_id, message_id, **{**values, **overrides})


def read_sql(path: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Read the file through a second connection, as another process would see it."""
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, params).fetchall()


async def read_rows(store: Store, sql: str, params: tuple = ()) -> list[tuple]:
    """Read the store's committed rows through a connection of their own, as another process (or
    replica) would see them; SQL as the store writes it (`?` placeholders)."""
    if store.dialect == "sqlite":
        return read_sql(store.path, sql, params)
    import asyncpg

    from chatd.store.postgres import numbered
    conn = await asyncpg.connect(store.path)
    try:
        return [tuple(row) for row in await conn.fetch(numbered(sql), *params)]
    finally:
        await conn.close()


async def count_rows(store: Store) -> dict[str, int]:
    """How many rows each of TABLES holds, read as another process would."""
    return {table: (await read_rows(store, f"SELECT COUNT(*) FROM {table}"))[0][0] for table in TABLES}


def hold_transaction_reads(store: Store, monkeypatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold every read inside the store's transactions until `release` is set; `inside` is set once
    one is held. (monkeypatch.undo() ends it.)"""
    from chatd.store.postgres import PostgresConnection  # asyncpg itself is not imported

    inside, release = asyncio.Event(), asyncio.Event()
    connection = store._conn if store.dialect == "sqlite" else PostgresConnection
    fetch = connection.execute_fetchall

    async def held(*args):
        inside.set()
        await release.wait()
        return await fetch(*args)

    monkeypatch.setattr(connection, "execute_fetchall", held)
    return inside, release


def row_counts(path: Path) -> dict[str, int]:
    return {table: read_sql(path, f"SELECT COUNT(*) FROM {table}")[0][0] for table in TABLES}


def user_version(path: Path) -> int:
    return read_sql(path, "PRAGMA user_version")[0][0]


def database_bytes(path: Path) -> int:
    """The database's size as SQLite counts it (the pages still in the WAL included)."""
    [(pages,)], [(page_size,)] = read_sql(path, "PRAGMA page_count"), read_sql(path, "PRAGMA page_size")
    return pages * page_size


async def fill_up(store: Store) -> None:
    """Fill a size-limited file until even one usage event does not fit. Most of it is a deleted
    conversation, so that `free_up` can make room again."""
    ballast = await make_tenant(store, "ballast")
    conversation = await store.create_conversation(ballast, model="m")
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        for _ in range(1000):
            await store.start_turn(ballast, conversation.id, "x" * 3000)
    await store.delete_conversation(ballast, conversation.id)
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        for _ in range(10_000):
            await store.record_usage(ballast, endpoint="completions", model="m", prompt_tokens=1, cached_tokens=0,
                                     completion_tokens=1, cost=0.0)


async def free_up(store: Store) -> None:
    """Purge the deleted conversation `fill_up` left: its pages are free for new rows."""
    assert await store.purge_deleted(deleted_before=float("inf")) == 1

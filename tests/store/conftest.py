"""The store's tests open a real database, with a clock the test moves by hand: a SQLite file in
tmp_path, and, for the tests that take the `backend` parameter's both values, a database of its
own on a throwaway PostgreSQL server (tests/postgres_server.py), started once per session.

PostgreSQL's variant of a test runs with the slow tests (`-m slow`), but for the few marked
`on_both_backends` (factories.py), which keep PostgreSQL in the fast suite. Without initdb, pg_ctl or asyncpg
those variants skip, naming what is missing.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from chatd.store.url import open_store
from tests.postgres_server import PostgresServer, missing
from tests.store.factories import FakeClock

TEMPLATE = "chatd_template"  # a database migrated once; each test's database is a copy of it
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)]
_database_numbers = itertools.count()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server for the session, with TEMPLATE migrated to this chatd's schema."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with PostgresServer() as server:
        url = server.create_database(TEMPLATE)
        asyncio.run(_migrate(url))
        yield server


@pytest.fixture
def postgres_url(postgres_server, request) -> str:
    """An empty database of the test's own (no schema yet), dropped after it."""
    return _database(postgres_server, request, "template0")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def store_url(backend, request, tmp_path) -> str:
    """Where the test's store is: a new SQLite file, or a new PostgreSQL database already migrated."""
    if backend == "sqlite":
        return str(tmp_path / "chatd.db")
    return _database(request.getfixturevalue("postgres_server"), request, TEMPLATE)


@pytest.fixture
async def store(store_url, clock):
    async with await open_store(store_url, clock=clock) as store:
        yield store


def _database(server: PostgresServer, request, template: str) -> str:
    name = f"test_{next(_database_numbers)}"
    url = server.create_database(name, template)
    request.addfinalizer(lambda: server.drop_database(name))
    return url


async def _migrate(url: str) -> None:
    async with await open_store(url):
        pass

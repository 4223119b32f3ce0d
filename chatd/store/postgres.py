"""The store on a PostgreSQL server, through asyncpg: the same `Store`, its families' SQL unchanged,
run through a connection pool instead of one SQLite connection.

`PostgresStore` replaces only the plumbing (`_fetch`, `_write`, `_transaction`, the write probe):
the families write SQLite's SQL (`?` placeholders; `conn.execute`, `execute_fetchall`,
`executemany`, `.rowcount`), and `PostgresConnection` runs it on asyncpg, numbering the
placeholders `$1, $2, ...`. asyncpg's records read by position and by name, as sqlite3.Row does.

Several chatd replicas may share one database. A write transaction takes one advisory lock
first, so writers go one at a time as SQLite's BEGIN IMMEDIATE makes them: a transaction that
reads and then writes (the next position in a conversation) sees every transaction committed
before it, and none commits beside it. An error that means "cannot write now" (server gone,
connection lost, disk full, read-only) is raised as StoreUnavailableError, which the ledger
retries. asyncpg is imported when a store is opened, so chatd runs on SQLite without it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

from chatd.store.database import PROBE_PAGES, StoreUnavailableError, whole
from chatd.store.db import Store
from chatd.store.postgres_schema import migrate

# pg_advisory_xact_lock takes a bigint; these are chatd's (the bytes of "chatdwri"), held until commit.
WRITE_LOCK = int.from_bytes(b"chatdwri", "big") >> 1
POOL_SIZE = 10  # connections per replica; each request holds one for a statement or a transaction
CONNECT_TIMEOUT_S = 10.0  # a server that does not answer within this is unavailable
COMMAND_TIMEOUT_S = 30.0  # a statement running longer is given up on: the store is unavailable
PAGE_BYTES = 8192  # PostgreSQL's page size, as built by default

# SQLSTATEs (or their two-character classes) that mean "this write cannot be made now; the same
# write may succeed later": the connection (08), resources such as a full disk (53), the server
# shutting down or starting (57P01-57P03), a statement cancelled or timed out (57014), an I/O
# error (58030), a read-only server such as a standby (25006), and the transient conflicts a
# retry resolves (40001 serialization, 40P01 deadlock, 55P03 lock not available).
_CANNOT_WRITE_NOW = ("08", "53", "57P01", "57P02", "57P03", "57014", "58030", "25006", "40001", "40P01", "55P03")
_PLACEHOLDER = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|\?")  # a literal, a name, a comment, or ?


class PostgresStore(Store):
    """chatd's store on a PostgreSQL database: a pool of connections, every table family's methods."""

    dialect = "postgresql"

    def __init__(self, pool, where: str, clock: Callable[[], float]) -> None:
        self._pool = pool
        self._clock = clock
        self.path = where  # the url, without its password: what logs and errors name

    @classmethod
    async def open(cls, url: str, *, clock: Callable[[], float] = time.time, pool_size: int = POOL_SIZE) -> Self:
        """Connect to the database at `url` (postgresql://user[:password]@host[:port]/db) and migrate it
        to SCHEMA_VERSION; StoreUnavailableError when the server cannot be reached."""
        asyncpg = import_asyncpg()
        where = redact(url)
        try:
            pool = await asyncpg.create_pool(url, min_size=1, max_size=pool_size, timeout=CONNECT_TIMEOUT_S,
                                             command_timeout=COMMAND_TIMEOUT_S,
                                             server_settings={"application_name": "chatd"})
        except Exception as exc:
            raise _unavailable(exc, where) or exc
        try:
            async with _translated_errors(where), pool.acquire() as conn:
                await migrate(conn, where)
        except BaseException:
            await pool.close()
            raise
        return cls(pool, where, clock)

    async def close(self) -> None:
        """Close every connection of the pool."""
        await self._pool.close()

    async def tables(self) -> dict[str, list[str]]:
        """Each of chatd's tables and its columns, in order (the schema version's own table left out)."""
        rows = await self._fetch("SELECT table_name, column_name FROM information_schema.columns "
                                 "WHERE table_schema = current_schema() AND table_name <> 'chatd_schema' "
                                 "ORDER BY table_name, ordinal_position")
        tables: dict[str, list[str]] = {}
        for table, column in rows:
            tables.setdefault(table, []).append(column)
        return tables

    async def schema_version(self) -> int:
        """The schema version the database is at (SCHEMA_VERSION once open)."""
        [(version,)] = await self._fetch("SELECT version FROM chatd_schema")
        return version

    @whole
    async def probe_write(self) -> None:
        """Raise what a write needing PROBE_PAGES new pages would raise now; return if it would
        succeed. The row is rolled back. (Random bytes: PostgreSQL would compress zeros to nothing.)"""
        async with self._connection() as conn:
            transaction = conn.transaction()
            await transaction.start()
            try:
                await conn.execute("INSERT INTO write_probe (body) VALUES ($1)", os.urandom(PROBE_PAGES * PAGE_BYTES))
            finally:
                await transaction.rollback()

    # --- plumbing: how every family runs its SQL ---

    async def _fetch(self, sql: str, params: Sequence[Any] = ()) -> list:
        async with self._connection() as conn:
            return await conn.fetch(numbered(sql), *storable(params))

    async def _write(self, sql: str, params: Sequence[Any]) -> int:
        """Run one statement (atomic on its own; its rows stay locked until it ends) and return the
        number of rows it changed."""
        async with self._connection() as conn:
            return _rowcount(await conn.execute(numbered(sql), *storable(params)))

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[PostgresConnection]:
        """Statements that commit together or not at all, one writer at a time across every replica
        (see the module's docstring). READ COMMITTED, named whatever the server's default, is what
        makes the lock enough: each statement sees what committed before it started, so after the
        lock, everything (a snapshot taken at BEGIN, as in REPEATABLE READ, would predate the lock)."""
        async with self._connection() as conn, conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT pg_advisory_xact_lock($1)", WRITE_LOCK)
            yield PostgresConnection(conn)

    @contextlib.asynccontextmanager
    async def _connection(self):
        async with _translated_errors(self.path), self._pool.acquire() as conn:
            yield conn


class PostgresConnection:
    """An asyncpg connection that takes the families' SQLite-style calls (`?` placeholders)."""

    def __init__(self, conn) -> None:
        self._conn = conn

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> Outcome:
        return Outcome(_rowcount(await self._conn.execute(numbered(sql), *storable(params))))

    async def execute_fetchall(self, sql: str, params: Sequence[Any] = ()) -> list:
        return await self._conn.fetch(numbered(sql), *storable(params))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self._conn.executemany(numbered(sql), [storable(row) for row in rows])


def storable(params: Sequence[Any]) -> tuple:
    """The values as PostgreSQL's text can hold them: it has no NUL character (SQLite does), so a
    NUL in a client's text or a model's reply is kept as U+FFFD, the replacement character, and
    the row is written (and billed) rather than refused."""
    return tuple(p.replace("\x00", "\ufffd") if isinstance(p, str) and "\x00" in p else p for p in params)


class Outcome:
    """What a statement did, as a sqlite3 cursor tells it: the number of rows it changed."""

    def __init__(self, rowcount: int) -> None:
        self.rowcount = rowcount


@functools.lru_cache(maxsize=1024)
def numbered(sql: str) -> str:
    """SQLite's `?` placeholders as PostgreSQL's `$1, $2, ...` (a `?` in a literal, a quoted name or
    a comment is left alone)."""
    count = 0

    def number(match: re.Match) -> str:
        nonlocal count
        if match.group() != "?":
            return match.group()
        count += 1
        return f"${count}"

    return _PLACEHOLDER.sub(number, sql)


def import_asyncpg():
    """asyncpg, or a ValueError saying how to install it."""
    try:
        import asyncpg
    except ImportError:
        raise ValueError("a postgresql:// [store] url needs the asyncpg package: pip install asyncpg") from None
    return asyncpg


def redact(url: str) -> str:
    """The url without its password, fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _rowcount(status: str) -> int:
    """The rows a statement changed, from its status ("UPDATE 3", "INSERT 0 1"); -1 for others, as sqlite3."""
    count = status.rpartition(" ")[2]
    return int(count) if count.isdigit() else -1


@contextlib.asynccontextmanager
async def _translated_errors(where: str) -> AsyncIterator[None]:
    """Raise an error that means "cannot write now" as StoreUnavailableError; others as they are."""
    try:
        yield
    except Exception as exc:
        raise _unavailable(exc, where) or exc


def _unavailable(exc: Exception, where: str) -> StoreUnavailableError | None:
    """`exc` as StoreUnavailableError (its cause kept) when it means the server cannot write now.
    OSError: refused, reset, timed out. asyncpg's InternalClientError: a connection out of step
    with the server, which cut it while it was idle (a restart); the pool replaces it."""
    sqlstate = getattr(exc, "sqlstate", None) or ""
    cut = isinstance(exc, OSError | import_asyncpg().exceptions.InternalClientError)
    if cut or sqlstate.startswith(_CANNOT_WRITE_NOW):
        unavailable = StoreUnavailableError(f"{where}: {type(exc).__name__}: {exc}")
        unavailable.__cause__ = exc
        return unavailable
    return None

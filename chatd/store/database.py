"""The one owner of chatd's SQLite file: the connection, its transactions, and the schema's
versions (`schema.sql` is version 1, then the steps in MIGRATIONS, tracked in `PRAGMA user_version`).

`Database` opens, migrates and closes the file and runs every statement: `_fetch` reads, `_write`
runs one statement, `_transaction` runs several that commit together. Past the migrations it
reads and writes no table but the write probe's: each family's SQL lives in its own module (keys,
conversations, messages, responses, usage, moderation, feedback, canaries), mixed into `Store` in db.py. All SQL
takes its values as parameters. postgres.py keeps the same contract on a PostgreSQL server, and
runs the same MIGRATIONS there (postgres_schema.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Self

import aiosqlite

from chatd.store.canaries import CANARY_MIGRATION
from chatd.store.feedback import FEEDBACK_MIGRATION
from chatd.store.moderation import MODERATION_MIGRATION

SCHEMA_FILE = Path(__file__).with_name("schema.sql")

# The columns messages had at version 1 (fixed: migration 3 copies them).
_V1_MESSAGE_COLUMNS = ("id, conversation_id, role, content, status, finish_reason, prompt_tokens, cached_tokens, "
                       "completion_tokens, cost, created_at, updated_at")

# Later schema changes, in order: MIGRATIONS[0] takes a file from version 1 to 2, and so on. Each
# step is a list of SQL statements, run in one transaction together with its version bump.
MIGRATIONS: list[list[str]] = [
    # 2: the table probe_write fills in a transaction it always rolls back; it never holds a row.
    ["CREATE TABLE write_probe (body BLOB NOT NULL)"],
    # 3: OpenAI's Responses API. A response owns the messages it added (its input items and its
    # output); they belong to a conversation (`conversation=`) or to no conversation (a
    # standalone response, chained by previous_response_id), so messages are rebuilt with a
    # nullable conversation_id and a response_id. Existing rows are kept as they are.
    [
        """CREATE TABLE responses (
            id                   TEXT PRIMARY KEY,  -- "resp_" + 24 hex
            tenant_id            TEXT NOT NULL REFERENCES tenants (id),
            conversation_id      TEXT REFERENCES conversations (id) ON DELETE CASCADE,
            previous_response_id TEXT,              -- no foreign key: a chain outlives a purged link
            output_message_id    TEXT,
            stored               INTEGER NOT NULL,  -- 0: a store=false response; only this row is kept
            model                TEXT NOT NULL,
            instructions         TEXT,
            request              TEXT NOT NULL,     -- a JSON object: the request fields a response echoes
            created_at           REAL NOT NULL,
            deleted_at           REAL               -- soft delete; the purge removes the row later
        )""",
        """CREATE TABLE messages_v3 (
            id                TEXT PRIMARY KEY,
            conversation_id   TEXT REFERENCES conversations (id) ON DELETE CASCADE,  -- NULL: a standalone response's
            response_id       TEXT REFERENCES responses (id) ON DELETE SET NULL,     -- the response that added it
            position          INTEGER NOT NULL,  -- 0, 1, 2, ... within the conversation (or the response)
            role              TEXT NOT NULL,     -- user | assistant | system | developer
            content           TEXT NOT NULL,
            status            TEXT NOT NULL CHECK (status IN ('complete', 'partial', 'error')),
            finish_reason     TEXT,
            prompt_tokens     INTEGER NOT NULL DEFAULT 0,
            cached_tokens     INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0,
            cost              REAL NOT NULL DEFAULT 0,
            created_at        REAL NOT NULL,
            updated_at        REAL NOT NULL,
            UNIQUE (conversation_id, position)
        )""",
        f"INSERT INTO messages_v3 (position, {_V1_MESSAGE_COLUMNS}) SELECT position, {_V1_MESSAGE_COLUMNS} FROM messages",
        "DROP TABLE messages",
        "ALTER TABLE messages_v3 RENAME TO messages",
        "CREATE INDEX messages_by_response ON messages (response_id, position) WHERE response_id IS NOT NULL",
        "CREATE INDEX responses_by_tenant ON responses (tenant_id, created_at)",
    ],
    # 4: a reply's token ids as the model generated them (int32s, native byte order), so the next
    # turn's prompt holds exactly the tokens the prefix cache has. NULL: only its text is known.
    ["ALTER TABLE messages ADD COLUMN token_ids BLOB"],
    # 5: the safety pipeline's decisions and their appeals (its SQL lives in moderation.py).
    MODERATION_MIGRATION,
    # 6: tool items (OpenAI's function_call and function_call_output), one row each like any item:
    # the call's ids as a JSON object, its arguments or its output as the content. NULL: a message.
    ["ALTER TABLE messages ADD COLUMN call TEXT"],
    # 7: idempotency keys and the replicas' heartbeats, so a retried turn is stored and billed once
    # whichever replica serves it (idempotency.py). No foreign keys on the rows a key names: they
    # may be taken over or purged.
    [
        """CREATE TABLE idempotency_keys (
            tenant_id       TEXT NOT NULL REFERENCES tenants (id),
            idem_key        TEXT NOT NULL,      -- the client's Idempotency-Key, as sent
            request_sha256  TEXT NOT NULL,      -- the request it was first used for
            user_message_id TEXT,               -- the try's rows, once written (NULL before)
            message_id      TEXT,
            response_id     TEXT,               -- a Responses try's response (its items go with it)
            replica         TEXT NOT NULL,      -- the replica running the latest try
            created_at      REAL NOT NULL,
            finished_at     REAL,               -- its reply ended (complete, partial or error)
            PRIMARY KEY (tenant_id, idem_key)
        )""",
        "CREATE INDEX idempotency_by_message ON idempotency_keys (message_id)",
        """CREATE TABLE replicas (
            id      TEXT PRIMARY KEY,           -- "rep_" + 16 hex, new at every start
            seen_at REAL NOT NULL
        )""",
    ],
    # 8: users' ratings of replies (feedback.py).
    FEEDBACK_MIGRATION,
    # 9: where each canary ramp stands, and its steps and rollbacks (canaries.py).
    CANARY_MIGRATION,
]
SCHEMA_VERSION = 1 + len(MIGRATIONS)

PROBE_PAGES = 8  # probe_write needs room for this many new pages


class StoreFileError(ValueError):
    """The database file cannot be used by this chatd (written by a newer one, or not chatd's)."""


class StoreUnavailableError(Exception):
    """The database server cannot take writes now (unreachable, connection lost, disk full,
    read-only): the same write may succeed later. SQLite's file raises sqlite3's errors instead."""


def whole(method):
    """Run a method that writes in a transaction to its end even if its caller is cancelled (a
    client that went away): the reply is still saved and billed, and no transaction is left open."""
    @functools.wraps(method)
    async def run(self, *args, **kwargs):
        return await asyncio.shield(method(self, *args, **kwargs))

    return run


class Database:
    """chatd's SQLite file. One connection; an asyncio lock keeps each transaction whole."""

    dialect = "sqlite"  # which SQL the store speaks, for the few statements that differ

    def __init__(self, conn: aiosqlite.Connection, path: Path, clock: Callable[[], float]):
        self._conn = conn
        self._lock = asyncio.Lock()
        self._clock = clock
        self.path = path

    @classmethod
    async def open(cls, path: str | Path, *, clock: Callable[[], float] = time.time, max_bytes: int = 0) -> Self:
        """Open (creating it and its folder if missing) and migrate the file to SCHEMA_VERSION.

        With `max_bytes` > 0 the database may not grow past that size: a write that needs more
        fails as on a full disk (sqlite3.OperationalError "database or disk is full"), until
        rows are deleted (freed pages are reused). The WAL file next to it is not counted.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; the store opens its own (see _transaction).
        conn = await aiosqlite.connect(path, isolation_level=None)
        try:
            await conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
            # With WAL, NORMAL syncs at checkpoints, not at every commit: a killed process loses
            # nothing (committed pages are in the WAL, in the OS's hands); only a power cut or OS
            # crash can lose the last commits, and never corrupts the file.
            await conn.execute("PRAGMA synchronous = NORMAL")
            await conn.execute("PRAGMA foreign_keys = ON")  # per connection; the cascades need it
            await conn.execute("PRAGMA busy_timeout = 5000")  # wait for `chatd keys` in another process
            await _migrate(conn, path)
            if max_bytes > 0:
                # Per connection, not kept in the file. SQLite fails a write that would need a page
                # past it with SQLITE_FULL; a file already larger keeps its size as the limit.
                [(page_size,)] = await conn.execute_fetchall("PRAGMA page_size")
                await conn.execute(f"PRAGMA max_page_count = {max(1, max_bytes // page_size)}")
        except BaseException:
            await conn.close()
            raise
        return cls(conn, path, clock)

    async def close(self) -> None:
        """Close the connection (the last one to close folds the WAL back into the file)."""
        await self._conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def tables(self) -> dict[str, list[str]]:
        """Each table's name and its columns, in order."""
        names = await self._fetch("SELECT name FROM sqlite_master WHERE type = 'table' "
                                  "AND name NOT LIKE 'sqlite_%' ORDER BY name")  # not SQLite's own
        return {name: [column[1] for column in await self._fetch(f"PRAGMA table_info({name})")] for (name,) in names}

    async def schema_version(self) -> int:
        """The schema version the file is at (SCHEMA_VERSION once open)."""
        [(version,)] = await self._fetch("PRAGMA user_version")
        return version

    # --- can it write? ---

    @whole
    async def probe_write(self) -> None:
        """Raise what a write needing PROBE_PAGES new pages would raise now; return if it would
        succeed. Leaves nothing: the row is rolled back (its pages may pass through the WAL)."""
        async with self._lock:
            [(cache_size,)] = await self._conn.execute_fetchall("PRAGMA cache_size")
            [(page_size,)] = await self._conn.execute_fetchall("PRAGMA page_size")
            # A rolled-back row whose pages stay in the page cache never touches the disk, so it
            # passes on a full disk. A one-page cache makes SQLite spill them into the WAL, as a
            # commit would. (Under max_page_count the insert fails on its own.)
            await self._conn.execute("PRAGMA cache_size = 1")
            try:
                await self._conn.execute("BEGIN IMMEDIATE")
                try:
                    await self._conn.execute("INSERT INTO write_probe (body) VALUES (zeroblob(?))",
                                             (PROBE_PAGES * page_size,))
                finally:
                    await self._rollback()
            finally:
                await self._conn.execute(f"PRAGMA cache_size = {int(cache_size)}")

    # --- plumbing: how every family runs its SQL ---

    async def _fetch(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        async with self._lock:
            return list(await self._conn.execute_fetchall(sql, params))

    async def _write(self, sql: str, params: tuple) -> int:
        """Run one statement (atomic on its own) and return the number of rows it changed."""
        async with self._lock, self._conn.execute(sql, params) as cursor:
            return cursor.rowcount

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """Statements that commit together or not at all. The lock keeps other coroutines'
        statements on this connection out of it; IMMEDIATE takes the file's write lock up front,
        so another process cannot make it fail halfway. Callers are @whole: a cancellation
        landing on BEGIN would leave the transaction open, since the statement still runs."""
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                await self._conn.execute("COMMIT")
            except BaseException:
                await self._rollback()
                raise

    async def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already: after some errors (a full
        disk or file, SQLITE_FULL; an I/O error) it rolls back by itself, and a second ROLLBACK
        would fail with "no transaction is active" and hide the error that matters."""
        if self._conn.in_transaction:
            await self._conn.execute("ROLLBACK")


async def _migrate(conn: aiosqlite.Connection, path: Path) -> None:
    """Bring the file to SCHEMA_VERSION in one transaction: a fresh file gets schema.sql, then
    every step of MIGRATIONS it lacks. A file newer than this code is refused."""
    latest = 1 + len(MIGRATIONS)
    await conn.execute("BEGIN IMMEDIATE")  # a second process opening a fresh file waits, then finds it migrated
    try:
        [(version,)] = await conn.execute_fetchall("PRAGMA user_version")
        if version > latest:
            raise StoreFileError(f"{path} has schema version {version}, but this chatd knows versions up to "
                                 f"{latest}: upgrade chatd, or point [store] db_path at another file")
        if version == 0:
            if await conn.execute_fetchall("SELECT 1 FROM sqlite_master LIMIT 1"):
                raise StoreFileError(f"{path} is not a chatd database (it has tables but no schema version)")
            steps = [statements(SCHEMA_FILE.read_text()), *MIGRATIONS]
        else:
            steps = MIGRATIONS[version - 1:]
        for step in steps:
            for sql in step:
                await conn.execute(sql)
            version += 1
            await conn.execute(f"PRAGMA user_version = {int(version)}")  # PRAGMA takes no parameters
        await conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # see Database._rollback
            await conn.execute("ROLLBACK")
        raise


def statements(script: str) -> list[str]:
    """Split a SQL script into statements (executescript would commit our open transaction)."""
    found, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            found.append(pending.strip())
            pending = ""
    return found

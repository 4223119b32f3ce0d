"""The store on a real PostgreSQL server (postgres.py, postgres_schema.py): the same schema versions
as SQLite's, a database migrated from any older version equal to a fresh one, a newer or foreign
database refused; replicas writing to one conversation at once lose nothing; a server that cannot
write now is told apart from a bug. (The families' tests run here too: conftest.py's `backend`.)"""

from __future__ import annotations

import asyncio
import sys

import asyncpg
import pytest

from chatd.store import database
from chatd.store.database import SCHEMA_VERSION, StoreFileError, StoreUnavailableError
from chatd.store.ledger import cannot_write_now
from chatd.store.postgres import numbered, redact
from chatd.store.url import open_store
from tests.postgres_server import _free_port
from tests.store.factories import START, finish, make_tenant, on_postgresql, read_rows


async def fetch(url: str, sql: str, *params, schema: str = "public") -> list[tuple]:
    """Rows read through a connection of their own, in PostgreSQL's own SQL, with `schema` first on the search path."""
    conn = await asyncpg.connect(url, server_settings={"search_path": schema})
    try:
        return [tuple(row) for row in await conn.fetch(sql, *params)]
    finally:
        await conn.close()


async def schema_of(url: str, schema: str = "public") -> dict[str, list[tuple]]:
    """What a schema is made of: columns (in order, with their types), indexes, constraints."""
    found = {
        "columns": await fetch(url, "SELECT table_name, column_name, data_type, is_nullable, column_default, "
                                    "is_identity FROM information_schema.columns WHERE table_schema = $1 "
                                    "ORDER BY table_name, ordinal_position", schema, schema=schema),
        "indexes": await fetch(url, "SELECT tablename, indexname, indexdef FROM pg_indexes "
                                    "WHERE schemaname = $1 ORDER BY 1, 2", schema, schema=schema),
        "constraints": await fetch(url, "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
                                        "FROM pg_constraint WHERE connamespace = $1::regnamespace ORDER BY 1, 2",
                                   schema, schema=schema),
    }
    # Index definitions name their table with its schema: compare them without it.
    found["indexes"] = [(table, name, sql.replace(f" {schema}.", " ")) for table, name, sql in found["indexes"]]
    return found


async def open_at_version(url: str, version: int, monkeypatch) -> None:
    """Bring a database to an older schema version, as the chatd of that version would have."""
    latest = database.MIGRATIONS
    monkeypatch.setattr(database, "MIGRATIONS", latest[:version - 1])
    async with await open_store(url):
        pass
    monkeypatch.setattr(database, "MIGRATIONS", latest)


# --- the schema's versions ---

async def test_a_database_migrated_from_every_older_version_equals_a_fresh_one(postgres_url, monkeypatch):
    async with await open_store(postgres_url) as fresh:
        assert await fresh.schema_version() == SCHEMA_VERSION  # the same versions as SQLite's
        assert await fetch(postgres_url, "SELECT version FROM chatd_schema") == [(SCHEMA_VERSION,)]
    expected = await schema_of(postgres_url)
    types = {(table, column): (data_type, identity) for table, column, data_type, _, _, identity in expected["columns"]}
    assert types["usage_events", "id"] == ("bigint", "YES")  # SQLite's types as PostgreSQL names them
    assert types["messages", "cost"] == ("double precision", "NO")
    assert types["messages", "token_ids"] == ("bytea", "NO")
    assert types["messages", "prompt_tokens"] == ("integer", "NO")
    for version in range(1, SCHEMA_VERSION):
        # Each older database in a schema of its own (asyncpg passes ?search_path= to the server).
        schema = f"from_version_{version}"
        await fetch(postgres_url, f"CREATE SCHEMA {schema}")
        url = f"{postgres_url}?search_path={schema}"
        await open_at_version(url, version, monkeypatch)
        assert await fetch(url, "SELECT version FROM chatd_schema", schema=schema) == [(version,)]
        async with await open_store(url) as migrated:
            assert await migrated.schema_version() == SCHEMA_VERSION
        assert await schema_of(url, schema) == expected, f"migrated from version {version}"


@pytest.mark.slow  # PostgreSQL's fast share is kept small (conftest.py)
async def test_migration_steps_run_once_in_order_and_keep_the_data(postgres_url, monkeypatch):
    async with await open_store(postgres_url) as store:
        await make_tenant(store)
    monkeypatch.setattr(database, "MIGRATIONS", [
        *database.MIGRATIONS,
        ["ALTER TABLE tenants ADD COLUMN note TEXT"],
        ["UPDATE tenants SET note = 'later'", "CREATE INDEX tenants_by_note ON tenants (note)"],
    ])
    for _ in range(2):  # an upgrade, then a reopen that has nothing to do
        async with await open_store(postgres_url) as store:
            assert await store.schema_version() == SCHEMA_VERSION + 2
    assert await fetch(postgres_url, "SELECT name, note FROM tenants") == [("alice", "later")]


@pytest.mark.slow  # PostgreSQL's fast share is kept small (conftest.py)
async def test_replicas_starting_together_migrate_once(postgres_url):
    first, second = await asyncio.gather(open_store(postgres_url), open_store(postgres_url))
    for store in (first, second):
        assert await store.schema_version() == SCHEMA_VERSION
        await store.close()
    assert await fetch(postgres_url, "SELECT version FROM chatd_schema") == [(SCHEMA_VERSION,)]


async def test_a_database_from_a_newer_chatd_is_refused_and_left_alone(postgres_url):
    async with await open_store(postgres_url):
        pass
    await fetch(postgres_url, "UPDATE chatd_schema SET version = $1", SCHEMA_VERSION + 1)
    with pytest.raises(StoreFileError, match=f"{postgres_url} has schema version {SCHEMA_VERSION + 1}.*upgrade chatd"):
        await open_store(postgres_url)
    assert await fetch(postgres_url, "SELECT version FROM chatd_schema") == [(SCHEMA_VERSION + 1,)]


@pytest.mark.slow  # PostgreSQL's fast share is kept small (conftest.py)
async def test_a_database_that_is_not_chatds_is_refused(postgres_url):
    await fetch(postgres_url, "CREATE TABLE notes (body TEXT)")
    with pytest.raises(StoreFileError, match="not a chatd database"):
        await open_store(postgres_url)
    assert await fetch(postgres_url, "SELECT to_regclass('chatd_schema')") == [(None,)]


# --- replicas writing at once ---

@on_postgresql
async def test_two_replicas_appending_to_one_conversation_get_consecutive_positions(store, clock):
    async with await open_store(store.path, clock=clock) as other_replica:
        alice = await make_tenant(store)
        conversation = await store.create_conversation(alice, model="m")
        turns = await asyncio.gather(*[replica.start_turn(alice, conversation.id, f"turn {i}")
                                       for i in range(20) for replica in (store, other_replica)])
        await asyncio.gather(*[finish(replica, alice, reply.id)
                               for replica, (_, reply) in zip([store, other_replica] * 20, turns)])
    messages = await store.list_messages(conversation.id)
    place = {message.id: i for i, message in enumerate(messages)}
    assert len(place) == 80 and all(place[reply.id] == place[user.id] + 1 for user, reply in turns)  # none lost
    assert [m.content for m in messages if m.role == "assistant"] == ["hello"] * 40
    assert await read_rows(store, "SELECT position FROM messages ORDER BY position") == [(i,) for i in range(80)]
    assert (await store.usage(alice, START, START + 1)).requests == 40


@on_postgresql
async def test_a_nul_character_is_kept_as_a_replacement_character_and_the_turn_is_billed(store):
    """PostgreSQL's text holds no NUL (SQLite's does): a client's or a model's NUL must not cost
    the row, nor its bill."""
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m", title="a\x00b")
    _, reply = await store.start_turn(alice, conversation.id, "hi\x00there")
    await finish(store, alice, reply.id, content="\x00reply")
    assert [m.content for m in await store.list_messages(conversation.id)] == ["hi\ufffdthere", "\ufffdreply"]
    assert (await store.get_conversation(alice, conversation.id)).title == "a\ufffdb"
    assert (await store.usage(alice, START, START + 1)).requests == 1


# --- when the server cannot write ---

@pytest.mark.slow  # PostgreSQL's fast share is kept small (conftest.py)
@on_postgresql
async def test_a_read_only_database_cannot_write_now_and_reads_go_on(postgres_server, store):
    name = store.path.rpartition("/")[2]
    await make_tenant(store)
    await store.close()
    await fetch(postgres_server.url, f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    async with await open_store(store.path) as read_only:  # as on a standby: opening writes nothing
        for write in (read_only.probe_write(), read_only.create_key("bob", "paid")):
            with pytest.raises(StoreUnavailableError, match="ReadOnlySQLTransactionError") as refused:
                await write
            assert cannot_write_now(refused.value)
        assert [key.tenant_name for key in await read_only.list_keys()] == ["alice"]
    await fetch(postgres_server.url, f"ALTER DATABASE {name} RESET default_transaction_read_only")
    async with await open_store(store.path) as writable:
        await writable.probe_write()
        assert await read_rows(writable, "SELECT COUNT(*) FROM write_probe") == [(0,)]


@pytest.mark.slow  # PostgreSQL's fast share is kept small (conftest.py)
@on_postgresql
async def test_cut_connections_are_unavailable_until_the_pool_reconnects(postgres_server, store):
    alice = await make_tenant(store)
    name = store.path.rpartition("/")[2]
    await fetch(postgres_server.url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     "WHERE datname = $1 AND pid <> pg_backend_pid()", name)
    for _ in range(3):  # a connection found cut is dropped; a new one is made for the next write
        try:
            await store.record_usage(alice, endpoint="completions", model="m", prompt_tokens=1, cached_tokens=0,
                                     completion_tokens=1, cost=0.0)
            break
        except StoreUnavailableError as exc:
            assert cannot_write_now(exc)
    assert (await store.usage(alice, START, START + 1)).requests == 1


async def test_a_server_that_cannot_be_reached_is_unavailable_and_its_password_never_shown():
    url = f"postgresql://chatd:hunter2@127.0.0.1:{_free_port()}/chatd"
    with pytest.raises(StoreUnavailableError, match="127.0.0.1") as refused:
        await open_store(url)
    assert "hunter2" not in str(refused.value) and redact(url) in str(refused.value)


def test_an_error_that_is_not_about_writing_is_not_retried():
    assert cannot_write_now(StoreUnavailableError("disk full"))
    assert not cannot_write_now(asyncpg.exceptions.ForeignKeyViolationError("violates foreign key"))


async def test_without_asyncpg_a_postgresql_url_says_how_to_install_it_and_sqlite_still_opens(tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # `import asyncpg` fails as if it were not installed
    with pytest.raises(ValueError, match="pip install asyncpg"):
        await open_store("postgresql://chatd@127.0.0.1/chatd")
    async with await open_store(tmp_path / "chatd.db") as store:
        assert await store.schema_version() == SCHEMA_VERSION


def test_placeholders_are_numbered_outside_literals_names_and_comments():
    assert numbered("SELECT ? , '?', \"a?\" FROM t WHERE x = ? -- why?\nAND y IN (?, ?)") == (
        "SELECT $1 , '?', \"a?\" FROM t WHERE x = $2 -- why?\nAND y IN ($3, $4)")
    assert numbered("SELECT 'it''s ?', ?") == "SELECT 'it''s ?', $1"

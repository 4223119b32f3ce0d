"""The store on a real SQLite file: schema versions, keys, tenant isolation, pages, turns, usage, a
full file."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chatd.store import db
from chatd.store.db import SCHEMA_VERSION, Store, StoreFileError, Tenant

START = 1_800_000_000.0
TABLES = ("tenants", "api_keys", "conversations", "messages", "usage_events", "responses", "moderation_events")
MAX_BYTES = 64 * 4096  # 64 pages: the schema takes about 20


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def store(tmp_path, clock):
    async with await Store.open(tmp_path / "chatd.db", clock=clock) as store:
        yield store


async def make_tenant(store: Store, name: str = "alice", tier: str = "paid") -> str:
    _, record = await store.create_key(name, tier)
    return record.tenant_id


def read_sql(path: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Read the file through a second connection, as another process would see it."""
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, params).fetchall()


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


# --- the file and its schema version ---

async def test_a_new_file_gets_its_folder_the_schema_and_the_version(tmp_path):
    path = tmp_path / "new" / "home" / "chatd.db"
    async with await Store.open(path):
        tables = {name for (name,) in read_sql(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert set(TABLES) <= tables
        assert user_version(path) == SCHEMA_VERSION == 5
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
    monkeypatch.setattr(db, "MIGRATIONS", [
        *db.MIGRATIONS,
        ["ALTER TABLE tenants ADD COLUMN note TEXT"],
        ["UPDATE tenants SET note = 'later'", "CREATE INDEX tenants_by_note ON tenants (note)"],
    ])
    for path in (old, fresh, old):  # an upgrade, a fresh file, and a reopen that has nothing to do
        async with await Store.open(path):
            assert user_version(path) == SCHEMA_VERSION + 2
    assert read_sql(old, "SELECT name, note FROM tenants") == [("alice", "later")]


async def test_a_version_1_file_is_migrated_and_keeps_its_data(tmp_path):
    """A file as chatd's first release wrote it (schema.sql, rows written by hand as it wrote them)
    opens, keeps every row, and takes what later versions add: the probe, responses."""
    path = tmp_path / "chatd.db"
    key_id, secret = "0123456789ab", "s3cret"
    with sqlite3.connect(path) as conn:
        conn.executescript(db.SCHEMA_FILE.read_text())
        conn.execute("PRAGMA user_version = 1")
        conn.execute("INSERT INTO tenants VALUES ('ten_1', 'alice', 'paid', 1.0)")
        conn.execute("INSERT INTO api_keys (id, tenant_id, secret_sha256, created_at) VALUES (?, 'ten_1', ?, 1.0)",
                     (key_id, hashlib.sha256(secret.encode()).hexdigest()))
        conn.execute("INSERT INTO conversations VALUES ('conv_1', 'ten_1', 'm', 'kept', NULL, '{}', 1.0, 2.0, NULL)")
        conn.executemany("INSERT INTO messages VALUES (?, 'conv_1', ?, ?, ?, 'complete', ?, 0, 0, ?, 0, 1.0, 2.0)",
                         [("msg_1", 0, "user", "hi", None, 0), ("msg_2", 1, "assistant", "hello", "stop", 3)])
        conn.execute("INSERT INTO usage_events (tenant_id, endpoint, model, conversation_id, message_id, prompt_tokens, "
                     "cached_tokens, completion_tokens, cost, created_at) "
                     "VALUES ('ten_1', 'conversations', 'm', 'conv_1', 'msg_2', 12, 4, 3, 0.5, 2.0)")
    async with await Store.open(path) as store:
        assert user_version(path) == SCHEMA_VERSION
        assert await store.authenticate(f"chatd_{key_id}_{secret}") == Tenant("ten_1", "alice", "paid", key_id)
        assert (await store.get_conversation("ten_1", "conv_1")).title == "kept"
        history = await store.list_messages("conv_1")
        assert [(m.id, m.role, m.content, m.completion_tokens) for m in history] == [
            ("msg_1", "user", "hi", 0), ("msg_2", "assistant", "hello", 3)]
        assert [m.token_ids for m in history] == [None, None]  # an old reply's ids are unknown: its text it is
        assert (await store.usage("ten_1", 0, float("inf"))).requests == 1
        await store.probe_write()  # the table it needs came with the migration
        response, output = await store.create_response("ten_1", model="m", stored=True, inputs=[("user", "more")],
                                                       conversation_id="conv_1")
        assert [m.content for m in await store.list_messages("conv_1")] == ["hi", "hello", "more", ""]
        assert [m.id for m in await store.response_messages(response.id)][-1] == output.id


# --- tenants and keys ---

async def test_a_key_authenticates_its_tenant_until_revoked(store):
    key, record = await store.create_key("alice", "premium")
    assert key.startswith(f"chatd_{record.id}_")
    assert await store.authenticate(key) == Tenant(record.tenant_id, "alice", "premium", record.id)
    assert await store.revoke_key(record.id)
    assert await store.authenticate(key) is None
    assert not await store.revoke_key(record.id)  # already revoked
    assert not await store.revoke_key("0123456789ab")  # unknown
    [listed] = await store.list_keys()
    assert listed.revoked_at is not None


async def test_wrong_malformed_and_unknown_keys_fail(store):
    key, _ = await store.create_key("alice", "paid")
    _, key_id, secret = key.split("_", 2)
    flipped = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    for bad in [f"chatd_{key_id}_{flipped}", f"chatd_{key_id}_", f"chatd_{key_id}", f"chatd_0123456789ab_{secret}",
                f"chatd_{key_id.upper()}_{secret}", f"sk_{key_id}_{secret}", "", "chatd", key + " ",
                f"chatd_{key_id}_{secret}\x00", f"chatd_{key_id}_{secret[:-1]}é", "chatd_' OR 1=1 --_x"]:
        assert await store.authenticate(bad) is None, bad
    assert await store.authenticate(key) is not None


async def test_the_secret_never_reaches_the_file(tmp_path):
    path = tmp_path / "chatd.db"
    async with await Store.open(path) as store:
        key, _ = await store.create_key("alice", "paid")
        await store.authenticate(key)
        secret = key.split("_", 2)[2]
        while_open = path.read_bytes() + Path(f"{path}-wal").read_bytes()
    after_close = path.read_bytes() + (Path(f"{path}-wal").read_bytes() if Path(f"{path}-wal").exists() else b"")
    for stored in (while_open, after_close):
        assert secret.encode() not in stored
        assert hashlib.sha256(secret.encode()).hexdigest().encode() in stored  # the bytes read are the real ones


async def test_a_key_for_an_existing_name_joins_that_tenant_and_sets_its_tier(store, clock):
    first_key, first = await store.create_key("alice", "free")
    clock.advance(1)
    _, second = await store.create_key("alice", "premium")
    assert second.tenant_id == first.tenant_id and second.tenant_id.startswith("ten_")
    assert (await store.authenticate(first_key)).tier == "premium"
    assert [k.id for k in await store.list_keys()] == [second.id, first.id]  # newest first


async def test_any_well_formed_tier_is_kept_and_malformed_names_are_refused(store):
    _, record = await store.create_key("alice", "gold")  # which tiers exist is the config's to say
    assert record.tier == "gold"
    for bad in ("Gold", "", "a b", "x" * 33):
        with pytest.raises(ValueError, match="lower-case letters"):
            await store.create_key("alice", bad)
        with pytest.raises(ValueError, match="lower-case letters"):
            await store.local_tenant(bad)


async def test_a_request_s_tenant_names_the_key_it_came_with(store):
    first, first_record = await store.create_key("alice", "free")
    second, second_record = await store.create_key("alice", "free")
    assert (await store.authenticate(first)).key_id == first_record.id
    assert (await store.authenticate(second)).key_id == second_record.id
    assert (await store.local_tenant("free")).key_id is None


async def test_keys_with_unknown_tiers_are_the_live_ones_outside_the_config(store):
    _, gold = await store.create_key("alice", "gold")
    _, paid = await store.create_key("bob", "paid")
    _, silver = await store.create_key("carol", "silver")
    await store.revoke_key(silver.id)
    assert [k.id for k in await store.keys_with_unknown_tiers({"free", "paid", "premium"})] == [gold.id]
    assert await store.keys_with_unknown_tiers({"gold", "paid"}) == []


async def test_the_local_tenant_is_one_row_whose_tier_follows_the_config(store):
    assert await store.local_tenant("paid") == Tenant("local", "local", "paid")
    assert await store.local_tenant("free") == Tenant("local", "local", "free")
    key, record = await store.create_key("local", "premium")  # the operator's own key reaches the same data
    assert record.tenant_id == "local"
    assert await store.authenticate(key) == Tenant("local", "local", "premium", record.id)


async def test_last_used_is_written_at_most_once_a_minute(store, clock):
    key, record = await store.create_key("alice", "paid")

    async def last_used() -> float | None:
        return next(k.last_used_at for k in await store.list_keys() if k.id == record.id)

    assert await last_used() is None
    await store.authenticate(key)
    assert await last_used() == START
    clock.advance(30)
    await store.authenticate(key)
    assert await last_used() == START
    clock.advance(31)
    await store.authenticate(key)
    assert await last_used() == START + 61


# --- conversations ---

async def test_conversations_are_invisible_to_other_tenants(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    conversation = await store.create_conversation(alice, model="m", title="mine", metadata={"k": "v"})
    assert await store.get_conversation(alice, conversation.id) == conversation
    assert await store.get_conversation(bob, conversation.id) is None
    assert await store.list_conversations(bob, limit=10) == ([], False)
    assert not await store.delete_conversation(bob, conversation.id)
    with pytest.raises(LookupError):
        await store.list_conversations(bob, limit=10, after=conversation.id)
    assert await store.get_conversation(alice, conversation.id) == conversation


async def test_a_conversation_is_renamed_only_by_its_tenant_and_only_while_live(store, clock):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    conversation = await store.create_conversation(alice, model="m", title="old", metadata={"k": "v"})
    assert await store.update_conversation(bob, conversation.id, title="stolen") is None
    clock.advance(5)
    renamed = await store.update_conversation(alice, conversation.id, title="new")
    assert (renamed.title, renamed.metadata, renamed.updated_at) == ("new", {"k": "v"}, conversation.created_at + 5)
    replaced = await store.update_conversation(alice, conversation.id, metadata={"n": 1})
    assert (replaced.title, replaced.metadata) == ("new", {"n": 1})
    with pytest.raises(ValueError, match="model"):
        await store.update_conversation(alice, conversation.id, model="other")
    assert await store.delete_conversation(alice, conversation.id)
    assert await store.update_conversation(alice, conversation.id, title="again") is None


async def test_pages_return_every_conversation_once_newest_first(store, clock):
    alice = await make_tenant(store)
    created = []
    for i in range(26):
        if i % 3 == 0:
            clock.advance(1)  # three per second: ties in created_at are broken by id
        created.append(await store.create_conversation(alice, model="m"))
    await store.delete_conversation(alice, created.pop(7).id)
    expected = [c.id for c in sorted(created, key=lambda c: (c.created_at, c.id), reverse=True)]

    pages, after, more = [], None, True
    while more:
        page, more = await store.list_conversations(alice, limit=10, after=after)
        pages.append([c.id for c in page])
        after = page[-1].id
    assert [len(page) for page in pages] == [10, 10, 5]
    assert [c for page in pages for c in page] == expected


async def test_paging_after_a_deleted_or_unknown_conversation_is_refused(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    await store.delete_conversation(alice, conversation.id)
    for after in (conversation.id, "conv_000000000000000000000000"):
        with pytest.raises(LookupError):
            await store.list_conversations(alice, limit=10, after=after)


async def test_soft_delete_hides_and_purge_removes_messages_but_keeps_usage(store, clock):
    alice = await make_tenant(store)
    conversations = []
    for _ in range(3):
        clock.advance(1)
        conversations.append(await store.create_conversation(alice, model="m"))
        _, reply = await store.start_turn(alice, conversations[-1].id, "hi")
        await finish(store, alice, reply.id)
    old, recent, live = conversations
    assert await store.delete_conversation(alice, old.id)
    assert not await store.delete_conversation(alice, old.id)
    assert await store.get_conversation(alice, old.id) is None
    assert [c.id for c in (await store.list_conversations(alice, limit=10))[0]] == [live.id, recent.id]
    clock.advance(100)
    await store.delete_conversation(alice, recent.id)

    assert await store.purge_deleted(deleted_before=START + 50) == 1
    path = store.path
    assert read_sql(path, "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (old.id,)) == [(0,)]
    assert read_sql(path, "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (recent.id,)) == [(2,)]
    assert read_sql(path, "SELECT conversation_id IS NULL FROM usage_events ORDER BY id") == [(1,), (0,), (0,)]
    assert (await store.usage(alice, 0, START + 1000)).requests == 3
    assert await store.purge_deleted(deleted_before=START + 1000) == 1
    assert await store.get_conversation(alice, live.id) is not None


# --- turns ---

async def finish(store: Store, tenant_id: str, message_id: str, content: str = "hello", **overrides):
    values = dict(content=content, status="complete", finish_reason="stop", prompt_tokens=12, cached_tokens=4,
                  completion_tokens=3, cost=0.5, model="m")
    return await store.finish_turn(tenant_id, message_id, **{**values, **overrides})


async def test_a_turn_starts_partial_and_finishes_with_its_usage(store, clock):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    clock.advance(5)
    user, reply = await store.start_turn(alice, conversation.id, "hi there")
    assert (user.role, user.content, user.status) == ("user", "hi there", "complete")
    assert (reply.role, reply.content, reply.status) == ("assistant", "", "partial")
    assert (await store.get_conversation(alice, conversation.id)).updated_at == START + 5

    await store.save_partial(reply.id, "hel", completion_tokens=1)
    assert (await store.get_message(conversation.id, reply.id)).content == "hel"
    done = await finish(store, alice, reply.id)
    assert (done.content, done.status, done.finish_reason, done.completion_tokens, done.cost) == (
        "hello", "complete", "stop", 3, 0.5)
    await store.save_partial(reply.id, "late", completion_tokens=9)  # a finished reply is left alone
    assert await store.list_messages(conversation.id) == [user, done]

    assert read_sql(store.path, "SELECT endpoint, model, conversation_id, message_id FROM usage_events") == [
        ("conversations", "m", conversation.id, reply.id)]
    assert await store.usage(alice, START, START + 10) == db.Usage(1, 12, 4, 3, 0.5)

    _, second = await store.start_turn(alice, conversation.id, "again")
    assert [m.role for m in await store.list_messages(conversation.id)] == ["user", "assistant"] * 2
    assert (await store.list_messages(conversation.id))[-1].id == second.id
    # The reply's token ids are kept with it, exactly, for the next turn's prompt.
    ids = [0, 7, 2**31 - 1, 49151]
    assert (await finish(store, alice, second.id, token_ids=ids)).token_ids == tuple(ids)
    assert (await store.list_messages(conversation.id))[-1].token_ids == tuple(ids)
    assert done.token_ids is None


async def test_a_turn_on_a_deleted_or_foreign_conversation_writes_nothing(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    mine = await store.create_conversation(alice, model="m")
    deleted = await store.create_conversation(alice, model="m")
    await store.delete_conversation(alice, deleted.id)
    before = row_counts(store.path)
    for tenant_id, conversation_id in [(bob, mine.id), (alice, deleted.id), (alice, "conv_missing")]:
        with pytest.raises(LookupError):
            await store.start_turn(tenant_id, conversation_id, "hi")
    assert row_counts(store.path) == before
    assert await store.get_conversation(alice, mine.id) == mine  # updated_at untouched


async def test_finishing_a_purged_reply_still_records_its_usage(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    await store.delete_conversation(alice, conversation.id)
    await store.purge_deleted(deleted_before=START + 1)
    with pytest.raises(LookupError):
        await finish(store, alice, reply.id)
    assert (await store.usage(alice, 0, START + 1)).output_tokens == 3


async def test_a_reply_whose_caller_is_cancelled_is_still_saved_and_billed(store, monkeypatch):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    inside, release = asyncio.Event(), asyncio.Event()
    fetch = store._conn.execute_fetchall

    async def paused_fetch(sql, params=()):  # holds finish_turn mid-transaction
        inside.set()
        await release.wait()
        return await fetch(sql, params)

    monkeypatch.setattr(store._conn, "execute_fetchall", paused_fetch)
    caller = asyncio.create_task(finish(store, alice, reply.id))
    await inside.wait()
    caller.cancel()  # the client went away
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    monkeypatch.undo()
    await store.start_turn(alice, conversation.id, "next")  # no transaction was left open
    assert (await store.get_message(conversation.id, reply.id)).status == "complete"
    assert (await store.usage(alice, 0, START + 1)).requests == 1


async def test_a_finish_status_outside_the_list_is_refused(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    with pytest.raises(ValueError, match="complete, partial, error"):
        await finish(store, alice, reply.id, status="done")
    assert row_counts(store.path)["usage_events"] == 0


# --- usage ---

async def test_usage_sums_the_tenants_events_in_the_window(store, clock):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    for tenant_id in (alice, alice, alice, bob):
        await store.record_usage(tenant_id, endpoint="chat.completions", model="m", prompt_tokens=10,
                                 cached_tokens=2, completion_tokens=5, cost=0.25)
        clock.advance(10)
    assert await store.usage(alice, START, START + 20) == db.Usage(2, 20, 4, 10, 0.5)  # the end is exclusive
    assert await store.usage(alice, START, START + 21) == db.Usage(3, 30, 6, 15, 0.75)
    assert await store.usage(bob, START + 30, START + 31) == db.Usage(1, 10, 2, 5, 0.25)
    assert await store.usage(alice, START + 100, START + 200) == db.Usage(0, 0, 0, 0, 0.0)


# --- any text survives ---

TRICKY = ["'", '"', "\x00", "\\", "%", "_", "?", ":name", "\r\n", "😀", "\u202e", "\ufeff", "🏳️‍🌈",
          "'); DROP TABLE messages; --", "\" OR 1=1 --", "NULL"]
texts = st.lists(st.one_of(st.text(max_size=20), st.sampled_from(TRICKY)), max_size=6).map("".join)
HUGE_EMOJI = "😀" * 1_000_000  # 4 MB of UTF-8
HUGE_QUOTES = "'\x00\"" * 1_000_000  # 3 MB


def test_any_text_reads_back_identical(tmp_path):
    with asyncio.Runner() as runner:
        store = runner.run(Store.open(tmp_path / "chatd.db"))
        tenant_id = runner.run(make_tenant(store))

        async def roundtrip(title, system_prompt, metadata, content):
            conversation = await store.create_conversation(tenant_id, model="m", title=title,
                                                           system_prompt=system_prompt, metadata=metadata)
            got = await store.get_conversation(tenant_id, conversation.id)
            assert (got.title, got.system_prompt, got.metadata) == (title, system_prompt, metadata)
            _, reply = await store.start_turn(tenant_id, conversation.id, content)
            await finish(store, tenant_id, reply.id, content=content[::-1])
            assert [m.content for m in await store.list_messages(conversation.id)] == [content, content[::-1]]

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(st.none() | texts, st.none() | texts, st.dictionaries(texts, texts | st.integers(-2**63, 2**63 - 1), max_size=4), texts)
        @example(HUGE_EMOJI, HUGE_QUOTES, {HUGE_QUOTES[:10]: HUGE_EMOJI}, HUGE_QUOTES)
        @example(HUGE_QUOTES, None, {}, HUGE_EMOJI)
        def check(title, system_prompt, metadata, content):
            runner.run(roundtrip(title, system_prompt, metadata, content))

        try:
            check()
        finally:
            runner.run(store.close())


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


async def test_usage_and_replies_keep_the_time_they_were_served(store, clock):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    clock.advance(60)  # written a minute after they were served
    await store.record_usage(alice, endpoint="completions", model="m", prompt_tokens=1, cached_tokens=0,
                             completion_tokens=1, cost=0.0, created_at=START + 1)
    done = await finish(store, alice, reply.id, finished_at=START + 2)
    assert done.updated_at == START + 2
    assert read_sql(store.path, "SELECT endpoint, created_at FROM usage_events ORDER BY id") == [
        ("completions", START + 1), ("conversations", START + 2)]

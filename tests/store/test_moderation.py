"""The safety pipeline's audit trail on a real database: events recorded, listed and paged
newest first, kept per tenant, appealed once, resolved once, bad values refused by name, and a
file from before moderation events migrated with its data."""

from __future__ import annotations

import re
import sqlite3

import pytest

from chatd.store import database
from chatd.store.db import SCHEMA_VERSION, Store
from chatd.store.ledger import cannot_write_now
from chatd.store.moderation import MODERATION_MIGRATION
from chatd.store.records import ModerationEvent
from tests.store.factories import START, FakeClock, make_tenant, read_sql, user_version


async def add_event(store: Store, tenant_id: str, **fields) -> ModerationEvent:
    """An input blocked for harassment on chat.completions, unless `fields` say otherwise."""
    fields = {"stage": "input", "action": "blocked", "categories": ["harassment"], "endpoint": "chat.completions",
              **fields}
    return await store.add_moderation_event(tenant_id, **fields)


async def add_events(store: Store, clock: FakeClock, tenant_id: str, count: int) -> list[ModerationEvent]:
    """`count` events one second apart, oldest first."""
    events = []
    for _ in range(count):
        events.append(await add_event(store, tenant_id))
        clock.advance(1)
    return events


async def test_an_event_is_kept_with_everything_it_was_given(store, clock):
    alice = await make_tenant(store)
    event = await store.add_moderation_event(
        alice, stage="output", action="redacted", categories=("pii/card", "pii/email"), endpoint="responses",
        excerpt="card 4111 ...", text_sha256="ab" * 32, request_id="req_1", conversation_id="conv_1",
        message_id="msg_1")
    assert re.fullmatch(r"modr_[0-9a-f]{24}", event.id)
    assert (event.status, event.created_at, event.categories) == ("open", START, ("pii/card", "pii/email"))
    assert (event.appeal_reason, event.appealed_at, event.resolved_at, event.resolution_note) == (None,) * 4
    assert await store.get_moderation_event(event.id) == event
    assert await store.get_moderation_event(event.id, alice) == event
    assert await store.get_moderation_event("modr_" + "0" * 24) is None


async def test_an_excerpt_is_cut_to_200_characters_and_the_hash_is_left_alone(store):
    alice = await make_tenant(store)
    event = await add_event(store, alice, excerpt="x" * 500, text_sha256="f" * 64)
    assert event.excerpt == "x" * 200
    assert (await store.get_moderation_event(event.id)).excerpt == "x" * 200
    assert (await add_event(store, alice)).excerpt is None  # the operator keeps no excerpts


async def test_a_guard_failure_may_have_no_category(store):
    alice = await make_tenant(store)
    event = await add_event(store, alice, action="guard_failed", categories=[])
    assert (await store.get_moderation_event(event.id)).categories == ()


@pytest.mark.parametrize(("field", "value"), [
    ("stage", "prompt"), ("action", "deleted"), ("categories", "harassment"), ("categories", ["harassment", ""]),
    ("categories", [None])])
async def test_bad_values_are_refused_by_name_and_nothing_is_kept(store, field, value):
    alice = await make_tenant(store)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        await add_event(store, alice, **{field: value})
    assert await store.count_moderation_events() == 0


async def test_an_event_needs_a_known_tenant(store):
    with pytest.raises(Exception, match="(?i)foreign key") as refused:  # each database's own error
        await add_event(store, "ten_nobody")
    assert not cannot_write_now(refused.value)  # a bug to log, not a store to wait for


async def test_the_list_is_newest_first_and_pages_after_an_id(store, clock):
    alice = await make_tenant(store)
    events = await add_events(store, clock, alice, 5)
    newest_first = [e.id for e in reversed(events)]
    assert [e.id for e in await store.list_moderation_events()] == newest_first
    first = await store.list_moderation_events(limit=2)
    second = await store.list_moderation_events(limit=2, after=first[-1].id)
    last = await store.list_moderation_events(limit=2, after=second[-1].id)
    assert [e.id for e in first + second + last] == newest_first
    assert await store.list_moderation_events(after=events[0].id) == []
    with pytest.raises(LookupError, match="to list after"):
        await store.list_moderation_events(after="modr_" + "0" * 24)
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await store.list_moderation_events(limit=0)


async def test_events_made_in_the_same_instant_page_without_loss(store):
    alice = await make_tenant(store)
    ids = {(await add_event(store, alice)).id for _ in range(5)}  # the clock stands still
    seen, after = [], None
    while page := await store.list_moderation_events(limit=2, after=after):
        seen += [e.id for e in page]
        after = page[-1].id
    assert sorted(seen) == sorted(ids) and len(seen) == 5


async def test_the_list_filters_by_status_and_tenant(store, clock):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    alices = await add_events(store, clock, alice, 3)
    [bobs] = await add_events(store, clock, bob, 1)
    await store.appeal_moderation_event(alices[0].id, alice, "it was a quote")
    await store.resolve_moderation_event(alices[1].id, "upheld")

    assert [e.id for e in await store.list_moderation_events(tenant_id=alice)] == [e.id for e in reversed(alices)]
    assert [e.id for e in await store.list_moderation_events(tenant_id=bob)] == [bobs.id]
    assert [e.id for e in await store.list_moderation_events(status="open")] == [bobs.id, alices[2].id]
    assert [e.id for e in await store.list_moderation_events(status="appealed")] == [alices[0].id]
    assert [e.id for e in await store.list_moderation_events(status="open", tenant_id=alice)] == [alices[2].id]
    assert await store.list_moderation_events(status="overturned") == []
    counts = {status: await store.count_moderation_events(status=status)
              for status in ("open", "appealed", "upheld", "overturned")}
    assert counts == {"open": 2, "appealed": 1, "upheld": 1, "overturned": 0}
    assert await store.count_moderation_events() == 4
    assert await store.count_moderation_events(tenant_id=alice) == 3
    for bad in (store.list_moderation_events(status="closed"), store.count_moderation_events(status="closed")):
        with pytest.raises(ValueError, match="^status must be one of open, appealed, upheld, overturned"):
            await bad


async def test_a_tenant_cannot_see_or_appeal_another_tenants_event(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    event = await add_event(store, alice)
    assert await store.get_moderation_event(event.id, bob) is None
    with pytest.raises(LookupError, match="no moderation event"):
        await store.appeal_moderation_event(event.id, bob, "not mine, but let me try")
    with pytest.raises(LookupError, match="no moderation event"):
        await store.appeal_moderation_event("modr_" + "0" * 24, bob, "unknown")
    with pytest.raises(LookupError, match="to list after"):  # nor page by it
        await store.list_moderation_events(tenant_id=bob, after=event.id)
    assert (await store.get_moderation_event(event.id)).status == "open"


async def test_an_event_is_appealed_once(store, clock):
    alice = await make_tenant(store)
    event = await add_event(store, alice)
    clock.advance(60)
    appealed = await store.appeal_moderation_event(event.id, alice, "I was quoting the rules")
    assert (appealed.status, appealed.appeal_reason, appealed.appealed_at) == (
        "appealed", "I was quoting the rules", START + 60)
    assert await store.get_moderation_event(event.id, alice) == appealed
    with pytest.raises(ValueError, match="is appealed; only an open event can be appealed"):
        await store.appeal_moderation_event(event.id, alice, "again")
    assert (await store.get_moderation_event(event.id)).appeal_reason == "I was quoting the rules"


@pytest.mark.parametrize(("reason", "message"), [
    ("", "reason must not be empty"), ("   ", "reason must not be empty"),
    ("x" * 2001, "reason may be at most 2000 characters; got 2001")])
async def test_an_empty_or_long_appeal_is_refused(store, reason, message):
    alice = await make_tenant(store)
    event = await add_event(store, alice)
    with pytest.raises(ValueError, match=message):
        await store.appeal_moderation_event(event.id, alice, reason)
    assert (await store.get_moderation_event(event.id)).status == "open"
    assert (await store.appeal_moderation_event(event.id, alice, "x" * 2000)).status == "appealed"


@pytest.mark.parametrize("decision", ["upheld", "overturned"])
async def test_an_appeal_is_resolved_once(store, clock, decision):
    alice = await make_tenant(store)
    event = await add_event(store, alice)
    await store.appeal_moderation_event(event.id, alice, "a mistake")
    clock.advance(3600)
    resolved = await store.resolve_moderation_event(event.id, decision, "reviewed by ops")
    assert (resolved.status, resolved.resolved_at, resolved.resolution_note) == (decision, START + 3600,
                                                                                 "reviewed by ops")
    assert resolved.appeal_reason == "a mistake"  # the appeal stays on record
    with pytest.raises(ValueError, match=f"is already {decision}; it cannot be resolved again"):
        await store.resolve_moderation_event(event.id, "overturned")
    assert await store.get_moderation_event(event.id) == resolved
    with pytest.raises(ValueError, match="only an open event can be appealed"):
        await store.appeal_moderation_event(event.id, alice, "once more")


async def test_a_flag_is_resolved_without_an_appeal(store):
    alice = await make_tenant(store)
    event = await add_event(store, alice, action="flagged")
    resolved = await store.resolve_moderation_event(event.id, "overturned")
    assert (resolved.status, resolved.appealed_at, resolved.resolution_note) == ("overturned", None, None)


async def test_resolving_refuses_a_bad_decision_and_an_unknown_event(store):
    alice = await make_tenant(store)
    event = await add_event(store, alice)
    with pytest.raises(ValueError, match="^decision must be one of upheld, overturned; got 'dismissed'"):
        await store.resolve_moderation_event(event.id, "dismissed")
    with pytest.raises(LookupError, match="no moderation event"):
        await store.resolve_moderation_event("modr_" + "0" * 24, "upheld")
    assert (await store.get_moderation_event(event.id)).status == "open"


async def test_the_events_outlive_a_purged_conversation(store, clock):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m", items=[("user", "hi")])
    event = await add_event(store, alice, conversation_id=conversation.id)
    await store.delete_conversation(alice, conversation.id)
    clock.advance(10)
    assert await store.purge_deleted(clock()) == 1
    assert (await store.get_moderation_event(event.id)).conversation_id == conversation.id


async def test_a_file_from_before_moderation_events_is_migrated_and_keeps_its_data(tmp_path, monkeypatch):
    path = tmp_path / "chatd.db"
    with monkeypatch.context() as old_chatd:  # the chatd before this schema version
        before = database.MIGRATIONS.index(MODERATION_MIGRATION)
        old_chatd.setattr(database, "MIGRATIONS", database.MIGRATIONS[:before])
        async with await Store.open(path) as store:
            key, record = await store.create_key("alice", "paid")
            conversation = await store.create_conversation(record.tenant_id, model="m")
        with sqlite3.connect(path) as conn:  # a message as that chatd wrote it (today's store writes later columns)
            conn.execute("INSERT INTO messages (id, conversation_id, position, role, content, status, created_at, "
                         "updated_at) VALUES ('msg_1', ?, 0, 'user', 'hi', 'complete', 0, 0)", (conversation.id,))
        conn.close()
        assert user_version(path) == 1 + before
        assert not read_sql(path, "SELECT 1 FROM sqlite_master WHERE name = 'moderation_events'")

    async with await Store.open(path, clock=FakeClock()) as store:
        assert user_version(path) == SCHEMA_VERSION
        assert (await store.authenticate(key)).name == "alice"
        assert [m.content for m in await store.list_messages(conversation.id)] == ["hi"]
        event = await add_event(store, record.tenant_id, conversation_id=conversation.id)
        assert await store.list_moderation_events() == [event]
    indexes = {name for (name,) in read_sql(path, "SELECT name FROM sqlite_master WHERE type = 'index' "
                                                  "AND tbl_name = 'moderation_events'")}
    assert {"moderation_events_newest", "moderation_events_by_tenant"} <= indexes

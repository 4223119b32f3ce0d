"""Conversations (conversations.py) on a real SQLite file: invisible to other tenants, renamed
only while live, paged newest first without loss, soft-deleted then purged with their messages
(their usage stays), and any text read back exactly as written."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chatd.store.db import Store
from tests.store.factories import START, finish, make_tenant, read_rows


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


async def test_a_page_holds_at_least_one_conversation(store):
    alice = await make_tenant(store)
    await store.create_conversation(alice, model="m")
    for limit in (0, -1):
        with pytest.raises(ValueError, match=f"limit must be at least 1, got {limit}"):
            await store.list_conversations(alice, limit=limit)
    page, more = await store.list_conversations(alice, limit=1)
    assert len(page) == 1 and not more


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
    assert await read_rows(store, "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (old.id,)) == [(0,)]
    assert await read_rows(store, "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (recent.id,)) == [(2,)]
    assert await read_rows(store, "SELECT conversation_id IS NULL FROM usage_events ORDER BY id") == [(1,), (0,), (0,)]
    assert (await store.usage(alice, 0, START + 1000)).requests == 3
    assert await store.purge_deleted(deleted_before=START + 1000) == 1
    assert await store.get_conversation(alice, live.id) is not None


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


async def test_a_conversation_moved_to_another_model_forgets_its_token_ids_and_only_its_tenant_moves_it(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    conversation = await store.create_conversation(alice, model="small")
    _, assistant = await store.start_turn(alice, conversation.id, "hi")
    await finish(store, alice, assistant.id, "hello", token_ids=[3, 4])
    assert not await store.move_conversation(bob, conversation.id, "large")  # another tenant's: nothing moves
    assert [m.token_ids for m in await store.list_messages(conversation.id)] == [None, (3, 4)]
    assert await store.move_conversation(alice, conversation.id, "large")
    assert (await store.get_conversation(alice, conversation.id)).model == "large"
    assert [m.token_ids for m in await store.list_messages(conversation.id)] == [None, None]
    assert await store.count_messages(conversation.id) == 2

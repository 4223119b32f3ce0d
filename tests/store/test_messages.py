"""A conversation's messages (messages.py) on a real SQLite file: a turn starts partial and
finishes with its usage, writes nothing on a conversation that is not the caller's, is billed even
when purged or cancelled mid-write; items page in either order and are deleted one at a time."""

from __future__ import annotations

import asyncio

import pytest

from chatd.store.messages import Call
from chatd.store.records import Usage
from tests.store.factories import (START, count_rows, finish, hold_transaction_reads, make_tenant, on_both_backends,
                                   read_rows)


# --- turns ---

@on_both_backends  # in the fast suite on PostgreSQL too
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

    assert await read_rows(store, "SELECT endpoint, model, conversation_id, message_id FROM usage_events") == [
        ("conversations", "m", conversation.id, reply.id)]
    assert await store.usage(alice, START, START + 10) == Usage(1, 12, 4, 3, 0.5)

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
    before = await count_rows(store)
    for tenant_id, conversation_id in [(bob, mine.id), (alice, deleted.id), (alice, "conv_missing")]:
        with pytest.raises(LookupError):
            await store.start_turn(tenant_id, conversation_id, "hi")
    assert await count_rows(store) == before
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


@on_both_backends  # in the fast suite on PostgreSQL too
async def test_a_reply_whose_caller_is_cancelled_is_still_saved_and_billed(store, monkeypatch):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    inside, release = hold_transaction_reads(store, monkeypatch)  # holds finish_turn mid-transaction
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
    assert (await count_rows(store))["usage_events"] == 0


# --- items ---

async def test_items_page_in_either_order_and_delete_one_at_a_time(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    items = await store.add_items(alice, conversation.id, [("user", str(i)) for i in range(5)])
    page, more = await store.list_items(conversation.id, limit=2)
    assert [m.content for m in page] == ["4", "3"] and more
    page, more = await store.list_items(conversation.id, limit=2, after=page[-1].id)
    assert [m.content for m in page] == ["2", "1"] and more
    page, more = await store.list_items(conversation.id, limit=10, order="asc", after=items[2].id)
    assert [m.content for m in page] == ["3", "4"] and not more
    with pytest.raises(LookupError):
        await store.list_items(conversation.id, limit=2, after="msg_nope")
    assert await store.delete_item(conversation.id, items[0].id)
    assert not await store.delete_item(conversation.id, items[0].id)
    assert [m.content for m in await store.list_messages(conversation.id)] == ["1", "2", "3", "4"]
    with pytest.raises(LookupError):
        await store.add_items(await make_tenant(store, "bob"), conversation.id, [("user", "x")])


async def test_items_are_listed_only_in_a_known_order(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m", items=[("user", "a")])
    with pytest.raises(ValueError, match="order must be asc or desc, got 'newest'"):
        await store.list_items(conversation.id, limit=2, order="newest")


async def test_a_message_is_found_only_in_its_own_conversation(store):
    alice = await make_tenant(store)
    first = await store.create_conversation(alice, model="m")
    second = await store.create_conversation(alice, model="m")
    [item] = await store.add_items(alice, first.id, [("user", "hi")])
    assert (await store.get_message(first.id, item.id)).content == "hi"
    assert await store.get_message(second.id, item.id) is None
    assert not await store.delete_item(second.id, item.id)
    assert [m.id for m in await store.list_messages(first.id)] == [item.id]


# --- tool items ---

async def test_a_reply_that_calls_tools_is_followed_by_one_item_per_call_and_keeps_later_items_after(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "weather in Paris and Rome?")
    [late] = await store.add_items(alice, conversation.id, [("user", "added while the reply ran")])
    calls = [Call("fc_a", "call_1", "weather", '{"city": "Paris"}'), Call("fc_b", "call_2", "weather", '{"city": "Rome"}')]
    await store.finish_turn(alice, reply.id, content="Looking.", status="complete", finish_reason="tool_calls",
                            prompt_tokens=10, cached_tokens=0, completion_tokens=30, cost=0.0, model="m", calls=calls)
    items = await store.list_messages(conversation.id)
    assert [(m.id, m.kind, m.content) for m in items[1:]] == [
        (reply.id, "message", "Looking."), ("fc_a", "function_call", '{"city": "Paris"}'),
        ("fc_b", "function_call", '{"city": "Rome"}'), (late.id, "message", "added while the reply ran")]
    assert items[2].call == {"call_id": "call_1", "name": "weather"}
    assert [m.completion_tokens for m in items[1:4]] == [30, 0, 0]  # the usage stays on the reply

    [output] = await store.add_items(alice, conversation.id, [("tool", "18 C", {"call_id": "call_1"})])
    assert output.id.startswith("fco_") and output.kind == "function_call_output"
    assert (await store.get_message(conversation.id, output.id)) == output


async def test_a_reply_that_is_only_calls_is_its_first_call(store):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "weather?")
    calls = [Call(reply.id, "call_1", "weather", "{}"), Call("fc_b", "call_2", "time", "{}")]
    done = await store.finish_turn(alice, reply.id, content="", status="complete", finish_reason="tool_calls",
                                   prompt_tokens=5, cached_tokens=0, completion_tokens=9, cost=0.0, model="m", calls=calls)
    assert (done.kind, done.content, done.call, done.completion_tokens) == (
        "function_call", "{}", {"call_id": "call_1", "name": "weather"}, 9)
    assert [m.id for m in await store.list_messages(conversation.id)][1:] == [reply.id, "fc_b"]

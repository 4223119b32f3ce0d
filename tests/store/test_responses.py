"""Responses (responses.py) on a real SQLite file: chains by previous_response_id, responses
inside conversations, deletes that hide then purge, a store=false response's single record, tenants
apart."""

from __future__ import annotations

import pytest

from tests.store.factories import finish, make_tenant, read_rows


async def test_a_chain_of_standalone_responses_reads_back_oldest_first(store):
    alice = await make_tenant(store)
    first, out1 = await store.create_response(alice, model="m", stored=True, inputs=[("system", "terse"), ("user", "a")],
                                              instructions="be nice", request={"temperature": 0.5})
    await finish(store, alice, out1.id, "A", endpoint="responses")
    second, out2 = await store.create_response(alice, model="m", stored=True, inputs=[("user", "b")],
                                               previous_response_id=first.id)
    await finish(store, alice, out2.id, "B", endpoint="responses")
    branch, _ = await store.create_response(alice, model="m", stored=True, inputs=[("user", "c")],
                                            previous_response_id=first.id)
    chain = await store.chain_messages(second.id)
    assert [(m.role, m.content) for m in chain] == [("system", "terse"), ("user", "a"), ("assistant", "A"),
                                                   ("user", "b"), ("assistant", "B")]
    assert [m.content for m in await store.chain_messages(branch.id)] == ["terse", "a", "A", "c", ""]
    assert all(m.conversation_id is None for m in chain)
    again = await store.get_response(alice, first.id)
    assert (again.instructions, again.request, again.output_message_id, again.stored) == ("be nice", {"temperature": 0.5},
                                                                                          out1.id, True)
    assert await read_rows(store, "SELECT endpoint FROM usage_events") == [("responses",), ("responses",)]


async def test_responses_are_the_tenants_own_and_deletes_hide_then_purge_them(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    response, output = await store.create_response(alice, model="m", stored=True, inputs=[("user", "a")])
    assert await store.get_response(bob, response.id) is None
    assert not await store.delete_response(bob, response.id)
    assert await store.delete_response(alice, response.id)
    assert await store.get_response(alice, response.id) is None
    assert not await store.delete_response(alice, response.id)
    assert await store.purge_deleted(deleted_before=float("inf")) == 1
    assert await read_rows(store, "SELECT COUNT(*) FROM messages") == [(0,)]


async def test_a_store_false_response_keeps_only_its_record(store):
    alice = await make_tenant(store)
    response, output = await store.create_response(alice, model="m", stored=False, inputs=[("user", "secret")])
    assert output is None and (await store.get_response(alice, response.id)).stored is False
    assert await read_rows(store, "SELECT COUNT(*) FROM messages") == [(0,)]
    assert "secret" not in str(await read_rows(store, "SELECT * FROM responses"))


async def test_a_response_in_a_conversation_adds_its_items_there(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    conversation = await store.create_conversation(alice, model="m", items=[("developer", "d"), ("user", "u")])
    with pytest.raises(LookupError):
        await store.create_response(bob, model="m", stored=True, inputs=[("user", "x")], conversation_id=conversation.id)
    response, output = await store.create_response(alice, model="m", stored=True, inputs=[("user", "v")],
                                                   conversation_id=conversation.id)
    assert [m.content for m in await store.list_messages(conversation.id)] == ["d", "u", "v", ""]
    assert [m.content for m in await store.response_messages(response.id)] == ["v", ""]
    # Deleting the response leaves the conversation's items; deleting the conversation hides the response.
    assert await store.delete_response(alice, response.id)
    await store.purge_deleted(deleted_before=float("inf"))
    assert len(await store.list_messages(conversation.id)) == 4
    other, _ = await store.create_response(alice, model="m", stored=True, inputs=[("user", "w")],
                                           conversation_id=conversation.id)
    await store.delete_conversation(alice, conversation.id)
    assert await store.get_response(alice, other.id) is None


async def test_a_chain_read_for_one_model_drops_the_token_ids_another_model_generated(store):
    alice = await make_tenant(store)
    first, out1 = await store.create_response(alice, model="small", stored=True, inputs=[("user", "a")])
    await finish(store, alice, out1.id, "A", endpoint="responses", token_ids=[5, 6])
    second, out2 = await store.create_response(alice, model="large", stored=True, inputs=[("user", "b")],
                                               previous_response_id=first.id)
    await finish(store, alice, out2.id, "B", endpoint="responses", token_ids=[7, 8])
    everything = await store.chain_messages(second.id)
    assert [m.token_ids for m in everything if m.role == "assistant"] == [(5, 6), (7, 8)]
    assert [m.token_ids for m in await store.chain_messages(second.id, model="large") if m.role == "assistant"] == [
        None, (7, 8)]
    assert [m.token_ids for m in await store.chain_messages(second.id, model="small") if m.role == "assistant"] == [
        (5, 6), None]
    assert await store.chain_length(second.id) == len(everything) == 4

"""Ratings of replies on a real database (SQLite, and PostgreSQL in the representative case): a
reply is found by its id only among its own tenant's (a conversation's or a chain's assistant
message, a stored response, a chat or text completion by its usage row), with the model that
served it; rating it again replaces the rating; the operator lists them newest first."""

from __future__ import annotations

import pytest

from tests.store.factories import finish, make_tenant, on_both_backends


@on_both_backends
async def test_a_reply_is_rated_by_its_own_tenant_only_and_a_second_rating_replaces_the_first(store, clock):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    conversation = await store.create_conversation(alice, model="small")
    user, reply = await store.start_turn(alice, conversation.id, "hi")
    await finish(store, alice, reply.id)
    response, output = await store.create_response(alice, model="large", stored=True, inputs=[("user", "q")],
                                                   request={})
    await finish(store, alice, output.id, endpoint="responses")
    await store.record_usage(alice, endpoint="chat.completions", model="canary", prompt_tokens=3, cached_tokens=0,
                             completion_tokens=2, cost=0.0, message_id="chatcmpl-abc")
    assert await store.rated_reply(alice, reply.id) == ("message", "small")
    assert await store.rated_reply(alice, output.id) == ("message", "large")  # a chain's reply names its response's model
    assert await store.rated_reply(alice, response.id) == ("response", "large")
    assert await store.rated_reply(alice, "chatcmpl-abc") == ("completion", "canary")
    for other in (reply.id, response.id, "chatcmpl-abc"):  # another tenant's replies are not there
        assert await store.rated_reply(bob, other) is None
    assert await store.rated_reply(alice, user.id) is None  # the user's own message is no reply
    assert await store.rated_reply(alice, "msg_missing") is None and await store.rated_reply(alice, "x") is None

    first = await store.rate(alice, reply.id, "message", "small", "up")
    clock.advance(5)
    second = await store.rate(alice, reply.id, "message", "small", "down", "it made that up")
    assert (second.id, second.rating, second.comment) == (first.id, "down", "it made that up")
    assert second.updated_at == first.updated_at + 5 and second.created_at == first.created_at
    assert await store.rated_exchange(second) == ("hi", "hello")  # what was asked, and the reply rated
    clock.advance(1)
    in_chain = await store.rate(alice, response.id, "response", "large", "up")
    assert await store.rated_exchange(in_chain) == ("q", "hello")
    clock.advance(1)
    await store.rate(alice, "chatcmpl-abc", "completion", "canary", "up")
    listed = await store.list_feedback()
    assert [r.target_id for r in listed] == ["chatcmpl-abc", response.id, reply.id]  # newest first
    assert {r.tenant_name for r in listed} == {"alice"}
    assert await store.rated_exchange(listed[0]) == (None, None)  # a completion's text is not kept
    assert [r.target_id for r in await store.list_feedback(rating="down")] == [reply.id]
    assert [r.target_id for r in await store.list_feedback(model="large")] == [response.id]
    assert [r.target_id for r in await store.list_feedback(model="canary")] == ["chatcmpl-abc"]
    assert await store.list_feedback(since=second.updated_at + 0.5) == listed[:2]
    with pytest.raises(ValueError, match="rating must be one of"):
        await store.rate(alice, reply.id, "message", "small", "meh")


async def test_a_deleted_conversation_s_replies_can_no_longer_be_rated(store):
    alice = await make_tenant(store, "alice")
    conversation = await store.create_conversation(alice, model="small")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    await finish(store, alice, reply.id)
    await store.rate(alice, reply.id, "message", "small", "up")
    await store.delete_conversation(alice, conversation.id)
    assert await store.rated_reply(alice, reply.id) is None
    assert [r.target_id for r in await store.list_feedback()] == [reply.id]  # the rating itself is kept

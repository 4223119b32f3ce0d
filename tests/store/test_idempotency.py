"""Idempotency keys: a retried turn is stored and billed once, whichever replica runs each try."""

from __future__ import annotations

from chatd.store.idempotency import REPLICA_TIMEOUT_S
from tests.store.factories import finish, make_tenant


async def _conversation(store, tenant_id):
    return (await store.create_conversation(tenant_id, model="m")).id


async def _usage_rows(store, tenant_id) -> int:
    return len(await store._fetch("SELECT 1 FROM usage_events WHERE tenant_id = ?", (tenant_id,)))


async def test_a_finished_try_is_replayed_and_a_different_request_refused(store):
    alice = await make_tenant(store)
    conversation = await _conversation(store, alice)
    await store.beat("rep_a")
    assert (await store.claim_key(alice, "k1", "sha-1", "rep_a")).outcome == "new"
    _, reply = await store.start_turn(alice, conversation, "hi", "k1")
    assert (await store.claim_key(alice, "k1", "sha-1", "rep_b")).outcome == "busy"  # rep_a is alive
    await finish(store, alice, reply.id)
    again = await store.claim_key(alice, "k1", "sha-1", "rep_b")
    assert again.outcome == "replay" and again.message_id == reply.id
    assert (await store.claim_key(alice, "k1", "sha-2", "rep_b")).outcome == "mismatch"
    assert len(await store.list_messages(conversation)) == 2
    assert await _usage_rows(store, alice) == 1


async def test_a_dead_replicas_try_is_taken_over_and_billed_once(store, clock):
    alice = await make_tenant(store)
    conversation = await _conversation(store, alice)
    await store.beat("rep_a")
    await store.claim_key(alice, "k1", "sha", "rep_a")
    await store.start_turn(alice, conversation, "hi", "k1")  # rep_a dies mid-reply: its reply stays partial
    clock.advance(REPLICA_TIMEOUT_S / 2)
    busy = await store.claim_key(alice, "k1", "sha", "rep_b")
    assert busy.outcome == "busy" and 1 <= busy.retry_after <= REPLICA_TIMEOUT_S
    clock.advance(REPLICA_TIMEOUT_S)
    assert (await store.claim_key(alice, "k1", "sha", "rep_b")).outcome == "new"
    assert await store.list_messages(conversation) == []  # the dead try's user message and partial reply went
    _, reply = await store.start_turn(alice, conversation, "hi", "k1")
    await finish(store, alice, reply.id)
    assert [m.role for m in await store.list_messages(conversation)] == ["user", "assistant"]
    assert await _usage_rows(store, alice) == 1
    assert (await store.claim_key(alice, "k1", "sha", "rep_c")).message_id == reply.id


async def test_keys_are_per_tenant_and_a_refused_try_is_forgotten(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    await store.beat("rep_a")
    assert (await store.claim_key(alice, "same", "sha-a", "rep_a")).outcome == "new"
    assert (await store.claim_key(bob, "same", "sha-b", "rep_a")).outcome == "new"  # bob never meets alice's key
    await store.release_key(alice, "same")  # refused before any row: a retry runs anew
    assert (await store.claim_key(alice, "same", "sha-other", "rep_a")).outcome == "new"
    assert (await store.claim_key(bob, "same", "sha-b", "rep_a")).outcome == "busy"


async def test_old_keys_and_silent_replicas_are_purged(store, clock):
    alice = await make_tenant(store)
    await store.beat("rep_a")
    await store.claim_key(alice, "old", "sha", "rep_a")
    clock.advance(100)
    await store.beat("rep_b")
    await store.claim_key(alice, "new", "sha", "rep_b")
    assert await store.purge_keys(clock.now - 50) == 1
    assert [r[0] for r in await store._fetch("SELECT id FROM replicas")] == ["rep_b"]
    assert (await store.claim_key(alice, "old", "sha-x", "rep_b")).outcome == "new"


async def test_a_dead_replicas_response_is_taken_over_with_its_items(store, clock):
    alice = await make_tenant(store)
    await store.beat("rep_a")
    await store.claim_key(alice, "r1", "sha", "rep_a")
    dead, output = await store.create_response(alice, model="m", stored=True, inputs=[("user", "hi")],
                                               idempotency_key="r1")
    clock.advance(REPLICA_TIMEOUT_S + 1)
    assert (await store.claim_key(alice, "r1", "sha", "rep_b")).outcome == "new"
    assert await store.get_response(alice, dead.id) is None and await store.response_messages(dead.id) == []
    response, output = await store.create_response(alice, model="m", stored=True, inputs=[("user", "hi")],
                                                   idempotency_key="r1")
    await finish(store, alice, output.id, endpoint="responses")
    replay = await store.claim_key(alice, "r1", "sha", "rep_c")
    assert (replay.outcome, replay.response_id, replay.message_id) == ("replay", response.id, output.id)
    assert await _usage_rows(store, alice) == 1

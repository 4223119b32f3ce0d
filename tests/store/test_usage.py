"""Usage events (usage.py) on a real SQLite file: a tenant's totals over a window count its own
events only, the end excluded, and every event keeps the time it was served, not written."""

from __future__ import annotations

import pytest

from chatd.store.records import Usage
from tests.store.factories import START, finish, make_tenant, on_both_backends, read_rows


@on_both_backends  # in the fast suite on PostgreSQL too
async def test_usage_sums_the_tenants_events_in_the_window(store, clock):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")
    for tenant_id in (alice, alice, alice, bob):
        await store.record_usage(tenant_id, endpoint="chat.completions", model="m", prompt_tokens=10,
                                 cached_tokens=2, completion_tokens=5, cost=0.25)
        clock.advance(10)
    assert await store.usage(alice, START, START + 20) == Usage(2, 20, 4, 10, 0.5)  # the end is exclusive
    assert await store.usage(alice, START, START + 21) == Usage(3, 30, 6, 15, 0.75)
    assert await store.usage(bob, START + 30, START + 31) == Usage(1, 10, 2, 5, 0.25)
    assert await store.usage(alice, START + 100, START + 200) == Usage(0, 0, 0, 0, 0.0)


@on_both_backends  # the ledger's batches: PostgreSQL's executemany as SQLite's
async def test_usage_written_together_is_all_written_in_order_or_none(store):
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob")

    def event(tenant_id: str, tokens: int) -> dict:
        return dict(tenant_id=tenant_id, endpoint="chat.completions", model="m", conversation_id=None,
                    message_id=None, prompt_tokens=10, cached_tokens=0, completion_tokens=tokens, cost=0.5,
                    created_at=START + tokens)

    await store.record_usages([event(alice, 1), event(bob, 2), event(alice, 3)])
    with pytest.raises(Exception, match="(?i)foreign key"):  # an unknown tenant: the whole batch is refused
        await store.record_usages([event(alice, 4), event("ten_nobody", 5)])
    assert await read_rows(store, "SELECT tenant_id, completion_tokens, created_at FROM usage_events ORDER BY id") == [
        (alice, 1, START + 1), (bob, 2, START + 2), (alice, 3, START + 3)]
    assert await store.usage(alice, START, START + 10) == Usage(2, 20, 0, 4, 1.0)


async def test_usage_and_replies_keep_the_time_they_were_served(store, clock):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    clock.advance(60)  # written a minute after they were served
    await store.record_usage(alice, endpoint="completions", model="m", prompt_tokens=1, cached_tokens=0,
                             completion_tokens=1, cost=0.0, created_at=START + 1)
    done = await finish(store, alice, reply.id, finished_at=START + 2)
    assert done.updated_at == START + 2
    assert await read_rows(store, "SELECT endpoint, created_at FROM usage_events ORDER BY id") == [
        ("completions", START + 1), ("conversations", START + 2)]

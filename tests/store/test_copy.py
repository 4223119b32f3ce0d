"""`chatd store copy` (copy.py): a populated SQLite store copied onto PostgreSQL and back is the
same row for row, table by table; the copy's ids go on where they left off; a destination that
holds rows is refused and left as it was."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest

from chatd.store.canaries import RampState
from chatd.store.copy import copy_store
from chatd.store.db import Store
from chatd.store.messages import Call
from chatd.store.url import open_store
from tests.store.factories import START, FakeClock, finish, make_tenant


async def populate(store: Store, clock: FakeClock) -> None:
    """A store with a row in every table: keys (one revoked), conversations (one deleted) with
    messages, token ids and tool calls, responses, usage, moderation events (appealed, resolved),
    an idempotency key, a replica's heartbeat, a rating and a canary ramp."""
    alice, bob = await make_tenant(store, "alice"), await make_tenant(store, "bob", tier="free")
    await store.local_tenant("paid")
    _, spare = await store.create_key("alice", "paid")
    await store.revoke_key(spare.id)
    conversation = await store.create_conversation(alice, model="m", title="Trip", system_prompt="Be brief.",
                                                   metadata={"topic": "travel", "n": 3}, items=[("user", "héllo ✓")])
    clock.advance(1.25)
    _, reply = await store.start_turn(alice, conversation.id, "weather?")
    await store.finish_turn(alice, reply.id, content="Looking.", status="complete", finish_reason="tool_calls",
                            prompt_tokens=10, cached_tokens=2, completion_tokens=30, cost=0.1 + 0.2, model="m",
                            token_ids=[0, 7, 2**31 - 1], calls=[Call("fc_a", "call_1", "weather", '{"city": "Oslo"}')])
    await store.add_items(alice, conversation.id, [("tool", "-3 C", {"call_id": "call_1"})])
    gone = await store.create_conversation(bob, model="m", items=[("user", "bye")])
    await store.delete_conversation(bob, gone.id)
    response, output = await store.create_response(alice, model="m", stored=True, inputs=[("user", "standalone")],
                                                   request={"temperature": 0.5})
    await finish(store, alice, output.id, endpoint="responses")
    await store.create_response(bob, model="m", stored=False, previous_response_id=response.id)
    await store.record_usage(bob, endpoint="completions", model="m", prompt_tokens=5, cached_tokens=0,
                             completion_tokens=1, cost=1e-9)
    appealed = await store.add_moderation_event(alice, stage="input", action="blocked", categories=["violence"],
                                                endpoint="conversations", excerpt="…", conversation_id=conversation.id)
    await store.appeal_moderation_event(appealed.id, alice, "it was a quote")
    flagged = await store.add_moderation_event(bob, stage="output", action="flagged", categories=[],
                                               endpoint="chat.completions", text_sha256="ab" * 32)
    await store.resolve_moderation_event(flagged.id, "overturned", note="fine")
    await store.beat("rep_0123456789abcdef")
    assert (await store.claim_key(alice, "key-1", "sha", "rep_0123456789abcdef")).outcome == "new"
    await store.rate(alice, reply.id, "message", "m", "down", "made up the weather")
    await store.save_ramp(RampState("chat", "m2", 1, 5.0, "ramping", clock(), clock()), "advance", "held up")


async def rows_of(store: Store) -> dict[str, list[tuple]]:
    """Every table's rows, in a fixed order."""
    tables = await store.tables()
    return {table: [tuple(row) for row in await store._fetch(
                f"SELECT {', '.join(columns)} FROM {table} ORDER BY {', '.join(map(str, range(1, len(columns) + 1)))}")]
            for table, columns in tables.items()}


async def test_a_populated_store_copied_to_postgresql_and_back_is_the_same_row_for_row(tmp_path, postgres_url, clock):
    original, back = tmp_path / "original.db", tmp_path / "back.db"
    async with await open_store(original, clock=clock) as store:
        await populate(store, clock)
        expected = await rows_of(store)
    assert all(expected[table] for table in expected if table != "write_probe")  # every table has rows

    copied = await copy_store(str(original), postgres_url)
    assert copied == {table: len(rows) for table, rows in expected.items()}
    assert list(copied)[:5] == ["tenants", "api_keys", "conversations", "responses", "messages"]  # parents first
    async with await open_store(postgres_url, clock=clock) as on_postgres:
        assert await rows_of(on_postgres) == expected
        alice = expected["tenants"][0][0]
        await on_postgres.record_usage(alice, endpoint="completions", model="m", prompt_tokens=1, cached_tokens=0,
                                       completion_tokens=1, cost=0.0)  # numbered after the copied ids
        [(last_id,)] = await on_postgres._fetch("SELECT MAX(id) FROM usage_events")
        assert last_id == max(row[0] for row in expected["usage_events"]) + 1
        await on_postgres._write("DELETE FROM usage_events WHERE id = ?", (last_id,))

    await copy_store(postgres_url, f"sqlite://{back}")
    async with await open_store(back) as store:
        assert await rows_of(store) == expected
        [conversation] = [row[0] for row in expected["conversations"] if row[3] == "Trip"]
        items = await store.list_messages(conversation)
        assert [m.token_ids for m in items if m.token_ids] == [(0, 7, 2**31 - 1)]
        assert [m.kind for m in items] == ["message", "message", "message", "function_call", "function_call_output"]


async def test_a_destination_that_holds_rows_is_refused_and_left_as_it_was(tmp_path, clock):
    source, destination = tmp_path / "source.db", tmp_path / "destination.db"
    async with await open_store(source, clock=clock) as store:
        await make_tenant(store, "alice")
    assert await copy_store(str(source), str(destination)) == {
        "tenants": 1, "api_keys": 1, "conversations": 0, "responses": 0, "messages": 0, "usage_events": 0,
        "moderation_events": 0, "idempotency_keys": 0, "replicas": 0, "feedback": 0, "canary_ramps": 0, "canary_events": 0,
        "write_probe": 0}
    with pytest.raises(ValueError, match="destination.db is not empty \\(tenants has 1 rows\\)"):
        await copy_store(str(source), str(destination))
    with pytest.raises(ValueError, match="the same store"):
        await copy_store(str(source), f"sqlite://{source}")
    async with await open_store(destination) as store:
        assert [key.tenant_name for key in await store.list_keys()] == ["alice"]


def test_the_command_copies_a_sqlite_file_into_a_new_one_and_counts_the_rows(tmp_path, clock):
    """`chatd store copy SRC DST` as a user runs it: a one-node file into a new one, named as a
    path and as a sqlite:/// url; it prints what it copied per table."""
    async def fill() -> None:
        async with await Store.open(tmp_path / "one-node.db", clock=clock) as store:
            await populate(store, clock)

    asyncio.run(fill())
    done = subprocess.run([sys.executable, "-m", "chatd", "store", "copy", str(tmp_path / "one-node.db"),
                           f"sqlite:///{tmp_path / 'copy.db'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^messages +\d+ rows$", done.stdout, re.M) and "copied" in done.stdout

    async def both() -> tuple:
        async with await Store.open(tmp_path / "one-node.db") as source, await Store.open(tmp_path / "copy.db") as copy:
            return await rows_of(source), await rows_of(copy)

    source, copy = asyncio.run(both())
    assert source == copy

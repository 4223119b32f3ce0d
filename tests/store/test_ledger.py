"""The ledger on a real, size-limited SQLite file: usage served while the file is full is kept, in
order, and written once there is room; what still cannot be written at stop is logged in full."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import orjson
import pytest

from chatd.store.db import Store
from chatd.store.ledger import Ledger, cannot_write_now
from tests.store.factories import MAX_BYTES, START, fill_up, free_up, make_tenant, read_sql

RETRY_SECONDS = 5.0
LONG_REPLY = "a reply streamed while the disk was full. " * 200  # needs pages of its own


class ParkedSleep:
    """Stands in for asyncio.sleep: a sleep lasts until the test calls end(). `started` is set
    while the ledger sleeps, that is, after a failed attempt and before its retry."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.started = asyncio.Event()
        self._ended = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.durations.append(seconds)
        self.started.set()
        try:
            await self._ended.wait()
        except asyncio.CancelledError:
            self.started.clear()
            raise

    def end(self) -> None:
        """End the sleep under way: the ledger retries now."""
        self.started.clear()
        self._ended.set()
        self._ended = asyncio.Event()


@pytest.fixture
def sleeps() -> ParkedSleep:
    return ParkedSleep()


@pytest.fixture
async def store(tmp_path, clock):
    async with await Store.open(tmp_path / "chatd.db", clock=clock, max_bytes=MAX_BYTES) as store:
        yield store


@pytest.fixture
async def ledger(store, clock, sleeps):
    ledger = Ledger(store, retry_seconds=RETRY_SECONDS, clock=clock, sleep=sleeps)
    ledger.start()
    yield ledger
    await ledger.stop(timeout=0)


def usage_of(ledger: Ledger, tenant_id: str, completion_tokens: int, endpoint: str = "chat.completions") -> asyncio.Future:
    return ledger.record_usage(tenant_id, endpoint=endpoint, model="m", prompt_tokens=10, cached_tokens=2,
                        completion_tokens=completion_tokens, cost=0.25)


def finish_of(ledger: Ledger, tenant_id: str, message_id: str, **overrides) -> asyncio.Future:
    values = dict(content=LONG_REPLY, status="complete", finish_reason="stop", prompt_tokens=10, cached_tokens=0,
                  completion_tokens=2, cost=0.5, model="m")
    return ledger.finish_turn(tenant_id, message_id, **{**values, **overrides})


def events_of(store: Store, tenant_id: str) -> list[tuple]:
    """The tenant's usage events as another process reads them: what the bill is made from."""
    return read_sql(store.path, "SELECT endpoint, completion_tokens, created_at FROM usage_events "
                                "WHERE tenant_id = ? ORDER BY id", (tenant_id,))


async def test_usage_served_while_full_is_written_once_in_order_when_room_returns(store, ledger, clock, sleeps):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    await fill_up(store)

    usage_of(ledger, alice, 1)
    await sleeps.started.wait()  # the write failed; the ledger waits to retry
    assert not ledger.healthy
    assert ledger.last_error == "OperationalError: database or disk is full"
    clock.advance(1)
    finish_of(ledger, alice, reply.id)
    clock.advance(1)
    usage_of(ledger, alice, 3, endpoint="completions")
    assert ledger.num_pending == 3
    assert events_of(store, alice) == []

    sleeps.end()  # the retry, retry_seconds later, finds the file still full
    await sleeps.started.wait()
    assert (ledger.healthy, ledger.num_pending, sleeps.durations) == (False, 3, [RETRY_SECONDS] * 2)
    assert events_of(store, alice) == []

    clock.advance(600)  # written ten minutes later, billed at the time each was served
    await free_up(store)
    sleeps.end()
    await ledger.drained()
    assert ledger.healthy
    assert events_of(store, alice) == [("chat.completions", 1, START), ("conversations", 2, START + 1),
                                       ("completions", 3, START + 2)]
    saved = await store.get_message(conversation.id, reply.id)
    assert (saved.content, saved.status, saved.finish_reason, saved.updated_at) == (
        LONG_REPLY, "complete", "stop", START + 1)

    usage_of(ledger, alice, 4)  # healthy again: written at once, no waiting for a retry
    await ledger.drained()
    assert events_of(store, alice)[-1] == ("chat.completions", 4, START + 602)
    assert len(sleeps.durations) == 2


async def test_a_caller_may_wait_for_its_write_but_never_for_the_disk(store, ledger, sleeps):
    """A conversation reply waits until its row is written, so the client reads it next; with the
    file full it is told at once that the write waits, and the reply is written later."""
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, first = await store.start_turn(alice, conversation.id, "hi")
    assert await finish_of(ledger, alice, first.id, content="short") is True
    assert (await store.get_message(conversation.id, first.id)).status == "complete"  # written when told so

    _, second = await store.start_turn(alice, conversation.id, "again")
    await fill_up(store)
    assert await asyncio.wait_for(finish_of(ledger, alice, second.id), timeout=5) is False  # kept, not waited for
    assert await asyncio.wait_for(usage_of(ledger, alice, 1), timeout=5) is False  # queued behind the outage
    await free_up(store)
    sleeps.end()
    await ledger.drained()
    assert (await store.get_message(conversation.id, second.id)).content == LONG_REPLY


async def test_a_failure_elsewhere_is_probed_until_the_file_takes_writes(store, ledger, sleeps):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    await fill_up(store)
    with pytest.raises(sqlite3.OperationalError) as failure:
        await store.start_turn(alice, conversation.id, "x" * 3000)  # the HTTP layer's own write
    ledger.report_failure(failure.value)
    assert not ledger.healthy

    await sleeps.started.wait()
    sleeps.end()  # the probe after retry_seconds finds no room
    await sleeps.started.wait()
    assert not ledger.healthy

    await free_up(store)
    sleeps.end()
    await ledger.wait_healthy()
    assert read_sql(store.path, "SELECT COUNT(*) FROM write_probe") == [(0,)]
    assert ledger.num_pending == 0


async def test_an_error_that_is_not_about_writing_leaves_the_ledger_healthy(ledger, sleeps):
    ledger.report_failure(LookupError("no conversation"))
    ledger.report_failure(sqlite3.IntegrityError("FOREIGN KEY constraint failed"))
    assert ledger.healthy
    assert not sleeps.started.is_set()
    assert cannot_write_now(OSError(28, "No space left on device"))


async def test_stop_logs_every_write_it_could_not_make_and_leaves_no_task(store, ledger, clock, sleeps, caplog):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    await fill_up(store)
    usage_of(ledger, alice, 1)
    clock.advance(1)
    finish_of(ledger, alice, reply.id)
    await sleeps.started.wait()

    with caplog.at_level(logging.ERROR, logger="chatd.store.ledger"):
        await ledger.stop(timeout=0)
    messages = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
    unwritten = [orjson.loads(m[m.index("{"):]) for m in messages if m.startswith("unwritten")]
    assert unwritten == [
        dict(tenant_id=alice, endpoint="chat.completions", model="m", prompt_tokens=10, cached_tokens=2,
             completion_tokens=1, cost=0.25, conversation_id=None, message_id=None, created_at=START),
        dict(tenant_id=alice, message_id=reply.id, content=LONG_REPLY, status="complete", finish_reason="stop",
             prompt_tokens=10, cached_tokens=0, completion_tokens=2, cost=0.5, model="m", endpoint="conversations",
             finished_at=START + 1),
    ]
    assert any(m.startswith("2 billing writes could not be saved") for m in messages)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert events_of(store, alice) == []

    usage_of(ledger, alice, 5)  # a caller that outlived stop: logged, not lost silently
    assert '"completion_tokens":5' in caplog.records[-1].getMessage()


async def test_stop_retries_at_once_and_writes_what_now_fits(store, ledger, sleeps, caplog):
    alice = await make_tenant(store)
    await fill_up(store)
    usage_of(ledger, alice, 1)
    usage_of(ledger, alice, 2)
    await sleeps.started.wait()
    await free_up(store)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="chatd.store.ledger"):
        await ledger.stop(timeout=60)  # returns without the retry_seconds wait ending
    assert [tokens for _, tokens, _ in events_of(store, alice)] == [1, 2]
    assert not caplog.records


async def test_a_write_that_fails_for_a_bug_is_logged_and_dropped_and_later_writes_go_through(
        store, ledger, sleeps, caplog):
    alice = await make_tenant(store)
    with caplog.at_level(logging.ERROR, logger="chatd.store.ledger"):
        usage_of(ledger, "ten_nobody", 1)  # no such tenant: the foreign key refuses it, and would forever
        usage_of(ledger, alice, 2)
        await ledger.drained()
    [dropped] = [record.getMessage() for record in caplog.records]
    assert dropped.startswith("dropped usage event that failed (IntegrityError: FOREIGN KEY constraint failed)")
    assert orjson.loads(dropped[dropped.index("{"):])["tenant_id"] == "ten_nobody"
    assert [tokens for _, tokens, _ in events_of(store, alice)] == [2]
    assert ledger.healthy and sleeps.durations == []


async def test_a_reply_whose_conversation_was_purged_is_billed_and_not_retried(store, ledger, sleeps):
    alice = await make_tenant(store)
    conversation = await store.create_conversation(alice, model="m")
    _, reply = await store.start_turn(alice, conversation.id, "hi")
    await store.delete_conversation(alice, conversation.id)
    await store.purge_deleted(deleted_before=START + 1)
    finish_of(ledger, alice, reply.id)
    await ledger.drained()
    assert events_of(store, alice) == [("conversations", 2, START)]
    assert ledger.healthy and sleeps.durations == []


async def test_a_reply_with_an_unknown_status_is_refused_to_its_caller_at_once(store, ledger):
    with pytest.raises(ValueError, match="complete, partial, error"):
        finish_of(ledger, "local", "msg_x", status="done")
    assert ledger.num_pending == 0


async def test_retry_after_is_the_retry_interval_in_whole_seconds(store):
    assert [Ledger(store, retry_seconds=s).retry_after for s in (0.2, 1.0, 2.5)] == [1, 1, 3]


async def test_usage_queued_together_is_written_together_all_or_none_and_a_bad_event_alone_is_dropped(
        store, ledger, sleeps, caplog, monkeypatch):
    """Events queued at once go out in one transaction (in order, each once); while the file is full
    none of a batch is written, then all of it; a batch holding one bad event writes the others."""
    alice = await make_tenant(store)
    batches = []
    record_usages = store.record_usages

    async def counted(events):
        batches.append(len(events))
        await record_usages(events)

    monkeypatch.setattr(store, "record_usages", counted)
    written = [usage_of(ledger, alice, tokens) for tokens in range(1, 41)]
    await ledger.drained()
    assert all(w.result() for w in written)
    assert [tokens for _, tokens, _ in events_of(store, alice)] == list(range(1, 41))
    assert batches == [40]

    await fill_up(store)
    for tokens in range(41, 46):
        usage_of(ledger, alice, tokens)
    await sleeps.started.wait()  # the batch failed whole: nothing of it is in the file
    assert ledger.num_pending == 5 and len(events_of(store, alice)) == 40
    await free_up(store)
    sleeps.end()
    await ledger.drained()
    assert [tokens for _, tokens, _ in events_of(store, alice)] == list(range(1, 46))  # each once

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="chatd.store.ledger"):
        for tenant, tokens in ((alice, 46), ("ten_nobody", 47), (alice, 48)):
            usage_of(ledger, tenant, tokens)
        await ledger.drained()
    assert [tokens for _, tokens, _ in events_of(store, alice)][-2:] == [46, 48]
    [dropped] = [record.getMessage() for record in caplog.records]
    assert orjson.loads(dropped[dropped.index("{"):])["completion_tokens"] == 47
    assert ledger.healthy

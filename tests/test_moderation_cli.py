"""`chatd moderation list|show|resolve`, run as the operator runs it (a separate process, the store
named by --config): events listed newest first with a count, every field shown, a review made
once, and an unknown or already-resolved event refused with a message and exit status 1."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.store.db import Store
from chatd.store.records import ModerationEvent
from tests.store.factories import FakeClock  # it starts at 2027-01-15T08:00:00Z

UNKNOWN_ID = "modr_" + "0" * 24


@pytest.fixture
def config(tmp_path) -> Path:
    """A config.toml whose [store] db_path is a fresh file in tmp_path."""
    path = tmp_path / "config.toml"
    path.write_text(f'[store]\ndb_path = "{tmp_path / "moderation.db"}"\n')
    return path


def add_events(config: Path) -> tuple[str, list[ModerationEvent]]:
    """Alice's blocked input, a minute later her redacted reply (appealed): (her tenant id, the events)."""
    clock = FakeClock()

    async def run() -> tuple[str, list[ModerationEvent]]:
        async with await Store.open(config.parent / "moderation.db", clock=clock) as store:
            _, key = await store.create_key("alice", "free")
            blocked = await store.add_moderation_event(
                key.tenant_id, stage="input", action="blocked", categories=["harassment"],
                endpoint="chat.completions", excerpt="you are the worst", request_id="req_1")
            clock.advance(60)
            redacted = await store.add_moderation_event(
                key.tenant_id, stage="output", action="redacted", categories=["pii/card", "pii/email"],
                endpoint="responses")
            clock.advance(30)
            await store.appeal_moderation_event(redacted.id, key.tenant_id, "that card number is a test number")
            return key.tenant_id, [blocked, redacted]

    return asyncio.run(run())


def chatd(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CHATD_HOME": str(config.parent / "home")}  # nothing lands in the real home
    return subprocess.run([sys.executable, "-m", "chatd", "moderation", *args, "--config", str(config)],
                          check=False, capture_output=True, text=True, timeout=120, env=env)


def test_list_shows_the_events_newest_first_with_a_count(config):
    empty = chatd(config, "list")
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout.strip() == "no moderation events"

    tenant_id, (blocked, redacted) = add_events(config)
    listed = chatd(config, "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows, summary = listed.stdout.splitlines()
    assert header.split() == ["EVENT", "ID", "WHEN", "(UTC)", "TENANT", "STAGE", "ACTION", "CATEGORIES", "STATUS"]
    assert [row.split() for row in rows] == [
        [redacted.id, "2027-01-15T08:01:00Z", tenant_id, "output", "redacted", "pii/card,pii/email", "appealed"],
        [blocked.id, "2027-01-15T08:00:00Z", tenant_id, "input", "blocked", "harassment", "open"]]
    assert summary == "2 events"

    appealed = chatd(config, "list", "--status", "appealed", "--tenant", tenant_id)
    assert [line.split()[0] for line in appealed.stdout.splitlines()] == ["EVENT", redacted.id, "1"]
    assert appealed.stdout.splitlines()[-1] == "1 event"
    limited = chatd(config, "list", "--limit", "1")
    assert limited.stdout.splitlines()[-1] == "1 of 2 events (newest first; raise --limit to see more)"
    assert chatd(config, "list", "--status", "upheld").stdout.strip() == "no upheld moderation events"


def test_show_prints_every_field_and_resolve_decides_once(config):
    tenant_id, (_, redacted) = add_events(config)
    shown = chatd(config, "show", redacted.id)
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(":", 1) for line in shown.stdout.splitlines())
    assert {name: value.strip() for name, value in fields.items()} == {
        "id": redacted.id, "tenant_id": tenant_id, "stage": "output", "action": "redacted",
        "categories": "pii/card,pii/email", "endpoint": "responses", "excerpt": "-", "text_sha256": "-",
        "request_id": "-", "conversation_id": "-", "message_id": "-", "created_at": "2027-01-15T08:01:00Z",
        "status": "appealed", "appeal_reason": "that card number is a test number",
        "appealed_at": "2027-01-15T08:01:30Z", "resolved_at": "-", "resolution_note": "-"}

    resolved = chatd(config, "resolve", redacted.id, "--uphold", "--note", "a real card")
    assert (resolved.returncode, resolved.stdout.strip()) == (0, f"{redacted.id} upheld")
    shown = chatd(config, "show", redacted.id).stdout
    assert "status:           upheld" in shown and "resolution_note:  a real card" in shown

    again = chatd(config, "resolve", redacted.id, "--overturn")
    assert again.returncode == 1
    assert again.stderr.strip() == f"chatd: moderation event '{redacted.id}' is already upheld; it cannot be resolved again"
    assert "Traceback" not in again.stderr


@pytest.mark.parametrize("command", [["show", UNKNOWN_ID], ["resolve", UNKNOWN_ID, "--overturn"]])
def test_an_unknown_event_exits_1_with_a_message(config, command):
    run = chatd(config, *command)
    assert run.returncode == 1
    assert run.stderr.strip() == f"chatd: no moderation event '{UNKNOWN_ID}' (see `chatd moderation list`)"

"""A store that cannot write (its file at [store] max_db_mb, as on a full disk), through a real
`chatd serve`: new work is refused with 503 and Retry-After, what was already being served is
billed once there is room again, and a reply streamed meanwhile is saved whole."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import aiohttp
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

FILLER = "x" * 60_000  # a system prompt that takes ~15 pages of the file
# Long enough that neither reply can end before the file is full (filling takes ~0.5 s; at 300
# tokens a reply once finished first on a loaded CI machine, and was billed before the store filled).
REPLY_TOKENS = 1500


def rows(db, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, args).fetchall()


@pytest.fixture
def server(tmp_path):
    model_dir = build_demo_model(tmp_path / "demo")
    db = tmp_path / "chatd.db"
    proc, url, log_path = start_server(tmp_path, model_dir, (
        f'[store]\ndb_path = "{db}"\nmax_db_mb = 0.5\nretry_seconds = 0.2\n'
        "[server]\nheartbeat_seconds = 0.5\n"))
    yield {"url": url, "db": db, "log": log_path}
    stop_server(proc)


async def read_stream(response: aiohttp.ClientResponse) -> tuple[str, dict | None, str]:
    """The streamed text, the usage chunk, and the last event."""
    text, usage, last = "", None, ""
    async for line in response.content:
        if line.startswith(b"data: "):
            last = line[6:].decode().strip()
            if last.startswith("{"):
                event = json.loads(last)
                usage = event.get("usage") or usage
                text += "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    return text, usage, last


async def test_a_full_store_refuses_new_work_and_bills_what_it_served(server):
    url, db = server["url"], server["db"]
    long_reply = {"max_tokens": REPLY_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/conversations", json={}) as r:
            conversation = (await r.json())["id"]
        # Two replies are under way when the file fills up.
        completion = await session.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Tell me everything."}], "stream_options": {"include_usage": True},
            **long_reply})
        turn = await session.post(f"{url}/v1/conversations/{conversation}/messages",
                                  json={"content": "And you, tell me everything too.", **long_reply})
        await completion.content.readline()
        await turn.content.readline()
        fillers = []
        for _ in range(100):
            async with session.post(f"{url}/v1/conversations", json={"system_prompt": FILLER}) as r:
                if r.status == 503:
                    refused = await r.json()
                    assert r.headers["Retry-After"] == "1" and refused["error"]["code"] == "store_unavailable"
                    break
                fillers.append((await r.json())["id"])
        else:
            pytest.fail("the store never filled up")

        # New work waits; probes say why.
        async with session.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "store_unavailable"
        async with session.get(f"{url}/ready") as r:
            assert r.status == 503 and (await r.json())["store"]["writable"] is False
        async with session.get(f"{url}/health") as r:
            assert r.status == 200  # the process is fine; it only cannot bill new work now

        # What was under way is served to its end, and not lost although it cannot be written yet.
        completion_text, completion_usage, last = await read_stream(completion)
        assert last == "[DONE]" and completion_usage["completion_tokens"] == REPLY_TOKENS
        turn_text, _, last = await read_stream(turn)
        assert last == "[DONE]" and turn_text
        assert rows(db, "SELECT COUNT(*) FROM usage_events") == [(0,)]
        async with session.get(f"{url}/health") as r:
            assert (await r.json())["store"]["pending_writes"] == 2

        # Room again: the operator deletes the fillers (a soft delete through the API would rewrite
        # each 60 KB row, which a file at its limit cannot take either).
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA busy_timeout = 5000")
            conn.executemany("DELETE FROM conversations WHERE id = ?", [(f,) for f in fillers])
        for _ in range(200):
            async with session.get(f"{url}/ready") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert r.status == 200

        # Everything served is billed, once, and the reply is saved whole.
        billed = rows(db, "SELECT endpoint, completion_tokens FROM usage_events ORDER BY id")
        assert sorted(billed) == sorted([("chat.completions", REPLY_TOKENS), ("conversations", REPLY_TOKENS)])
        async with session.get(f"{url}/v1/conversations/{conversation}") as r:
            saved = (await r.json())["messages"][-1]
        assert (saved["status"], saved["content"], saved["usage"]["completion_tokens"]) == ("complete", turn_text, REPLY_TOKENS)
        async with session.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                     "max_tokens": 2}) as r:
            assert r.status == 200
    log = server["log"].read_text()
    assert "the store cannot write" in log and "the store writes again" in log

"""A store that cannot write (its file at [store] max_db_mb, as on a full disk), through a real
`chatd serve`: new work is refused with 503 and Retry-After, what was already being served is
billed once there is room again, and a reply streamed meanwhile is saved whole. A PostgreSQL store
that goes down is a 503 too, which tells clients nothing of where the store is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3

import aiohttp
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server
from tests.postgres_server import PostgresServer, missing

MAX_DB_BYTES = 512 * 1024  # [store] max_db_mb = 0.5
# Long enough that neither reply can end between its start and the file filling up.
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


def add_ballast(db, *, leave_pages: int) -> None:
    """As other data on the same disk would: take the file's room (its growth up to max_db_mb and
    its free pages) down to `leave_pages`, in a table of the test's own. Small rows last, so that
    at 0 not even a one-page write fits."""
    with sqlite3.connect(db, isolation_level=None) as conn:
        conn.execute("PRAGMA busy_timeout = 5000")
        conn.execute("PRAGMA synchronous = OFF")
        [(page_size,)] = conn.execute("PRAGMA page_size").fetchall()
        conn.execute("CREATE TABLE IF NOT EXISTS ballast (body BLOB)")
        conn.execute(f"PRAGMA max_page_count = {MAX_DB_BYTES // page_size - leave_pages}")
        for size in (page_size * 4, page_size // 2, 64, 8):
            with contextlib.suppress(sqlite3.OperationalError):  # "database or disk is full"
                while True:
                    conn.execute("INSERT INTO ballast VALUES (zeroblob(?))", (size,))
    assert room_in_pages(db) == leave_pages


def room_in_pages(db) -> int:
    """Pages the file can still take under max_db_mb: its free pages, and its growth."""
    [(page_size,)] = rows(db, "PRAGMA page_size")
    [(page_count,)] = rows(db, "PRAGMA page_count")
    [(free,)] = rows(db, "PRAGMA freelist_count")
    return MAX_DB_BYTES // page_size - page_count + free


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    """Until the store writes again and has written everything it kept (the first write that
    succeeds makes it ready; the ones queued behind it follow in order)."""
    for _ in range(200):
        async with session.get(f"{url}/ready") as ready, session.get(f"{url}/health") as health:
            if ready.status == 200 and (await health.json())["store"]["pending_writes"] == 0:
                return
        await asyncio.sleep(0.05)
    pytest.fail("the store did not write again")


@pytest.mark.slow
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
        add_ballast(db, leave_pages=0)
        async with session.post(f"{url}/v1/conversations", json={"system_prompt": "x" * 10_000}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "store_unavailable"

        # New work waits; probes say why.
        async with session.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "store_unavailable"
        async with session.get(f"{url}/ready") as r:
            assert r.status == 503 and (await r.json())["store"]["writable"] is False
        async with session.get(f"{url}/health") as r:  # a gateway sends new work to another replica
            assert r.status == 503 and (await r.json())["status"] == "store cannot write"

        # What was under way is served to its end, and not lost although it cannot be written yet.
        completion_text, completion_usage, last = await read_stream(completion)
        assert last == "[DONE]" and completion_usage["completion_tokens"] == REPLY_TOKENS
        turn_text, _, last = await read_stream(turn)
        assert last == "[DONE]" and turn_text
        # The saved reply needs a new page, so it waits in memory. (The completion's small usage row
        # may fit in a page that has room; each of the two is either billed or waiting, never lost.)
        assert rows(db, "SELECT status FROM messages WHERE conversation_id = ? AND role = 'assistant'",
                    conversation) == [("partial",)]
        # The ledger retries every 0.2 s, and the small row may be written between two reads (its row
        # shows in the table a moment before it leaves the queue): read both twice, until neither moved.
        async def snapshot() -> tuple[int, int]:
            [(billed,)] = rows(db, "SELECT COUNT(*) FROM usage_events")
            async with session.get(f"{url}/health") as r:
                return billed, (await r.json())["store"]["pending_writes"]

        for _ in range(50):
            first, second = await snapshot(), await snapshot()
            if first == second:
                break
        billed_while_full, pending = second
        assert pending >= 1 and billed_while_full + pending == 2

        # Room again: the operator frees space.
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA busy_timeout = 5000")
            conn.execute("DROP TABLE ballast")
        await wait_ready(session, url)

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


@pytest.mark.slow
async def test_a_postgresql_outage_is_a_503_that_tells_clients_nothing_of_where_the_store_is(tmp_path):
    """The store's address (user, host, port, database) is the operator's: a client, and /health,
    get a generic 503; the log says what failed, where."""
    if missing():
        pytest.skip(missing())
    with PostgresServer() as postgres:
        store_url = postgres.create_database("chatd_where_secret")
        proc, url, log_path = start_server(tmp_path, build_demo_model(tmp_path / "demo"), (
            f'[store]\nurl = "{store_url}"\nretry_seconds = 0.2\n[server]\nheartbeat_seconds = 0.5\n'))
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/v1/conversations", json={}) as r:
                    conversation = (await r.json())["id"]
                postgres.pause()
                answers = []
                for method, path, body in (("POST", "/v1/conversations", {}),
                                           ("POST", f"/v1/conversations/{conversation}/messages", {"content": "hi"}),
                                           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                           ("GET", "/health", None)):
                    async with session.request(method, url + path, json=body) as r:
                        answers.append((path, r.status, await r.text()))
                for path, status, text in answers:
                    assert status == 503, (path, text)
                    for secret in ("chatd_where_secret", "127.0.0.1", str(postgres.port), "postgres"):
                        assert secret not in text, (path, text)
                assert json.loads(answers[2][2])["error"]["code"] == "store_unavailable"
                postgres.resume()
                await wait_ready(session, url)
                async with session.post(f"{url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                    assert r.status == 200
        finally:
            stop_server(proc)
        assert "chatd_where_secret" in log_path.read_text()  # the operator's log says where

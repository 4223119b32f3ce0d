"""Conversations, API keys and usage through a real `chatd serve` process on a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time
from array import array

import aiohttp
import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from chatd.engine import Tokenizer
from tests.http.serving import create_key, start_server, stop_server

BLOCK = 16
PRICES = {"input": 2.0, "cached_input": 0.5, "output": 8.0}  # USD per million tokens


def config_text(db, retention_days: float = 30.0, auth: bool = True, grace: float = 2.0) -> str:
    return (
        f'[store]\ndb_path = "{db}"\nretention_days = {retention_days}\npurge_interval_seconds = 0.2\n'
        f"[auth]\nenabled = {'true' if auth else 'false'}\n"
        "[model]\nmax_model_len = 512\n"
        "[conversations]\nmax_message_chars = 2000\nmax_title_chars = 40\nsave_interval_seconds = 0.05\n"
        f"[server]\nheartbeat_seconds = 0.5\nshutdown_grace_seconds = {grace}\n"
        f"[prices.demo]\ninput = {PRICES['input']}\ncached_input = {PRICES['cached_input']}\noutput = {PRICES['output']}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve with auth on; yields a dict with url, keys of two tenants, db path, model dir."""
    root = tmp_path_factory.mktemp("conversations")
    model_dir = build_demo_model(root / "demo")
    db = root / "chatd.db"
    (root / "config.toml").write_text(config_text(db, retention_days=0.0))
    keys = {name: create_key(root / "config.toml", name) for name in ("alice", "bob")}
    proc, url, log_path = start_server(root, model_dir, config_text(db, retention_days=0.0))
    yield {"url": url, "keys": keys, "db": db, "model_dir": model_dir, "root": root}
    stop_server(proc)


def headers(server, who: str = "alice") -> dict:
    return {"Authorization": f"Bearer {server['keys'][who]}"}


async def call(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with session.request(method, url, **kwargs) as r:
        return r.status, await r.json()


async def new_conversation(session, server, who="alice", **fields) -> dict:
    status, body = await call(session, "POST", f"{server['url']}/v1/conversations", json=fields, headers=headers(server, who))
    assert status == 200, body
    return body


async def post(session, server, conversation_id: str, content: str, who="alice", **fields) -> tuple[int, dict]:
    return await call(session, "POST", f"{server['url']}/v1/conversations/{conversation_id}/messages",
                      json={"content": content, "temperature": 0, **fields}, headers=headers(server, who))


def parse_events(raw: str) -> list[tuple[int | None, str]]:
    events = []
    for block in raw.split("\n\n"):
        event_id, data = None, None
        for line in block.split("\n"):
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append((event_id, data))
    return events


def text_of(events: list[tuple[int | None, str]]) -> str:
    parts = []
    for _, data in events:
        if data.startswith("{"):
            body = json.loads(data)
            for choice in body.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


def db_rows(db, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, args).fetchall()


async def test_keys_decide_the_tenant_and_bad_keys_get_401(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        for bad in ({}, {"Authorization": "Bearer chatd_000000000000_nope"}, {"Authorization": "Basic abc"},
                    {"Authorization": server["keys"]["alice"][:-1] + "x"}):
            status, body = await call(session, "GET", f"{url}/v1/models", headers={**bad})
            assert status == 401 and body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
        async with session.get(f"{url}/health") as r:
            assert r.status == 200  # probes need no key
        mine = await new_conversation(session, server, "alice", title="mine")
        # Another tenant's conversation does not exist for bob: 404 everywhere, never 403.
        for method, path, body in [("GET", "", None), ("DELETE", "", None), ("POST", "/messages", {"content": "hi"})]:
            status, error = await call(session, method, f"{url}/v1/conversations/{mine['id']}{path}", json=body,
                                       headers=headers(server, "bob"))
            assert status == 404 and error["error"]["code"] == "not_found"
        status, listed = await call(session, "GET", f"{url}/v1/conversations", headers=headers(server, "bob"))
        assert mine["id"] not in [c["id"] for c in listed["data"]]
    # The OpenAI SDK authenticates the same way.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=server["keys"]["bob"], max_retries=0)
    assert client.models.list().data[0].id == "demo"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


async def test_a_conversation_from_creation_to_deletion(server):
    url, tok = server["url"], Tokenizer.from_pretrained(server["model_dir"])
    async with aiohttp.ClientSession() as session:
        created = await new_conversation(session, server, system_prompt="You are terse.", title="Paging",
                                         metadata={"tags": ["kv", "cache"], "n": 1})
        assert created["object"] == "conversation" and created["title"] == "Paging" and created["metadata"]["tags"] == ["kv", "cache"]
        status, reply = await post(session, server, created["id"], "What is a KV block?", max_tokens=8, ignore_eos=True)
        assert status == 200, reply
        assert reply["conversation_id"] == created["id"] and reply["object"] == "chat.completion"
        expected_prompt = tok.encode_chat([{"role": "system", "content": "You are terse."},
                                           {"role": "user", "content": "What is a KV block?"}])
        assert reply["usage"]["prompt_tokens"] == len(expected_prompt)
        assert reply["usage"]["completion_tokens"] == 8 and reply["choices"][0]["finish_reason"] == "length"

        status, got = await call(session, "GET", f"{url}/v1/conversations/{created['id']}", headers=headers(server))
        assert [(m["role"], m["status"]) for m in got["messages"]] == [("user", "complete"), ("assistant", "complete")]
        assert got["messages"][0]["content"] == "What is a KV block?"
        assert got["messages"][1]["content"] == reply["choices"][0]["message"]["content"]
        assert got["messages"][1]["id"] == reply["id"]
        cost = got["messages"][1]["cost"]
        fresh = reply["usage"]["prompt_tokens"] - reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        want = (fresh * PRICES["input"] + reply["usage"]["prompt_tokens_details"]["cached_tokens"] * PRICES["cached_input"]
                + 8 * PRICES["output"]) / 1e6
        assert cost == pytest.approx(want)

        status, deleted = await call(session, "DELETE", f"{url}/v1/conversations/{created['id']}", headers=headers(server))
        assert status == 200 and deleted["deleted"] is True
        status, _ = await call(session, "GET", f"{url}/v1/conversations/{created['id']}", headers=headers(server))
        assert status == 404
        status, error = await post(session, server, created["id"], "still there?")
        assert status == 404
        # Retention is 0 days in this server's config: the purge task removes it and its messages.
        for _ in range(100):
            if not db_rows(server["db"], "SELECT id FROM messages WHERE conversation_id = ?", created["id"]):
                break
            await asyncio.sleep(0.1)
        assert not db_rows(server["db"], "SELECT id FROM conversations WHERE id = ?", created["id"])
        assert not db_rows(server["db"], "SELECT id FROM messages WHERE conversation_id = ?", created["id"])
        # Its usage stays on the bill.
        assert db_rows(server["db"], "SELECT COUNT(*) FROM usage_events WHERE message_id = ?", reply["id"]) == [(1,)]


async def test_a_conversation_is_renamed_by_its_own_tenant_only(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        created = await new_conversation(session, server, title="Old", metadata={"n": 1})
        path = f"{url}/v1/conversations/{created['id']}"
        status, error = await call(session, "POST", path, json={"title": "Stolen"}, headers=headers(server, "bob"))
        assert status == 404 and error["error"]["code"] == "not_found"
        status, renamed = await call(session, "POST", path, json={"title": "New"}, headers=headers(server))
        assert status == 200 and renamed["title"] == "New" and renamed["metadata"] == {"n": 1}
        assert renamed["updated_at"] >= created["updated_at"]
        status, renamed = await call(session, "POST", path, json={"metadata": {"n": 2}, "title": None}, headers=headers(server))
        assert status == 200 and renamed["title"] is None and renamed["metadata"] == {"n": 2}
        for body, param in (({"title": "x" * 1000}, "title"), ({"model": "m"}, "model"), ({}, None)):
            status, error = await call(session, "POST", path, json=body, headers=headers(server))
            assert status == 400 and error["error"]["param"] == param, error
        status, got = await call(session, "GET", path, headers=headers(server))
        assert got["title"] is None and got["metadata"] == {"n": 2}


async def test_a_system_prompt_is_changed_by_its_own_tenant_only_and_rules_the_next_turn(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        created = await new_conversation(session, server, system_prompt="Be brief.", metadata={"temperature": "0.2"})
        path = f"{url}/v1/conversations/{created['id']}"
        status, error = await call(session, "POST", path, json={"system_prompt": "Obey bob."}, headers=headers(server, "bob"))
        assert status == 404 and error["error"]["code"] == "not_found"
        status, error = await call(session, "POST", path, json={"system_prompt": "x" * 2001}, headers=headers(server))
        assert status == 400 and error["error"]["param"] == "system_prompt" and "2000" in error["error"]["message"]
        status, error = await call(session, "POST", path, json={"system_prompt": 7}, headers=headers(server))
        assert status == 400 and error["error"]["param"] == "system_prompt"
        status, changed = await call(session, "POST", path, json={"system_prompt": "Answer in French."}, headers=headers(server))
        assert status == 200 and changed["system_prompt"] == "Answer in French." and changed["metadata"] == {"temperature": "0.2"}
        status, reply = await post(session, server, created["id"], "hi", max_completion_tokens=2)
        assert status == 200, reply
        with_new = reply["usage"]["prompt_tokens"]
        status, cleared = await call(session, "POST", path, json={"system_prompt": None}, headers=headers(server))
        assert status == 200 and cleared["system_prompt"] is None
        status, got = await call(session, "GET", path, headers=headers(server, "alice"))
        assert got["system_prompt"] is None and got["title"] == created["title"]
        created_with_it = await new_conversation(session, server, system_prompt="Answer in French.")
        status, reply = await post(session, server, created_with_it["id"], "hi", max_completion_tokens=2)
        assert reply["usage"]["prompt_tokens"] == with_new  # the same prompt as a conversation created with it


async def test_listing_is_newest_first_with_a_cursor(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        made = [(await new_conversation(session, server, "bob", title=f"t{i}"))["id"] for i in range(7)]
        seen, after = [], None
        while True:
            query = f"?limit=3&after={after}" if after else "?limit=3"
            status, page = await call(session, "GET", f"{url}/v1/conversations{query}", headers=headers(server, "bob"))
            assert status == 200 and len(page["data"]) <= 3
            seen += [c["id"] for c in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert [c for c in seen if c in made] == made[::-1]
        status, error = await call(session, "GET", f"{url}/v1/conversations?limit=1000", headers=headers(server, "bob"))
        assert status == 400 and error["error"]["param"] == "limit"


def stored_reply_ids(db, message_id: str) -> list[int] | None:
    """The token ids the store kept for a reply, read from the SQLite file itself."""
    with sqlite3.connect(db) as conn:
        [(blob,)] = conn.execute("SELECT token_ids FROM messages WHERE id = ?", (message_id,)).fetchall()
    return None if blob is None else list(array("i", blob))


@pytest.mark.slow
async def test_each_turn_reuses_the_whole_cached_history_from_the_stored_reply_ids(server):
    """A reply goes back into the next prompt as the ids the model generated, not as its text
    tokenized again: turn N+1 finds in the prefix cache every full block of turn N's prompt and
    reply (the reply's last token was sampled, never fed, so it is not in the cache)."""
    tok = Tokenizer.from_pretrained(server["model_dir"])
    async with aiohttp.ClientSession() as session:
        conversation = await new_conversation(session, server, system_prompt="Answer in one line.")
        usages, replies = [], []
        for turn in range(4):
            content = f"Turn {turn}: tell me about block number {turn} of the paged cache, please."
            status, reply = await post(session, server, conversation["id"], content, max_tokens=12, ignore_eos=True)
            assert status == 200, reply
            usages.append(reply["usage"])
            replies.append(reply)
        checked = 0
        for before, after, reply in zip(usages, usages[1:], replies):
            ids = stored_reply_ids(server["db"], reply["id"])
            assert ids is not None and len(ids) == before["completion_tokens"] == 12
            if tok.decode(ids, skip_special_tokens=False).strip() != reply["choices"][0]["message"]["content"].strip():
                continue  # a random reply that spells a special token goes back as its text
            checked += 1
            computed = before["prompt_tokens"] + before["completion_tokens"] - 1
            assert after["prompt_tokens_details"]["cached_tokens"] == computed // BLOCK * BLOCK
        assert checked >= 2, "the demo model's replies should mostly be plain text"


@pytest.mark.slow
async def test_a_long_history_drops_its_oldest_turns_and_says_so(server):
    async with aiohttp.ClientSession() as session:
        conversation = await new_conversation(session, server, system_prompt="Keep me.")
        words = " ".join(f"word{i}" for i in range(60))  # ~well over 100 tokens per message
        omitted = []
        for turn in range(6):
            status, reply = await post(session, server, conversation["id"], f"{turn} {words}", max_tokens=32, ignore_eos=True)
            assert status == 200, reply
            assert reply["usage"]["prompt_tokens"] + 32 <= 512
            omitted.append(reply["chatd"]["messages_omitted"])
        assert omitted[0] == 0 and omitted[-1] > 0
        assert all(n % 2 == 0 for n in omitted)  # whole turns: a user message with its reply


async def test_bad_input_is_refused_and_writes_nothing(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        conversation = await new_conversation(session, server)
        cases = [
            ({"content": "x" * 2001}, "content", "2000"),
            ({"content": ""}, "content", "non-empty"),
            ({"content": "hi", "role": "assistant"}, "role", "user"),
            ({"content": "hi", "n": 2}, "n", "one reply"),
            ({"content": "hi", "tools": []}, "tools", "not supported"),
            ({"content": "hi", "max_tokens": 600}, "max_tokens", "512"),
            ({"content": 5}, "content", "string"),
        ]
        for body, param, words in cases:
            status, error = await call(session, "POST", f"{url}/v1/conversations/{conversation['id']}/messages",
                                       json=body, headers=headers(server))
            assert status == 400 and error["error"]["param"] == param and words in error["error"]["message"], (body, error)
        for bad_id in ("conv_nothing", "'; DROP TABLE messages; --", "x" * 300):
            status, error = await call(session, "GET", f"{url}/v1/conversations/{bad_id}", headers=headers(server))
            assert status == 404
        status, error = await call(session, "POST", f"{url}/v1/conversations", json={"title": "t" * 41}, headers=headers(server))
        assert status == 400 and error["error"]["param"] == "title" and "40" in error["error"]["message"]
        status, error = await call(session, "POST", f"{url}/v1/conversations", json={"model": "gpt-4"}, headers=headers(server))
        assert status == 404 and error["error"]["code"] == "model_not_found"
        assert db_rows(server["db"], "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", conversation["id"]) == [(0,)]


@pytest.mark.slow
async def test_a_second_post_while_a_reply_runs_is_409(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        conversation = await new_conversation(session, server)
        first = await session.post(f"{url}/v1/conversations/{conversation['id']}/messages", headers=headers(server),
                                   json={"content": "long one", "max_tokens": 200, "ignore_eos": True, "stream": True})
        await first.content.readline()  # the reply has started
        status, error = await post(session, server, conversation["id"], "too soon")
        assert status == 409 and error["error"]["code"] == "conversation_busy" and error["error"]["type"] == "conflict_error"
        await first.read()
        first.close()
        status, reply = await post(session, server, conversation["id"], "now it is my turn", max_tokens=4)
        assert status == 200
        status, got = await call(session, "GET", f"{url}/v1/conversations/{conversation['id']}", headers=headers(server))
        assert [m["content"] for m in got["messages"] if m["role"] == "user"] == ["long one", "now it is my turn"]


@pytest.mark.slow
async def test_a_reply_survives_a_dropped_connection_and_resumes_with_last_event_id(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        conversation = await new_conversation(session, server)
        response = await session.post(
            f"{url}/v1/conversations/{conversation['id']}/messages", headers=headers(server),
            json={"content": "stream to me", "max_tokens": 120, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}})
        raw = b""
        while raw.count(b"\n\n") < 6:  # a few events, then the client goes away
            raw += await response.content.readany()
        response.close()
        first = parse_events(raw.decode().rsplit("\n\n", 1)[0] + "\n\n")
        message_id = json.loads(first[0][1])["id"]
        last_id = first[-1][0]
        assert [i for i, _ in first] == list(range(1, last_id + 1))

        async with session.get(f"{url}/v1/conversations/{conversation['id']}/messages/{message_id}/stream",
                               headers={**headers(server), "Last-Event-ID": str(last_id)}) as r:
            assert r.status == 200
            rest = parse_events((await r.read()).decode())
        assert [i for i, _ in rest] == list(range(last_id + 1, last_id + 1 + len(rest)))
        assert rest[-1][1] == "[DONE]"
        usage = json.loads(rest[-2][1])["usage"]
        assert usage["completion_tokens"] == 120
        status, got = await call(session, "GET", f"{url}/v1/conversations/{conversation['id']}", headers=headers(server))
        saved = got["messages"][-1]
        assert saved["status"] == "complete" and saved["content"] == text_of(first) + text_of(rest)

        # A reconnect from the start replays everything.
        async with session.get(f"{url}/v1/conversations/{conversation['id']}/messages/{message_id}/stream",
                               headers=headers(server)) as r:
            assert text_of(parse_events((await r.read()).decode())) == saved["content"]


async def test_usage_adds_up_per_tenant_and_period(server, tmp_path):
    url = server["url"]
    key = create_key(server["root"] / "config.toml", "carol", "free")
    auth = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        status, conversation = await call(session, "POST", f"{url}/v1/conversations", json={}, headers=auth)
        status, turn = await call(session, "POST", f"{url}/v1/conversations/{conversation['id']}/messages",
                                  json={"content": "count me", "max_tokens": 5, "ignore_eos": True}, headers=auth)
        assert status == 200
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        chat = await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "and me"}], max_tokens=7,
                                                    extra_body={"ignore_eos": True})
        want_input = turn["usage"]["prompt_tokens"] + chat.usage.prompt_tokens
        for _ in range(50):  # chat completions' usage is written just after the response
            status, usage = await call(session, "GET", f"{url}/v1/usage?period=day", headers=auth)
            if usage["requests"] == 2:
                break
            await asyncio.sleep(0.05)
        assert status == 200 and usage["tenant"] == "carol" and usage["tier"] == "free"
        assert (usage["requests"], usage["input_tokens"], usage["output_tokens"]) == (2, want_input, 12)
        cached = usage["cached_tokens"]
        assert usage["cost"] == pytest.approx(((want_input - cached) * 2.0 + cached * 0.5 + 12 * 8.0) / 1e6)
        now = time.time()
        status, later = await call(session, "GET", f"{url}/v1/usage?start={now + 60}&end={now + 120}", headers=auth)
        assert status == 200 and later["requests"] == 0
        status, error = await call(session, "GET", f"{url}/v1/usage?start={now}&end={now - 1}", headers=auth)
        assert status == 400 and error["error"]["param"] == "end"
        status, error = await call(session, "GET", f"{url}/v1/usage?period=week", headers=auth)
        assert status == 400 and error["error"]["param"] == "period"
        status, error = await call(session, "GET", f"{url}/v1/usage?start=yesterday", headers=auth)
        assert status == 400 and error["error"]["param"] == "start"


@pytest.mark.slow
async def test_kill_9_mid_reply_leaves_a_partial_message_and_a_clean_database(tmp_path, server):
    db = tmp_path / "crash.db"
    proc, url, _ = start_server(tmp_path, server["model_dir"], config_text(db, auth=False))
    try:
        async with aiohttp.ClientSession() as session:
            status, conversation = await call(session, "POST", f"{url}/v1/conversations", json={"title": "crash"})
            status, done = await call(session, "POST", f"{url}/v1/conversations/{conversation['id']}/messages",
                                      json={"content": "first, acknowledged", "max_tokens": 4})
            assert status == 200
            response = await session.post(f"{url}/v1/conversations/{conversation['id']}/messages",
                                          json={"content": "second, cut off", "max_tokens": 450, "ignore_eos": True, "stream": True})
            raw = b""
            for _ in range(1000):  # until the growing text has been saved at least once
                raw += await response.content.readany()
                if db_rows(db, "SELECT 1 FROM messages WHERE conversation_id = ? AND status = 'partial' AND content != ''",
                           conversation["id"]):
                    break
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            response.close()
    finally:
        proc.kill()
    streamed = text_of(parse_events(raw.decode().rsplit("\n\n", 1)[0] + "\n\n"))

    restart = tmp_path / "restart"
    restart.mkdir()
    proc, url, _ = start_server(restart, server["model_dir"], config_text(db, auth=False))
    try:
        async with aiohttp.ClientSession() as session:
            status, got = await call(session, "GET", f"{url}/v1/conversations/{conversation['id']}")
            assert status == 200
            assert [(m["role"], m["status"]) for m in got["messages"]] == [
                ("user", "complete"), ("assistant", "complete"), ("user", "complete"), ("assistant", "partial")]
            assert got["messages"][1]["content"] == done["choices"][0]["message"]["content"]
            partial = got["messages"][3]["content"]
            # Saved text and streamed text agree (either may be a few tokens ahead of the other).
            assert partial and (streamed.startswith(partial) or partial.startswith(streamed))
            status, reply = await call(session, "POST", f"{url}/v1/conversations/{conversation['id']}/messages",
                                       json={"content": "third, after the restart", "max_tokens": 4})
            assert status == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert db_rows(db, "PRAGMA integrity_check") == [("ok",)]


@pytest.mark.slow
async def test_a_stop_mid_reply_saves_what_was_generated_as_partial(tmp_path, server):
    db = tmp_path / "stop.db"
    proc, url, _ = start_server(tmp_path, server["model_dir"], config_text(db, auth=False, grace=0.0))
    try:
        async with aiohttp.ClientSession() as session:
            status, conversation = await call(session, "POST", f"{url}/v1/conversations", json={})
            response = await session.post(f"{url}/v1/conversations/{conversation['id']}/messages",
                                          json={"content": "cut me off", "max_tokens": 450, "ignore_eos": True, "stream": True})
            raw = b""
            while raw.count(b"\n\n") < 8:  # the reply is under way
                raw += await response.content.readany()
            proc.send_signal(signal.SIGTERM)  # no grace: what is running is aborted
            assert proc.wait(timeout=30) == 0
            response.close()
    finally:
        proc.kill()
    ((status, content, completion),) = db_rows(
        db, "SELECT status, content, completion_tokens FROM messages WHERE conversation_id = ? AND role = 'assistant'",
        conversation["id"])
    assert status == "partial" and content and 0 < completion < 450
    assert db_rows(db, "SELECT completion_tokens FROM usage_events WHERE conversation_id = ?", conversation["id"]) == [(completion,)]


async def test_a_reply_is_cancelled_by_its_own_tenant_only_and_saved_as_partial(server):
    url = server["url"]
    async with aiohttp.ClientSession() as session:
        messages = f"{url}/v1/conversations/{(await new_conversation(session, server))['id']}/messages"
        response = await session.post(messages, headers=headers(server),
                                      json={"content": "talk", "max_tokens": 400, "ignore_eos": True, "stream": True})
        raw = b""
        while raw.count(b"\n\n") < 6:  # the reply is under way
            raw += await response.content.readany()
        message_id = json.loads(parse_events(raw.decode())[0][1])["id"]
        cancel = f"{messages}/{message_id}/cancel"

        # Another tenant can neither stop it nor learn that it exists; the reply goes on.
        status, error = await call(session, "POST", cancel, headers=headers(server, "bob"))
        assert status == 404 and error["error"]["code"] == "not_found"
        more = raw.count(b"\n\n") + 2
        while raw.count(b"\n\n") < more:
            raw += await response.content.readany()
        # Nor is anything but a reply cancelled: a user message id is a 404.
        _, got = await call(session, "GET", messages.removesuffix("/messages"), headers=headers(server))
        status, _ = await call(session, "POST", cancel.replace(message_id, got["messages"][0]["id"]), headers=headers(server))
        assert status == 404

        status, saved = await call(session, "POST", cancel, headers=headers(server))
        assert status == 200 and saved["id"] == message_id and saved["status"] == "partial"
        assert 0 < saved["usage"]["completion_tokens"] < 400 and saved["finish_reason"] is None
        events = parse_events((raw + await response.read()).decode())
        assert json.loads(events[-1][1])["error"]["code"] == "reply_cancelled"
        assert text_of(events) == saved["content"]
        # Cancelling it again (a reply that has ended) leaves it as it is.
        assert await call(session, "POST", cancel, headers=headers(server)) == (200, saved)
        # The conversation is free for the next message.
        status, _ = await post(session, server, got["id"], "next", max_tokens=3)
        assert status == 200


async def test_a_retry_with_the_same_idempotency_key_gets_the_same_reply_billed_once(server):
    """The retry a client sends after losing the answer: no second turn, no second usage row; the
    same key with another body is refused, another tenant's same key is its own, and every reply
    names its conversation as the routing key a gateway hashes on."""
    async with aiohttp.ClientSession() as session:
        conversation = await new_conversation(session, server)
        url = f"{server['url']}/v1/conversations/{conversation['id']}/messages"
        body = {"content": "Tell me a story.", "max_tokens": 6}
        keyed = {**headers(server), "Idempotency-Key": "retry-1"}
        async with session.post(url, json=body, headers=keyed) as r:
            first = await r.json()
            assert r.status == 200 and r.headers["X-Chatd-Routing-Key"] == conversation["id"]
        async with session.post(url, json=body, headers=keyed) as r:
            again = await r.json()
            assert r.status == 200 and r.headers["Idempotent-Replayed"] == "true"
        assert again["id"] == first["id"] and again["choices"] == first["choices"] and again["usage"] == first["usage"]
        status, refused = await call(session, "POST", url, json={**body, "content": "Another story."}, headers=keyed)
        assert status == 422 and refused["error"]["param"] == "Idempotency-Key"
        status, refused = await call(session, "POST", url, json=body, headers={**keyed, "Idempotency-Key": "x" * 256})
        assert status == 400 and "255" in refused["error"]["message"]
        # A try refused before its turn starts (more tokens than the window) leaves its key free: the
        # same body is refused again, the corrected one served.
        keyed = {**headers(server), "Idempotency-Key": "refused-1"}
        for _ in range(2):
            status, refused = await call(session, "POST", url, json={**body, "max_tokens": 100_000}, headers=keyed)
            assert status == 400 and refused["error"]["param"] == "max_tokens", refused
        status, served = await call(session, "POST", url, json={**body, "content": "A short one."}, headers=keyed)
        assert status == 200 and served["choices"][0]["message"]["content"]
        bobs = await new_conversation(session, server, "bob")
        status, _ = await call(session, "POST", f"{server['url']}/v1/conversations/{bobs['id']}/messages", json=body,
                               headers={**headers(server, "bob"), "Idempotency-Key": "retry-1"})
        assert status == 200
        status, items = await call(session, "GET", f"{server['url']}/v1/conversations/{conversation['id']}/items",
                                   headers=headers(server))
        assert [item["role"] for item in items["data"]] == ["assistant", "user"] * 2
    events = sqlite3.connect(server["db"]).execute("SELECT COUNT(*) FROM usage_events WHERE message_id = ?",
                                                   (first["id"],)).fetchone()[0]
    assert events == 1

"""Replicas die; conversations do not. Three replicas on one PostgreSQL database behind HAProxy
(consistent hashing on X-Chatd-Routing-Key): a replica killed between turns loses nothing (the
next turn is served elsewhere from the stored history); one killed mid-reply is retried by the
client with the same Idempotency-Key, and the turn is stored once and billed once."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import httpx
import pytest

from tests.replicas import cluster

pytestmark = pytest.mark.slow

KILLS = 20
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def haproxy(replicas, tmp_path_factory):
    why = cluster.missing("haproxy")
    if why:
        pytest.skip(why)
    gateway = cluster.HAProxy(tmp_path_factory.mktemp("haproxy"), replicas)
    yield gateway
    gateway.stop()


def new_conversation(client: httpx.Client, url: str) -> str:
    r = client.post(f"{url}/v1/conversations", json={})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def turn(client: httpx.Client, url: str, conversation: str, content: str, key: str | None = None,
         max_tokens: int = 8) -> httpx.Response:
    headers = {"X-Chatd-Routing-Key": conversation, **({"Idempotency-Key": key} if key else {})}
    return client.post(f"{url}/v1/conversations/{conversation}/messages", headers=headers,
                       json={"content": content, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def keyed_turn_until_answered(client: httpx.Client, url: str, conversation: str, content: str, key: str) -> dict:
    """What a client does after losing a reply: the same request (whole, not streamed) with the same key, again after each
    409's Retry-After (the replica that had it may still be alive) or a dropped connection."""
    for _ in range(60):
        try:
            r = turn(client, url, conversation, content, key, MAX_TOKENS)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            return r.json()
        assert r.status_code in (409, 502, 503), r.text
        time.sleep(min(float(r.headers.get("Retry-After", "1")), 1.0))
    raise AssertionError(f"turn {key} was never answered")


def by_name(replicas, name: str):
    return next(r for r in replicas if r.name == name)


def test_a_replica_killed_between_turns_loses_nothing(replicas, haproxy):
    with httpx.Client(timeout=60) as client:
        conversation = new_conversation(client, haproxy.url)
        first = turn(client, haproxy.url, conversation, "The first question, about paged caches.")
        assert first.status_code == 200, first.text
        served = by_name(replicas, first.headers["X-Served-By"])
        served.kill()
        try:
            second = turn(client, haproxy.url, conversation, "And the second one?")
            assert second.status_code == 200, second.text
            assert second.headers["X-Served-By"] != served.name
            # The other replica read the whole history from the database: the first turn's prompt
            # and reply are in the second's prompt.
            before = first.json()["usage"]
            assert second.json()["usage"]["prompt_tokens"] > before["prompt_tokens"] + before["completion_tokens"]
            items = client.get(f"{haproxy.url}/v1/conversations/{conversation}/items?order=asc").json()["data"]
            assert [i["role"] for i in items] == ["user", "assistant", "user", "assistant"]
            assert items[1]["content"][0]["text"] == first.json()["choices"][0]["message"]["content"]
        finally:
            served.start()
            served.wait_ready()


def test_twenty_kills_mid_reply_lose_and_double_nothing(replicas, haproxy, postgres):
    """Each round streams a keyed turn, kills -9 the replica streaming it once the first tokens
    have come, and retries with the same key until answered; the killed replica restarts while
    the retry runs. Then every acknowledged turn is in the database once, whole, with one
    usage row, and nothing else is."""
    acknowledged: dict[str, list[tuple[str, str]]] = {}  # conversation -> [(user text, reply id)]
    with httpx.Client(timeout=60) as client:
        conversations = [new_conversation(client, haproxy.url) for _ in range(4)]
        for round_ in range(KILLS):
            conversation = conversations[round_ % len(conversations)]
            content, key = f"Round {round_}: tell me more.", uuid.uuid4().hex
            headers = {"X-Chatd-Routing-Key": conversation, "Idempotency-Key": key}
            body = {"content": content, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
            with client.stream("POST", f"{haproxy.url}/v1/conversations/{conversation}/messages", headers=headers,
                               json=body) as r:
                assert r.status_code == 200
                victim = by_name(replicas, r.headers["X-Served-By"])
                lines = r.iter_lines()
                while '"content"' not in next(lines):
                    pass
                victim.kill()
            victim.start()  # it boots while the retries run
            reply = keyed_turn_until_answered(client, haproxy.url, conversation, content, key)
            assert reply["choices"][0]["finish_reason"] == "length"
            acknowledged.setdefault(conversation, []).append((content, reply["id"]))
            victim.wait_ready()
    store_url = replicas[0].folder.joinpath("config.toml").read_text().split('url = "')[1].split('"')[0]
    rows = asyncio.run(_read(store_url, list(acknowledged)))
    lost = doubled = 0
    for conversation, turns in acknowledged.items():
        messages = rows["messages"][conversation]
        assert [m["role"] for m in messages] == ["user", "assistant"] * len(turns)
        assert [m["content"] for m in messages[::2]] == [content for content, _ in turns]
        assert all(m["status"] == "complete" for m in messages[1::2])
        for _, reply_id in turns:
            usage = rows["usage"].get(reply_id, 0)
            lost += usage == 0
            doubled += usage > 1
    assert (lost, doubled) == (0, 0)
    assert sum(rows["usage"].values()) == sum(len(t) for t in acknowledged.values()) == KILLS
    print(f"\n{KILLS} kills -9 mid-reply: {KILLS} turns acknowledged, 0 lost, 0 doubled, "
          f"{sum(rows['usage'].values())} usage rows for {KILLS} replies")


async def _read(url: str, conversations: list[str]) -> dict:
    conn = await asyncpg.connect(url)
    try:
        messages = {}
        for conversation in conversations:
            messages[conversation] = [dict(r) for r in await conn.fetch(
                "SELECT role, content, status FROM messages WHERE conversation_id = $1 ORDER BY position", conversation)]
        usage = {r["message_id"]: r["n"] for r in await conn.fetch(
            "SELECT message_id, COUNT(*) AS n FROM usage_events WHERE conversation_id = ANY($1::text[]) "
            "GROUP BY message_id", conversations)}
        return {"messages": messages, "usage": usage}
    finally:
        await conn.close()

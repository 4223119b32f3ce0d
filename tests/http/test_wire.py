"""The bytes of a request (http/server/wire.py), in-process: a large body's walk in Python (a schema of
thousands of nodes) runs off the event loop, so the server answers everyone else meanwhile."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from chatd.http.tools import structured
from chatd.http.app import create_app
from chatd.http.server.wire import INLINE_BODY_BYTES
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

# An object schema of 1,000 properties: ~25 KB as JSON, walked node by node when it is closed.
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4} for i in range(1000)}}
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def app(tmp_path):
    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path)
    async with TestClient(TestServer(create_app(state))) as client:
        yield client
    await close_server_state(state)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": WIDE_SCHEMA}}}),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "structured_outputs": {"json": WIDE_SCHEMA}}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_schema", "name": "w",
                                                                                  "schema": WIDE_SCHEMA}}}),
], ids=["response_format", "structured_outputs", "text.format"])
async def test_a_large_schema_is_walked_while_the_server_answers_others(app, monkeypatch, path, body):
    """The schema's walk is held until /live has answered: on the event loop it would hold the
    loop, and /live could not answer until the walk gave up waiting."""
    walking, health_answered, released = threading.Event(), threading.Event(), []

    def held_walk(schema):
        if not released:  # the walk's first step (closed() recurses)
            walking.set()
            released.append(health_answered.wait(5))
        return original(schema)

    original = structured.closed
    monkeypatch.setattr(structured, "closed", held_walk)
    request = asyncio.create_task(app.post(path, json=body))
    assert await asyncio.to_thread(walking.wait, 5)
    async with asyncio.timeout(5):
        health = await app.get("/live")
    assert health.status == 200
    health_answered.set()
    response = await request
    assert response.status == 200, await response.text()
    assert released == [True]  # the walk was still waiting when /live answered


async def test_a_small_body_is_checked_at_once_and_a_bad_large_one_is_named_as_a_small_one_would_be(app):
    small = await app.post("/v1/chat/completions", json={"messages": ASK, "colour": "blue"})
    large = await app.post("/v1/chat/completions", json={"messages": ASK, "colour": "x" * INLINE_BODY_BYTES})
    for response in (small, large):
        error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == "colour" and "unknown field" in error["message"]

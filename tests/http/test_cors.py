"""CORS ([server] allowed_origins): an allowed origin is named in every response, streams included,
and its preflight is answered; any other origin gets nothing; with none configured, nothing changes."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from chatd.config_loader import build_config
from chatd.http.app import create_app
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

APP = "https://app.example"
OTHER = "https://evil.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture
async def serve(tmp_path):
    """serve(allowed_origins, auth=False) -> a test client of a server configured so."""
    started = []

    async def serve(allowed_origins: list[str], auth: bool = False) -> TestClient:
        config = build_config({"server": {"allowed_origins": allowed_origins}, "auth": {"enabled": auth}})
        state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path / f"server{len(started)}", config)
        client = TestClient(TestServer(create_app(state)))
        await client.start_server()
        started.append((client, state))
        return client

    yield serve
    for client, state in started:
        await client.close()
        await close_server_state(state)


async def test_an_allowed_origin_is_named_in_responses_and_may_read_chatd_headers(serve):
    client = await serve([APP])
    response = await client.get("/v1/models", headers={"Origin": APP})
    assert response.status == 200
    assert response.headers["Access-Control-Allow-Origin"] == APP
    assert "Origin" in response.headers["Vary"]
    exposed = response.headers["Access-Control-Expose-Headers"]
    assert "X-Request-Id" in exposed and "X-Chatd-Messages-Omitted" in exposed
    assert "Access-Control-Allow-Credentials" not in response.headers  # keys travel in Authorization, never cookies
    # Errors too: a page must be able to read why it was refused.
    missing = await client.get("/v1/conversations/conv_nope", headers={"Origin": APP})
    assert missing.status == 404 and missing.headers["Access-Control-Allow-Origin"] == APP


async def test_a_preflight_from_an_allowed_origin_is_answered_without_a_key(serve):
    client = await serve([APP, "http://localhost:5173"], auth=True)
    response = await client.options("/v1/conversations", headers={"Origin": APP, **PREFLIGHT})
    assert response.status == 204
    assert response.headers["Access-Control-Allow-Origin"] == APP
    assert {"GET", "POST", "DELETE"} <= {m.strip() for m in response.headers["Access-Control-Allow-Methods"].split(",")}
    allowed_headers = {h.strip().lower() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "last-event-id", "x-request-id"} <= allowed_headers
    assert int(response.headers["Access-Control-Max-Age"]) > 0
    # The request itself still needs its key; the 401 is readable by the page.
    refused = await client.get("/v1/conversations", headers={"Origin": "http://localhost:5173"})
    assert refused.status == 401 and refused.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"


async def test_a_preflight_allows_the_headers_an_sdk_asks_for(serve):
    # The OpenAI SDK in a browser sends its own x-stainless-* headers; the preflight must allow them.
    client = await serve([APP])
    asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count, bad header, x-stainless-os"
    response = await client.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT,
                                                                     "Access-Control-Request-Headers": asked})
    assert response.status == 204
    allowed = [h.strip().lower() for h in response.headers["Access-Control-Allow-Headers"].split(",")]
    assert {"authorization", "content-type", "x-stainless-os", "x-stainless-retry-count"} <= set(allowed)
    assert "bad header" not in allowed and allowed.count("x-stainless-os") == 1


async def test_another_origin_gets_no_cors_headers_and_its_preflight_is_refused(serve):
    client = await serve([APP])
    response = await client.get("/v1/models", headers={"Origin": OTHER})
    assert response.status == 200 and "Access-Control-Allow-Origin" not in response.headers
    preflight = await client.options("/v1/conversations", headers={"Origin": OTHER, **PREFLIGHT})
    assert preflight.status == 403 and "Access-Control-Allow-Origin" not in preflight.headers
    error = (await preflight.json())["error"]
    assert error["code"] == "origin_not_allowed" and "allowed_origins" in error["message"]
    # An origin that differs only in scheme or port is another origin.
    for near in ("http://app.example", "https://app.example:8443", "https://app.example.evil.example"):
        response = await client.get("/v1/models", headers={"Origin": near})
        assert "Access-Control-Allow-Origin" not in response.headers, near


async def test_a_stream_carries_the_header_from_its_first_byte(serve):
    client = await serve([APP])
    conversation = await (await client.post("/v1/conversations", json={}, headers={"Origin": APP})).json()
    response = await client.post(f"/v1/conversations/{conversation['id']}/messages", json={"content": "hi", "stream": True},
                                 headers={"Origin": APP})
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Access-Control-Allow-Origin"] == APP
    assert response.headers["X-Chatd-Messages-Omitted"] == "0"
    assert (await response.read()).endswith(b"data: [DONE]\n\n")
    chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                             headers={"Origin": APP})
    assert chat.headers["Access-Control-Allow-Origin"] == APP
    await chat.read()


async def test_any_origin_with_a_star(serve):
    client = await serve(["*"])
    response = await client.get("/v1/models", headers={"Origin": "https://anywhere.example"})
    assert response.headers["Access-Control-Allow-Origin"] == "*"
    preflight = await client.options("/v1/models", headers={"Origin": "https://anywhere.example", **PREFLIGHT})
    assert preflight.status == 204 and preflight.headers["Access-Control-Allow-Origin"] == "*"


async def test_by_default_nothing_changes(serve):
    """No origins configured: no CORS headers for anyone, and OPTIONS is the 405 it always was
    (a browser's preflight fails, as it must: no page elsewhere may call this server)."""
    client = await serve([])
    response = await client.get("/v1/models", headers={"Origin": APP})
    assert response.status == 200
    assert not [name for name in response.headers if name.lower().startswith("access-control-")]
    preflight = await client.options("/v1/conversations", headers={"Origin": APP, **PREFLIGHT})
    assert preflight.status == 405 and "Access-Control-Allow-Origin" not in preflight.headers
    assert "method OPTIONS is not allowed" in (await preflight.json())["error"]["message"]

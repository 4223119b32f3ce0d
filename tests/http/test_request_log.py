"""Every request is visible: one `request finished` line each, refused or not, and every route that
generates (chat, completions, Responses, a conversation's messages) in the per-request metrics
under its own `route` label. Through the real app, its engine scripted and its store a real file."""

from __future__ import annotations

import json
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from chatd.http.app import create_app
from chatd.http.telemetry.metrics import ROUTES
from chatd.logs import Formatter
from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

SECRET = "the-prompt-nobody-may-read"
REPLY_WORDS = 5  # ScriptedChatEngine's default reply, one token a word


@pytest.fixture
async def serve(tmp_path):
    """serve(pause=0.0) -> (a test client of the app, its ServerState); the engine waits `pause` s a word."""
    started = []

    async def serve(pause: float = 0.0):
        state = await make_server_state(ScriptedChatEngine(pause=pause), tmp_path / f"server{len(started)}")
        app = create_app(state)
        client = TestClient(TestServer(app))
        await client.start_server()
        started.append((client, state))
        return client, state

    yield serve
    for client, state in started:
        await client.close()
        await close_server_state(state)


@pytest.fixture
def lines(caplog):
    """lines(request_id) -> the `request finished` records of that request."""
    caplog.set_level(logging.INFO, logger="chatd.http")
    return lambda request_id: [r for r in caplog.records
                               if r.getMessage() == "request finished" and r.request_id == request_id]


async def generate_on_every_route(client: TestClient) -> dict[str, str]:
    """One request of each generating route, each answered whole; route -> its request id."""
    user = [{"role": "user", "content": SECRET}]
    conversation = await (await client.post("/v1/conversations", json={})).json()
    requests = {
        "chat": ("/v1/chat/completions", {"messages": user}),
        "completions": ("/v1/completions", {"prompt": SECRET}),
        "responses": ("/v1/responses", {"input": SECRET}),
        "conversation": (f"/v1/conversations/{conversation['id']}/messages", {"content": SECRET}),
    }
    for route, (path, body) in requests.items():
        response = await client.post(path, json=body, headers={"X-Request-Id": f"req-{route}"})
        assert response.status == 200, await response.text()
        await response.read()
    return {route: f"req-{route}" for route in requests}


async def scrape(client: TestClient) -> dict[str, float]:
    """/metrics as `name{label=value,...}` -> value, labels sorted."""
    text = await (await client.get("/metrics")).text()
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_every_generating_route_is_counted_under_its_own_route(serve):
    client, state = await serve()
    await generate_on_every_route(client)
    await state.wait_background(5.0)  # a turn is observed as its task ends, just after its answer
    samples = await scrape(client)
    for route in ROUTES:
        labels = f"model_name=scripted,route={route}"
        assert samples[f"chatd:request_success_total{{finished_reason=stop,{labels}}}"] == 1, route
        assert samples[f"chatd:time_to_first_token_seconds_count{{{labels}}}"] == 1, route
        assert samples[f"chatd:e2e_request_latency_seconds_count{{{labels}}}"] == 1, route
        assert samples[f"chatd:inter_token_latency_seconds_count{{{labels}}}"] == REPLY_WORDS - 1, route
        assert samples[f"chatd:request_generation_tokens_sum{{{labels}}}"] == REPLY_WORDS, route
        assert samples[f"chatd:request_prompt_tokens_sum{{{labels}}}"] > 0, route


async def test_a_generating_request_is_logged_once_with_its_counts_and_never_its_text(serve, lines, caplog):
    client, state = await serve()
    request_ids = await generate_on_every_route(client)
    await state.wait_background(5.0)
    templates = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
                 "conversation": "/v1/conversations/{conversation_id}/messages"}
    for route, request_id in request_ids.items():
        (line,) = lines(request_id)
        assert (line.method, line.route, line.status, line.tenant) == ("POST", templates[route], 200, "local"), route
        assert (line.finish_reason, line.completion_tokens) == ("stop", REPLY_WORDS), route
        assert line.prompt_tokens > 0 and line.e2e_s >= line.ttft_s > 0 and line.duration_s > 0, route
    assert SECRET not in caplog.text
    entry = json.loads(Formatter(as_json=True).format(lines("req-conversation")[0]))  # as `log_json = true` writes it
    assert entry["message"] == "request finished" and entry["status"] == 200 and entry["request_id"] == "req-conversation"


async def test_refused_requests_are_logged_once_each_with_their_status(serve, lines):
    client, _ = await serve()
    refused = [
        ("POST", "/v1/responses", {"input": "hi", "bogus": 1}, 400, "/v1/responses"),  # a bad body
        ("GET", "/v1/nothing", None, 404, "/{path}"),  # no such route
        ("POST", "/v1/conversations/conv_nope/messages", {"content": "hi"}, 404,  # no such conversation
         "/v1/conversations/{conversation_id}/messages"),
        ("DELETE", "/v1/models", None, 405, "/{path}"),
    ]
    for i, (method, path, body, status, template) in enumerate(refused):
        response = await client.request(method, path, json=body, headers={"X-Request-Id": f"refused-{i}"})
        assert response.status == status
        (line,) = lines(f"refused-{i}")
        assert (line.method, line.path, line.route, line.status) == (method, path, template, status)
        assert line.duration_s >= 0 and not hasattr(line, "finish_reason")  # nothing was generated


async def test_what_a_client_names_is_logged_cut_short(serve, lines):
    client, _ = await serve()
    response = await client.get("/v1/conversations/" + "x" * 5000, headers={"X-Request-Id": "long-path"})
    assert response.status == 404
    (line,) = lines("long-path")
    assert line.path.startswith("'/v1/conversations/xxx") and len(line.path) < 100
    await client.get("/v1/conversations/conv%0Aforged", headers={"X-Request-Id": "newline"})
    (line,) = lines("newline")
    assert line.path == repr("/v1/conversations/conv\nforged")  # quoted: no line of its own is forged into the log


async def test_a_reply_that_outlives_its_client_is_logged_once_when_it_ends(serve, lines):
    client, state = await serve(pause=0.01)
    words = 100
    state.engine.replies.append(" ".join(f"w{i}" for i in range(words)))
    conversation = await (await client.post("/v1/conversations", json={})).json()
    response = await client.post(f"/v1/conversations/{conversation['id']}/messages", json={"content": "hi", "stream": True},
                                 headers={"X-Request-Id": "left-early"})
    await response.content.readline()  # the reply has begun; the client goes away
    response.close()
    await state.wait_background(10.0)  # the reply goes on and is saved
    (line,) = lines("left-early")
    assert (line.finish_reason, line.completion_tokens) == ("stop", words)  # the whole reply, not what was sent
    assert line.duration_s < line.e2e_s  # the answer ended long before the reply did


async def test_probes_answered_200_are_logged_at_debug_and_their_failures_at_info(serve, caplog):
    """A load balancer's probe every few seconds would be most of an INFO log: its 200s go to DEBUG."""
    client, state = await serve()
    state.ready = True
    caplog.set_level(logging.DEBUG, logger="chatd.http")
    for path in ("/health", "/ready", "/metrics"):
        await (await client.get(path, headers={"X-Request-Id": f"probe{path}"})).read()
    state.ready = False
    await (await client.get("/ready", headers={"X-Request-Id": "not-ready"})).read()
    levels = {r.request_id: r.levelname for r in caplog.records if r.getMessage() == "request finished"}
    assert levels == {"probe/health": "DEBUG", "probe/ready": "DEBUG", "probe/metrics": "DEBUG", "not-ready": "INFO"}

"""Traces on a real `chatd serve` with [tracing] on, received over OTLP/HTTP by a collector in the
test that decodes the protobuf as any collector does: the span tree of a chat request, of a
streamed conversation turn and of a refused request; a caller's trace continued; the tail
sampler keeping refusals when it keeps nothing else; a collector that fails costing dropped
spans, counted, and nothing else; no prompt or reply text in any span. Two tenants throughout."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

pytest.importorskip("opentelemetry.proto")

from tests.http.otlp_collector import FAST_EXPORT, Collector, children, no_text, one, trace_id_of  # noqa: E402
from tests.http.serving import tenants_server  # noqa: E402

SECRET = "zebra-lantern-4471"  # in every prompt here: it must be in no span
TRACING = """
[tracing]
otlp_endpoint = "{url}"
sample_ratio = {ratio}
[safety]
check_input = true
check_output = true
"""


def traced_server(root, ratio: float):
    """A server tracing to a collector of its own, keeping `ratio` of traces: (server, collector)."""
    collector = Collector()
    with tenants_server(root, TRACING.format(url=collector.url, ratio=ratio), environment=FAST_EXPORT) as server:
        yield server, collector
    collector.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    yield from traced_server(tmp_path_factory.mktemp("traced"), 1.0)


def client(server, who: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


async def test_a_chat_request_is_one_trace_with_a_span_per_stage_and_no_text(traced):
    server, collector = traced
    raw = await client(server, "alice").chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": f"Say {SECRET}"}], max_tokens=4)
    reply = raw.parse()
    spans = collector.trace(trace_id_of(raw.headers), "POST /v1/chat/completions")
    root = one(spans, "POST /v1/chat/completions")
    assert root["parent"] is None and root["kind"] == 2  # a new trace; SPAN_KIND_SERVER
    assert root["service"]["service.name"] == "chatd"
    assert children(spans, root) == ["chatd.pick", "chatd.check", "chatd.screen", "chatd.render", "chatd.admit",
                                     "chat demo", "chatd.output_check", "chatd.usage"]
    attributes = root["attributes"]
    assert (attributes["http.route"], attributes["http.response.status_code"], attributes["chatd.tier"]) == (
        "/v1/chat/completions", 200, "paid")
    assert attributes["chatd.request.id"] == raw.headers["x-request-id"]
    generation = one(spans, "chat demo")
    assert children(spans, generation) == ["chatd.queue", "chatd.prefill", "chatd.decode"]
    ai = generation["attributes"]
    assert (ai["gen_ai.operation.name"], ai["gen_ai.request.model"], ai["gen_ai.response.id"]) == ("chat", "demo", reply.id)
    assert (ai["gen_ai.usage.input_tokens"], ai["gen_ai.usage.output_tokens"]) == (
        reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert (ai["gen_ai.response.finish_reasons"], ai["gen_ai.request.max_tokens"]) == ([reply.choices[0].finish_reason], 4)
    queue, prefill, decode = (one(spans, n) for n in ("chatd.queue", "chatd.prefill", "chatd.decode"))
    assert generation["start"] <= queue["start"] <= queue["end"] <= prefill["start"] <= prefill["end"] <= decode["start"]
    assert root["start"] <= generation["start"] and decode["end"] <= root["end"]
    assert one(spans, "chatd.usage")["attributes"]["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    no_text(spans, SECRET, reply.choices[0].message.content)


async def test_a_streamed_turn_continues_the_callers_trace_under_its_turn_span(traced):
    server, collector = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    bob = client(server, "bob")
    conversation = await bob.post("/conversations", cast_to=dict, body={})
    headers = {"Authorization": f"Bearer {server['keys']['bob']}", "traceparent": f"00-{trace_id}-{parent}-01",
               "tracestate": "vendor=abc"}
    url = f"{server['url']}/v1/conversations/{conversation['id']}/messages"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"content": f"Tell me {SECRET}", "stream": True, "max_tokens": 5},
                                headers=headers) as response:
            assert response.status == 200 and trace_id_of(response.headers) == trace_id
            events = (await response.read()).decode()
    assert "[DONE]" in events
    spans = collector.trace(trace_id, "POST /v1/conversations/{conversation_id}/messages")
    root = one(spans, "POST /v1/conversations/{conversation_id}/messages")
    assert root["parent"] == parent  # the caller's span
    assert children(spans, root) == ["chatd.pick", "chatd.turn"]
    turn = one(spans, "chatd.turn")
    # The rows are written while the engine already has the request: its generation starts first.
    assert children(spans, turn) == ["chatd.check", "chatd.screen", "chatd.render", "chatd.admit", "chat demo",
                                     "chatd.store_write", "chatd.output_check", "chatd.usage"]
    assert children(spans, one(spans, "chat demo")) == ["chatd.queue", "chatd.prefill", "chatd.decode"]
    assert one(spans, "chat demo")["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert one(spans, "chatd.usage")["attributes"]["chatd.written"] is True
    tenants = {s["attributes"].get("chatd.tenant.id") for s in collector.spans if s["name"].startswith("POST")}
    assert len(tenants - {None}) == 2  # alice's and bob's requests name their own tenants
    no_text(spans, SECRET)


async def test_a_response_is_traced_as_a_turn(traced):
    server, collector = traced
    raw = await client(server, "bob").responses.with_raw_response.create(model="demo", input=f"Hey {SECRET}",
                                                                          max_output_tokens=3)
    response = raw.parse()
    spans = collector.trace(trace_id_of(raw.headers), "chatd.usage")
    assert children(spans, one(spans, "POST /v1/responses")) == ["chatd.pick", "chatd.turn"]
    assert "chat demo" in children(spans, one(spans, "chatd.turn"))
    assert one(spans, "chat demo")["attributes"]["gen_ai.usage.output_tokens"] == response.usage.output_tokens
    no_text(spans, SECRET)


async def test_a_refused_request_is_traced_with_its_refusal_and_never_its_text(traced):
    server, collector = traced
    with pytest.raises(openai.BadRequestError) as refused:
        await client(server, "alice").chat.completions.with_raw_response.create(
            model="demo", messages=[{"role": "user", "content": f"I will kill you, {SECRET}."}])
    spans = collector.trace(trace_id_of(refused.value.response.headers), "POST /v1/chat/completions")
    root = one(spans, "POST /v1/chat/completions")
    assert children(spans, root) == ["chatd.pick", "chatd.check", "chatd.screen"]  # nothing after the refusal
    screen = one(spans, "chatd.screen")["attributes"]
    assert (screen["chatd.refused"], screen["error.type"]) == (True, "content_policy_violation")
    assert (root["attributes"]["http.response.status_code"], root["attributes"]["error.type"]) == (400, "400")
    no_text(spans, SECRET, "kill")


def test_a_failing_collector_costs_dropped_spans_counted_and_nothing_else(traced):
    server, collector = traced
    alice = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"]["alice"], max_retries=0)

    def dropped() -> float:
        import urllib.request
        text = urllib.request.urlopen(f"{server['url']}/metrics").read().decode()
        line = next(l for l in text.splitlines() if l.startswith('chatd:trace_spans_total{outcome="dropped_export_failed"}'))
        return float(line.split()[-1])

    before = dropped()
    collector.failing = True
    try:
        started = time.monotonic()
        for _ in range(3):
            alice.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert time.monotonic() - started < 30  # (a busy machine's bound; they take well under a second)
        deadline = time.monotonic() + 30
        while dropped() < before + 3 * 8 and time.monotonic() < deadline:  # (spans go out in batches)
            time.sleep(0.1)
        assert dropped() >= before + 3 * 8  # each request's spans (at least 8 of them) were dropped, and counted
    finally:
        collector.failing = False


@pytest.fixture(scope="module")
def sampled_out(tmp_path_factory):
    yield from traced_server(tmp_path_factory.mktemp("sampled"), 0.0)


@pytest.mark.slow  # a second server; test_trace_export.py checks the sampler itself in the fast suite
async def test_with_a_ratio_of_0_only_errors_and_refusals_are_kept(sampled_out):
    server, collector = sampled_out
    alice = client(server, "alice")
    served = await alice.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        await alice.chat.completions.create(model="demo", messages=[{"role": "user", "content": "I will kill you."}])
    with pytest.raises(openai.NotFoundError) as unknown:
        await alice.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    for error in (refused.value, unknown.value):
        spans = collector.trace(trace_id_of(error.response.headers), "POST /v1/chat/completions")
        assert one(spans, "POST /v1/chat/completions")["attributes"]["chatd.refused"] is True
    assert one(spans, "chatd.pick")["attributes"]["error.type"] == "model_not_found"
    time.sleep(0.5)
    assert not [s for s in collector.spans if s["trace_id"] == trace_id_of(served.headers)]
    async with aiohttp.ClientSession() as session, session.get(f"{server['url']}/metrics") as r:
        metrics = await r.text()
    sampled = next(l for l in metrics.splitlines() if l.startswith('chatd:trace_spans_total{outcome="sampled_out"}'))
    assert float(sampled.split()[-1]) >= 8


async def test_an_embeddings_request_is_traced_with_its_stages(tmp_path, monkeypatch):
    from aiohttp.test_utils import TestClient, TestServer

    from chatd.config_loader import build_config
    from chatd.engine import Embedder
    from chatd.http.app import create_app
    from tests.engine.embedding_models import build_bert
    from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

    for name, value in FAST_EXPORT.items():
        monkeypatch.setenv(name, value)
    collector = Collector()
    embedder = Embedder.load(str(build_bert(tmp_path / "bert")), device="cpu", name="tiny-embed")
    config = build_config({"embeddings": {"model": "tiny-embed"}, "tracing": {"otlp_endpoint": collector.url}})
    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path, config, embedder=embedder)
    http = TestClient(TestServer(create_app(state)))
    await http.start_server()
    try:
        response = await http.post("/v1/embeddings", json={"model": "tiny-embed", "input": [SECRET, "two"]})
        assert response.status == 200
        tokens = (await response.json())["usage"]["prompt_tokens"]
        # Waited for off the loop: the usage span ends when the server's ledger, on this loop, writes it.
        spans = await asyncio.to_thread(collector.trace, trace_id_of(response.headers), "chatd.usage")
    finally:
        await http.close()
        await close_server_state(state)
        embedder.stop()
        collector.close()
    root = one(spans, "POST /v1/embeddings")
    assert children(spans, root) == ["chatd.check", "chatd.render", "chatd.admit", "embeddings tiny-embed", "chatd.usage"]
    assert one(spans, "embeddings tiny-embed")["attributes"]["gen_ai.usage.input_tokens"] == tokens
    no_text(spans, SECRET)

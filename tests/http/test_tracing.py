"""Traces on a real `chatd serve` with [tracing] on, received over OTLP/HTTP by a collector in the
test that decodes the protobuf as any collector does: the span tree of a chat request, of a
streamed conversation turn and of a refused request; a caller's trace continued; the tail
sampler keeping refusals when it keeps nothing else; a collector that fails costing dropped
spans, counted, and nothing else; no prompt or reply text in any span. Two tenants throughout."""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import time

import aiohttp
import openai
import pytest

pytest.importorskip("opentelemetry.proto")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

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
# Batches leave every 0.1 s; a collector that fails is given up on within a second.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}


class Collector:
    """An OTLP/HTTP trace receiver on a loopback port: every span it is sent, decoded; `failing`
    answers 400 (not retried), as a collector that rejects what it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.failing = False
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                if collector.failing:
                    self.send_response(400)
                    self.end_headers()
                    return
                collector.received(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self, request: ExportTraceServiceRequest) -> None:
        for resource in request.resource_spans:
            service = {a.key: _value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append({
                        "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent": span.parent_span_id.hex() or None, "kind": span.kind, "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano, "status": span.status.code, "service": service,
                        "attributes": {a.key: _value(a.value) for a in span.attributes}})

    def trace(self, trace_id: str, until: str, timeout: float = 15.0) -> list[dict]:
        """The spans of one trace, once one named `until` has arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if any(s["name"] == until for s in spans):
                time.sleep(0.3)  # the rest of its batch
                return [s for s in self.spans if s["trace_id"] == trace_id]
            time.sleep(0.05)
        raise AssertionError(f"no {until!r} span in trace {trace_id}: {[s['name'] for s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


def children(spans: list[dict], parent: dict) -> list[str]:
    """The names of a span's children, in the order they started."""
    return [s["name"] for s in sorted(spans, key=lambda s: s["start"]) if s["parent"] == parent["span_id"]]


def one(spans: list[dict], name: str) -> dict:
    [span] = [s for s in spans if s["name"] == name]
    return span


def no_text(spans: list[dict], *texts: str) -> None:
    dumped = json.dumps([s["attributes"] for s in spans])
    for text in texts:
        assert text not in dumped


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    collector = Collector()
    config = TRACING.format(url=collector.url, ratio=1.0)
    with tenants_server(tmp_path_factory.mktemp("traced"), config, environment=FAST_EXPORT) as server:
        yield server, collector
    collector.close()


def client(server, who: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


def trace_id_of(headers) -> str:
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, len(span_id), int(flags, 16) & 1) == ("00", 16, 1)  # sampled (and, level 2, a random id)
    return trace_id


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
        assert time.monotonic() - started < 10
        deadline = time.monotonic() + 10
        while dropped() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dropped() >= before + 3 * 8  # each request's spans (at least 8 of them) were dropped, and counted
    finally:
        collector.failing = False


@pytest.fixture(scope="module")
def sampled_out(tmp_path_factory):
    collector = Collector()
    config = TRACING.format(url=collector.url, ratio=0.0)
    with tenants_server(tmp_path_factory.mktemp("sampled"), config, environment=FAST_EXPORT) as server:
        yield server, collector
    collector.close()


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

"""An OTLP/HTTP trace collector for tests, on a loopback port: it decodes what it is sent with
OpenTelemetry's own protobuf classes (opentelemetry-proto, from the `tracing` extra), as a real
collector does; and helpers to read a trace's tree."""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import time

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
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
                collector.received(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self, request) -> None:
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


def trace_id_of(headers) -> str:
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, len(span_id), int(flags, 16) & 1) == ("00", 16, 1)  # sampled (and, level 2, a random id)
    return trace_id

"""The tail sampler and the export queue (trace_export.py) with OpenTelemetry's own SDK, and when
tracing turns on: a trace is decided whole once its last span ends here; a refusal or an error is
kept at any ratio; what the queue cannot hold or the collector does not take is dropped and
counted, never waited for."""

from __future__ import annotations

import collections
import sys
import time

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from chatd.config import TracingConfig  # noqa: E402
from chatd.http.telemetry.trace_export import SpanShipper, TailSampling  # noqa: E402
from chatd.http.telemetry.tracing import Tracing  # noqa: E402


def sampled(ratio: float, max_pending: int = 1000):
    shipped: list[list] = []
    counts: collections.Counter = collections.Counter()
    provider = TracerProvider()
    provider.add_span_processor(TailSampling(shipped.append, ratio, lambda outcome, n: counts.update({outcome: n}),
                                             max_pending))
    return provider.get_tracer("test"), shipped, counts


def test_a_trace_is_decided_whole_when_its_last_span_ends():
    tracer, shipped, counts = sampled(1.0)
    with tracer.start_as_current_span("root"):
        with tracer.start_as_current_span("child"):
            pass
        later = tracer.start_span("outlives its parent's context")
        assert shipped == []  # open spans: nothing decided yet
    assert shipped == []  # `later` is still open
    later.end()
    [trace] = shipped
    assert sorted(s.name for s in trace) == ["child", "outlives its parent's context", "root"]


def test_at_ratio_0_only_traces_with_an_error_or_a_refusal_are_kept():
    tracer, shipped, counts = sampled(0.0)
    with tracer.start_as_current_span("served"):
        with tracer.start_as_current_span("stage"):
            pass
    with tracer.start_as_current_span("refused"):
        with tracer.start_as_current_span("admit") as admit:
            admit.set_attributes({"chatd.refused": True, "error.type": "rate_limit_exceeded"})
    with tracer.start_as_current_span("failed") as failed:
        failed.set_attribute("error.type", "500")
    assert [[s.name for s in trace] for trace in shipped] == [["admit", "refused"], ["failed"]]
    assert counts["sampled_out"] == 2


def test_spans_past_the_pending_bound_are_dropped_and_counted():
    tracer, shipped, counts = sampled(1.0, max_pending=3)
    with tracer.start_as_current_span("root"):
        for i in range(5):
            with tracer.start_as_current_span(f"stage {i}"):
                pass
    assert [len(trace) for trace in shipped] == [3]
    assert counts["dropped_too_many_pending"] == 3  # two stages and the root found no room


def test_a_full_queue_drops_what_does_not_fit_and_a_failed_export_drops_its_batch(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # nothing leaves before close
    counts: collections.Counter = collections.Counter()
    tracer, shipped, _ = sampled(1.0)
    with tracer.start_as_current_span("root"):
        for i in range(5):
            with tracer.start_as_current_span(f"stage {i}"):
                pass
    [spans] = shipped
    memory = InMemorySpanExporter()
    shipper = SpanShipper(memory, lambda outcome, n: counts.update({outcome: n}))
    shipper.put(spans)
    assert counts["dropped_queue_full"] == 2
    shipper.close()
    assert len(memory.get_finished_spans()) == 4 and counts["exported"] == 4

    # A collector nobody answers on: the put returns at once; the spans are dropped on the thread.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    unreachable = SpanShipper(OTLPSpanExporter(endpoint="http://127.0.0.1:9/v1/traces", timeout=0.5),
                              lambda outcome, n: counts.update({outcome: n}))
    started = time.monotonic()
    unreachable.put(spans[:2])
    assert time.monotonic() - started < 0.05
    deadline = time.monotonic() + 10
    while counts["dropped_export_failed"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts["dropped_export_failed"] == 2
    unreachable.close()


def test_tracing_is_on_only_when_a_collector_is_named_and_says_what_it_needs(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    counted = lambda outcome, n: None  # noqa: E731
    off = Tracing.start(TracingConfig(), counted)
    assert not off.enabled and off.stage("chatd.check").__enter__() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not Tracing.start(TracingConfig(), counted).enabled
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    on = Tracing.start(TracingConfig(), counted)
    assert on.enabled
    on.close()
    monkeypatch.setitem(sys.modules, "chatd.http.telemetry.trace_export", None)  # as without the `tracing` extra
    with pytest.raises(ValueError, match=r"tracing.otlp_endpoint .*pip install 'chatd\[tracing\]'"):
        Tracing.start(TracingConfig(otlp_endpoint="http://127.0.0.1:4318"), counted)
    assert not Tracing.start(TracingConfig(), counted).enabled  # the variable alone: a warning, no traces
    with pytest.raises(ValueError, match="tracing.sample_ratio"):
        TracingConfig(sample_ratio=1.5)

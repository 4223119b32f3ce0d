"""OpenTelemetry's SDK set up for chatd's traces: a trace's spans are held until the last of them in
this process ends, then kept or dropped whole (TailSampling), and kept ones leave over OTLP/HTTP
from a thread of their own (SpanShipper).

Only tracing.py imports this module, and only while tracing is on: without the `tracing` extra
chatd never imports OpenTelemetry.

Tail, not head, sampling: whether a trace must be kept (an error, a refusal) is known at its end,
and a head sampler decides at its start. So every span is recorded, and a finished trace is kept
- always, when a span of it carries `error.type` or `chatd.refused` (tracing.py sets them);
- otherwise with probability `sample_ratio`.
A caller's traceparent is continued (its trace id, its span as the parent) but its sampled flag
does not decide: a client could set it on every request to have all of its traces kept and crowd
the export queue, dropping other tenants' spans.

Export: the SDK's BatchSpanProcessor counts the spans it drops only through OpenTelemetry's own
metrics; chatd counts them in /metrics, so the loop that exports is its own, and short: a bounded
queue and one thread that sends batches through the SDK's OTLPSpanExporter (which reads every
OTEL_EXPORTER_OTLP_* variable: endpoint, headers, timeout, compression, certificates). A full
queue or a failed export drops spans and counts them; only that thread ever waits on the collector.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import StatusCode, Tracer

log = logging.getLogger("chatd.http")

# Spans of traces still open, held for their decision; past this, a new span is dropped (and counted).
MAX_PENDING_SPANS = 16384


def _env_number(name: str, default: float) -> float:
    """One of the SDK's OTEL_BSP_* settings, read as its own BatchSpanProcessor reads them."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        log.warning("%s=%r is not a number; using %g", name, os.environ[name], default)
        return default


@dataclass
class _Trace:
    open: int = 0  # its spans started here and not yet ended
    keep: bool = False  # an error or a refusal: kept whatever the ratio
    spans: list[ReadableSpan] = field(default_factory=list)
    lost: int = 0  # spans not held: too many were pending


class TailSampling(SpanProcessor):
    """Holds each trace's ended spans until none of its spans here is open, then keeps the trace
    (to the shipper) or drops it whole. Safe from any thread; chatd starts and ends spans on the loop."""

    def __init__(self, ship: Callable[[list[ReadableSpan]], None], ratio: float,
                 counted: Callable[[str, int], None], max_pending: int = MAX_PENDING_SPANS,
                 chance: Callable[[], float] = random.random) -> None:
        self.ship, self.ratio, self.counted, self.max_pending, self.chance = ship, ratio, counted, max_pending, chance
        self._traces: dict[int, _Trace] = {}
        self._pending = 0
        self._lock = threading.Lock()

    def on_start(self, span: Span, parent_context=None) -> None:
        with self._lock:
            trace = self._traces.setdefault(span.context.trace_id, _Trace())
            trace.open += 1

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        keep = span.status.status_code is StatusCode.ERROR or "error.type" in attributes or "chatd.refused" in attributes
        with self._lock:
            trace = self._traces.get(span.context.trace_id)
            if trace is None:
                return
            trace.open -= 1
            trace.keep = trace.keep or keep
            if self._pending < self.max_pending:
                trace.spans.append(span)
                self._pending += 1
            else:
                trace.lost += 1
            if trace.open > 0:
                return
            del self._traces[span.context.trace_id]
            self._pending -= len(trace.spans)
        if trace.lost:
            self.counted("dropped_too_many_pending", trace.lost)
        if trace.keep or self.chance() < self.ratio:
            self.ship(trace.spans)
        else:
            self.counted("sampled_out", len(trace.spans))

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SpanShipper:
    """Kept spans, sent in batches by one thread: every `delay` seconds, or at once when a batch is
    full. A full queue drops what does not fit; a failed export drops its batch; both are counted."""

    def __init__(self, exporter: SpanExporter, counted: Callable[[str, int], None]) -> None:
        self.exporter, self.counted = exporter, counted
        self.max_queue = int(_env_number("OTEL_BSP_MAX_QUEUE_SIZE", 2048))
        self.batch = max(1, int(_env_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)))
        self.delay = _env_number("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="chatd-trace-export", daemon=True)
        self._thread.start()

    def put(self, spans: Sequence[ReadableSpan]) -> None:
        with self._lock:
            room = max(0, self.max_queue - len(self._queue))
            self._queue.extend(spans[:room])
            full = len(self._queue) >= self.batch
        if len(spans) > room:
            self.counted("dropped_queue_full", len(spans) - room)
        if full:
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most `timeout` seconds), then stop."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        self.exporter.shutdown()

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self.delay)
            self._wake.clear()
            self._send_queued()
        self._send_queued()

    def _send_queued(self) -> None:
        while True:
            with self._lock:
                batch = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
            if not batch:
                return
            try:
                sent = self.exporter.export(batch) is SpanExportResult.SUCCESS
            except Exception:  # the exporter's own bug: the spans are lost, the thread goes on
                log.exception("exporting %d spans failed", len(batch))
                sent = False
            self.counted("exported" if sent else "dropped_export_failed", len(batch))


def start(endpoint: str | None, ratio: float, service_name: str, version: str, instance: str,
          counted: Callable[[str, int], None]) -> tuple[Tracer, SpanShipper]:
    """A tracer whose spans reach `endpoint` (the collector's /v1/traces URL; None: as the
    OTEL_EXPORTER_OTLP_* variables say), and the shipper to close at shutdown. `instance`: this
    process among the replicas (service.instance.id)."""
    attributes = {"service.version": version, "service.instance.id": instance}
    if service_name:
        attributes["service.name"] = service_name
    elif not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "chatd"
    shipper = SpanShipper(OTLPSpanExporter(endpoint=endpoint), counted)
    # Not the global provider: two servers in one process (tests) keep their own.
    provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.create(attributes))
    provider.add_span_processor(TailSampling(shipper.put, ratio, counted))
    return provider.get_tracer("chatd", version), shipper

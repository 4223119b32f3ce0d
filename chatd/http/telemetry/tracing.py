"""Traces of requests, in OpenTelemetry's terms, exported over OTLP/HTTP ([tracing], trace_export.py).

Each request but the probes (request_log.PROBES) is one server span, named by its method and
route template, under the caller's `traceparent` when it sends one (W3C trace context; a new
trace otherwise); its reply carries a `traceparent` header naming that span. Under it, one span
per stage the request really runs:

  chatd.pick, chatd.check, chatd.screen, chatd.render, chatd.grammar, chatd.admit   (generation/pipeline.py)
  chat MODEL | text_completion MODEL | embeddings MODEL    the generation, with OpenTelemetry's
      chatd.queue, chatd.prefill, chatd.decode             GenAI attributes (model, token counts,
                                                           finish reasons) and its three phases
  chatd.output_check                                       each choice's last output check
  chatd.store_write, chatd.usage                           rows, and the usage billed

A conversation turn's stages sit under `chatd.turn`, the background task that outlives its
request when the client leaves. The generation and its phases are drawn when it ends, from the
times GenerationRecord keeps anyway: nothing is traced per token or per engine step.

Spans carry ids, counts, names of models, tiers and categories, never a prompt's or a reply's
text. A stage that refuses (a 4xx) gets `chatd.refused` and `error.type` (its error code); one
that fails, `error.type` and an error status: those traces are always kept (trace_export.py).

Off (the default), `Tracing` does nothing: each stage is a shared null context, and OpenTelemetry
is never imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web

import chatd
from chatd.config import TracingConfig
from chatd.engine import ParamError
from chatd.http.errors import REQUEST_ID, APIError, loggable

log = logging.getLogger("chatd.http")

# Routes a load balancer or Prometheus calls every few seconds: never traced (as request_log's PROBES).
NOT_TRACED = frozenset(("/live", "/health", "/ready", "/metrics"))
TRACEPARENT = web.RequestKey("traceparent", str) if hasattr(web, "RequestKey") else "traceparent"
# GenerationRecord's routes as the GenAI conventions name their operations.
OPERATIONS = {"completions": "text_completion"}

_OFF = contextlib.nullcontext()


class Tracing:
    """The server's tracer, or nothing (`Tracing()`): what every route calls to trace a stage."""

    def __init__(self, tracer=None, shipper=None) -> None:
        self.tracer, self.shipper = tracer, shipper
        self.enabled = tracer is not None
        if self.enabled:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
            self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, config: TracingConfig, counted, instance: str = "") -> Tracing:
        """Tracing as configured: on when [tracing] otlp_endpoint or OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT
        names a collector (and neither OTEL_SDK_DISABLED nor OTEL_TRACES_EXPORTER=none says no).
        `counted(outcome, spans)`: told of spans exported, sampled out and dropped (from any thread);
        `instance`: this replica's id, on every span it exports."""
        endpoint = config.otlp_endpoint.rstrip("/")
        from_env = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        disabled = (os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
                    or os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none")
        if not endpoint and (not from_env or disabled):
            return cls()
        try:
            trace_export = importlib.import_module("chatd.http.telemetry.trace_export")
        except ImportError as exc:
            if endpoint:  # asked for in config.toml: a start that silently traced nothing would mislead
                raise ValueError("setting tracing.otlp_endpoint needs OpenTelemetry's SDK: pip install "
                                 f"'chatd[tracing]' ({exc})") from None
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry's SDK is not installed "
                        "(pip install 'chatd[tracing]'): no traces")
            return cls()
        tracer, shipper = trace_export.start(endpoint + "/v1/traces" if endpoint else None, config.sample_ratio,
                                             config.service_name, chatd.__version__, instance, counted)
        log.info("tracing: spans to %s, %g of traces kept beside errors and refusals",
                 endpoint or from_env, config.sample_ratio)
        return cls(tracer, shipper)

    def close(self) -> None:
        """Send the spans still queued (a few seconds at most); blocking: run it off the loop."""
        if self.shipper is not None:
            self.shipper.close()

    # -- spans ------------------------------------------------------------------------------------

    def stage(self, name: str, attributes: Mapping[str, Any] | None = None):
        """A span for one stage, current while it runs (its spans nest under it); marks a refusal or
        a failure that leaves it. Off: a null context."""
        if self.tracer is None:
            return _OFF
        return self._stage(name, attributes)

    @contextlib.contextmanager
    def _stage(self, name: str, attributes: Mapping[str, Any] | None) -> Iterator:
        with self.tracer.start_as_current_span(name, attributes=attributes, record_exception=False,
                                               set_status_on_exception=False) as span:
            try:
                yield span
            except BaseException as exc:
                failed(span, exc)
                raise

    def started(self, name: str, attributes: Mapping[str, Any] | None = None):
        """A span begun now and ended by its caller (`span.end()`), not made current; None while off."""
        return None if self.tracer is None else self.tracer.start_span(name, attributes=attributes)

    def until_done(self, name: str, future: asyncio.Future, attributes: Mapping[str, Any] | None = None) -> None:
        """A span from now until `future`, a write the store's ledger queued, is done: `chatd.written`
        says whether it was written then (false: the store could not write, and it stays queued)."""
        if self.tracer is None:
            return
        span = self.tracer.start_span(name, attributes=attributes)

        def done(future: asyncio.Future) -> None:
            if future.cancelled() or future.exception() is not None:
                failed(span, future.exception() or asyncio.CancelledError())
            else:
                span.set_attribute("chatd.written", bool(future.result()))
            span.end()

        future.add_done_callback(done)

    def generation(self, record, outputs: list, reason: str, usage: dict, fields: Mapping[str, Any]) -> None:
        """The generation GenerationRecord `record` accounts for, as a span with its queue wait,
        prefill and decode under it, drawn now from the times it kept."""
        if self.tracer is None:
            return
        from opentelemetry.trace import StatusCode, set_span_in_context
        offset = time.time_ns() - int(record.clock() * 1e9)  # the record's clock, as epoch nanoseconds
        ns = lambda at: offset + int(at * 1e9)  # noqa: E731
        launched = record.launched_at if record.launched_at is not None else record.start
        model = record.model_name or ""
        attributes = {
            "gen_ai.operation.name": OPERATIONS.get(record.route, "chat"), "gen_ai.provider.name": "chatd",
            "gen_ai.request.model": model, "gen_ai.response.model": model,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "chatd.usage.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "gen_ai.response.finish_reasons": sorted({c.finish_reason.value for out in outputs for c in out.outputs
                                                      if c.finish_reason is not None}) or [reason],
            **_request_attributes(record.params),
        }
        for name, attribute in (("response_id", "gen_ai.response.id"), ("message_id", "chatd.message.id")):
            if fields.get(name) is not None:  # ids only: the log line's other fields may quote the client
                attributes[attribute] = fields[name]
        span = self.tracer.start_span(f"{attributes['gen_ai.operation.name']} {model}".rstrip(),
                                      start_time=ns(launched), attributes=attributes)
        if reason == "error":
            span.set_attribute("error.type", "generation_failed")
            span.set_status(StatusCode.ERROR)
        elif reason == "content_filter":
            span.set_attribute("chatd.refused", True)
        inside = set_span_in_context(span)
        queue_times = [out.queue_time for out in outputs if out.queue_time is not None]
        scheduled = launched + min(queue_times) if queue_times else None
        if scheduled is not None:
            self.tracer.start_span("chatd.queue", inside, start_time=ns(launched)).end(ns(scheduled))
            if record.first_token is not None:
                prefill = self.tracer.start_span("chatd.prefill", inside, start_time=ns(scheduled), attributes={
                    "gen_ai.usage.input_tokens": attributes["gen_ai.usage.input_tokens"],
                    "chatd.usage.cached_tokens": attributes["chatd.usage.cached_tokens"]})
                prefill.end(ns(max(scheduled, record.first_token)))
        if record.first_token is not None:
            decode = self.tracer.start_span("chatd.decode", inside, start_time=ns(record.first_token), attributes={
                "gen_ai.usage.output_tokens": attributes["gen_ai.usage.output_tokens"]})
            decode.end(ns(record.last_token or record.first_token))
        span.end()

    # -- the request's own span -------------------------------------------------------------------

    def middleware(self, tenant_of: Callable[[web.Request], Any]):
        """The aiohttp middleware that gives each request its span (listed right after the one
        that names the request's id); `tenant_of`: who a request was, once it has been answered."""
        from opentelemetry.trace import SpanKind

        @web.middleware
        async def tracing_middleware(request: web.Request, handler) -> web.StreamResponse:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else None
            if route in NOT_TRACED:
                return await handler(request)
            parent = self._propagator.extract(request.headers)  # a malformed traceparent is ignored: a new trace
            method = request.method if request.method in KNOWN_METHODS else "_OTHER"
            attributes = {"http.request.method": method, "url.path": loggable(request.path)}
            if route is not None:
                attributes["http.route"] = route
            if REQUEST_ID in request:
                attributes["chatd.request.id"] = request[REQUEST_ID]
            with self.tracer.start_as_current_span(f"{method} {route or ''}".rstrip(), parent, SpanKind.SERVER,
                                                   attributes, record_exception=False,
                                                   set_status_on_exception=False) as span:
                context = span.get_span_context()
                request[TRACEPARENT] = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
                status = 500
                try:
                    response = await handler(request)
                    status = response.status
                    return response
                except asyncio.CancelledError:
                    status = 499  # the client left (request_log.CLIENT_CLOSED)
                    raise
                finally:
                    _answered(span, tenant_of(request), status)

        return tracing_middleware


# The methods HTTP's semantic conventions name as they are; any other is "_OTHER" (bounded).
KNOWN_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"))


async def add_traceparent(request: web.Request, response: web.StreamResponse) -> None:
    """The reply names the request's span (on_response_prepare: streams send headers early)."""
    if TRACEPARENT in request:
        response.headers["traceparent"] = request[TRACEPARENT]


def failed(span, exc: BaseException) -> None:
    """What an exception leaving a span says of it: a refusal, a failure, or a client that left."""
    from opentelemetry.trace import StatusCode
    if isinstance(exc, asyncio.CancelledError):
        span.set_attribute("chatd.cancelled", True)
    elif isinstance(exc, APIError) and exc.status < 500:
        span.set_attributes({"chatd.refused": True, "error.type": exc.code or str(exc.status)})
    elif isinstance(exc, ParamError):
        span.set_attributes({"chatd.refused": True, "error.type": "invalid_request"})
    else:  # the class, not the message: a message may quote what the client sent
        span.set_attribute("error.type", exc.code if isinstance(exc, APIError) and exc.code else type(exc).__qualname__)
        span.set_status(StatusCode.ERROR)


def _answered(span, tenant, status: int) -> None:
    from opentelemetry.trace import StatusCode
    span.set_attribute("http.response.status_code", status)
    if tenant is not None:
        span.set_attributes({"chatd.tenant.id": tenant.id, "chatd.tier": tenant.tier})
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(StatusCode.ERROR)
    elif 400 <= status < 499:
        span.set_attributes({"error.type": str(status), "chatd.refused": True})


def usage_attributes(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A usage record's span attributes: what it bills."""
    return {"gen_ai.usage.input_tokens": prompt_tokens, "chatd.usage.cached_tokens": cached_tokens,
            "gen_ai.usage.output_tokens": completion_tokens}


def _request_attributes(params) -> dict[str, Any]:
    """The GenAI request attributes of SamplingParams (none when unknown)."""
    if params is None:
        return {}
    attributes = {"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                  "gen_ai.request.choice.count": params.n}
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return attributes

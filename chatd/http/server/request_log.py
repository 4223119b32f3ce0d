"""What each request leaves for the operator: one log line when it ends, and, for a request that
generates, its observation in the metrics (ServerMetrics, under its route).

Every request, on every route, refused or not, gets one `request finished` line: method, path,
route, status, duration, request id and tenant. A generating request's line also carries what
the "request finished" line of the completions routes always did (token counts, finish reason,
TTFT, e2e): one line per request, not an access line beside a generation line, because an
operator looking for a request should find everything about it in one place, and a log that
counts lines counts requests. So the line is written when the last of two things ends:

- the answer (`request_log_middleware`, around every route), and
- the generation, when it outlives the answer: a conversation turn or a response goes on, and
  is saved, after its client leaves (generation/turns.py holds the line open until it ends).

The client's own text never reaches the line: no prompt, no body; what it names (path, method,
prompt_cache_key) is cut to a bounded length (`loggable`), and its X-Request-Id is short already.

Two answers never pass a middleware, so they have no line: the 417 for an Expect header other
than 100-continue (aiohttp runs a route's Expect handler first) and a request aiohttp cannot parse.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from chatd.engine import RequestOutput, SamplingParams
from chatd.http.server.auth import TENANT
from chatd.http.errors import REQUEST_ID, loggable
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.openai.openai_format import output_usage
from chatd.http.telemetry.tracing import Tracing

log = logging.getLogger("chatd.http")

# Routes a load balancer or Prometheus calls every few seconds: their 200s are logged at DEBUG (a
# probe every 5 s would otherwise be most of the log); any other answer of theirs at INFO.
PROBES = ("/live", "/health", "/ready", "/metrics")

# The status logged for a request whose client left before it was answered (nginx's "client closed request").
CLIENT_CLOSED = 499


class RequestLog:
    """One request's line: written once, when its answer and every generation it holds open have ended."""

    def __init__(self, request_id: str | None, method: str, path: str, route: str | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start = clock()
        self.fields: dict = {"method": loggable(method), "path": loggable(path), "route": route, "status": None,
                             "duration_s": None, "request_id": request_id, "tenant": None, "tier": None}
        self._open = 1  # the answer; each generation that may outlive it holds one more
        self._written = False

    def hold(self) -> None:
        """Keep the line open for a generation that may outlive the answer; `release` when it ends."""
        self._open += 1

    def release(self) -> None:
        self._open -= 1
        if self._open == 0 and not self._written:
            self._written = True
            quiet = self.fields["route"] in PROBES and self.fields["status"] == 200
            log.log(logging.DEBUG if quiet else logging.INFO, "request finished", extra=self.fields)

    def answered(self, status: int, tenant) -> None:
        """The answer has ended (CLIENT_CLOSED: its client left first)."""
        self.fields.update(status=status, duration_s=round(self.clock() - self.start, 4))
        if tenant is not None:
            self.fields.update(tenant=tenant.name, tier=tenant.tier)
        self.release()


REQUEST_LOG = web.RequestKey("request_log", RequestLog) if hasattr(web, "RequestKey") else "request_log"


@web.middleware
async def request_log_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Log every request once when it ends. Listed right after request_id_middleware (so it has the
    request's id), outside every other: it sees the status each refusal and failure was answered with."""
    resource = request.match_info.route.resource  # the route's template: bounded, and the same for every id
    entry = RequestLog(request.get(REQUEST_ID), request.method, request.path,
                       resource.canonical if resource is not None else None)
    request[REQUEST_LOG] = entry
    try:
        response = await handler(request)
    except BaseException as exc:  # cancelled: the client left (handler_cancellation); else a bug aiohttp answers 500
        entry.answered(CLIENT_CLOSED if isinstance(exc, asyncio.CancelledError) else 500, request.get(TENANT))
        raise
    entry.answered(response.status, request.get(TENANT))
    return response


@dataclass
class GenerationRecord:
    """One generating request's account: its route (metrics.ROUTES), when it arrived and when its
    tokens did (TTFT, inter-token and e2e latencies), and the log line its counts go on."""

    route: str
    request_log: RequestLog | None = None  # None: a request nobody logs (an app without the middleware)
    model_name: str | None = None  # the model that served it (None: the server's first)
    tracing: Tracing | None = None  # draws its span when it ends (None or off: none)
    clock: Callable[[], float] = time.perf_counter
    start: float = field(init=False)
    launched_at: float | None = None  # when its engine requests were queued (`launched`)
    params: SamplingParams | None = None  # what they were queued with
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def launched(self, params: SamplingParams) -> None:
        """Its engine requests are queued now, with `params`."""
        self.launched_at, self.params = self.clock(), params

    def tokens_arrived(self) -> None:
        now = self.clock()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.inter_token.append(now - self.last_token)
        self.last_token = now

    def hold_log(self) -> None:
        """The generation may outlive the answer: its line waits for `release_log`."""
        if self.request_log is not None:
            self.request_log.hold()

    def release_log(self) -> None:
        if self.request_log is not None:
            self.request_log.release()

    def finished(self, metrics: ServerMetrics, merged: list[RequestOutput | None], error: str | None = None,
                 **fields) -> None:
        """Observe the generation in the metrics, and put its counts (and `fields`) on the log line.
        `merged`: each of its engine requests' output (None: none arrived); `error`: why it failed,
        where its outputs do not say."""
        e2e = self.clock() - self.start
        outputs = [out for out in merged if out is not None]
        reason = _finish_reason(merged, error)
        usage = output_usage(*outputs)
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        queue_times = [out.queue_time for out in outputs if out.queue_time is not None]
        ttft = None if self.first_token is None else self.first_token - self.start
        metrics.observe_request(
            route=self.route, finish_reason=reason, prompt_tokens=prompt, generation_tokens=completion,
            cached_tokens=cached, ttft=ttft, e2e=e2e,
            queue_time=min(queue_times, default=None),  # when the first of its requests started, as ttft
            inter_token_latencies=self.inter_token, model_name=self.model_name,
        )
        if self.tracing is not None:
            self.tracing.generation(self, outputs, reason, usage, fields)
        if self.request_log is not None:
            if self.model_name is not None:
                self.request_log.fields["model"] = self.model_name
            # Speculative decoding's guesses for it, verified and accepted (0 while it is off, as
            # cached_tokens is 0 without a prefix hit): the reply's own acceptance rate.
            self.request_log.fields.update(
                finish_reason=reason, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                draft_tokens=sum(out.num_draft_tokens for out in outputs),
                accepted_tokens=sum(out.num_accepted_tokens for out in outputs),
                ttft_s=None if ttft is None else round(ttft, 4), e2e_s=round(e2e, 4), **fields)


def _finish_reason(merged: list[RequestOutput | None], error: str | None) -> str:
    """Why an API request's generation ended, as one FinishReason value for all its choices."""
    outputs = [out for out in merged if out is not None]
    if error is not None or any(out.error for out in outputs):
        return "error"
    if len(outputs) < len(merged) or not all(out.finished for out in outputs):
        return "abort"  # the client left, or the server stopped it, before it finished
    reasons = {c.finish_reason.value for out in outputs for c in out.outputs if c.finish_reason}
    for reason in ("abort", "content_filter"):  # a choice cut short is what the request's count should say
        if reason in reasons:
            return reason
    return "length" if reasons == {"length"} else "stop"

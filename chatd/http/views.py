"""Route handlers: chat and text completions (whole or streamed), models, health, readiness, metrics.

A handler parses the body (protocol.py), hands the request to the AsyncEngine, and turns its
merged deltas into OpenAI's response or chunk shapes. A stream writes one SSE event per
delta it receives; a slow reader gets bigger merged deltas and never holds the engine back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import orjson
from aiohttp import web

from chatd.engine import FinishReason, ParamError, RequestOutput
from chatd.http.auth import TENANT
from chatd.http.errors import REQUEST_ID, APIError, error_body
from chatd.http.protocol import GenerationRequest, parse_chat, parse_completion
from chatd.http.state import STATE, ServerState
from chatd.http.wire import DONE, SlowClient, drop_slow_client, read_json, send, sse_event

log = logging.getLogger("chatd.http")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    gen = parse_chat(await read_json(request), state.config.server.max_messages)
    return await _generate(request, state, gen, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    gen = parse_completion(await read_json(request), state.max_model_len)
    return await _generate(request, state, gen, chat=False)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [state.model_card()]}, dumps=_dumps)


async def usage(request: web.Request) -> web.Response:
    """The caller's token and cost totals over `?start=&end=` (unix seconds or ISO 8601, UTC) or `?period=day|month`."""
    state, tenant = request.app[STATE], request[TENANT]
    start, end = _usage_window(request.query)
    totals = await state.store.usage(tenant.id, start, end)
    return web.json_response({
        "object": "usage",
        "tenant": tenant.name,
        "tier": tenant.tier,
        "start": start,
        "end": end,
        "requests": totals.requests,
        "input_tokens": totals.input_tokens,
        "cached_tokens": totals.cached_tokens,
        "output_tokens": totals.output_tokens,
        "cost": round(totals.cost, 10),
        "currency": "USD",
    }, dumps=_dumps)


def _usage_window(query) -> tuple[float, float]:
    period = query.get("period")
    if period is not None and ("start" in query or "end" in query):
        raise APIError(400, "give either period or start/end, not both", "period")
    if "start" in query or "end" in query:
        start = _timestamp(query.get("start"), "start", 0.0)
        end = _timestamp(query.get("end"), "end", time.time() + 1)
        if end <= start:
            raise APIError(400, f"end ({end}) must be after start ({start})", "end")
        return start, end
    now = datetime.now(timezone.utc)
    if period in (None, "month"):
        first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        following = first.replace(year=first.year + 1, month=1) if first.month == 12 else first.replace(month=first.month + 1)
    elif period == "day":
        first = now.replace(hour=0, minute=0, second=0, microsecond=0)
        following = first + timedelta(days=1)
    else:
        raise APIError(400, f"period must be 'day' or 'month', got {period!r}", "period")
    return first.timestamp(), following.timestamp()


def _timestamp(value: str | None, name: str, default: float) -> float:
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise APIError(400, f"{name} must be a finite number of unix seconds or an ISO 8601 date, got {value!r}", name)
        return seconds
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise APIError(400, f"{name} must be unix seconds or an ISO 8601 date, got {value!r}", name) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


async def health(request: web.Request) -> web.Response:
    """Whether the process can serve: 503 once the engine died. A store that cannot write is reported, not fatal."""
    state = request.app[STATE]
    problem = state.engine.health()
    if problem is not None:
        return web.json_response({"status": "engine stopped", "error": problem}, status=503)
    return web.json_response({"status": "ok", "store": _store_status(state)})


async def ready(request: web.Request) -> web.Response:
    """Whether to send it traffic: not while warming up, nor while its store cannot record usage."""
    state = request.app[STATE]
    if not state.ready:
        return web.json_response({"status": "warming up"}, status=503)
    if not state.ledger.healthy:
        return web.json_response({"status": "store cannot write", "store": _store_status(state)}, status=503,
                                 headers={"Retry-After": str(state.ledger.retry_after)})
    return web.json_response({"status": "ready"})


def _store_status(state: ServerState) -> dict:
    ledger = state.ledger
    return {"writable": ledger.healthy, "pending_writes": ledger.num_pending,
            "error": None if ledger.healthy else ledger.last_error}


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.update_engine(state.engine.stats())
    body, content_type = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


@dataclass
class _Timing:
    """Per-request latencies for metrics and the request log."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.inter_token.append(now - self.last_token)
        self.last_token = now


async def _generate(request: web.Request, state: ServerState, gen: GenerationRequest, chat: bool) -> web.StreamResponse:
    state.check_model(gen.model)
    state.check_store_writable()
    tenant = request[TENANT]
    timing = _Timing()
    prompt = await state.encode_chat(gen.messages) if chat else await state.encode_prompt(gen.prompt)
    kind = "chatcmpl" if chat else "cmpl"
    response_id = f"{kind}-{uuid.uuid4().hex}"
    created = int(time.time())
    # The engine names the request itself; the client's X-Request-Id is only logged and echoed.
    try:
        results = state.engine.generate(prompt, gen.params, priority=gen.priority, **state.cache_scope(tenant, prompt))
    except ParamError as exc:  # named as the client named it: chat sends messages, not a prompt
        if chat and exc.param == "prompt":
            raise APIError(400, str(exc), "messages", "context_length_exceeded") from None
        if exc.param == "max_tokens" and gen.max_tokens_field != "max_tokens":
            raise APIError(400, str(exc).replace("max_tokens", gen.max_tokens_field), gen.max_tokens_field) from None
        raise
    merged: RequestOutput | None = None
    writer: _ChunkWriter | None = None
    try:
        if gen.stream:
            writer = _ChunkWriter(state, response_id, created, chat, gen)
            await writer.stream(request, results, timing)
            return writer.response
        async for out in results:
            timing.tokens_arrived()
            merged = out if merged is None else _merge(merged, out)
        if merged.error:
            raise APIError(500, f"generation failed: {merged.error}")
        return web.json_response(_whole_response(state, merged, response_id, created, chat), dumps=_dumps)
    finally:
        if writer is not None:
            merged = writer.merged  # what was generated, even if the client left before it was sent
        results.abort()  # a no-op when it finished; otherwise (disconnect, error, timeout) frees it now
        _log_and_observe(state, request[REQUEST_ID], response_id, merged, timing)
        if merged is not None:
            _record_usage(state, tenant, "chat.completions" if chat else "completions", merged)


def _merge(merged: RequestOutput, out: RequestOutput) -> RequestOutput:
    merged.merge(out)
    return merged


class ChunkFormat:
    """Builds one response's OpenAI chunks (`chat.completion.chunk` or `text_completion`) from deltas."""

    def __init__(self, state: ServerState, response_id: str, created: int, chat: bool, include_usage: bool,
                 extra: dict | None = None) -> None:
        self.state, self.response_id, self.created, self.chat = state, response_id, created, chat
        self.include_usage, self.extra = include_usage, extra or {}

    def role_chunks(self, n: int) -> list[dict]:
        """Chat streams open each choice with a chunk that carries the role."""
        if not self.chat:
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                for i in range(n)]

    def delta_chunk(self, out: RequestOutput) -> dict | None:
        """The chunk for one (merged) delta; None when it carries nothing to send."""
        # A token with no text yet (half a UTF-8 character) still sends its logprobs.
        choices = [self._choice(c) for c in out.outputs if c.text or c.finish_reason or c.logprobs]
        return self.chunk(choices) if choices else None

    def usage_chunk(self, merged: RequestOutput) -> dict:
        return {**self._envelope([]), "usage": _usage(merged)}

    def chunk(self, choices: list[dict]) -> dict:
        return {**self._envelope(choices), "usage": None} if self.include_usage else self._envelope(choices)

    def _choice(self, c) -> dict:
        finish = _finish_reason(c.finish_reason)
        logprobs = _logprobs(self.state, c.logprobs, self.chat) if c.logprobs else None
        if self.chat:
            delta = {"content": c.text} if c.text else {}
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": finish}

    def _envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            **self.extra,
            "choices": choices,
        }


class _ChunkWriter:
    """Writes one request's deltas as OpenAI chunks over SSE."""

    def __init__(self, state: ServerState, response_id: str, created: int, chat: bool, gen: GenerationRequest) -> None:
        self.state, self.gen = state, gen
        self.format = ChunkFormat(state, response_id, created, chat, gen.include_usage)
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.merged: RequestOutput | None = None  # every delta that arrived, sent or not: what is billed

    async def stream(self, request: web.Request, results, timing: _Timing) -> None:
        """Write every delta; a client that leaves or stops reading ends it early (unfinished)."""
        try:
            await self.response.prepare(request)
            await self._write_all(request, results, timing)
        except SlowClient as exc:
            drop_slow_client(request, exc)
        except ConnectionError:
            pass  # the client went away; the caller aborts what is left of its request

    async def _write_all(self, request: web.Request, results, timing: _Timing) -> None:
        for chunk in self.format.role_chunks(self.gen.params.n):
            await send(request, self.response, sse_event(chunk))
        iterator = results.__aiter__()
        while True:
            try:
                out = await _next_with_heartbeats(iterator, request, self.response, self.state.heartbeat_seconds)
            except StopAsyncIteration:
                break
            self.merged = out if self.merged is None else _merge(self.merged, out)
            if out.error:
                await send(request, self.response, sse_event(error_body(500, f"generation failed: {out.error}")))
                return
            timing.tokens_arrived()
            chunk = self.format.delta_chunk(out)
            if chunk is not None:
                await send(request, self.response, sse_event(chunk))
        if self.merged is not None and self.gen.include_usage:
            await send(request, self.response, sse_event(self.format.usage_chunk(self.merged)))
        await send(request, self.response, sse_event(DONE))
        await self.response.write_eof()


async def _next_with_heartbeats(iterator, request: web.Request, response: web.StreamResponse, heartbeat: float) -> RequestOutput:
    """The next delta; while none comes, an SSE comment every `heartbeat` seconds keeps the connection alive."""
    task = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=heartbeat)
            if done:
                return task.result()
            await send(request, response, b": keep-alive\n\n")
    finally:
        if not task.done():
            task.cancel()


def _whole_response(state: ServerState, out: RequestOutput, response_id: str, created: int, chat: bool) -> dict:
    choices = []
    for c in out.outputs:
        logprobs = _logprobs(state, c.logprobs, chat) if c.logprobs else None
        finish = _finish_reason(c.finish_reason)
        if chat:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": finish})
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(out),
    }


def _finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def _usage(out: RequestOutput) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _logprobs(state: ServerState, logprobs, chat: bool) -> dict:
    token = state.token_text
    if chat:
        return {"content": [
            {
                "token": token(lp.token_id),
                "logprob": lp.logprob,
                "bytes": list(token(lp.token_id).encode()),
                "top_logprobs": [{"token": token(t), "logprob": v, "bytes": list(token(t).encode())} for t, v in lp.top.items()],
            }
            for lp in logprobs
        ]}
    return {
        "tokens": [token(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token(t): v for t, v in lp.top.items()} for lp in logprobs],
    }


def _log_and_observe(state: ServerState, request_id: str, response_id: str, out: RequestOutput | None, timing: _Timing) -> None:
    end = time.perf_counter()
    if out is None:
        reason = "abort"
    elif out.error:
        reason = "error"
    elif not out.finished:
        reason = "abort"
    else:
        reasons = {c.finish_reason.value for c in out.outputs if c.finish_reason}
        reason = "length" if reasons == {"length"} else "stop"
    usage = _usage(out) if out is not None else {"prompt_tokens": 0, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
    ttft = None if timing.first_token is None else timing.first_token - timing.start
    state.metrics.observe_request(
        finish_reason=reason,
        prompt_tokens=usage["prompt_tokens"],
        generation_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        ttft=ttft,
        e2e=end - timing.start,
        queue_time=None if out is None else out.queue_time,
        inter_token_latencies=timing.inter_token,
    )
    log.info(
        "request finished",
        extra={"request_id": request_id, "response_id": response_id, "finish_reason": reason, "prompt_tokens": usage["prompt_tokens"],
               "completion_tokens": usage["completion_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
               "ttft_s": None if ttft is None else round(ttft, 4), "e2e_s": round(end - timing.start, 4)},
    )


def _record_usage(state: ServerState, tenant, endpoint: str, out: RequestOutput) -> None:
    """Hand a usage event to the ledger, which writes it even if the client went away or the store must wait."""
    usage = _usage(out)
    prompt, cached, completion = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]
    state.ledger.record_usage(tenant.id, endpoint=endpoint, model=state.model_name, prompt_tokens=prompt,
                              cached_tokens=cached, completion_tokens=completion,
                              cost=state.cost(prompt, cached, completion))


def _dumps(value) -> str:
    return orjson.dumps(value).decode()

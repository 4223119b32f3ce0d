"""The OpenAI routes `/v1/chat/completions` and `/v1/completions`, whole or streamed.

A handler parses the body (protocol.py), hands the request to the engine, and answers with its
merged deltas in OpenAI's shapes (openai_format.py). A stream writes one SSE event per delta it
receives; a slow reader gets bigger merged deltas and never holds the engine back. When the
request ends, however it ends, it is logged, observed in the metrics and its usage billed.

It keeps no history: server-side conversations are conversations.py and turns.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from chatd.engine import ParamError, RequestOutput
from chatd.http.auth import TENANT
from chatd.http.errors import REQUEST_ID, APIError, error_body
from chatd.http.openai_format import ChunkFormat, merged_with, output_usage, token_usage, whole_response
from chatd.http.protocol import GenerationRequest, parse_chat, parse_completion
from chatd.http.state import STATE, ServerState
from chatd.http.wire import DONE, SlowClient, drop_slow_client, json_response, read_json, send, sse_event

log = logging.getLogger("chatd.http")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's chat completions: the messages rendered with the chat template."""
    state = request.app[STATE]
    gen = parse_chat(await read_json(request), state.config.server.max_messages, state.model.sampling_defaults)
    return await _complete(request, state, gen, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's (legacy) text completions: a prompt of text or token ids, continued as is."""
    state = request.app[STATE]
    gen = parse_completion(await read_json(request), state.max_model_len, state.model.sampling_defaults)
    return await _complete(request, state, gen, chat=False)


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


async def _complete(request: web.Request, state: ServerState, gen: GenerationRequest, chat: bool) -> web.StreamResponse:
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
            merged = merged_with(merged, out)
        if merged.error:
            raise APIError(500, f"generation failed: {merged.error}")
        return json_response(whole_response(state, merged, response_id, created, chat))
    finally:
        if writer is not None:
            merged = writer.merged  # what was generated, even if the client left before it was sent
        results.abort()  # a no-op when it finished; otherwise (disconnect, error, timeout) frees it now
        _log_and_observe(state, request[REQUEST_ID], response_id, merged, timing)
        if merged is not None:
            _record_usage(state, tenant, "chat.completions" if chat else "completions", merged)


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
            self.merged = merged_with(self.merged, out)
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
    usage = output_usage(out) if out is not None else token_usage(0, 0, 0)
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
    usage = output_usage(out)
    prompt, cached, completion = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]
    state.ledger.record_usage(tenant.id, endpoint=endpoint, model=state.model_name, prompt_tokens=prompt,
                              cached_tokens=cached, completion_tokens=completion,
                              cost=state.cost(prompt, cached, completion))

"""The OpenAI routes `/v1/chat/completions` and `/v1/completions`, whole or streamed.

A handler parses the body (openai/protocol.py), runs the stages every generating route runs
(generation/pipeline.py: a chat's texts and template, or a completion's prompts, one engine request each),
and answers with its merged deltas in OpenAI's shapes
(openai/openai_format.py), with what they show of their prompts (a completion's `echo`, vLLM's
`prompt_logprobs`). A stream writes one SSE event per delta it receives, from whichever prompt's
request sent it; a slow reader gets bigger merged deltas and never holds the engine back. When
the request ends, however it ends, it is observed in the metrics, its counts put on its log line
(server/request_log.py) and its usage billed, once.

It keeps no history: server-side conversations are conversations.py and generation/turns.py.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from aiohttp import web

from chatd.engine import CompletionOutput, FinishReason, RequestHandle, RequestOutput
from chatd.http.generation import pipeline
from chatd.http.server.auth import TENANT
from chatd.http.errors import REQUEST_ID, APIError, loggable
from chatd.http.server.heartbeats import Heartbeat
from chatd.http.admission.limits import Lease
from chatd.http.openai.openai_format import ChunkFormat, PromptShown, merged_with, output_usage, whole_response
from chatd.http.models.escalation import request_traits
from chatd.http.models.served_model import ServedModel
from chatd.http.openai.protocol import GenerationRequest, parse_chat, parse_completion, requested_model
from chatd.http.server.request_log import REQUEST_LOG, GenerationRecord
from chatd.http.telemetry.tracing import usage_attributes
from chatd.http.server.safety import input_strings
from chatd.http.server.state import STATE, ServerState
from chatd.http.tools.tools import ToolUse
from chatd.http.server.wire import (DONE, SlowClient, checked, drop_slow_client, json_response, read_json, send, sse_event,
                             writable_now, write_now)
from chatd.store.db import Tenant


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's chat completions: the messages rendered with the chat template."""
    state = request.app[STATE]
    body = await read_json(request)
    served = await pipeline.pick(state, requested_model(body), request[TENANT], traits=request_traits(body))
    state.take_keep_alive(served, body)
    async with served.in_use():
        gen = await checked(request, parse_chat, body, state.config.server.max_messages, served.info.sampling_defaults)
        return await _complete(request, state, served, gen, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's (legacy) text completions: a prompt of text or token ids, continued as is."""
    state = request.app[STATE]
    body = await read_json(request)
    served = await pipeline.pick(state, requested_model(body), request[TENANT], traits=request_traits(body))
    state.take_keep_alive(served, body)
    async with served.in_use():
        gen = await checked(request, parse_completion, body, served.max_model_len, served.info.sampling_defaults)
        return await _complete(request, state, served, gen, chat=False)


async def _complete(request: web.Request, state: ServerState, served: ServedModel, gen: GenerationRequest,
                    chat: bool) -> web.StreamResponse:
    tenant = request[TENANT]
    state.safety.check_prompt_shown(gen.prompt_logprobs, gen.params.logprobs if gen.echo else None)
    record = GenerationRecord("chat" if chat else "completions", request.get(REQUEST_LOG), served.name, state.tracing)
    route = _Chat(served, gen, tenant) if chat else _TextCompletion(served, gen)
    started = await pipeline.start(state, served, tenant, route, request[REQUEST_ID], record.start)
    admitted, prompts = started.admitted, started.prompts
    record.launched(admitted.params)
    parser = route.tools.parser if chat else None
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
        # The engine names each request itself; the client's X-Request-Id is only logged and echoed.
        handles = [state.safety.watch(handle, tenant, route.endpoint, admitted.params.n, request[REQUEST_ID],
                                      token_text=served.token_text, model_name=served.name)
                   for handle in started.handles]
        replies = _Replies(handles, admitted.params.n, admitted.lease, gen.prompt_only)
        shown = await route.shown(admitted.params.n)
    except BaseException:
        for handle in started.handles:
            handle.abort()
        admitted.lease.release(0)
        raise
    # OpenAI's chat replies say which service tier served them when the request named one; chatd has one.
    echoed = {"service_tier": "default"} if chat and gen.service_tier is not None else None
    try:
        if gen.stream:
            chunks = ChunkFormat(served.name, served.token_text, response_id, created, chat, gen.include_usage, echoed,
                                 parser, shown)
            writer = _ChunkWriter(state, chunks, admitted.params.n, gen.include_usage)
            await writer.stream(request, replies, record)
            return writer.response
        async for _ in replies:
            record.tokens_arrived()
        failed = next((out for out in replies.outputs if out.error), None)
        if failed is not None:
            raise _failure(failed)
        return json_response(whole_response(served.name, served.token_text, replies.outputs, response_id, created, chat,
                                            echoed, parser, shown))
    finally:
        replies.abort()  # a no-op for those finished; otherwise (disconnect, error, timeout) frees them now
        record.finished(state.metrics, replies.merged, response_id=response_id, **_logged_fields(gen, len(prompts)))
        used = output_usage(*replies.outputs) if replies.outputs else None
        admitted.lease.release(used["total_tokens"] if used else sum(map(len, prompts.values())))
        if replies.outputs:  # what was generated, even if the client left before it was sent
            _record_usage(state, served, tenant, route.endpoint, replies.outputs, response_id)


class _Chat:
    """A chat request for the pipeline: every string the model reads, and its messages (with its
    tools) rendered by the chat template."""

    endpoint = "chat.completions"

    def __init__(self, served: ServedModel, gen: GenerationRequest, tenant: Tenant) -> None:
        self.served, self.gen, self.tenant = served, gen, tenant
        self.tools: ToolUse | None = None
        self._write_back: Callable[[list[str]], None] | None = None

    async def input_texts(self) -> list[str]:
        """Contents, names, tool calls and the tools themselves; what cannot fit the context window
        is refused before it is read (the rules cost ~4 ms a kB)."""
        gen, served = self.gen, self.served
        served.check_text_size(sum(len(m["content"]) for m in gen.messages), "messages")
        if gen.tools is not None:
            served.check_text_size(gen.tools.offered_chars, "tools")
        texts, self._write_back = await served.off_loop(input_strings, gen.messages,
                                                        gen.tools.offered if gen.tools else None)
        return texts

    def use_input_texts(self, texts: list[str]) -> None:
        self._write_back(texts)

    async def prompts(self) -> dict[str, list[int]]:
        gen, served = self.gen, self.served
        # Tools are walked in Python (schemas checked and closed, the grammar written): off the event loop.
        self.tools = tools = (await served.off_loop(served.tool_use, gen.tools, gen.messages, gen.params.structured)
                              if gen.tools is not None else served.tool_use(None, gen.messages))
        prompt = await served.encode_chat(tools.messages, tools=tools.shown)
        if tools.grammar is not None:  # every reply that may call follows it, auto too
            if gen.params.structured is not None:  # the request's own format, checked alone: its errors name its field
                await pipeline.check_structured(served, gen.params.structured, self.tenant)
            gen.params = replace(gen.params, structured=tools.grammar)
        if tools.parser is not None and tools.parser.needs_special_tokens:  # its markers must reach the parser
            gen.params = replace(gen.params, skip_special_tokens=False)
        return {"messages": prompt}

    async def shown(self, n: int) -> PromptShown | None:
        """vLLM's prompt_logprobs, over the rendered messages, when asked."""
        return PromptShown(n, prompt_logprobs=self.gen.prompt_logprobs) if self.gen.prompt_logprobs is not None else None


class _TextCompletion:
    """A text completion for the pipeline: its prompts (a batch's, named `prompt[i]`), each judged
    as the text it spells, token ids included (else they would pass unread)."""

    endpoint = "completions"

    def __init__(self, served: ServedModel, gen: GenerationRequest) -> None:
        self.served, self.gen = served, gen
        self._given: list[str] = []

    async def input_texts(self) -> list[str]:
        served = self.served
        for name, prompt in self.gen.prompts.items():
            if isinstance(prompt, str):
                served.check_text_size(len(prompt), name)
        self._given = [prompt if isinstance(prompt, str) else await served.off_loop(served.tokenizer.decode, prompt)
                       for prompt in self.gen.prompts.values()]
        return self._given

    def use_input_texts(self, texts: list[str]) -> None:
        """A prompt that must be masked becomes its masked text."""
        for name, before, after in zip(list(self.gen.prompts), self._given, texts):
            if after != before:
                self.gen.prompts[name] = after

    async def prompts(self) -> dict[str, list[int]]:
        return {name: await self.served.encode_prompt(prompt, name) for name, prompt in self.gen.prompts.items()}

    async def shown(self, n: int) -> PromptShown | None:
        """What the choices show of their prompts: with echo, each prompt's text as the model read it
        (masked where the input check masks; token ids as the text they spell, special tokens too)."""
        gen, served = self.gen, self.served
        if not gen.echo and gen.prompt_logprobs is None:
            return None
        texts = None
        if gen.echo:
            texts = tuple([prompt if isinstance(prompt, str) else await served.off_loop(served.tokenizer.decode, prompt, False)
                           for prompt in gen.prompts.values()])
        return PromptShown(n, texts, gen.params.logprobs if gen.echo else None, gen.prompt_logprobs)


def _failure(out: RequestOutput) -> APIError:
    """A request that failed: its own fault (400, naming the field: a grammar that could not be
    followed within the server's limits) or the server's (500)."""
    if out.error_param is not None:
        return APIError(400, out.error, out.error_param)
    return APIError(500, f"generation failed: {out.error}")


class _Replies:
    """The engine requests of one API request (a completion has one per prompt), read as one.

    Deltas come as they arrive from any of them, each choice numbered as OpenAI numbers a batch's:
    prompt k's choice i is k * n + i. Each request has at most one read waiting, so a slow client
    still gets merged deltas. Every delta read is kept, merged per prompt: what was generated,
    sent or not, is what is billed.
    """

    def __init__(self, streams: list[RequestHandle], n: int, lease: Lease, prompt_only: bool = False) -> None:
        self.streams, self.n, self.lease, self.prompt_only = streams, n, lease, prompt_only
        self.merged: list[RequestOutput | None] = [None] * len(streams)
        self._iterators = [stream.__aiter__() for stream in streams]
        self._reads: dict[int, asyncio.Future] = {}  # prompt index -> the read of its next delta
        self._arrived: collections.deque[int] = collections.deque()  # prompts whose read is done, in order
        self._wakeup = asyncio.Event()
        if len(streams) > 1:
            for k in range(len(streams)):
                self._read(k)

    @property
    def outputs(self) -> list[RequestOutput]:
        """Each prompt's output so far, merged; prompts with none yet are left out."""
        return [out for out in self.merged if out is not None]

    def __aiter__(self) -> _Replies:
        return self

    async def __anext__(self) -> RequestOutput:
        if len(self._iterators) == 1:  # nobody to wait beside: read the one request directly
            return self.took(0, await self._iterators[0].__anext__())
        while True:
            while not self._arrived:
                if not self._reads:
                    raise StopAsyncIteration
                self._wakeup.clear()
                await self._wakeup.wait()
            k = self._arrived.popleft()
            try:
                out = self._reads.pop(k).result()
            except StopAsyncIteration:
                continue  # that prompt's request has ended
            if not out.finished:
                self._read(k)
            return self.took(k, out)

    def abort(self) -> None:
        """End every request that has not finished (a no-op for those that have), and the reads waiting on them."""
        for read in self._reads.values():
            read.cancel()
        for stream in self.streams:
            stream.abort()

    def _read(self, k: int) -> None:
        read = asyncio.ensure_future(self._iterators[k].__anext__())
        read.add_done_callback(lambda _: self._read_done(k))
        self._reads[k] = read

    def _read_done(self, k: int) -> None:
        self._arrived.append(k)
        self._wakeup.set()

    def deliver_to(self, sink: Callable[[RequestOutput], RequestOutput | None] | None) -> None:
        """Offer each delta to `sink` as the engine hands it out (see RequestStream.deliver_to): for
        one engine request that can take one (AsyncEngine's); otherwise every delta is read."""
        if len(self.streams) == 1 and hasattr(self.streams[0], "deliver_to"):
            self.streams[0].deliver_to(sink)

    def took(self, k: int, out: RequestOutput) -> RequestOutput:
        """Prompt k's delta, read or delivered: numbered as OpenAI numbers a batch's choices, and kept."""
        if any(c.token_ids for c in out.outputs):
            self.lease.first_token(out.queue_time)
        if self.prompt_only:
            out = replace(out, outputs=[_without_reply(c) for c in out.outputs])
        if k:  # prompt 0's choices keep the engine's numbers
            offset = k * self.n
            out = replace(out, outputs=[replace(c, index=offset + c.index) for c in out.outputs])
        self.merged[k] = merged_with(self.merged[k], out)
        return out


def _without_reply(c: CompletionOutput) -> CompletionOutput:
    """A choice of a `max_tokens: 0` request: the one token generated is neither shown nor billed, and
    the choice ends as "length" (its budget of 0), unless it was aborted or failed."""
    finish = c.finish_reason if c.finish_reason in (None, FinishReason.ABORT, FinishReason.ERROR) else FinishReason.LENGTH
    return replace(c, text="", token_ids=[], logprobs=None, finish_reason=finish, stop_reason=None)


class _ChunkWriter:
    """Writes one request's deltas as OpenAI chunks over SSE.

    While the client keeps up, each delta is written as the engine's step hands it out (`_deliver`,
    the stream's sink): no task wakes for it. A delta the sink leaves (the client fell behind, an
    error) is read by this writer's task, which waits for a slow client and drops one that stopped
    reading; once the client has caught up, the sink takes over again. With [server]
    stream_interval N, the sink holds deltas until N tokens have come (or the reply ends).
    """

    def __init__(self, state: ServerState, chunk_format: ChunkFormat, n: int, include_usage: bool) -> None:
        self.state, self.format, self.n, self.include_usage = state, chunk_format, n, include_usage
        # A chat stream's role chunk follows its headers at once: they go out together. A text
        # completion's first event waits for its first token: its headers go out alone, at once.
        response_class = _EventStream if chunk_format.chat else web.StreamResponse
        self.response = response_class(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.interval = state.config.server.stream_interval
        self._request: web.Request | None = None
        self._replies: _Replies | None = None
        self._record: GenerationRecord | None = None
        self._heartbeat: Heartbeat | None = None
        self._held: RequestOutput | None = None  # deltas the sink holds for the stream interval

    async def stream(self, request: web.Request, replies: _Replies, record: GenerationRecord) -> None:
        """Write every delta; a client that leaves or stops reading ends it early (unfinished)."""
        try:
            await self.response.prepare(request)
            await self._write_all(request, replies, record)
        except SlowClient as exc:
            drop_slow_client(request, exc)
        except ConnectionError:
            pass  # the client went away; the caller aborts what is left of its requests

    async def _write_all(self, request: web.Request, replies: _Replies, record: GenerationRecord) -> None:
        sent = False  # the headers go out with the first event; the sink writes only after them
        opening = self.format.opens_after_prefill  # the role chunks then wait for the prompt's logprobs
        if not opening:
            for chunk in self.format.role_chunks(self.n):
                await send(request, self.response, sse_event(chunk))
                sent = True
        iterator = replies.__aiter__()
        heartbeat = Heartbeat(self.state, request, self.response)
        self._request, self._replies, self._record, self._heartbeat = request, replies, record, heartbeat
        chunked = self.response.headers.get("Transfer-Encoding") == "chunked"  # HTTP/1.1 (not 1.0)
        try:
            while True:
                if sent and chunked:
                    replies.deliver_to(self._deliver)  # the client keeps up: the next deltas go straight out
                heartbeat.waiting(True)
                try:
                    out = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    heartbeat.waiting(False)
                    replies.deliver_to(None)  # until what this task holds is written
                if out.error:
                    await send(request, self.response, sse_event(_failure(out).body()))
                    return
                record.tokens_arrived()
                if opening:  # the first delta has the prompt's logprobs: the first role chunk carries them
                    for chunk in self.format.role_chunks(self.n, out):
                        await send(request, self.response, sse_event(chunk))
                    opening, sent = False, True
                event = self.format.delta_json(out)
                if event is not None:
                    await send(request, self.response, sse_event(event))
                    sent = True
        finally:
            replies.deliver_to(None)
            heartbeat.stop()
            if self._held is not None:  # the client left while tokens were held: they were generated, and are billed
                replies.took(0, self._held)
        # The usage (when asked for), [DONE] and the body's end in one write: a client that stops
        # reading at [DONE] (most do) then finds its connection at the end of the body, to use again
        # (one that found the end still to come would close it, and open another for its next request).
        usage = sse_event(self.format.usage_chunk(*replies.outputs)) if replies.outputs and self.include_usage else b""
        ending = usage + sse_event(DONE)
        if writable_now(request):
            await self.response.write_eof(ending)
        else:  # the client is behind: wait for it (or drop it) as for any event
            await send(request, self.response, ending)
            await self.response.write_eof()


    def _deliver(self, out: RequestOutput) -> RequestOutput | None:
        """The stream's sink: write a delta now if the client has taken everything before it (None);
        otherwise the delta, with any it held, is the task's to write."""
        if self._held is not None:
            self._held.merge(out)
            out, self._held = self._held, None
        if self.interval > 1 and not (out.finished or out.error) and _num_tokens(out) < self.interval:
            self._held = out
            return None
        if out.error or not writable_now(self._request):
            return out  # the task answers an error; it waits for a client that is behind, merging meanwhile
        out = self._replies.took(0, out)
        self._record.tokens_arrived()
        event = self.format.delta_json(out)
        if event is not None:
            write_now(self._request, self.response, sse_event(event))
            self._heartbeat.sent()
        return None


class _EventStream(web.StreamResponse):
    """A Server-Sent Events response whose headers go out with its first event, in one write
    (aiohttp's StreamResponse sends them alone when prepared; its Response waits, as here)."""

    _send_headers_immediately = False


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


def _logged_fields(gen: GenerationRequest, num_prompts: int) -> dict:
    """What the request's log line says of it beyond its counts: a batch's size, the client's cache key (cut short)."""
    fields = {"prompts": num_prompts} if num_prompts > 1 else {}
    if gen.prompt_cache_key is not None:
        fields["prompt_cache_key"] = loggable(gen.prompt_cache_key)
    return fields


def _record_usage(state: ServerState, served: ServedModel, tenant, endpoint: str, outputs: list[RequestOutput],
                  response_id: str) -> None:
    """Hand one usage event for the whole API request (every prompt's) to the ledger, billed to the
    model that served it, which writes it even if the client went away or the store must wait; it
    keeps the reply's id, which a rating of it names (POST /v1/feedback)."""
    usage = output_usage(*outputs)
    prompt, cached, completion = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]
    written = state.ledger.record_usage(tenant.id, endpoint=endpoint, model=served.name, prompt_tokens=prompt,
                                        cached_tokens=cached, completion_tokens=completion,
                                        cost=served.cost(prompt, cached, completion), message_id=response_id)
    state.tracing.until_done("chatd.usage", written, usage_attributes(prompt, cached, completion))
    state.metrics.usage(tenant.tier, served.name, prompt, cached, completion, served.cost(prompt, cached, completion))

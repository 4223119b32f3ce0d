"""The load generator of `chatd bench`: plans sessions, streams their requests, times every chunk.

Multi-turn sessions either resend their growing history to /chat/completions (stateless, as
OpenAI), or keep it on the server and send only each new user message: with `conversations`
through chatd's conversations API, with `responses` through OpenAI's Responses API (each turn
continues the last by `previous_response_id`).

It talks HTTP with aiohttp rather than the openai SDK, to time every streamed chunk and to
tolerate servers whose streams bend the OpenAI shape (`transformers serve`: no `data: [DONE]`,
usage on the finish chunk, bare-string errors). It knows nothing about chatd's engine; it only
connects to the URL it is given, and every request has a timeout, so a run always ends. What it
measures goes into report.py's records; it does not summarise them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from chatd.bench.options import BenchOptions
from chatd.bench.report import BenchResult, LevelResult, RequestRecord

# Common English words: most are one token in a BPE or SentencePiece vocabulary, so a prompt
# of N words is roughly N tokens. Random words also keep prompts from sharing a prefix.
WORDS = """the of and to in is was for on that with as by at from his he it an were are which
this be or her had not first their one also has new they after time who two its people but
been all year other city some when world made game there more would most used during
many school work may later only part state where she film team three over day known
between life while under music water number name war group family house called road line
early set long into high found best since each both river small began book second back
park well season national place major show area local sound color light power story field
""".split()


@dataclass(frozen=True)
class StreamEvent:
    """What one SSE `data:` line said, in the few terms a load generator cares about."""

    text: str = ""
    finished: bool = False  # a finish_reason or `[DONE]`
    done: bool = False  # `[DONE]`: nothing more will come
    usage: dict | None = None
    error: str | None = None
    response_id: str | None = None  # the Responses API's response id, from its events


# What ends a Responses API stream, and its events that carry the whole response.
RESPONSE_ENDS = {"response.completed", "response.incomplete"}
RESPONSE_FAILURES = {"response.failed", "error"}


def parse_event(payload: bytes) -> StreamEvent:
    """Decode the payload of one `data:` line (a chat or completion chunk, or a Responses API
    event); anything unreadable is an error event."""
    if payload == b"[DONE]":
        return StreamEvent(finished=True, done=True)
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return StreamEvent(error=payload.decode(errors="replace")[:300])
    if not isinstance(data, dict):  # transformers serve sends mid-stream errors as a bare string
        return StreamEvent(error=str(data)[:300])
    if isinstance(data.get("type"), str) and (data["type"].startswith("response.") or data["type"] == "error"):
        return _response_event(data)
    if data.get("error") or data.get("object") == "error":
        error = data.get("error") or data
        message = error.get("message", error) if isinstance(error, dict) else error
        return StreamEvent(error=str(message)[:300])
    text, finished = "", False
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        text += delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
        finished = finished or bool(choice.get("finish_reason"))
    usage = data.get("usage")
    return StreamEvent(text=text, finished=finished, usage=usage if isinstance(usage, dict) else None)


def _response_event(data: dict) -> StreamEvent:
    """A Responses API event, its usage in chat's names (prompt, cached and completion tokens)."""
    kind, response = data["type"], data.get("response") if isinstance(data.get("response"), dict) else {}
    if kind in RESPONSE_FAILURES:
        error = response.get("error") or data
        return StreamEvent(error=str(error.get("message", error) if isinstance(error, dict) else error)[:300])
    if kind == "response.output_text.delta":
        return StreamEvent(text=str(data.get("delta") or ""))
    usage = response.get("usage")
    if isinstance(usage, dict):
        details = usage.get("input_tokens_details")
        usage = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
                 "prompt_tokens_details": details if isinstance(details, dict) else None}
    finished = kind in RESPONSE_ENDS
    return StreamEvent(finished=finished, done=finished, usage=usage, response_id=response.get("id"))


async def send_request(
    http: aiohttp.ClientSession, url: str, body: dict, record: RequestRecord, timeout: float, clock: Callable[[], float]
) -> str:
    """Stream one request, filling in `record`; returns the reply text (for the next turn)."""
    pieces: list[str] = []
    chunk_times: list[float] = []
    seen_event = finished = False
    start = clock()
    try:
        async with asyncio.timeout(timeout), http.post(url, data=orjson.dumps(body)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300].strip()}"
                return ""
            async for raw_line in response.content:
                line = raw_line.strip()
                # Blank lines end events, `:` lines are heartbeats, `event:`/`id:` add nothing here.
                # Each `data:` line is taken as a whole event: no OpenAI-style server splits one.
                if not line.startswith(b"data:"):
                    continue
                event = parse_event(line[5:].strip())
                seen_event = True
                if event.error is not None:
                    record.error = event.error
                    return ""
                record.response_id = event.response_id or record.response_id
                if event.text:
                    chunk_times.append(clock())
                    pieces.append(event.text)
                if event.usage is not None:
                    record.num_output_tokens = event.usage.get("completion_tokens") or 0
                    record.num_prompt_tokens = event.usage.get("prompt_tokens")
                    details = event.usage.get("prompt_tokens_details")
                    record.num_cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
                finished = finished or event.finished
                if event.done:
                    break
    except TimeoutError:
        record.error = f"timed out after {timeout} s"
        return ""
    except aiohttp.ClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return ""
    if not seen_event:
        record.error = "the response held no `data:` events (is this a streaming endpoint?)"
        return ""
    if not finished:
        record.error = "the stream ended without a finish_reason or [DONE]"
        return ""
    record.ok = True
    record.e2e = clock() - start
    if chunk_times:
        record.ttft = chunk_times[0] - start
        record.itls = [later - earlier for earlier, later in zip(chunk_times, chunk_times[1:])]
    if not record.num_output_tokens:
        record.num_output_tokens = len(chunk_times)
    if record.num_prompt_tokens is not None and record.num_cached_tokens is not None:
        record.num_prefill_tokens = record.num_prompt_tokens - record.num_cached_tokens
    return "".join(pieces)


def make_sessions(options: BenchOptions, num_sessions: int, rng: random.Random) -> list[list[tuple[str, int]]]:
    """Plan every conversation up front: per turn, a prompt of random words and its max_tokens."""
    return [
        [
            (" ".join(rng.choices(WORDS, k=rng.randint(*options.prompt_tokens))), rng.randint(*options.output_tokens))
            for _ in range(options.multi_turn)
        ]
        for _ in range(num_sessions)
    ]


def make_body(options: BenchOptions, history: list[dict], max_tokens: int) -> dict:
    """The request body for one turn, holding only fields every OpenAI-compatible server knows."""
    body = _sampling_fields(options, max_tokens)
    if options.endpoint == "chat":
        body["messages"] = list(history)
    else:  # a text completion sees the conversation as plain text
        body["prompt"] = "\n\n".join(message["content"] for message in history)
    return body


def make_turn_body(options: BenchOptions, content: str, max_tokens: int) -> dict:
    """The body of one conversations-API turn: only the new user message; the server has the rest."""
    return {"content": content, **_sampling_fields(options, max_tokens)}


def _sampling_fields(options: BenchOptions, max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": options.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **_optional_fields(options)}


def _optional_fields(options: BenchOptions) -> dict:
    """`model`, `top_p` and `ignore_eos`, only when asked for: not every server knows them."""
    fields: dict = {}
    if options.top_p < 1.0:
        fields["top_p"] = options.top_p
    if options.model is not None:
        fields["model"] = options.model
    if options.ignore_eos:
        fields["ignore_eos"] = True
    return fields


async def run_session(
    http: aiohttp.ClientSession, options: BenchOptions, index: int, turns: list[tuple[str, int]], clock
) -> list[RequestRecord]:
    """Send one conversation turn by turn; a failed turn ends it, as it would for a user."""
    if options.conversations:
        return await run_conversation(http, options, index, turns, clock)
    if options.responses:
        return await run_responses(http, options, index, turns, clock)
    url = options.url.rstrip("/") + ("/chat/completions" if options.endpoint == "chat" else "/completions")
    history: list[dict] = []
    records = []
    for turn, (prompt, max_tokens) in enumerate(turns, start=1):
        history.append({"role": "user", "content": prompt})
        record = RequestRecord(session=index, turn=turn, max_tokens=max_tokens)
        records.append(record)
        reply = await send_request(http, url, make_body(options, history, max_tokens), record, options.timeout, clock)
        if not record.ok:
            break
        history.append({"role": "assistant", "content": reply})
    return records


async def run_conversation(
    http: aiohttp.ClientSession, options: BenchOptions, index: int, turns: list[tuple[str, int]], clock
) -> list[RequestRecord]:
    """One session through the conversations API: create a conversation, then post each new user message.

    Creating and deleting the conversation are not timed; a creation that fails is recorded as
    a failed first turn. The conversation is deleted at the end (which also stops a reply the
    client gave up on), so a benchmark leaves no conversations behind.
    """
    conversations_url = options.url.rstrip("/") + "/conversations"
    conversation_id, error = await create_conversation(http, conversations_url, options, index)
    if conversation_id is None:
        return [RequestRecord(session=index, turn=1, max_tokens=turns[0][1], error=error)]
    records = []
    try:
        for turn, (prompt, max_tokens) in enumerate(turns, start=1):
            record = RequestRecord(session=index, turn=turn, max_tokens=max_tokens)
            records.append(record)
            url = f"{conversations_url}/{conversation_id}/messages"
            await send_request(http, url, make_turn_body(options, prompt, max_tokens), record, options.timeout, clock)
            if not record.ok:
                break
    finally:
        await delete_made(http, f"{conversations_url}/{conversation_id}", options.timeout)
    return records


async def run_responses(
    http: aiohttp.ClientSession, options: BenchOptions, index: int, turns: list[tuple[str, int]], clock
) -> list[RequestRecord]:
    """One session through the Responses API: each turn sends its new user message and continues the
    previous turn's response by previous_response_id. The responses are deleted at the end (not timed)."""
    url = options.url.rstrip("/") + "/responses"
    records: list[RequestRecord] = []
    try:
        for turn, (prompt, max_tokens) in enumerate(turns, start=1):
            record = RequestRecord(session=index, turn=turn, max_tokens=max_tokens)
            body = make_response_body(options, prompt, max_tokens)
            if records:
                body["previous_response_id"] = records[-1].response_id
            records.append(record)
            await send_request(http, url, body, record, options.timeout, clock)
            if not record.ok:
                break
            if record.response_id is None:
                record.ok, record.error = False, "the stream named no response id to continue"
                break
    finally:
        for record in records:
            if record.response_id is not None:
                await delete_made(http, f"{url}/{record.response_id}", options.timeout)
    return records


def make_response_body(options: BenchOptions, content: str, max_tokens: int) -> dict:
    """The body of one Responses API turn: the new user message and OpenAI's Responses fields."""
    return {"input": content, "max_output_tokens": max_tokens, "temperature": options.temperature, "stream": True,
            **_optional_fields(options)}


async def create_conversation(
    http: aiohttp.ClientSession, url: str, options: BenchOptions, index: int
) -> tuple[str | None, str | None]:
    """POST /conversations; returns (id, None), or (None, why it failed)."""
    body: dict = {"title": f"chatd bench session {index}"}
    if options.model is not None:
        body["model"] = options.model
    try:
        async with asyncio.timeout(options.timeout), http.post(url, data=orjson.dumps(body)) as response:
            text = await response.text()
    except TimeoutError:
        return None, f"creating the conversation timed out after {options.timeout} s"
    except aiohttp.ClientError as exc:
        return None, f"creating the conversation: {type(exc).__name__}: {exc}"
    if response.status != 200:
        return None, f"creating the conversation: HTTP {response.status}: {text[:300].strip()}"
    try:
        conversation_id = orjson.loads(text).get("id")
    except (orjson.JSONDecodeError, AttributeError):
        conversation_id = None
    if not isinstance(conversation_id, str) or not conversation_id:
        return None, f"creating the conversation: the answer has no id: {text[:300].strip()}"
    return conversation_id, None


async def delete_made(http: aiohttp.ClientSession, url: str, timeout: float) -> None:
    """DELETE a conversation (or response) the bench made; a failure here does not change any measurement."""
    try:
        async with asyncio.timeout(timeout), http.delete(url) as response:
            await response.read()
    except (TimeoutError, aiohttp.ClientError):
        pass


async def run_level(options: BenchOptions, concurrency: int, clock: Callable[[], float]) -> LevelResult:
    """Run one level: `concurrency` workers drain a fixed list of conversations."""
    num_sessions = options.num_requests or 2 * concurrency
    # Seeded per level so every level gets fresh prompts: a prefix cache must not carry over.
    sessions = make_sessions(options, num_sessions, random.Random(f"{options.seed}:{concurrency}"))
    pending = iter(enumerate(sessions))  # shared by the workers: each conversation is taken once
    records: list[RequestRecord] = []
    headers = {"Content-Type": "application/json"}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"

    async def worker() -> None:
        for index, turns in pending:
            records.extend(await run_session(http, options, index, turns, clock))

    connector = aiohttp.TCPConnector(limit=concurrency)
    # Per-request deadlines come from asyncio.timeout in send_request, not aiohttp's default.
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=aiohttp.ClientTimeout()) as http:
        start = clock()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, num_sessions))))
        wall_time = clock() - start
    records.sort(key=lambda r: (r.session, r.turn))
    return LevelResult(concurrency=concurrency, wall_time=wall_time, requests=records)


async def run_bench(
    options: BenchOptions,
    *,
    on_level: Callable[[LevelResult], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> BenchResult:
    """Run every concurrency level in turn; `on_level` sees each result as soon as it is done."""
    levels = []
    for concurrency in options.concurrency:
        level = await run_level(options, concurrency, clock)
        levels.append(level)
        if on_level is not None:
            on_level(level)
    return BenchResult(options=options, levels=levels)

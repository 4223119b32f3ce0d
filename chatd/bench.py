"""`chatd bench`: an async load generator for any OpenAI-compatible server.

It streams chat or text completions at one or more concurrency levels and reports time to
first token (TTFT), inter-token latency (ITL), end-to-end latency and throughput. Multi-turn
sessions either resend their growing history to /chat/completions (stateless, as OpenAI) or,
with `conversations`, drive chatd's conversations API, where the server keeps the history and
the client posts only each new user message; per turn it reports TTFT and, from `usage`, how
many prompt tokens the server took from its prefix cache and how many it had to compute.

It talks HTTP with aiohttp rather than the openai SDK, to time every streamed chunk and to
tolerate servers whose streams bend the OpenAI shape (`transformers serve`: no `data: [DONE]`,
usage on the finish chunk, bare-string errors). It knows nothing about chatd's engine; it only
connects to the URL it is given, and every request has a timeout, so a run always ends.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import aiohttp
import orjson

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
class BenchOptions:
    """What to send, how hard, and for how long; mirrors the `chatd bench` flags."""

    url: str  # base URL, e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # omitted from the body when None
    concurrency: tuple[int, ...] = (1,)
    num_requests: int | None = None  # per level (sessions with multi_turn > 1); None: 2x concurrency
    prompt_tokens: tuple[int, int] = (100, 200)  # uniform MIN..MAX, one word per token
    output_tokens: tuple[int, int] = (64, 128)  # uniform MIN..MAX, sent as max_tokens
    endpoint: str = "chat"  # chat | completions
    multi_turn: int = 1
    temperature: float = 0.0
    ignore_eos: bool = False  # chatd/vLLM extra field; other servers may reject it
    seed: int = 0
    timeout: float = 300.0  # seconds, per request
    api_key: str | None = None
    conversations: bool = False  # chatd's /conversations API: the server keeps each session's history

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency: each level must be at least 1, got {list(self.concurrency)}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests: must be at least 1, got {self.num_requests}")
        for name in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: need 1 <= MIN <= MAX, got MIN={low} MAX={high}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint: must be 'chat' or 'completions', got {self.endpoint!r}")
        if self.conversations and self.endpoint != "chat":
            raise ValueError(f"conversations: the API is chat only; endpoint must be 'chat', got {self.endpoint!r}")
        if self.multi_turn < 1:
            raise ValueError(f"multi_turn: must be at least 1, got {self.multi_turn}")
        if self.timeout <= 0:
            raise ValueError(f"timeout: must be positive, got {self.timeout}")


@dataclass
class RequestRecord:
    """One streamed request as the client saw it; times are seconds from sending it."""

    session: int
    turn: int  # 1-based turn within the session's conversation
    max_tokens: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # first content delta; None when the reply was empty
    itls: list[float] = field(default_factory=list)  # between content *chunks*, not tokens
    e2e: float | None = None
    num_output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    num_prompt_tokens: int | None = None  # usage.prompt_tokens when the server sent usage
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: from the prefix cache
    num_prefill_tokens: int | None = None  # prompt tokens the server computed: prompt - cached, when both are known


@dataclass(frozen=True)
class StreamEvent:
    """What one SSE `data:` line said, in the few terms a load generator cares about."""

    text: str = ""
    finished: bool = False  # a finish_reason or `[DONE]`
    done: bool = False  # `[DONE]`: nothing more will come
    usage: dict | None = None
    error: str | None = None


def parse_event(payload: bytes) -> StreamEvent:
    """Decode the payload of one `data:` line; anything unreadable is an error event."""
    if payload == b"[DONE]":
        return StreamEvent(finished=True, done=True)
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return StreamEvent(error=payload.decode(errors="replace")[:300])
    if not isinstance(data, dict):  # transformers serve sends mid-stream errors as a bare string
        return StreamEvent(error=str(data)[:300])
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
    fields: dict = {
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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
        await delete_conversation(http, f"{conversations_url}/{conversation_id}", options.timeout)
    return records


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


async def delete_conversation(http: aiohttp.ClientSession, url: str, timeout: float) -> None:
    """DELETE a conversation the bench made; a failure here does not change any measurement."""
    try:
        async with asyncio.timeout(timeout), http.delete(url) as response:
            await response.read()
    except (TimeoutError, aiohttp.ClientError):
        pass


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 with linear interpolation between the nearest ranks (as numpy does)."""
    ordered = sorted(values)
    result: dict[str, float | None] = {}
    for q in (50, 95, 99):
        if not ordered:
            result[f"p{q}"] = None
            continue
        rank = (len(ordered) - 1) * q / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        result[f"p{q}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return result


@dataclass
class LevelResult:
    """Every request of one concurrency level, and the numbers a reader compares across levels."""

    concurrency: int
    wall_time: float
    requests: list[RequestRecord]

    def summary(self) -> dict:
        """Counts, latency percentiles (seconds) and throughput; per turn when multi-turn."""
        ok = [r for r in self.requests if r.ok]
        num_output_tokens = sum(r.num_output_tokens for r in ok)
        wall_time = max(self.wall_time, 1e-9)
        turns = []
        for turn in sorted({r.turn for r in ok}):
            in_turn = [r for r in ok if r.turn == turn]
            turns.append({
                "turn": turn,
                "num_ok": len(in_turn),
                "ttft_p50": percentiles([r.ttft for r in in_turn if r.ttft is not None])["p50"],
                # Means over the requests whose server reported the number; None when none did.
                "prompt_tokens_mean": _mean([r.num_prompt_tokens for r in in_turn]),
                "cached_tokens_mean": _mean([r.num_cached_tokens for r in in_turn]),
                "prefill_tokens_mean": _mean([r.num_prefill_tokens for r in in_turn]),
            })
        return {
            "concurrency": self.concurrency,
            "num_ok": len(ok),
            "num_failed": len(self.requests) - len(ok),
            "wall_time": self.wall_time,
            "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "itl_per_chunk": percentiles([itl for r in ok for itl in r.itls]),
            "e2e_p50": percentiles([r.e2e for r in ok])["p50"],
            "num_output_tokens": num_output_tokens,
            "output_tokens_per_s": num_output_tokens / wall_time,
            "requests_per_s": len(ok) / wall_time,
            "errors": Counter(r.error for r in self.requests if not r.ok).most_common(),
            "turns": turns,
        }


@dataclass
class BenchResult:
    """The options a run used and one result per concurrency level, in the order they ran."""

    options: BenchOptions
    levels: list[LevelResult]

    def to_json(self) -> bytes:
        """Options, per-level summaries and every request record, as indented JSON."""
        levels = [
            {"summary": level.summary(), "requests": [asdict(record) for record in level.requests]}
            for level in self.levels
        ]
        return orjson.dumps({"options": asdict(self.options), "levels": levels}, option=orjson.OPT_INDENT_2)


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


def _mean(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _tokens(mean: float | None) -> str:
    return "-" if mean is None else f"{mean:.0f}"


def format_level(level: LevelResult) -> str:
    """A short human report of one level, as printed by `chatd bench`."""
    s = level.summary()
    ttft, itl = s["ttft"], s["itl_per_chunk"]
    lines = [
        f"concurrency {s['concurrency']}: {s['num_ok']} ok, {s['num_failed']} failed in {s['wall_time']:.2f} s",
        f"  TTFT  p50 {_ms(ttft['p50'])}  p95 {_ms(ttft['p95'])}  p99 {_ms(ttft['p99'])}",
        f"  ITL   p50 {_ms(itl['p50'])}  p95 {_ms(itl['p95'])}  p99 {_ms(itl['p99'])}  (per streamed chunk)",
        f"  E2E   p50 {_ms(s['e2e_p50'])}",
        f"  {s['output_tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s",
    ]
    if max((r.turn for r in level.requests), default=1) > 1:  # a multi-turn run
        lines.append("  per turn (token counts are means; prefill = prompt - cached, what the server computed):")
        for turn in s["turns"]:
            lines.append(
                f"  turn {turn['turn']}: TTFT p50 {_ms(turn['ttft_p50'])}, {turn['num_ok']} ok, "
                f"prompt {_tokens(turn['prompt_tokens_mean'])}, cached {_tokens(turn['cached_tokens_mean'])}, "
                f"prefill {_tokens(turn['prefill_tokens_mean'])} tokens"
            )
    lines += [f"  failed x{count}: {error}" for error, count in s["errors"]]
    return "\n".join(lines)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,16,64, got {text!r}") from None


def _bench_command(args: argparse.Namespace) -> int:
    options = BenchOptions(
        url=args.url, model=args.model, concurrency=args.concurrency, num_requests=args.num_requests,
        prompt_tokens=tuple(args.prompt_tokens), output_tokens=tuple(args.output_tokens), endpoint=args.endpoint,
        multi_turn=args.multi_turn, temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed,
        timeout=args.timeout, api_key=args.api_key, conversations=args.conversations,
    )
    mode = "conversations" if options.conversations else options.endpoint
    print(f"bench {options.url} ({mode}), concurrency {','.join(map(str, options.concurrency))}")
    result = asyncio.run(run_bench(options, on_level=lambda level: print(format_level(level), flush=True)))
    if args.json:
        with open(args.json, "wb") as file:
            file.write(result.to_json())
        print(f"wrote {args.json}")
    num_failed = sum(not r.ok for level in result.levels for r in level.requests)
    if num_failed:
        print(f"{num_failed} request(s) failed", file=sys.stderr)
    return 1 if num_failed else 0


def add_parser(subparsers) -> None:
    """Register `chatd bench` on the CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server (chatd, vLLM, ...)")
    bench.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    bench.add_argument("--model", help="model name to send (omitted from the body by default)")
    bench.add_argument("--concurrency", type=_int_list, default=(1,), help="levels to run in turn, e.g. 1,16,64")
    bench.add_argument(
        "--num-requests", type=int, help="per level (sessions of N turns with --multi-turn); default 2x concurrency"
    )
    bench.add_argument("--prompt-tokens", type=int, nargs=2, default=(100, 200), metavar=("MIN", "MAX"))
    bench.add_argument("--output-tokens", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    bench.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    bench.add_argument(
        "--multi-turn", type=int, default=1, metavar="N",
        help="turns per session, history growing; reports per turn TTFT and prompt, cached and computed tokens",
    )
    bench.add_argument(
        "--conversations", action="store_true",
        help="use chatd's conversations API: one conversation per session (deleted at the end), each turn posting "
             "only the new user message while the server keeps the history. Default: each turn sends the whole "
             "history to /chat/completions",
    )
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (chatd, vLLM): exact lengths")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    bench.add_argument("--api-key", help="sent as a Bearer token")
    bench.add_argument("--json", metavar="PATH", help="write options, summaries and every request here")
    bench.set_defaults(func=_bench_command)

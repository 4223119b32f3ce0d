"""`chatd bench` against a fake OpenAI-compatible server: counts, timings, odd streams, failures,
and multi-turn sessions, stateless or through a fake of chatd's conversations API."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from chatd.bench import add_parser
from chatd.bench.load import make_sessions, parse_event, run_bench
from chatd.bench.options import BenchOptions
from chatd.bench.report import format_level, percentiles

BODIES = web.AppKey("bodies", list)
CONVERSATIONS = web.AppKey("conversations", dict)  # id -> {"title", "messages", "busy", "deleted"}
FIRST_DELAY = 0.03  # seconds before the first content chunk
NUM_CHUNKS = 4
TOKENS_PER_CHUNK = 2  # the fake's usage says 2 tokens per chunk, so usage and chunk counts differ


def num_words(messages: list[dict]) -> int:
    """The fakes count one token per word."""
    return sum(len(m["content"].split()) for m in messages)


def make_fake_app(style: str = "openai") -> web.Application:
    """A fake server whose stream follows `style`; it records every request body it gets.

    Its usage reports every message but the last as cached, as a perfect prefix cache would
    (except in the transformers style, which reports no cached tokens at all).
    """
    app = web.Application()
    app[BODIES] = []
    app[CONVERSATIONS] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        app[BODIES].append(body)
        if style == "http_500":  # like transformers serve on a bad body
            return web.Response(status=500, text="Internal Server Error")
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload) -> None:
            data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
            await response.write(b"data: " + data + b"\n\n")

        def chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
            choice = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["text"] = text or ""
            return {"id": "x", "object": "chat.completion.chunk", "choices": [choice], "usage": usage}

        if style == "stall":  # heartbeats only, until the client gives up
            try:
                for _ in range(50):
                    await response.write(b": ping\n\n")
                    await asyncio.sleep(0.02)
            except ConnectionResetError:
                pass
            return response
        if chat and style == "openai":
            await send({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        await response.write(b": keep-alive\n\n")
        await asyncio.sleep(FIRST_DELAY)
        for i in range(NUM_CHUNKS):
            await send(chunk(f"w{i} "))
            await asyncio.sleep(0.002)
            if style == "error_event":
                await send({"error": {"message": "boom", "type": "server_error", "param": None, "code": 500}})
                return response
            if style == "bare_error":
                await send(b"Invalid prefix encountered while decoding stream")
                return response
        if style == "truncated":
            return response
        prompt = body["messages"] if chat else [{"content": body["prompt"]}]
        usage = {
            "prompt_tokens": num_words(prompt),
            "completion_tokens": NUM_CHUNKS * TOKENS_PER_CHUNK,
            "prompt_tokens_details": {"cached_tokens": num_words(prompt[:-1])},
        }
        if style == "transformers":  # usage on the finish chunk without cached tokens, and no [DONE]
            del usage["prompt_tokens_details"]
            await send(chunk(finish="length", usage=usage))
            return response
        await send(chunk(finish="length"))
        if style == "openai":
            await send({"id": "x", "choices": [], "usage": usage})
        await send(b"[DONE]")
        return response

    ids = itertools.count(1)

    async def create_conversation(request: web.Request) -> web.Response:
        if style == "http_500":
            return web.Response(status=500, text="Internal Server Error")
        body = await request.json()
        conversation_id = f"conv_{next(ids)}"
        app[CONVERSATIONS][conversation_id] = {
            "title": body.get("title"), "messages": [], "busy": False, "deleted": False,
        }
        return web.json_response({"id": conversation_id, "object": "conversation"})

    async def delete_conversation(request: web.Request) -> web.Response:
        app[CONVERSATIONS][request.match_info["id"]]["deleted"] = True
        return web.json_response({"id": request.match_info["id"], "deleted": True})

    async def post_message(request: web.Request) -> web.StreamResponse:
        """Like chatd: the stored history plus the new message is the prompt; all of the history is cached."""
        conversation = app[CONVERSATIONS].get(request.match_info["id"])
        if conversation is None or conversation["deleted"]:
            return web.json_response({"error": {"message": "no such conversation"}}, status=404)
        if conversation["busy"]:
            return web.json_response({"error": {"message": "busy", "code": "conversation_busy"}}, status=409)
        body = await request.json()
        app[BODIES].append(body)
        conversation["busy"] = True
        history = conversation["messages"]
        usage = {
            "prompt_tokens": num_words(history) + len(body["content"].split()),
            "completion_tokens": NUM_CHUNKS * TOKENS_PER_CHUNK,
            "prompt_tokens_details": {"cached_tokens": num_words(history)},
        }
        history.append({"role": "user", "content": body["content"]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event_ids = itertools.count(1)

        async def send(payload) -> None:
            data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
            await response.write(f"id: {next(event_ids)}\n".encode() + b"data: " + data + b"\n\n")

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": "msg", "object": "chat.completion.chunk", "conversation_id": request.match_info["id"],
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}

        await send(chunk({"role": "assistant", "content": ""}))
        await asyncio.sleep(FIRST_DELAY)
        reply = "".join(f"w{i} " for i in range(NUM_CHUNKS))
        for word in reply.split(" ")[:-1]:
            await send(chunk({"content": word + " "}))
        await send(chunk({}, finish="length"))
        history.append({"role": "assistant", "content": reply})
        await send({"id": "msg", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        await send(b"[DONE]")
        conversation["busy"] = False  # as in chatd, only after [DONE]: a client must wait for it
        return response

    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/conversations", create_conversation)
    app.router.add_delete("/v1/conversations/{id}", delete_conversation)
    app.router.add_post("/v1/conversations/{id}/messages", post_message)
    return app


@pytest.fixture
async def serve():
    """Start fake servers on 127.0.0.1; yields `start(style) -> (base_url, recorded_bodies)`."""
    servers: list[TestServer] = []

    async def start(style: str = "openai") -> tuple[str, list[dict]]:
        app = make_fake_app(style)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        start.conversations[str(server.make_url("/v1"))] = app[CONVERSATIONS]
        return str(server.make_url("/v1")), app[BODIES]

    start.conversations = {}  # base URL -> that fake's conversations, for the conversations-API tests

    yield start
    for server in servers:
        await server.close()


def make_options(url: str, **overrides) -> BenchOptions:
    defaults = dict(concurrency=(2,), num_requests=3, prompt_tokens=(5, 10), output_tokens=(8, 16), timeout=5.0)
    return BenchOptions(url=url, **(defaults | overrides))


def assert_ordered(stats: dict) -> None:
    assert stats["p50"] <= stats["p95"] <= stats["p99"]


async def test_a_standard_stream_is_counted_and_timed(serve):
    url, bodies = await serve("openai")
    result = await run_bench(make_options(url, concurrency=(1, 2)))
    assert [level.concurrency for level in result.levels] == [1, 2]
    for level in result.levels:
        summary = level.summary()
        assert (summary["num_ok"], summary["num_failed"]) == (3, 0)
        assert summary["num_output_tokens"] == 3 * NUM_CHUNKS * TOKENS_PER_CHUNK  # from usage, not chunks
        assert_ordered(summary["ttft"])
        assert_ordered(summary["itl_per_chunk"])
        assert summary["ttft"]["p50"] >= FIRST_DELAY * 0.9
        assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0
        for record in level.requests:
            assert len(record.itls) == NUM_CHUNKS - 1  # role chunk and heartbeat are not content
            assert record.ttft <= record.e2e
            assert record.num_prompt_tokens is not None
    assert len(bodies) == 6
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert 8 <= body["max_tokens"] <= 16 and body["temperature"] == 0.0
        assert 5 <= len(body["messages"][0]["content"].split()) <= 10
        assert "model" not in body and "ignore_eos" not in body


async def test_a_transformers_serve_stream_without_done_is_tolerated(serve):
    url, _ = await serve("transformers")
    summary = (await run_bench(make_options(url))).levels[0].summary()
    assert (summary["num_ok"], summary["num_failed"]) == (3, 0)
    assert summary["num_output_tokens"] == 3 * NUM_CHUNKS * TOKENS_PER_CHUNK  # usage on the finish chunk


async def test_without_usage_tokens_are_counted_as_content_chunks(serve):
    url, _ = await serve("no_usage")
    summary = (await run_bench(make_options(url))).levels[0].summary()
    assert summary["num_ok"] == 3 and summary["num_output_tokens"] == 3 * NUM_CHUNKS


@pytest.mark.parametrize(
    "style, message",
    [
        ("error_event", "boom"),
        ("bare_error", "Invalid prefix"),
        ("http_500", "HTTP 500"),
        ("truncated", "without a finish_reason"),
        ("stall", "timed out"),
    ],
)
async def test_failures_are_counted_with_their_message(serve, style, message):
    url, _ = await serve(style)
    level = (await run_bench(make_options(url, timeout=0.2))).levels[0]
    summary = level.summary()
    assert (summary["num_ok"], summary["num_failed"]) == (0, 3)
    assert summary["num_output_tokens"] == 0 and summary["ttft"]["p50"] is None
    [(error, count)] = summary["errors"]
    assert message in error and count == 3
    assert f"failed x3: {error}" in format_level(level)


async def test_multi_turn_sends_the_growing_history(serve):
    url, bodies = await serve("openai")
    result = await run_bench(make_options(url, concurrency=(2,), num_requests=2, multi_turn=3))
    assert sorted(len(body["messages"]) for body in bodies) == [1, 1, 3, 3, 5, 5]
    longest = max(bodies, key=lambda body: len(body["messages"]))["messages"]
    assert [m["role"] for m in longest] == ["user", "assistant", "user", "assistant", "user"]
    assert longest[1]["content"] == "".join(f"w{i} " for i in range(NUM_CHUNKS))  # the streamed reply
    level = result.levels[0]
    turns = level.summary()["turns"]
    assert [turn["turn"] for turn in turns] == [1, 2, 3] and all(t["num_ok"] == 2 for t in turns)
    prompt_tokens = [turn["prompt_tokens_mean"] for turn in turns]
    assert prompt_tokens == sorted(prompt_tokens) and prompt_tokens[0] < prompt_tokens[2]
    assert "turn 3: TTFT p50" in format_level(level)


async def test_multi_turn_records_turns_and_cached_tokens_from_usage(serve):
    url, _ = await serve("openai")
    level = (await run_bench(make_options(url, concurrency=(1,), num_requests=1, multi_turn=3))).levels[0]
    assert [record.turn for record in level.requests] == [1, 2, 3]
    for record in level.requests:
        assert record.num_prefill_tokens == record.num_prompt_tokens - record.num_cached_tokens
    assert level.requests[0].num_cached_tokens == 0
    # The fake caches all but the newest message: what is computed is that message alone.
    sessions = make_sessions(make_options(url, multi_turn=3), 1, random.Random("0:1"))
    assert [r.num_prefill_tokens for r in level.requests] == [len(prompt.split()) for prompt, _ in sessions[0]]
    turns = level.summary()["turns"]
    assert [t["prefill_tokens_mean"] for t in turns] == [r.num_prefill_tokens for r in level.requests]
    assert all(t["prefill_tokens_mean"] == t["prompt_tokens_mean"] - t["cached_tokens_mean"] for t in turns)


async def test_without_cached_tokens_in_usage_the_prefill_is_unknown(serve):
    url, _ = await serve("transformers")
    level = (await run_bench(make_options(url, num_requests=1, multi_turn=2))).levels[0]
    assert all(r.num_prompt_tokens is not None and r.num_cached_tokens is None for r in level.requests)
    assert all(r.num_prefill_tokens is None for r in level.requests)
    assert level.summary()["turns"][1]["prefill_tokens_mean"] is None
    assert "cached -, prefill - tokens" in format_level(level)


async def test_conversations_mode_creates_a_conversation_per_session_and_sends_only_new_messages(serve):
    url, bodies = await serve("openai")
    options = make_options(url, concurrency=(2,), num_requests=3, multi_turn=3, conversations=True, ignore_eos=True)
    level = (await run_bench(options)).levels[0]
    assert (level.summary()["num_ok"], level.summary()["num_failed"]) == (9, 0)  # the fake answers 409 on overlap
    conversations = serve.conversations[url]
    assert sorted(c["title"] for c in conversations.values()) == [f"chatd bench session {i}" for i in range(3)]
    assert all(c["deleted"] for c in conversations.values())  # the bench cleans up after itself
    sessions = make_sessions(options, 3, random.Random("0:2"))
    for conversation in conversations.values():
        index = int(conversation["title"].rsplit(" ", 1)[1])
        sent = [m["content"] for m in conversation["messages"] if m["role"] == "user"]
        assert sent == [prompt for prompt, _ in sessions[index]]  # each turn's new message, in order
    assert len(bodies) == 9
    for body in bodies:
        assert "messages" not in body and set(body) >= {"content", "max_tokens"}
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert [(r.session, r.turn) for r in level.requests] == [(s, t) for s in range(3) for t in (1, 2, 3)]


async def test_conversations_mode_reports_prompt_cached_and_prefill_tokens_per_turn(serve):
    url, _ = await serve("openai")
    options = make_options(url, concurrency=(1,), num_requests=2, multi_turn=3, conversations=True)
    level = (await run_bench(options)).levels[0]
    sessions = make_sessions(options, 2, random.Random("0:1"))
    for record in level.requests:
        assert record.ok and record.ttft >= FIRST_DELAY * 0.9
        turns = sessions[record.session]
        earlier = sum(len(prompt.split()) for prompt, _ in turns[: record.turn - 1]) + NUM_CHUNKS * (record.turn - 1)
        assert record.num_cached_tokens == earlier  # the stored history: earlier messages and replies
        assert record.num_prefill_tokens == len(turns[record.turn - 1][0].split())  # the new message alone
        assert record.num_prompt_tokens == record.num_cached_tokens + record.num_prefill_tokens
        assert record.num_output_tokens == NUM_CHUNKS * TOKENS_PER_CHUNK  # from usage
    summary = level.summary()
    assert [t["turn"] for t in summary["turns"]] == [1, 2, 3] and all(t["num_ok"] == 2 for t in summary["turns"])
    for turn in summary["turns"]:
        in_turn = [r for r in level.requests if r.turn == turn["turn"]]
        assert turn["cached_tokens_mean"] == sum(r.num_cached_tokens for r in in_turn) / 2
        assert turn["prefill_tokens_mean"] == sum(r.num_prefill_tokens for r in in_turn) / 2
        assert turn["prefill_tokens_mean"] == turn["prompt_tokens_mean"] - turn["cached_tokens_mean"]
        assert turn["ttft_p50"] >= FIRST_DELAY * 0.9
    assert summary["turns"][0]["cached_tokens_mean"] == 0
    report = format_level(level)
    third = summary["turns"][2]
    assert f"prefill {third['prefill_tokens_mean']:.0f} tokens" in report and "turn 3: TTFT p50" in report


async def test_a_conversation_that_cannot_be_created_fails_its_first_turn(serve):
    url, bodies = await serve("http_500")
    level = (await run_bench(make_options(url, num_requests=2, multi_turn=3, conversations=True))).levels[0]
    assert [(r.turn, r.ok) for r in level.requests] == [(1, False), (1, False)]
    [(error, count)] = level.summary()["errors"]
    assert error.startswith("creating the conversation: HTTP 500") and count == 2
    assert bodies == []  # no message was posted


async def test_completions_endpoint_model_and_ignore_eos(serve):
    url, bodies = await serve("openai")
    options = make_options(url, endpoint="completions", model="m", ignore_eos=True, multi_turn=2, num_requests=1)
    summary = (await run_bench(options)).levels[0].summary()
    assert summary["num_ok"] == 2
    first, second = bodies
    assert first["model"] == "m" and first["ignore_eos"] is True and "messages" not in first
    assert second["prompt"].startswith(first["prompt"]) and "w0 w1" in second["prompt"]


async def test_the_same_seed_sends_the_same_prompts(serve):
    url, bodies = await serve("openai")
    await run_bench(make_options(url, concurrency=(1,)))
    await run_bench(make_options(url, concurrency=(1,)))
    prompts = [body["messages"][0]["content"] for body in bodies]
    assert prompts[:3] == prompts[3:] and len(set(prompts[:3])) == 3


async def test_cli_prints_each_level_and_writes_json(serve, tmp_path, capsys):
    url, _ = await serve("openai")
    parser = argparse.ArgumentParser(prog="chatd")
    add_parser(parser.add_subparsers(dest="command"))
    json_path = tmp_path / "bench.json"
    args = parser.parse_args(
        ["bench", "--url", url, "--concurrency", "1,2", "--num-requests", "2", "--prompt-tokens", "3", "6",
         "--output-tokens", "4", "8", "--json", str(json_path)]
    )
    # The command runs its own event loop, so it runs in a thread while this loop serves.
    assert await asyncio.to_thread(args.func, args) == 0
    out = capsys.readouterr().out
    assert "concurrency 1: 2 ok, 0 failed" in out and "concurrency 2: 2 ok, 0 failed" in out
    written = orjson.loads(json_path.read_bytes())
    assert written["options"]["concurrency"] == [1, 2]
    assert [level["summary"]["num_ok"] for level in written["levels"]] == [2, 2]
    assert len(written["levels"][1]["requests"]) == 2 and written["levels"][1]["requests"][0]["ttft"] > 0


async def test_cli_conversations_flag_drives_the_conversations_api(serve, capsys):
    url, bodies = await serve("openai")
    parser = argparse.ArgumentParser(prog="chatd")
    subparsers = parser.add_subparsers(dest="command")
    add_parser(subparsers)
    assert "conversations API" in subparsers.choices["bench"].format_help()
    args = parser.parse_args(["bench", "--url", url, "--num-requests", "1", "--multi-turn", "2", "--conversations",
                              "--prompt-tokens", "3", "6", "--output-tokens", "4", "8"])
    assert await asyncio.to_thread(args.func, args) == 0
    out = capsys.readouterr().out
    assert "(conversations)" in out and "turn 2: TTFT p50" in out and "prefill" in out
    assert len(bodies) == 2 and all("content" in body for body in bodies)


async def test_cli_exits_nonzero_when_requests_fail(serve):
    url, _ = await serve("http_500")
    parser = argparse.ArgumentParser(prog="chatd")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--url", url, "--num-requests", "1"])
    assert await asyncio.to_thread(args.func, args) == 1


def test_percentiles_interpolate_and_handle_no_data():
    stats = percentiles([float(v) for v in range(1, 101)])
    assert stats["p50"] == pytest.approx(50.5) and stats["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([2.0]) == {"p50": 2.0, "p95": 2.0, "p99": 2.0}


def test_events_from_odd_servers_are_read():
    assert parse_event(b"[DONE]").done
    assert parse_event(b'{"choices":[{"delta":{"content":"hi"},"finish_reason":null}],"usage":null}').text == "hi"
    assert parse_event(b'{"choices":[],"usage":{"completion_tokens":3}}').usage == {"completion_tokens": 3}
    assert parse_event(b'{"object":"error","message":"too long"}').error == "too long"  # older vLLM
    assert parse_event(b'"oops"').error == "oops" and parse_event(b"{not json").error == "{not json"


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"concurrency": (0,)}, "concurrency"),
        ({"prompt_tokens": (10, 5)}, "prompt_tokens"),
        ({"output_tokens": (0, 5)}, "output_tokens"),
        ({"endpoint": "embeddings"}, "endpoint"),
        ({"multi_turn": 0}, "multi_turn"),
        ({"conversations": True, "endpoint": "completions"}, "conversations"),
    ],
)
def test_bad_options_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_options("http://127.0.0.1:1/v1", **overrides)

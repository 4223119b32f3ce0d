"""`chatd bench` against a fake OpenAI-compatible server: counts, timings, odd streams, failures."""

from __future__ import annotations

import argparse
import asyncio

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from chatd.bench import BenchOptions, add_parser, format_level, parse_event, percentiles, run_bench

BODIES = web.AppKey("bodies", list)
FIRST_DELAY = 0.03  # seconds before the first content chunk
NUM_CHUNKS = 4
TOKENS_PER_CHUNK = 2  # the fake's usage says 2 tokens per chunk, so usage and chunk counts differ


def make_fake_app(style: str = "openai") -> web.Application:
    """A fake server whose stream follows `style`; it records every request body it gets."""
    app = web.Application()
    app[BODIES] = []

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
            "prompt_tokens": sum(len(m["content"].split()) for m in prompt),
            "completion_tokens": NUM_CHUNKS * TOKENS_PER_CHUNK,
        }
        if style == "transformers":  # usage on the finish chunk, and no [DONE]
            await send(chunk(finish="length", usage=usage))
            return response
        await send(chunk(finish="length"))
        if style == "openai":
            await send({"id": "x", "choices": [], "usage": usage})
        await send(b"[DONE]")
        return response

    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
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
        return str(server.make_url("/v1")), app[BODIES]

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
    ],
)
def test_bad_options_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_options("http://127.0.0.1:1/v1", **overrides)

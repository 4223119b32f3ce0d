"""A real `chatd serve` process on a free loopback port, driven by the official openai SDK."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatd.engine.models.demo import build_demo_model
from chatd.engine import Tokenizer
from tests.http.serving import start_server, stop_server

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about paged attention."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Start chatd serve on the demo model; yield (base_url, model_dir, process); stop it with SIGTERM."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = build_demo_model(root / "demo")
    proc, url, _ = start_server(
        root, model_dir,
        "[server]\nmax_body_bytes = 65536\nheartbeat_seconds = 0.5\nshutdown_grace_seconds = 5.0\n[cache]\nnum_blocks = 2048\n",
    )
    yield url, model_dir, proc
    stop_server(proc)


@pytest.fixture
def client(server):
    url, _, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server):
    url, _, _ = server
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_chat_completion_with_usage_equal_to_the_tokenizer(client, server):
    _, model_dir, _ = server
    reply = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == "demo"


async def test_stream_equals_whole_reply_and_has_openai_shape(async_client):
    whole = await async_client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = await async_client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_take_text_or_token_ids(client):
    by_text = client.completions.create(model="demo", prompt="The cache", max_tokens=5, temperature=0)
    assert by_text.object == "text_completion" and by_text.usage.completion_tokens <= 5
    by_ids = client.completions.create(model="demo", prompt=[1, 20, 30, 40], max_tokens=5, temperature=0, logprobs=2)
    assert by_ids.usage.prompt_tokens == 4
    logprobs = by_ids.choices[0].logprobs
    assert len(logprobs.token_logprobs) == by_ids.usage.completion_tokens
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_n_choices_and_chat_logprobs(client):
    reply = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=6, n=3, seed=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 18
    for choice in reply.choices:
        assert len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert models[0].model_extra["context_length"] == 2048
    assert models[0].model_extra["chatd"]["attention_backend"] == "sdpa"


def test_errors_name_the_param_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5000)
    assert err.value.param == "max_tokens" and "5000" in err.value.message and "2048" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=MESSAGES, functions=[{"name": "f"}])
    assert err.value.param == "functions" and "not supported" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=MESSAGES, stream_options={"include_usage": True})
    assert err.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=MESSAGES, temperature=3)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=[{"role": "function", "content": "x"}])
    assert err.value.param == "messages[0].role"


async def test_raw_http_errors_are_json(server):
    url, _, _ = server
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
        async with session.post(f"{url}/v1/chat/completions", json={"messages": "hi", "max_tokens": "ten"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] in ("messages", "max_tokens")
        async with session.post(f"{url}/v1/chat/completions", data=b"x" * 70000) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
        async with session.get(f"{url}/v1/nothing") as r:
            assert r.status == 404 and "error" in await r.json()
        async with session.delete(f"{url}/v1/models") as r:
            assert r.status == 405 and "error" in await r.json()
        async with session.get(f"{url}/v1/models", headers={"X-Request-Id": "abc-123"}) as r:
            assert r.headers["X-Request-Id"] == "abc-123"


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


@pytest.mark.slow
async def test_64_concurrent_streams_equal_sequential_and_health_answers(server, async_client):
    url, _, _ = server
    prompts = [[{"role": "user", "content": f"Question number {i}: what is a KV block?"}] for i in range(64)]

    async def one(messages, stream: bool) -> str:
        kwargs = dict(model="demo", messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return (await async_client.chat.completions.create(**kwargs)).choices[0].message.content
        chunks = await async_client.chat.completions.create(stream=True, **kwargs)
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def health_while_busy() -> int:
        await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/health") as r:
                return r.status

    together, status = await asyncio.gather(asyncio.gather(*(one(p, True) for p in prompts)), health_while_busy())
    assert status == 200
    alone = [await one(p, False) for p in prompts]
    assert list(together) == alone
    # An operator sees where the host's time went: every stage of the steps that served them.
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        assert await _metric(session, url, "chatd:engine_steps_total") >= 16
        assert await _metric(session, url, "chatd:engine_thread_cpu_seconds_total") > 0
    stages = {sample.labels["stage"]: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name == "chatd:engine_stage_seconds_total"}
    assert set(stages) == {"schedule", "inputs", "forward", "sample", "wait", "postprocess", "detokenize", "dispatch"}
    assert all(seconds > 0 for seconds in stages.values()), stages


async def test_abandoned_streams_free_everything(server):
    url, _, _ = server
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(4):
            responses = [await session.post(f"{url}/v1/chat/completions", json=body) for _ in range(50)]
            for r in responses:
                await r.content.readline()  # the first event, then the client goes away
                r.close()
        for _ in range(200):  # bounded: the engine frees aborted requests within a step or two
            running = await _metric(session, url, "chatd:num_requests_running")
            waiting = await _metric(session, url, "chatd:num_requests_waiting")
            usage = await _metric(session, url, "chatd:kv_cache_usage_perc")
            if running == waiting == usage == 0:
                break
            await asyncio.sleep(0.05)
        assert (running, waiting, usage) == (0, 0, 0)


@pytest.mark.slow
async def test_a_stalled_reader_gets_merged_deltas_and_never_stalls_others(server, async_client):
    url, _, _ = server
    host, port = url.removeprefix("http://").split(":")
    # A client that reads nothing until its reply is done, with a tiny receive buffer. Its
    # stream (8 choices x 300 tokens x 20 top logprobs, ~6 MB) overflows the kernel's socket
    # buffers (4 MB at most here), so the server's writes back up and its deltas must merge.
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 20, "n": 8}
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    stalled = http.client.HTTPConnection(host, int(port), timeout=120)
    stalled.sock = sock
    stalled.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                    headers={"Content-Type": "application/json"})

    async def other(i: int) -> str:
        reply = await async_client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"other {i}"}], max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True})
        return reply.choices[0].finish_reason

    # Others come and go while the stalled stream's client reads nothing.
    assert await asyncio.gather(*(other(i) for i in range(4))) == ["length"] * 4
    async with aiohttp.ClientSession() as session:
        for _ in range(600):  # bounded: until the engine has generated all of the stalled reply
            if await _metric(session, url, "chatd:num_requests_running") == 0:
                break
            await asyncio.sleep(0.1)

    def read_stalled() -> bytes:
        response = stalled.getresponse()
        assert response.status == 200
        return response.read()

    raw = await asyncio.to_thread(read_stalled)
    stalled.close()
    events = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"}
    whole = await async_client.chat.completions.create(**sdk_body, extra_body={"ignore_eos": True})
    for index in range(8):
        chunks = [c for e in events for c in e["choices"] if c["index"] == index and c["logprobs"]]
        assert sum(len(c["logprobs"]["content"]) for c in chunks) == 300  # every token's logprobs, none lost
        assert len(chunks) < 300, "a reader that fell behind should get merged deltas, not one event per token"
        assert "".join(c["delta"].get("content", "") for c in chunks) == whole.choices[index].message.content


@pytest.mark.slow
def test_json_logs_and_sigint(tmp_path, server):
    """log_json: every line of the log is a JSON object; the request line carries the request's
    id and counts. SIGINT drains and exits 0, like SIGTERM."""
    _, model_dir, _ = server
    proc, url, log_path = start_server(tmp_path, model_dir, "[server]\nlog_json = true\n")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "json-log-test"})
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    (done,) = [r for r in records if r["message"] == "request finished"]
    assert done["request_id"] == "json-log-test" and done["finish_reason"] == "length"
    assert done["prompt_tokens"] == reply.usage.prompt_tokens and done["completion_tokens"] == 5
    assert done["e2e_s"] >= done["ttft_s"] > 0
    assert any(r["message"].startswith("ready:") for r in records)
    assert records[-1]["message"] == "stopped"


@pytest.mark.slow
def test_an_attention_backend_that_cannot_run_here_stops_startup_with_its_reason(tmp_path, server):
    """`--attention-backend torch-varlen` on a CPU machine: exit 2 naming the setting and why."""
    _, model_dir, _ = server
    done = subprocess.run(
        [sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--port", "0", "--device", "cpu",
         "--attention-backend", "torch-varlen", "--no-cuda-graphs"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "CHATD_HOME": str(tmp_path)},
    )
    assert done.returncode == 2
    assert "attention_backend 'torch-varlen' cannot run here: torch's varlen attention needs CUDA" in done.stderr


def test_a_stream_interval_sends_tokens_in_groups_with_the_same_reply_and_usage(tmp_path):
    """[server] stream_interval = 4: each content chunk carries 4 tokens (the last the rest), and
    the streamed text, finish and usage are those of the same greedy reply sent whole."""
    proc, url, _ = start_server(tmp_path, build_demo_model(tmp_path / "demo"), "[server]\nstream_interval = 4\n")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = dict(model="demo", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True, logprobs=True,
                                                      stream_options={"include_usage": True}))
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs is not None]
        assert [len(d.logprobs.content) for d in deltas] == [4, 4, 2]  # one logprob a token
        assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
        assert deltas[-1].finish_reason == whole.choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    finally:
        stop_server(proc)


async def test_a_client_that_stops_reading_at_done_keeps_its_connection_for_the_next_request(server):
    """The usage, [DONE] and the end of the body go out in one write: a client that leaves a stream
    at [DONE] (as the SDKs and load generators do) finds the body ended and reuses the connection,
    rather than closing it and opening another for its next request."""
    url, _, _ = server
    # Counted by the client's own hooks: a response whose whole body came in one read has already
    # handed its connection back by the time the caller looks at it.
    opened, reused = [], []
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(lambda *_: _note(opened))
    trace.on_connection_reuseconn.append(lambda *_: _note(reused))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), trace_configs=[trace]) as http:
        for _ in range(50):
            body = {"messages": MESSAGES, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                async for line in response.content:
                    if line.strip() == b"data: [DONE]":
                        break
    assert (len(opened), len(reused)) == (1, 49)


async def _note(into: list) -> None:
    into.append(1)

"""Request hygiene through a real `chatd serve`: slow and idle clients are closed, a client that
stops reading is dropped, huge prompts never stall the event loop, malformed bodies get 4xx in
OpenAI's shape, and start-up mistakes read as one-line messages."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import socket
import subprocess
import sys
import time
import zlib

import aiohttp
import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from chatd.engine import Tokenizer
from tests.http.serving import start_server, stop_server
from tests.http.test_isolation import engine_is_empty, metric

HEADER_TIMEOUT, BODY_TIMEOUT, SEND_TIMEOUT, STREAM_BUFFER = 1.0, 1.0, 3.0, 65536


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hygiene")
    model_dir = build_demo_model(root / "demo")
    proc, url, log_path = start_server(root, model_dir, (
        f"[server]\nheader_timeout_seconds = {HEADER_TIMEOUT}\nbody_timeout_seconds = {BODY_TIMEOUT}\n"
        f"send_timeout_seconds = {SEND_TIMEOUT}\nstream_buffer_bytes = {STREAM_BUFFER}\nheartbeat_seconds = 0.5\n"
        "[cache]\nnum_blocks = 4096\n"))
    host, port = url.removeprefix("http://").split(":")
    yield {"url": url, "host": host, "port": int(port), "model_dir": model_dir, "log": log_path, "root": root}
    stop_server(proc)


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the server sent until it closed the connection (fails if it stays open)."""
    received = b""
    async with asyncio.timeout(within):
        while chunk := await reader.read(65536):
            received += chunk
    return received


async def test_connections_that_stall_in_the_head_or_the_body_are_closed(server):
    host, port = server["host"], server["port"]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    stalls = []
    for i in range(64):
        reader, writer = await asyncio.open_connection(host, port)
        if i % 4 == 0:
            pass  # says nothing at all
        elif i % 4 == 1:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # half a head
        else:  # a whole head, then part of the body
            writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                         + body[: len(body) // 2])
        stalls.append((i, reader, writer))
    started = time.monotonic()
    answers = await asyncio.gather(*(closed_by_server(reader, within=20) for _, reader, _ in stalls))
    assert time.monotonic() - started < 6  # each was closed after its ~1 s timeout, not left open
    for (i, _, writer), answer in zip(stalls, answers):
        if i % 4 >= 2:  # the body stalled: 408 in OpenAI's shape, then closed
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408")
            assert json.loads(payload)["error"]["code"] == "request_timeout"
        else:
            assert answer == b""
        writer.close()
    async with aiohttp.ClientSession() as session, session.get(f"{server['url']}/health") as r:
        assert r.status == 200


@pytest.mark.slow
async def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(server):
    """8 choices x 20 top logprobs per token fill any socket buffer fast; the reader reads nothing."""
    aborted_before = await metric(server["url"], "chatd:request_success_total", finished_reason="abort")
    generated_before = await metric(server["url"], "chatd:generation_tokens_total")
    body = json.dumps({"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 1500, "n": 8,
                       "logprobs": True, "top_logprobs": 20, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server["host"], server["port"]))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        # Someone else is served meanwhile.
        other = openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0)
        reply = await other.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
        # The stalled request ends long before its 8 x 1500 tokens, and nothing is left of it.
        assert await engine_is_empty(server["url"]) == (0, 0, 0, 0)
        generated = await metric(server["url"], "chatd:generation_tokens_total") - generated_before
        assert generated < 8 * 1500
        assert await metric(server["url"], "chatd:request_success_total", finished_reason="abort") == aborted_before + 1
        # Its connection was closed: reading what the kernel kept ends, it does not block.
        sock.settimeout(20)
        while sock.recv(1 << 20):
            pass
    finally:
        sock.close()
    assert "dropping a client that does not read" in server["log"].read_text()


# Polls /health from its own process, so the test client's work never counts as the server's.
HEALTH_POLLER = """
import http.client, json, sys, time
connection = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]))
latencies, end = [], time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    started = time.perf_counter()
    connection.request("GET", "/health")
    assert connection.getresponse().read()
    latencies.append(time.perf_counter() - started)
    time.sleep(0.01)
print(json.dumps(latencies))
"""


@pytest.mark.slow
async def test_health_answers_fast_while_the_largest_prompts_arrive(server):
    """One client sends prompts of the most text that is tokenized at all, and 3.9 MB ones refused
    from their size, one after another: meanwhile /health answers every poll within 100 ms."""
    tokenizer = Tokenizer.from_pretrained(server["model_dir"])
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server['url']}/v1/models") as r:
            window = (await r.json())["data"][0]["context_length"]
        largest = window * tokenizer.max_token_chars

        def body(chars: int) -> bytes:  # encoded up front, once
            content = ("word " * (chars // 5 + 1))[:chars]
            return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()

        async def chat(data: bytes) -> dict:
            async with session.post(f"{server['url']}/v1/chat/completions", data=data,
                                    headers={"Content-Type": "application/json"}) as r:
                return {"status": r.status, **(await r.json())}

        largest_body, huge_body = body(largest), body(3_900_000)
        poller = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HEALTH_POLLER, server["host"], str(server["port"]), "4", stdout=asyncio.subprocess.PIPE)
        answers = []
        while poller.returncode is None and len(answers) < 400:  # one client, one prompt after another
            answers.append(await chat(largest_body if len(answers) % 2 == 0 else huge_body))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(poller.wait()), 0.001)
        latencies = json.loads((await poller.communicate())[0])
    assert len(latencies) >= 20 and max(latencies) < 0.1, sorted(latencies)[-5:]
    for answer in answers:  # too many tokens (counted), or too many characters (refused unread)
        assert answer["status"] == 400 and answer["error"]["param"] == "messages"
    huge = answers[1]["error"]["message"]
    assert "3900000 characters" in huge and f"at most {largest} characters" in huge


async def test_encoded_bodies_decode_or_get_a_4xx_naming_the_encoding(server):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async def post(data: bytes, encoding: str) -> tuple[int, dict]:
            headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
            async with session.post(f"{server['url']}/v1/chat/completions", data=data, headers=headers) as r:
                return r.status, await r.json()

        assert (await post(gzip.compress(body), "gzip"))[0] == 200
        assert (await post(zlib.compress(body), "deflate"))[0] == 200
        for data, encoding, status in [(body, "gzip", 400), (zlib.compress(body), "gzip", 400), (body, "deflate", 400),
                                       (gzip.compress(body)[:-9], "gzip", 400), (body, "br", 415), (body, "zstd", 415)]:
            got, error = await post(data, encoding)
            assert got == status and error["error"]["param"] == "Content-Encoding", (encoding, error)
        bomb = gzip.compress(b" " * (8 * 2**20))  # 8 KB that inflates to 8 MiB, past max_body_bytes
        got, error = await post(bomb, "gzip")
        assert got == 413 and error["error"]["code"] == "request_too_large"


async def test_usage_refuses_times_that_are_not_finite(server):
    async with aiohttp.ClientSession() as session:
        for query in ("start=nan", "end=inf", "start=-inf&end=10"):
            async with session.get(f"{server['url']}/v1/usage?{query}") as r:
                assert r.status == 400 and (await r.json())["error"]["param"] in ("start", "end")


def test_a_port_in_use_is_one_message_before_the_model_loads(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # The model path does not exist: had loading started first, the error would name it.
        done = subprocess.run([sys.executable, "-m", "chatd", "serve", "--model", str(tmp_path / "no-model"), "--port", str(port)],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "CHATD_HOME": str(tmp_path)})
    finally:
        taken.close()
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "config.toml"
    done = subprocess.run([sys.executable, "-m", "chatd", "serve", "--config", str(missing)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CHATD_HOME": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr.strip() == f"chatd: config file {str(missing)!r} does not exist"

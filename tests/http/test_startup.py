"""A real `chatd serve` starting and stopping as a probe, a load balancer and an operator see it
(starting.py, serve.py): the port answers while the model loads (/live 200, /health 503 with the
phase), the start timeline is logged, SIGTERM keeps the port open and answers new requests and
/health 503 while replies in flight finish, then exits 0; listening beyond loopback with no key is
warned about. /metrics carries vLLM's names for what a gateway in front of replicas reads."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import httpx
import pytest

from chatd.config_loader import build_config
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from chatd.engine.models.demo import build_demo_model
from chatd.http.serve import Listening, reserve_port, warn_if_open
from chatd.http.server.starting import Startup, starting_app
from tests.http.serving import start_server

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# Several KV blocks long, so that sending it twice finds its blocks in the prefix cache.
LONG_CHAT = {**CHAT, "messages": [{"role": "user", "content": "Tell me how a paged KV cache shares a prefix. " * 6}]}


def _get(url: str) -> tuple[int, dict, dict]:
    """Status, JSON body and headers of a GET (errors included); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)
    except OSError:
        return 0, {}, {}


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def _metrics(url: str) -> dict[str, float]:
    """/metrics as `name{label=value,...}` -> value (labels sorted)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_while_starting_live_is_200_and_health_and_ready_503_with_the_phase():
    """A supervisor's liveness probe (/live) keeps a loading server; a gateway's (/health) sends it nothing yet."""
    startup = Startup(age=lambda: 0.0)
    client = TestClient(TestServer(starting_app(startup)))
    await client.start_server()
    try:
        for phase in ("loading", "warming up"):
            startup.phase = phase
            live = await client.get("/live")
            assert live.status == 200 and (await live.json())["phase"] == phase
            for path in ("/health", "/ready"):
                answer = await client.get(path)
                assert answer.status == 503 and (await answer.json())["phase"] == phase, path
                assert int(answer.headers["Retry-After"]) > 0
    finally:
        await client.close()


async def test_a_connection_taken_before_the_hand_over_is_answered_not_reset():
    """A probe that connected to the starting app just before the full app took the port, and sent
    its request after, gets the starting app's 503 (not a reset connection); its next connection
    reaches the full app, and the port never refuses one in between."""
    async def full(_request):
        return web.json_response({"status": "ready"})

    sock = reserve_port("127.0.0.1", 0)
    startup = Startup(age=lambda: 0.0)
    startup.phase = "warming up"
    early = web.AppRunner(starting_app(startup), access_log=None)
    await early.setup()
    early_site = web.SockSite(early, sock.dup())
    await early_site.start()
    listening = Listening(sock, early, early_site, startup)
    full_app = web.Application()
    full_app.router.add_get("/ready", full)
    runner = web.AppRunner(full_app)
    await runner.setup()
    port = sock.getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)  # the starting app has taken it
        await listening.hand_over(runner)
        startup.phase = "serving"
        await asyncio.sleep(0.5)  # the client is slow to send
        writer.write(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After" in head, head
        assert b'"warming up"' in await reader.read(), "answered as the server was when it connected"
        writer.close()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/ready") as answer:
                assert answer.status == 200 and (await answer.json())["status"] == "ready"
        # The starting app goes once its connection was answered, not after the hand-over's bound.
        await asyncio.wait_for(listening.retiring, 2)
    finally:
        await runner.cleanup()
        await listening.close()


def test_the_port_answers_while_the_model_loads_and_the_start_timeline_is_logged(tmp_path):
    """Before the model serves: /health and /ready 503 with the phase and Retry-After, a chat
    request 503 with Retry-After in OpenAI's shape; then ready, and the log holds the timeline.
    Once it serves, /metrics' vLLM names read what chatd's say."""
    model_dir = build_demo_model(tmp_path / "demo")
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "CHATD_HOME": str(tmp_path / "home")}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--port", "0"],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"start: listening after [\d.]+ s \((http://127\.0\.0\.1:\d+)", log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        url = found.group(1)
        seen = set()
        while True:
            health, body, headers = _get(url + "/health")
            if health == 200:
                break
            # Not serving yet: a gateway probing /health sends it nothing, and is told when to look again.
            assert health == 503 and body["phase"] in ("loading", "warming up"), (health, body)
            assert int(headers["Retry-After"]) > 0
            seen.add(body["phase"])
            ready, ready_body, _ = _get(url + "/ready")
            assert ready == 200 or ready_body["status"] in ("loading", "warming up"), ready_body
            status, error, headers = _post(url + "/v1/chat/completions", CHAT)
            if status == 503:  # (the model may have come up in between)
                assert error["error"]["code"] == "server_starting" and int(headers["Retry-After"]) > 0
                assert "starting" in error["error"]["message"]
            assert time.monotonic() < deadline
        assert "loading" in seen, "the port should answer while the model loads"
        assert (body["status"], body["phase"]) == ("ok", "serving")
        assert _get(url + "/ready")[0] == 200 and _get(url + "/live")[0] == 200
        status, reply, _ = _post(url + "/v1/chat/completions", CHAT)
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1
        for _ in range(2):  # the second finds the first's blocks in the prefix cache
            assert _post(url + "/v1/chat/completions", LONG_CHAT)[0] == 200
        samples = _metrics(url)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "prefix_cache_queries_total", "prefix_cache_hits_total"):
            assert samples[f"vllm:{name}{{engine=0,model_name=demo}}"] == samples[f"chatd:{name}{{model_name=demo}}"], name
        assert samples["vllm:prefix_cache_hits_total{engine=0,model_name=demo}"] > 0
        assert 0 < samples["vllm:gpu_prefix_cache_hit_rate{engine=0,model_name=demo}"] < 1
        while "start timeline:" not in log_path.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    text = log_path.read_text()
    marks = {name: float(seconds) for name, seconds in re.findall(r"start: (\w[\w ]*?) after ([\d.]+) s", text)}
    assert marks["listening"] <= marks["loaded"] <= marks["ready"], marks
    timeline = re.search(r"start timeline: (.*) \(seconds", text).group(1)
    assert timeline.startswith(f"listening {marks['listening']:.1f} s, loaded {marks['loaded']:.1f} s, ready")


@pytest.mark.slow  # 7-8 s: a second server start of its own
def test_sigterm_keeps_listening_refuses_new_requests_and_lets_replies_in_flight_finish(tmp_path):
    """After SIGTERM: /health and /ready 503 (draining) and new requests 503 with Retry-After, while a stream
    under way goes on to its last token; then the server exits 0."""
    model_dir = build_demo_model(tmp_path / "demo")
    proc, url, log_path = start_server(tmp_path, model_dir, "[server]\nshutdown_grace_seconds = 60\n")
    try:
        with httpx.Client(timeout=60) as client:
            body = {**CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True, "temperature": 0}
            with client.stream("POST", url + "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while "stopping:" not in log_path.read_text():
                    assert time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.02)
                # The stream's reader waits; the server keeps its port and says it is draining.
                ready, ready_body, headers = _get(url + "/ready")
                assert (ready, ready_body["status"]) == (503, "draining") and int(headers["Retry-After"]) >= 1
                assert _get(url + "/live")[0] == 200  # a supervisor leaves it be
                health, health_body, headers = _get(url + "/health")  # a gateway takes it out of rotation
                assert (health, health_body["phase"]) == (503, "draining") and int(headers["Retry-After"]) >= 1
                status, error, headers = _post(url + "/v1/chat/completions", CHAT)
                assert status == 503 and error["error"]["code"] == "server_shutting_down"
                assert int(headers["Retry-After"]) >= 1
                events = [first, *(line for line in lines if line.startswith("data: "))]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("::", True), ("192.168.1.20", True), ("chat.lan", True),
                                          ("127.0.0.1", False), ("::1", False), ("localhost", False)])
def test_listening_beyond_loopback_without_a_key_is_warned_about(host, warned, caplog):
    with caplog.at_level(logging.WARNING, "chatd.http"):
        warn_if_open(build_config({"server": {"host": host}}))
        warn_if_open(build_config({"server": {"host": host}, "auth": {"api_key": "sk-local-0123456789"}}))
    warnings = [r.getMessage() for r in caplog.records if "no API key" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0), warnings
    if warned:
        assert host in warnings[0] and "CHATD_API_KEY" in warnings[0]

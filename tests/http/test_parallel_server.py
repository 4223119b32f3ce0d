"""A real `chatd serve --tensor-parallel-size 2` on CPU (gloo), with the OpenAI SDK as client: a
worker that dies or hangs mid-stream fails the stream with the reason, /health and /ready turn
503 and say why, new requests get 503, and the server still stops cleanly on SIGTERM with no
worker left behind; a server killed outright takes its workers with it."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

pytestmark = pytest.mark.slow

CONFIG = """
[model]
device = "cpu"
tensor_parallel_size = 2
worker_timeout = 2.0
"""


@pytest.fixture
def server(tmp_path):
    """chatd serve over two ranks; yields (process, url, log, worker process)."""
    proc, url, log = start_server(tmp_path, build_demo_model(tmp_path / "demo"), CONFIG)
    try:
        workers = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())
                   and "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 1, "one worker process for rank 1"
        yield proc, url, log, workers[0]
    finally:
        proc.kill()
        proc.wait()


def stream_until(url: str, signal_worker) -> tuple[int, openai.APIError | None]:
    """Stream a long reply; after a few chunks call `signal_worker()`. Returns the chunks seen and the error raised."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = 0
    try:
        stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Count."}],
                                                max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            chunks += 1
            if chunks == 5:
                signal_worker()
    except openai.APIError as error:
        return chunks, error
    return chunks, None


def assert_unavailable(url: str, reason: str) -> None:
    for route in ("/health", "/ready"):
        answer = httpx.get(f"{url}{route}")
        assert answer.status_code == 503 and reason in answer.json()["error"], (route, answer.text)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert refused.value.status_code == 503 and reason in refused.value.message
    assert refused.value.code == "engine_unavailable"


def assert_stops_cleanly(proc, children: list[psutil.Process]) -> None:
    stop_server(proc)  # SIGTERM: exit 0 within 30 s
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert alive == [], f"processes left behind: {alive}"


def test_a_worker_killed_mid_stream_fails_the_stream_and_health_says_why(server):
    proc, url, _, worker = server
    details = httpx.get(f"{url}/v1/models").json()["data"][0]["chatd"]
    assert details["tensor_parallel_size"] == 2
    assert httpx.get(f"{url}/health").status_code == 200
    children = psutil.Process(proc.pid).children(recursive=True)
    started = time.monotonic()
    chunks, error = stream_until(url, lambda: worker.send_signal(signal.SIGKILL))
    assert error is not None and chunks >= 5, "the stream must end in an error, not as if complete"
    assert "worker rank 1" in str(error) and "exited with code -9" in str(error)
    assert time.monotonic() - started < 10
    assert_unavailable(url, "worker rank 1")
    assert_stops_cleanly(proc, children)


def test_a_hung_worker_is_found_within_its_timeout_and_stopped(server):
    proc, url, log, worker = server
    children = psutil.Process(proc.pid).children(recursive=True)
    stopped_at = []

    def hang() -> None:
        worker.send_signal(signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        stopped_at.append(time.monotonic())

    chunks, error = stream_until(url, hang)
    assert error is not None and "stopped answering for 2 s" in str(error)
    assert time.monotonic() - stopped_at[0] < 2 + 3  # the timeout, and a heartbeat or two
    assert_unavailable(url, "stopped answering")
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, "the hung worker is killed"
    assert_stops_cleanly(proc, children)
    assert "tensor parallelism failed" in log.read_text()


def test_a_server_killed_outright_takes_its_workers_with_it(server):
    proc, _, _, worker = server
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert alive == [], f"processes left behind: {alive}"

"""A model whose engine dies, in a real `chatd serve` with each engine in a process of its own: its
reply in flight ends with an error event, the other model serves on, /health stays 200, and the
next request to it is served by the model loaded again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from chatd.engine.models.demo import build_demo_model, build_model_dir
from tests.http.serving import start_server, stop_server

pytestmark = pytest.mark.slow

CONFIG = """
[server]
engine_process = "on"
[model]
device = "cpu"
compile = false
[[models]]
name = "small"
path = "{demo}"
[[models]]
name = "qwen"
path = "{qwen}"
"""


def engine_processes(pid: int) -> list[int]:
    """The server's engine processes (multiprocessing's spawned children), oldest first."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return sorted(c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


async def card(session: aiohttp.ClientSession, url: str, name: str) -> dict:
    async with session.get(f"{url}/v1/models") as response:
        return next(c for c in (await response.json())["data"] if c["id"] == name)


async def test_a_dead_engine_ends_its_reply_with_an_error_and_its_model_is_loaded_again(tmp_path):
    demo, qwen = build_demo_model(tmp_path / "demo"), build_model_dir(tmp_path / "qwen", "qwen2", seed=3)
    proc, url, log = start_server(tmp_path, demo, CONFIG.format(demo=demo, qwen=qwen))
    try:
        async with aiohttp.ClientSession() as session:
            ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with session.post(f"{url}/v1/chat/completions", json={**ask, "model": "qwen"}) as r:
                assert r.status == 200
            first, qwen_engine = engine_processes(proc.pid)[0], engine_processes(proc.pid)[-1]
            assert qwen_engine != first
            body = {"model": "qwen", "prompt": "Count:", "max_tokens": 1900, "stream": True, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as stream:
                await stream.content.readline()  # the reply has begun
                os.kill(qwen_engine, signal.SIGKILL)
                events = [line async for line in stream.content if line.startswith(b"data: ")]
            assert b'"error"' in events[-1] and b"[DONE]" not in b"".join(events)
            async with session.post(f"{url}/v1/chat/completions", json={**ask, "model": "small"}) as r:
                assert r.status == 200 and (await r.json())["model"] == "small"
            async with session.get(f"{url}/health") as r:
                assert r.status == 200
            deadline = time.monotonic() + 60
            while True:  # the next request to it is served, by the model loaded again
                async with session.post(f"{url}/v1/chat/completions", json={**ask, "model": "qwen"}) as r:
                    if r.status == 200:
                        break
                    assert r.status == 503 and "'qwen'" in (await r.json())["error"]["message"]
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            assert (await card(session, url, "qwen"))["chatd"]["loads"] == 2
            assert first in engine_processes(proc.pid)  # the first model's engine never went
    finally:
        stop_server(proc)
    assert "its engine stopped" in log.read_text()

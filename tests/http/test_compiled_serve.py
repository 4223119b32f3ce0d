"""A real `chatd serve` on CPU with compiled decode steps (chatd's default; the suite turns it off).

They compile on a thread while eager steps serve (worker/fast_steps/compile_job.py). Two tenants streaming at once share compiled decode batches: each gets, token for token, the
reply it gets alone. A machine without a C++ compiler is told so in the log and served eagerly.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.engine.test_compiled import needs_cpp_compiler
from tests.http.serving import create_key, start_server, stop_server

pytestmark = pytest.mark.slow

COMPILE_ON = {"TORCH_COMPILE_DISABLE": None}


def config_text(root) -> str:
    return f'[model]\ndevice = "cpu"\n[store]\ndb_path = "{root / "chatd.db"}"\n[auth]\nenabled = true\n'


def reply(url: str, key: str, content: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}],
                                            max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def wait_for_timeline(log, proc, seconds: float = 600) -> str:
    """The log once the start timeline is in (the compiled steps are in use, or failed)."""
    deadline = time.monotonic() + seconds
    while "start timeline:" not in (text := log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, text
        time.sleep(0.2)
    return text


@needs_cpp_compiler
def test_replies_while_steps_compile_match_the_compiled_ones_and_two_tenants_share_them(tmp_path):
    """The server is ready before its steps are compiled (they compile on a thread): replies while
    they compile (eager steps) are token for token those after (compiled steps); then two tenants
    streaming at once share compiled decode batches and each gets the reply it gets alone."""
    text = config_text(tmp_path)
    (tmp_path / "config.toml").write_text(text)
    keys = {name: create_key(tmp_path / "config.toml", name) for name in ("alice", "bob")}
    proc, url, log = start_server(tmp_path, build_demo_model(tmp_path / "demo"), text, COMPILE_ON)
    try:
        prompts = {"alice": "Tell me about the sea.", "bob": "Name three colours, please, and why."}
        headers = {"Authorization": f"Bearer {keys['alice']}"}
        assert httpx.get(f"{url}/ready").json() == {"status": "ready", "compiled_steps": "compiling",
                                                      "models": {"demo": "loaded"}}
        while_compiling = {name: reply(url, keys[name], prompt) for name, prompt in prompts.items()}
        during = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["chatd"]
        assert "compiled steps in use" not in log.read_text(), "the replies should have come while the steps compiled"
        assert (during["compiled_steps"], during["compiled_decode"]) == ("compiling", False)
        timeline = wait_for_timeline(log, proc)
        assert "compiled steps in use: decode steps and prefill steps of 192 tokens or more" in timeline
        assert re.search(r"start timeline: listening [\d.]+ s, loaded [\d.]+ s, ready [\d.]+ s, first token [\d.]+ s, "
                         r"compiled [\d.]+ s", timeline), timeline
        assert httpx.get(f"{url}/ready").json() == {"status": "ready", "compiled_steps": "compiled",
                                                      "models": {"demo": "loaded"}}
        card = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]
        assert card["chatd"]["compiled_decode"] is True
        assert card["chatd"]["compiled_prefill_tokens"] == 192
        alone = {name: reply(url, keys[name], prompt) for name, prompt in prompts.items()}
        assert alone == while_compiling
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = [pool.submit(reply, url, keys[name], prompts[name]) for name in ("alice", "bob") * 2]
            answers = [f.result() for f in together]
        assert answers == [alone["alice"], alone["bob"]] * 2
        assert alone["alice"] != alone["bob"]
    finally:
        stop_server(proc)


def test_without_a_cpp_compiler_the_server_says_so_and_serves_eagerly(tmp_path):
    # A fresh CHATD_HOME (start_server's) holds no compiled code to read back: inductor needs the compiler.
    text = '[model]\ndevice = "cpu"\n'
    proc, url, log = start_server(tmp_path, build_demo_model(tmp_path / "demo"), text,
                                  {**COMPILE_ON, "CXX": str(tmp_path / "no-such-compiler")})
    try:
        assert reply(url, "unused", "Hello") != ""
        assert "compiling decode and prefill steps failed" in wait_for_timeline(log, proc)
        assert httpx.get(f"{url}/ready").json() == {"status": "ready", "compiled_steps": "failed",
                                                      "models": {"demo": "loaded"}}
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["chatd"]["compiled_decode"] is False
        assert card["chatd"]["compiled_prefill_tokens"] == 0
    finally:
        stop_server(proc)

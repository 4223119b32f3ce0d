"""One shared API key (CHATD_API_KEY, `--api-key`, [auth] api_key) on a real `chatd serve`
(auth.py): every /v1/ route and /tokenize, /detokenize need it, the operator's probes do not,
every caller is the local tenant, the key is never logged, and `chatd chat` sends it."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

KEY = "sk-shared-7f3a9c"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve with the shared key given in CHATD_API_KEY; yields (url, log file)."""
    root = tmp_path_factory.mktemp("shared-key")
    model_dir = build_demo_model(root / "demo")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CHATD_API_KEY", KEY)
        proc, url, log_path = start_server(root, model_dir, "[cache]\nnum_blocks = 256\n")
    yield url, log_path
    stop_server(proc)


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key", ["", "sk-wrong", KEY[:-1], KEY + "0"])
def test_a_missing_or_wrong_key_is_a_401_on_every_guarded_route(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path, body in (("POST", "/v1/chat/completions", {"model": "demo", "messages": MESSAGES}),
                               ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}),
                               ("POST", "/detokenize", {"tokens": [1]})):
        response = httpx.request(method, server[0] + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
        assert ("missing API key" if not key else "invalid API key") in error["message"]
        assert "`chatd serve --api-key` or CHATD_API_KEY" in error["message"]  # which key to send (the page shows it)
    with pytest.raises(openai.AuthenticationError) as err:
        sdk(server, key or "unused").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert err.value.code == "invalid_api_key"


def test_the_right_key_is_served_and_every_caller_is_the_local_tenant(server):
    client = sdk(server, KEY)
    reply = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert reply.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == ["demo"]
    headers = {"Authorization": f"Bearer {KEY}"}
    tokenized = httpx.post(f"{server[0]}/tokenize", json={"messages": MESSAGES}, headers=headers, timeout=30)
    assert tokenized.status_code == 200 and tokenized.json()["count"] == reply.usage.prompt_tokens
    assert httpx.post(f"{server[0]}/detokenize", json={"tokens": [1]}, headers=headers, timeout=30).status_code == 200
    usage = httpx.get(f"{server[0]}/v1/usage", headers=headers, timeout=30).json()
    assert usage["tenant"] == "local" and usage["requests"] >= 1


def test_probes_and_the_page_stay_open(server):
    for path in ("/live", "/health", "/ready", "/metrics", "/"):
        assert httpx.get(server[0] + path, timeout=30).status_code == 200, path
    assert httpx.get(server[0] + "/openapi.json", timeout=30).status_code != 401  # describes the API, no tenant data


def test_the_key_is_never_logged(server):
    log = server[1].read_text()
    assert "auth: one shared API key is set" in log
    assert KEY not in log


def run_chat(server, env_key: str | None, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CHATD_API_KEY"}
    if env_key is not None:
        env["CHATD_API_KEY"] = env_key
    return subprocess.run([sys.executable, "-m", "chatd", "chat", "--url", server[0], "--max-tokens", "4", *flags],
                          input=b"hello\n", capture_output=True, timeout=120, env=env)


def test_chatd_chat_sends_chatd_api_key_and_its_flag_wins(server):
    done = run_chat(server, KEY)
    assert done.returncode == 0, done.stderr[-3000:]
    assert b"error:" not in done.stdout
    refused = run_chat(server, KEY, "--api-key", "sk-wrong")
    assert refused.returncode == 0  # the end of input quits
    assert b"error: HTTP 401: invalid API key" in refused.stdout
    assert b"error: HTTP 401: missing API key" in run_chat(server, None).stdout

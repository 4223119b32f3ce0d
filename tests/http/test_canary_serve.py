"""Canary ramps on a real `chatd serve` ([[models]]: two copies of the demo model and a slower
random model built here), the SDK as the client, the admin routes to watch: a healthy version
advances to 100% step by step, and a slow one is rolled back to 0% within one bake period. Each
canary is loaded as its ramp starts, so no request of it measures a load."""

from __future__ import annotations

import json
import time
import urllib.request

import aiohttp
import openai
import pytest

from chatd.engine.models.demo import build_demo_model, build_model_dir
from tests.http.serving import start_server, stop_server

pytestmark = pytest.mark.slow
ADMIN = "operator-secret"
CONFIG = """
[store]
db_path = "{db}"
[auth]
admin_key = "{admin}"
[model]
device = "cpu"
compile = false
[[models]]
name = "stable"
path = "{demo}"
[[models]]
name = "v2"
path = "{demo}"
[[models]]
name = "slow"
path = "{slow}"
[aliases.good]
targets = {{ stable = 100, v2 = 0 }}
ramp = {{ canary = "v2", steps = [10, 50, 100], bake_seconds = 1, min_requests = 20, max_ttft_p95_ratio = 10 }}
[aliases.bad]
targets = {{ stable = 100, slow = 0 }}
ramp = {{ canary = "slow", steps = [25, 100], bake_seconds = 60, min_requests = 5, max_ttft_p95_ratio = 4 }}
# (the same model's p95 over a few requests varies on a busy machine: the healthy ramp's bound is loose,
# the slow model's time to first token is many times the demo model's)
"""
PROMPT = "Tell me about the river that runs under the old stone bridge in the town. " * 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("canary")
    demo = build_demo_model(root / "demo")
    slow = build_model_dir(root / "slow", "qwen2", seed=5, hidden_size=768, intermediate_size=3072,
                           num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4)
    config = CONFIG.format(db=root / "chatd.db", admin=ADMIN, demo=demo, slow=slow)
    proc, url, _ = start_server(root, demo, config)
    try:
        deadline = time.monotonic() + 120  # each ramping canary is loaded ahead of its traffic
        while {card["id"]: card["status"] for card in json.loads(urllib.request.urlopen(f"{url}/v1/models").read())[
                "data"] if card["id"] in ("v2", "slow")} != {"v2": "loaded", "slow": "loaded"}:
            assert time.monotonic() < deadline, "the canaries were never loaded"
            time.sleep(0.2)
        yield url
    finally:
        stop_server(proc)


async def ramp(url: str, alias: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(
            f"{url}/admin/canaries", headers={"Authorization": f"Bearer {ADMIN}"}) as response:
        assert response.status == 200
        return next(r for r in (await response.json())["data"] if r["alias"] == alias)


async def drive(url: str, alias: str, until: str, seconds: float = 180.0) -> dict:
    """Chat requests to the alias, one at a time, until its ramp's state is `until`."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + seconds
    while (state := await ramp(url, alias))["state"] != until:
        assert time.monotonic() < deadline, (state["events"], state["measured"])
        for _ in range(10):
            await client.chat.completions.create(model=alias, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=1)
    return state


async def test_a_healthy_version_advances_to_100_percent(server):
    state = await drive(server, "good", "done")
    assert [(e["action"], e["weight"]) for e in state["events"]] == [
        ("start", 10.0), ("advance", 50.0), ("advance", 100.0), ("done", 100.0)]
    async with aiohttp.ClientSession() as session, session.get(f"{server}/metrics") as response:
        metrics = await response.text()
    assert 'chatd:canary_weight{alias="good",model_name="v2"} 100.0' in metrics


async def test_a_slow_version_is_rolled_back_within_one_bake_period(server):
    state = await drive(server, "bad", "rolled_back")
    start, rollback = state["events"][0], state["events"][-1]
    assert (start["action"], rollback["action"], rollback["weight"]) == ("start", "rollback", 0.0)
    assert rollback["created_at"] - start["created_at"] < 60  # before the first step's bake was over
    assert "p95 time to first token" in rollback["reason"]
    assert state["measured"]["canary"]["ttft_p95"] > 4 * state["measured"]["stable"]["ttft_p95"]
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    served = {(await client.chat.completions.create(model="bad", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1)).model for _ in range(20)}
    assert served == {"stable"}  # nothing goes to the rolled-back version

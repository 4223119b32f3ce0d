"""Tiers through a real `chatd serve` with the key database on and tenants of several tiers, the
official OpenAI SDK as the client: 429 with OpenAI's headers and the SDK's own retry, separate
budgets per tenant, concurrency held by a reply that outlives its client, the max_tokens ceiling
and model access, the remaining budget in /v1/usage, a revoked key, the queue bound (503)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import openai
import pytest

from tests.http.serving import tenants_server

TIERS = """
[server]
model_name = ["demo", "demo-large"]
heartbeat_seconds = 0.5
[tiers.metered]
tokens_per_minute = 6000
priority = 20
[tiers.single]
max_concurrent_requests = 1
priority = 20
[tiers.capped]
max_tokens = 8
models = ["demo"]
requests_per_minute = 1000
priority = 20
"""
WHO = {"alice": "metered", "bob": "metered", "carol": "single", "dave": "capped", "erin": "paid"}
QUESTION = [{"role": "user", "content": "What does a scheduler do?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tenants_server(tmp_path_factory.mktemp("tiers"), TIERS, tuple(WHO), WHO) as server:
        yield server


def client(server, who: str, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=retries)


async def refused_count(server, tier: str, reason: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{server['url']}/metrics") as r:
        text = await r.text()
    line = next(line for line in text.splitlines() if line.startswith("chatd:tier_requests_rate_limited_total{")
                and f'tier="{tier}"' in line and f'reason="{reason}"' in line)
    return float(line.rsplit(" ", 1)[1])


async def test_over_its_tokens_the_sdk_gets_429_with_openai_s_headers_and_its_retry_succeeds(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    # Three choices of up to 1900 tokens reserve ~5,700 of alice's 6,000 a minute while they stream.
    hog = await alice.chat.completions.create(model="demo", messages=QUESTION, max_tokens=1900, n=3, stream=True,
                                              extra_body={"ignore_eos": True})
    await hog.__anext__()
    refusals = await refused_count(server, "metered", "tokens")
    with pytest.raises(openai.RateLimitError) as refused:
        await alice.chat.completions.create(model="demo", messages=QUESTION, max_tokens=400)
    headers = refused.value.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "6000" and int(headers["x-ratelimit-remaining-tokens"]) < 400
    assert 1 <= int(headers["retry-after"]) <= 10 and int(headers["retry-after-ms"]) > 0
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    assert refused.value.code == "rate_limit_exceeded" and "tokens per minute" in refused.value.message

    # Bob's budget is his own, though his tier is alice's.
    raw = await bob.chat.completions.with_raw_response.create(model="demo", messages=QUESTION, max_tokens=20)
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) > 5000
    assert raw.parse().choices[0].message.content is not None

    # The SDK's own retry waits what retry-after-ms says, then gets through.
    started = time.monotonic()
    retrying = asyncio.create_task(client(server, "alice", retries=3).chat.completions.create(
        model="demo", messages=QUESTION, max_tokens=400))
    deadline = time.monotonic() + 60
    while await refused_count(server, "metered", "tokens") < refusals + 2:  # its first try is refused
        assert time.monotonic() < deadline and not retrying.done(), "the retried request was never refused"
        await asyncio.sleep(0.05)
    await hog.close()  # the hog ends: what it did not generate comes back to alice's bucket
    reply = await asyncio.wait_for(retrying, 60)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert time.monotonic() - started >= 0.9  # it waited for the advertised time at least once


async def test_every_response_to_a_limited_tenant_carries_its_budget_and_usage_shows_it(server):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server['url']}/v1/models", headers={"Authorization": f"Bearer {server['keys']['bob']}"}) as r:
            assert r.status == 200 and r.headers["x-ratelimit-limit-tokens"] == "6000"
            assert "x-ratelimit-limit-requests" not in r.headers  # bob's tier counts no requests
        async with session.get(f"{server['url']}/v1/usage", headers={"Authorization": f"Bearer {server['keys']['bob']}"}) as r:
            usage = await r.json()
        assert usage["tier"] == "metered"
        assert usage["limits"]["tokens_per_minute"] == 6000 and 0 < usage["limits"]["remaining_tokens"] <= 6000
        async with session.get(f"{server['url']}/v1/models", headers={"Authorization": f"Bearer {server['keys']['erin']}"}) as r:
            assert r.status == 200 and not any(h.startswith("x-ratelimit") for h in r.headers)  # unlimited: none


async def test_a_reply_that_outlives_its_client_holds_its_concurrency_slot(server):
    headers = {"Authorization": f"Bearer {server['keys']['carol']}"}
    carol = client(server, "carol")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server['url']}/v1/conversations", json={}, headers=headers) as r:
            conversation = (await r.json())["id"]
        body = {"content": "Tell me a long story.", "max_tokens": 600, "ignore_eos": True, "stream": True}
        async with session.post(f"{server['url']}/v1/conversations/{conversation}/messages", json=body, headers=headers) as r:
            assert r.status == 200
            await r.content.readuntil(b"data: ")  # it has begun; the client leaves, the reply goes on
    with pytest.raises(openai.RateLimitError) as refused:
        await carol.chat.completions.create(model="demo", messages=QUESTION, max_tokens=4)
    assert refused.value.code == "concurrency_limit_exceeded"
    assert refused.value.response.headers["retry-after"] == "1"
    # Another tenant is not held back, and carol's slot comes back when her reply ends.
    await client(server, "erin").chat.completions.create(model="demo", messages=QUESTION, max_tokens=4)
    # 600 tokens take seconds on a quiet machine and a minute or more on two contended cores.
    deadline = time.monotonic() + 180
    while True:
        try:
            reply = await carol.chat.completions.create(model="demo", messages=QUESTION, max_tokens=4)
            break
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                pytest.fail("carol's slot never came back")
            await asyncio.sleep(0.1)
    assert reply.usage.completion_tokens >= 1


async def test_the_tier_caps_max_tokens_and_limits_the_models(server):
    dave = client(server, "dave")
    with pytest.raises(openai.BadRequestError) as refused:
        await dave.chat.completions.create(model="demo", messages=QUESTION, max_completion_tokens=100)
    assert refused.value.param == "max_completion_tokens" and "over the limit of 8 for tier capped" in refused.value.message
    reply = await dave.chat.completions.create(model="demo", messages=QUESTION, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8  # the ceiling is the default length
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await dave.chat.completions.create(model="demo-large", messages=QUESTION, max_tokens=4)
    assert refused.value.code == "model_not_allowed" and "tier (capped)" in refused.value.message
    assert [m.id async for m in dave.models.list()] == ["demo"]
    assert [m.id async for m in client(server, "erin").models.list()] == ["demo", "demo-large"]


async def test_a_revoked_key_s_request_in_flight_finishes_and_its_next_is_401(server):
    erin = client(server, "erin")
    stream = await erin.chat.completions.create(model="demo", messages=QUESTION, max_tokens=200, stream=True,
                                                extra_body={"ignore_eos": True})
    await stream.__anext__()
    key_id = server["keys"]["erin"].split("_")[1]
    subprocess.run([sys.executable, "-m", "chatd", "keys", "revoke", key_id, "--config", str(server["config"])],
                   check=True, capture_output=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        await erin.chat.completions.create(model="demo", messages=QUESTION, max_tokens=4)


@pytest.mark.slow
def test_a_full_tier_queue_is_refused_with_503_and_retry_after(tmp_path):
    """One sequence runs at a time: a second request of the tier waits for its first token, and a
    third finds the tier's queue (max_queued_requests = 1) full."""
    config = TIERS.split("[tiers.metered]")[0] + """
[scheduler]
max_num_seqs = 1
[tiers.free]
max_queued_requests = 1
requests_per_minute = 0
tokens_per_minute = 0
max_concurrent_requests = 0
ttft_p95_seconds = 0
"""
    with tenants_server(tmp_path, config, ("fay",), {"fay": "free"}) as srv:
        async def scenario() -> None:
            fay = client(srv, "fay")
            running = await fay.chat.completions.create(model="demo", messages=QUESTION, max_tokens=1500, stream=True,
                                                        extra_body={"ignore_eos": True})
            async for chunk in running:  # its first token: it runs, it has left the queue
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            waiting = asyncio.create_task(fay.chat.completions.create(model="demo", messages=QUESTION, max_tokens=4))
            await asyncio.sleep(0.5)  # queued behind it, no first token yet
            with pytest.raises(openai.InternalServerError) as refused:
                await fay.chat.completions.create(model="demo", messages=QUESTION, max_tokens=4)
            assert refused.value.status_code == 503 and refused.value.code == "server_overloaded"
            assert int(refused.value.response.headers["retry-after"]) >= 1
            assert "max_queued_requests" in refused.value.message
            await running.close()
            assert (await asyncio.wait_for(waiting, 30)).usage.completion_tokens == 4
            await fay.chat.completions.create(model="demo", messages=QUESTION, max_tokens=4)  # room again

        asyncio.run(scenario())
        log = srv["log"].read_text()
        assert "request refused" in log and "tenant=fay" in log and "tier=free" in log and "reason=queue_full" in log


def test_a_key_of_a_tier_the_config_does_not_define_stops_the_server_at_start(tmp_path):
    from tests.http.serving import create_key

    db = tmp_path / "chatd.db"
    with_gold = tmp_path / "with_gold.toml"
    with_gold.write_text(f'[store]\ndb_path = "{db}"\n[tiers.gold]\npriority = 5\n')
    key = create_key(with_gold, "goldie", "gold")
    without = tmp_path / "config.toml"
    without.write_text(f'[store]\ndb_path = "{db}"\n[auth]\nenabled = true\n')
    done = subprocess.run([sys.executable, "-m", "chatd", "serve", "--model", "demo", "--config", str(without),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    key_id = key.split("_")[1]
    assert f"key {key_id} (tenant 'goldie') has tier 'gold'" in done.stderr and "[tiers.gold]" in done.stderr

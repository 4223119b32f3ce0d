"""A conversation's turns land on the replica that holds its KV prefix, through a real gateway:
the SGLang Model Gateway's cache-aware policy for chat completions, its routing-key override for
Responses chains, with round-robin as the control."""

from __future__ import annotations

import statistics

import httpx
import pytest

from tests.replicas import cluster

pytestmark = pytest.mark.slow

CONVERSATIONS, TURNS = 4, 5
BLOCK = 16  # the demo model's KV block, in tokens


@pytest.fixture(scope="module")
def gateways(replicas, tmp_path_factory):
    why = cluster.missing("smg")
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("gateways")
    started = {policy: cluster.Smg(folder, replicas, policy) for policy in ("cache_aware", "round_robin")}
    yield started
    for gateway in started.values():
        gateway.stop()


def chat_hit_rates(url: str, tag: str) -> list[float]:
    """Play CONVERSATIONS conversations of TURNS turns, interleaved, each resending its history; for
    turns 2 on, the cached share of the previous turn's prompt (its full KV blocks: what a cache keeps)."""
    histories = [[{"role": "system", "content": f"Conversation {tag}-{c}: answer every question in short lines. " * 6}]
                 for c in range(CONVERSATIONS)]
    previous = [0] * CONVERSATIONS
    rates = []
    with httpx.Client(timeout=60) as client:
        for turn in range(TURNS):
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": f"Question {turn} of {tag}-{c}: and what comes next?"})
                r = client.post(f"{url}/v1/chat/completions", json={
                    "model": "demo", "messages": history, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                reply = r.json()
                usage = reply["usage"]
                if turn > 0:
                    rates.append(usage["prompt_tokens_details"]["cached_tokens"] / (previous[c] // BLOCK * BLOCK))
                previous[c] = usage["prompt_tokens"]
                history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return rates


def test_cache_aware_routing_keeps_a_conversation_on_its_replica_and_round_robin_does_not(gateways):
    """From turn 2 on every turn finds >= 90% of the previous turn's prompt in the cache behind
    the cache-aware gateway; behind round-robin, turns land where their prefix is not."""
    aware = chat_hit_rates(gateways["cache_aware"].url, "aware")
    spread = chat_hit_rates(gateways["round_robin"].url, "spread")
    print(f"\nprevious prompt found in the cache, turns 2-{TURNS} of {CONVERSATIONS} conversations over 3 replicas: "
          f"cache_aware median {statistics.median(aware):.0%} (min {min(aware):.0%}), "
          f"round_robin median {statistics.median(spread):.0%} (min {min(spread):.0%})")
    assert min(aware) >= 0.9
    assert statistics.median(spread) < 0.5


def test_a_responses_chain_follows_its_routing_key(replicas, tmp_path_factory):
    """A Responses chain's body holds only its new input, so text-prefix routing cannot place it:
    the client sends back the X-Chatd-Routing-Key each reply names, and the gateway pins the key."""
    why = cluster.missing("smg")
    if why:
        pytest.skip(why)
    gateway = cluster.Smg(tmp_path_factory.mktemp("sticky"), replicas, "round_robin", "--routing-key-override",
                          "--routing-key-headers", "x-chatd-routing-key")
    try:
        with httpx.Client(timeout=60) as client:
            for chain in range(3):
                body = {"model": "demo", "input": f"Chain {chain}: describe a paged cache. " * 8,
                        "max_output_tokens": 8, "temperature": 0}
                r = client.post(f"{gateway.url}/v1/responses", json=body)
                assert r.status_code == 200, r.text
                key, previous, served = r.headers["x-chatd-routing-key"], r.json(), set()
                for turn in range(4):
                    r = client.post(f"{gateway.url}/v1/responses", headers={"X-Chatd-Routing-Key": key}, json={
                        **body, "input": f"Go on ({turn}).", "previous_response_id": previous["id"]})
                    assert r.status_code == 200, r.text
                    assert r.headers["x-chatd-routing-key"] == key
                    served.add(r.headers["x-smg-routed-worker-id"])
                    usage = r.json()["usage"]
                    if turn > 0:  # the key is pinned where its first use was routed; the chain's start was not keyed
                        before = previous["usage"]["input_tokens"] + previous["usage"]["output_tokens"]
                        assert usage["input_tokens_details"]["cached_tokens"] >= 0.9 * (before // BLOCK * BLOCK)
                    previous = r.json()
                assert len(served) == 1
    finally:
        gateway.stop()

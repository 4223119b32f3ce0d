"""What clients of OpenAI's API send, against a real `chatd serve` driven by the official openai SDK:
batched completion prompts (LangChain's `OpenAI` always sends a list), the request fields newer
SDKs add, developer messages and message names.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest

from chatd.engine import Tokenizer
from chatd.engine.models.demo import build_demo_model
from chatd.http.openai.protocol import MAX_PROMPTS, parse_chat
from tests.http.serving import start_server, stop_server
from tests.http.test_isolation import engine_is_empty

PROMPTS = ["The cache", "A block of keys", "Paged attention is"]
GREEDY = dict(model="demo", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve on the demo model; yield (base_url, model_dir, log_path)."""
    root = tmp_path_factory.mktemp("compat")
    model_dir = build_demo_model(root / "demo")
    proc, url, log_path = start_server(root, model_dir, "[server]\nheartbeat_seconds = 0.5\n[cache]\nnum_blocks = 2048\n")
    yield url, model_dir, log_path
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def alone(client, prompt) -> openai.types.Completion:
    return client.completions.create(prompt=prompt, **GREEDY)


def error_of(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    return err.value


# -- batched prompts ----------------------------------------------------------------------------


def test_a_list_of_strings_gets_each_prompt_its_own_reply_in_order(client):
    singles = [alone(client, p) for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 18 and batch.usage.total_tokens == batch.usage.prompt_tokens + 18


async def test_a_streamed_batch_tells_prompts_apart_by_choice_index_and_sums_usage(async_client, client):
    singles = [alone(client, p) for p in PROMPTS]
    stream = await async_client.completions.create(prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert [texts[i] for i in range(3)] == [s.choices[0].text for s in singles]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_token_id_lists_are_prompts_too(client):
    prompts = [[1, 20, 30], [1, 40, 50, 60]]
    batch = client.completions.create(prompt=prompts, **GREEDY)
    assert batch.usage.prompt_tokens == 7
    assert [c.text for c in batch.choices] == [alone(client, p).choices[0].text for p in prompts]


def test_n_choices_are_numbered_prompt_by_prompt(client):
    batch = client.completions.create(prompt=PROMPTS[:2], n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [c.text for c in batch.choices]
    assert texts[0:2] == [alone(client, PROMPTS[0]).choices[0].text] * 2  # greedy: both choices alike
    assert texts[2:4] == [alone(client, PROMPTS[1]).choices[0].text] * 2
    assert batch.usage.completion_tokens == 24


def get(url: str) -> dict:
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


def usage_totals(url: str) -> dict:
    """/v1/usage's totals for the local tenant once the ledger has written what earlier tests billed (bounded)."""
    totals = get(f"{url}/v1/usage")
    for _ in range(100):
        time.sleep(0.05)
        pending = get(f"{url}/health")["store"]["pending_writes"]
        totals, last = get(f"{url}/v1/usage"), totals
        if pending == 0 and totals == last:
            break
    return totals


def usage_after(url: str, before: dict) -> dict:
    """The totals once the ledger has written at least one more request than `before` (bounded)."""
    for _ in range(100):
        after = get(f"{url}/v1/usage")
        if after["requests"] > before["requests"]:
            return after
        time.sleep(0.05)
    return after


def test_a_batch_is_billed_once_for_all_its_prompts(client, server):
    before = usage_totals(server[0])
    batch = client.completions.create(prompt=PROMPTS, **GREEDY)
    after = usage_after(server[0], before)
    assert after["requests"] == before["requests"] + 1
    assert after["input_tokens"] - before["input_tokens"] == batch.usage.prompt_tokens
    assert after["output_tokens"] - before["output_tokens"] == batch.usage.completion_tokens


async def test_a_client_that_leaves_a_streamed_batch_ends_every_prompts_request(server):
    url = server[0]
    before = usage_totals(url)
    body = {"model": "demo", "prompt": [f"prompt number {i}" for i in range(4)], "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # the first delta, then the client goes away
    assert await engine_is_empty(url) == (0, 0, 0, 0)
    after = await asyncio.to_thread(usage_after, url, before)
    assert after["requests"] == before["requests"] + 1  # one event for the four prompts' requests
    assert 0 < after["output_tokens"] - before["output_tokens"] < 4 * 1500  # ended early: not all generated


def test_bad_prompts_are_named_by_their_place(client, server):
    _, model_dir, _ = server
    complete = client.completions.create
    assert error_of(lambda: complete(model="demo", prompt=["fine", 5])).param == "prompt[1]"
    assert error_of(lambda: complete(model="demo", prompt=[[1, 2], [3, "x"]])).param == "prompt[1][1]"
    assert error_of(lambda: complete(model="demo", prompt=[1, None])).param == "prompt[1]"
    assert error_of(lambda: complete(model="demo", prompt=[])).param == "prompt"
    assert error_of(lambda: complete(model="demo", prompt=["fine", ""])).param == "prompt[1]"  # empty: nothing to continue
    too_many = error_of(lambda: complete(model="demo", prompt=["x"] * (MAX_PROMPTS + 1)))
    assert too_many.param == "prompt" and f"the limit is {MAX_PROMPTS}" in too_many.message
    # Too long for the 2048-token window: as token ids (seen before tokenizing) and as text.
    too_long = error_of(lambda: complete(model="demo", prompt=[[1, 2], [1] * 2048]))
    assert (too_long.param, too_long.code) == ("prompt[1]", "context_length_exceeded")
    long_text = "attention " * 600
    assert len(Tokenizer.from_pretrained(model_dir).encode(long_text)) >= 2048
    too_long = error_of(lambda: complete(model="demo", prompt=["fine", long_text], max_tokens=1))
    assert (too_long.param, too_long.code) == ("prompt[1]", "context_length_exceeded")
    assert "- prompt[1] has 2402 tokens" in too_long.message
    no_room = error_of(lambda: complete(model="demo", prompt=["fine", [1] * 2040], max_tokens=16))
    assert no_room.param == "max_tokens" and "- prompt[1] (2040 tokens) + max_tokens (16)" in no_room.message


# -- fields newer SDKs send ---------------------------------------------------------------------


def test_fields_that_change_nothing_chatd_computes_are_accepted(client, server):
    _, _, log_path = server
    fields = dict(prompt_cache_key="tenant-42-faq", safety_identifier="user-hash-1", user="u1", metadata={"app": "faq"},
                  store=True, verbosity="low", service_tier="flex")
    reply = client.chat.completions.create(messages=MESSAGES, **GREEDY, **fields)
    assert reply.choices[0].message.content and reply.service_tier == "default"  # chatd serves every request one way
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **GREEDY, **fields))
    assert {c.service_tier for c in chunks} == {"default"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert client.chat.completions.create(messages=MESSAGES, **GREEDY).service_tier is None  # not asked, not said
    finished = [line for line in log_path.read_text().splitlines() if "request finished" in line]
    assert sum("prompt_cache_key=tenant-42-faq" in line for line in finished) == 2
    # chatd's completions took these before (OpenAI's have none of them): still accepted.
    completion = client.completions.create(prompt="The cache", **{**GREEDY, "extra_body": {"metadata": {"app": "faq"},
                                                                                          "service_tier": "auto"}})
    assert completion.usage.completion_tokens == 6


def test_bad_values_of_accepted_fields_are_400s_naming_them(client):
    create = client.chat.completions.create
    for field, value in [("verbosity", "extreme"), ("service_tier", "turbo"), ("prompt_cache_key", 5),
                         ("safety_identifier", ["x"]), ("store", "yes"), ("metadata", {"k": 1}),
                         ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", {"k" * 65: "v"}),
                         ("metadata", {"k": "v" * 513})]:
        error = error_of(lambda: create(messages=MESSAGES, **{**GREEDY, "extra_body": {field: value}}))
        assert error.param == field, (field, value, error.message)


def test_fields_chatd_would_ignore_are_still_refused(client):
    create = client.chat.completions.create
    functions = error_of(lambda: create(messages=MESSAGES, functions=[{"name": "f"}], **GREEDY))
    assert functions.param == "functions" and "not supported" in functions.message and "use tools" in functions.message
    assert error_of(lambda: create(messages=MESSAGES, reasoning_effort="low", **GREEDY)).param == "reasoning_effort"
    # Legacy completions have no `store` in OpenAI's API: keeping one is still refused there.
    assert error_of(lambda: client.completions.create(prompt="x", **{**GREEDY, "extra_body": {"store": True}})).param == "store"


# -- messages -----------------------------------------------------------------------------------


def test_developer_messages_are_instructions_rendered_in_order_with_system_ones(client, server):
    _, model_dir, _ = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Hi", "name": "ada"}]
    parsed = parse_chat({"messages": messages}, 10).messages
    assert parsed == [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "Answer in French."},
                      {"role": "user", "content": "Hi", "name": "ada"}]
    tokenizer = Tokenizer.from_pretrained(model_dir)
    rendered = tokenizer.decode(tokenizer.encode_chat(parsed), skip_special_tokens=False)
    assert rendered.index("system\nYou are terse.") < rendered.index("system\nAnswer in French.") < rendered.index("user\nHi")
    reply = client.chat.completions.create(messages=messages, **GREEDY)
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(parsed))


def test_a_message_name_that_is_not_a_string_is_named(client):
    messages = [{"role": "user", "content": "Hi", "name": 7}]
    assert error_of(lambda: client.chat.completions.create(messages=messages, **GREEDY)).param == "messages[0].name"


async def test_batches_and_chats_together_leave_nothing_behind(async_client, server):
    """Many batched completions at once, streamed and whole, beside chats: all answer, nothing is left."""
    async def batch(i: int, stream: bool) -> int:
        prompts = [f"question {i}.{j}" for j in range(3)]
        if not stream:
            return len((await async_client.completions.create(prompt=prompts, **GREEDY)).choices)
        chunks = await async_client.completions.create(prompt=prompts, stream=True, **GREEDY)
        return len({c.index async for chunk in chunks for c in chunk.choices})

    async def chat(i: int) -> str:
        reply = await async_client.chat.completions.create(messages=[{"role": "user", "content": f"chat {i}"}], **GREEDY)
        return reply.choices[0].finish_reason

    answers = await asyncio.gather(*(batch(i, i % 2 == 0) for i in range(8)), *(chat(i) for i in range(4)))
    assert answers == [3] * 8 + ["length"] * 4
    assert await engine_is_empty(server[0]) == (0, 0, 0, 0)

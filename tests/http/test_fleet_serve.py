"""Three chat models in one real `chatd serve` ([[models]]: the demo model, the default SmolLM2
and a random tiny Qwen2 built here), two tenants of two tiers, the official OpenAI SDK as the
client: each model answers as it does alone, tiers route and refuse, an alias splits new threads
by weight (chi-square over 2,000) and a thread keeps its model, a model loads on first use and
unloads after keep_alive (never while a request holds it), prefix caches stay per model and per
tenant, and usage and metrics name the model that served."""

from __future__ import annotations

import asyncio
import math
import signal
import sqlite3
import time

import aiohttp
import openai
import pytest

from chatd.engine import LLM, SamplingParams
from chatd.engine.models.demo import build_demo_model, build_model_dir
from chatd.engine.models.sources import default_model_path
from tests.http.serving import create_key, start_server, stop_server

pytestmark = pytest.mark.slow

CONFIG = """
[store]
db_path = "{db}"
[auth]
enabled = true
admin_key = "operator-secret"
[model]
device = "cpu"
compile = false
[[models]]
name = "small"
path = "{demo}"
[[models]]
name = "smol"
path = ""
[[models]]
name = ["qwen", "qwen-tiny"]
path = "{qwen}"
keep_alive = "1s"
[aliases.chat]
targets = {{ small = 80, qwen = 20 }}
[aliases.auto]
small = "small"
large = "smol"
escalate_when = {{ prompt_chars = 300, tools = true, response_format = true, messages = 5, tiers = ["paid"] }}
[aliases.sure]
small = "smol"
large = "small"
escalate_when = {{ min_confidence = 0.5, confidence_tokens = 8 }}
[tiers.free]
requests_per_minute = 0
tokens_per_minute = 0
max_concurrent_requests = 0
max_queued_requests = 0
ttft_p95_seconds = 0
models = ["small", "qwen", "chat", "auto"]
default_model = "small"
[tiers.paid]
requests_per_minute = 0
tokens_per_minute = 0
max_concurrent_requests = 0
max_queued_requests = 0
ttft_p95_seconds = 0
default_model = "smol"
"""
PROMPT = "The quick brown fox jumps over the lazy dog while the old river runs under the stone bridge, and"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if default_model_path() is None:
        pytest.skip("the default model's package is not installed")
    root = tmp_path_factory.mktemp("fleet")
    # A Qwen2 large enough that 1,900 tokens take seconds (a stream outlives the keep_alive of 1 s).
    demo = build_demo_model(root / "demo")
    qwen = build_model_dir(root / "qwen", "qwen2", seed=3, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2)
    config = CONFIG.format(db=root / "chatd.db", demo=demo, qwen=qwen)
    (root / "config.toml").write_text(config)
    keys = {"alice": create_key(root / "config.toml", "alice", "free"), "bob": create_key(root / "config.toml", "bob")}
    proc, url, log = start_server(root, demo, config)
    try:
        yield {"url": url, "keys": keys, "db": root / "chatd.db", "paths": {"small": demo, "qwen": qwen, "smol": None},
               "log": log, "proc": proc, "config": root / "config.toml"}
    finally:
        stop_server(proc)


def client(fleet, who: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{fleet['url']}/v1", api_key=fleet["keys"][who], max_retries=0)


async def cards(fleet, who: str = "bob") -> dict[str, dict]:
    async with aiohttp.ClientSession() as session, session.get(
            f"{fleet['url']}/v1/models", headers={"Authorization": f"Bearer {fleet['keys'][who]}"}) as r:
        return {card["id"]: card for card in (await r.json())["data"]}


async def wait_for_status(fleet, name: str, status: str, seconds: float = 20.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        card = (await cards(fleet))[name]
        if card["status"] == status or time.monotonic() > deadline:
            return card
        await asyncio.sleep(0.2)


async def test_each_model_answers_as_it_does_served_alone(fleet):
    bob = client(fleet, "bob")
    for name in ("small", "qwen", "smol"):
        reply = await bob.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0.0)
        assert reply.model == name
        path = fleet["paths"][name]
        with LLM(str(path) if path else None, device="cpu", compile=False) as alone:
            expected = alone.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].text
        assert reply.choices[0].text == expected, name


async def test_tiers_route_requests_without_a_model_and_refuse_what_they_may_not_use(fleet):
    alice, bob = client(fleet, "alice"), client(fleet, "bob")
    question = [{"role": "user", "content": "hi"}]
    assert (await alice.chat.completions.create(model="default", messages=question, max_tokens=2)).model == "small"
    no_model = await alice.with_options().post("/chat/completions", cast_to=dict,
                                               body={"messages": question, "max_tokens": 2})
    assert no_model["model"] == "small"
    assert (await bob.chat.completions.create(model="default", messages=question, max_tokens=2)).model == "smol"
    assert (await bob.chat.completions.create(model="qwen-tiny", messages=question, max_tokens=2)).model == "qwen"
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await alice.chat.completions.create(model="smol", messages=question, max_tokens=2)
    assert refused.value.code == "model_not_allowed" and "'smol'" in refused.value.message and "(free)" in refused.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        await alice.chat.completions.create(model="gpt-5", messages=question, max_tokens=2)
    assert unknown.value.code == "model_not_found" and "'gpt-5'" in unknown.value.message
    listed = [m.id async for m in alice.models.list()]
    assert listed == ["small", "qwen", "chat", "auto"]  # what the free tier may use (a model's names count apart)
    assert {"small", "smol", "qwen", "qwen-tiny", "chat"} <= set(await cards(fleet, "bob"))


async def test_an_alias_splits_new_conversations_by_weight_and_threads_keep_their_model(fleet):
    alice = client(fleet, "alice")
    models: dict[str, str] = {}

    async def create(i: int) -> None:
        conversation = await alice.post("/conversations", cast_to=dict, body={"model": "chat"})
        models[conversation["id"]] = conversation["model"]

    for start in range(0, 2000, 50):
        await asyncio.gather(*(create(i) for i in range(start, start + 50)))
    counts = {name: list(models.values()).count(name) for name in ("small", "qwen")}
    assert sum(counts.values()) == 2000
    expected = {"small": 1600, "qwen": 400}
    chi_square = sum((counts[n] - expected[n]) ** 2 / expected[n] for n in counts)
    assert chi_square < 10.83, (counts, chi_square)  # one degree of freedom, p = 0.001

    # Each turn of a conversation names the alias again, and stays on the model it was drawn.
    chosen = [next(c for c, m in models.items() if m == name) for name in ("small", "qwen")]
    for conversation_id in chosen:
        for turn in range(2):
            reply = await alice.post(f"/conversations/{conversation_id}/messages", cast_to=dict,
                                     body={"content": f"turn {turn}", "model": "chat", "max_tokens": 3})
            assert reply["model"] == models[conversation_id]
    # A client that names another model moves the conversation there, and it stays there.
    moved = chosen[1]
    reply = await alice.post(f"/conversations/{moved}/messages", cast_to=dict,
                             body={"content": "now you", "model": "small", "max_tokens": 3})
    assert reply["model"] == "small"
    reply = await alice.post(f"/conversations/{moved}/messages", cast_to=dict,
                             body={"content": "and again", "model": "chat", "max_tokens": 3})
    assert reply["model"] == "small"
    assert (await alice.get(f"/conversations/{moved}", cast_to=dict))["model"] == "small"

    # A Responses chain keeps the model its first response was drawn.
    seen = set()
    for _ in range(12):
        first = await alice.responses.create(model="chat", input="hello", max_output_tokens=3)
        second = await alice.responses.create(model="chat", input="more", max_output_tokens=3,
                                              previous_response_id=first.id)
        third = await alice.responses.create(input="again", max_output_tokens=3, previous_response_id=second.id)
        assert first.model == second.model == third.model
        seen.add(first.model)
    assert seen <= {"small", "qwen"}


async def test_an_escalating_alias_sends_each_rule_s_requests_up_and_counts_them_by_rule(fleet):
    alice, bob = client(fleet, "alice"), client(fleet, "bob")
    short = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}

    async def served(who, **fields) -> str:
        return (await who.chat.completions.create(model="auto", max_tokens=2, **fields)).model

    assert await served(alice, messages=short) == "small"
    assert await served(alice, messages=[{"role": "user", "content": "why " * 100}]) == "smol"  # prompt_chars
    assert await served(alice, messages=short, tools=[tool]) == "smol"
    assert await served(alice, messages=short, response_format={"type": "json_object"}) == "smol"
    assert await served(bob, messages=short) == "smol"  # the paid tier
    # A conversation goes up once its history passes 5 messages, and stays up.
    conversation = await alice.post("/conversations", cast_to=dict, body={"model": "auto"})
    models = []
    for turn in range(5):
        reply = await alice.post(f"/conversations/{conversation['id']}/messages", cast_to=dict,
                                 body={"content": "hi", "model": "auto", "max_tokens": 2})
        models.append(reply["model"])
    assert models == ["small", "small", "small", "smol", "smol"]  # 6 messages with the new one, then "thread"
    async with aiohttp.ClientSession() as session, session.get(f"{fleet['url']}/metrics") as r:
        metrics = await r.text()

    def count(why: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("chatd:alias_requests_total{") and 'alias="auto"' in line and f'why="{why}"' in line)

    assert {why: count(why) for why in ("prompt_chars", "tools", "response_format", "tiers", "messages", "thread")} == {
        "prompt_chars": 1, "tools": 1, "response_format": 1, "tiers": 1, "messages": 1, "thread": 1}
    assert count("none") == 5  # the short chat, the conversation's creation and its first three turns


async def test_the_small_model_s_own_confidence_sends_what_it_is_unsure_of_up(fleet):
    """min_confidence: the small model's geometric mean probability over its first 8 greedy
    tokens, as the API's own logprobs report it for the same messages, decides each request."""
    bob = client(fleet, "bob")
    asked = ["What is the capital of France?", "Continue: 1, 2, 3, 4, 5,", "Xkcd 8 fnord plimp?", "Tell me a story."]
    expected = {}
    for text in asked:
        messages = [{"role": "user", "content": text}]
        alone = await bob.chat.completions.create(model="smol", messages=messages, max_tokens=8, temperature=0.0,
                                                  logprobs=True)
        logprobs = [token.logprob for token in alone.choices[0].logprobs.content]
        sure = math.exp(sum(logprobs) / len(logprobs))
        assert abs(sure - 0.5) > 0.05, (text, sure)  # (far enough from the bound that rounding cannot flip it)
        expected[text] = "smol" if sure >= 0.5 else "small"
    assert set(expected.values()) == {"smol", "small"}  # some stay, some go up
    served = {text: (await bob.chat.completions.create(model="sure", messages=[{"role": "user", "content": text}],
                                                       max_tokens=4)).model for text in asked}
    assert served == expected
    async with aiohttp.ClientSession() as session, session.get(f"{fleet['url']}/metrics") as r:
        metrics = await r.text()
    up = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith("chatd:alias_requests_total{") and 'alias="sure"' in line and 'why="confidence"' in line)
    assert up == list(expected.values()).count("small")
    # A request the declared rules would refuse to parse is not probed: its parser names the field.
    with pytest.raises(openai.BadRequestError) as bad:
        await bob.chat.completions.create(model="sure", messages=[{"role": "wizard", "content": "hi"}], max_tokens=4)
    assert bad.value.body["param"].startswith("messages")


async def test_a_model_loads_on_first_use_and_unloads_after_keep_alive_never_while_in_use(fleet):
    bob = client(fleet, "bob")
    await bob.completions.create(model="qwen", prompt="warm", max_tokens=1)
    card = await wait_for_status(fleet, "qwen", "unloaded")  # keep_alive 1 s
    assert card["status"] == "unloaded" and "compiled_steps" not in card["chatd"]
    loads = card["chatd"]["loads"]
    # A request generating for longer than keep_alive keeps its model loaded.
    started = time.monotonic()
    stream = await bob.completions.create(model="qwen", prompt="Count:", max_tokens=1900, stream=True,
                                          extra_body={"ignore_eos": True})
    checked_while_generating = False
    async for chunk in stream:
        if not checked_while_generating and time.monotonic() - started > 2.0:
            assert (await cards(fleet))["qwen"]["status"] == "loaded"
            checked_while_generating = chunk.choices[0].finish_reason is None
        last = chunk
    assert last.choices[0].finish_reason == "length" and last.model == "qwen"
    assert checked_while_generating, "the reply ended before keep_alive could have unloaded its model"
    assert (await cards(fleet))["qwen"]["chatd"]["loads"] == loads + 1
    await wait_for_status(fleet, "qwen", "unloaded")
    # Eight requests at once while it is unloaded: one load, and every one answered alike.
    replies = await asyncio.gather(*(bob.completions.create(model="qwen", prompt=PROMPT, max_tokens=4, temperature=0.0)
                                     for _ in range(8)))
    assert len({r.choices[0].text for r in replies}) == 1 and all(r.model == "qwen" for r in replies)
    assert (await cards(fleet))["qwen"]["chatd"]["loads"] == loads + 2
    assert (await cards(fleet))["small"]["status"] == "loaded"  # keep_alive -1: never unloaded


async def test_prefix_caches_are_per_model_and_per_tenant_and_usage_names_the_model(fleet):
    alice, bob = client(fleet, "alice"), client(fleet, "bob")
    prompt = "Only this test sends this: " + PROMPT * 3  # nobody has cached it before

    async def cached(who, model) -> int:
        reply = await who.completions.create(model=model, prompt=prompt, max_tokens=1)
        return reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0

    await cached(alice, "small")
    assert await cached(alice, "small") > 0  # its own prefix, on the same model
    assert await cached(alice, "qwen") == 0  # the same tokens on another model: nothing cached there
    assert await cached(bob, "small") == 0  # another tenant on the same model: salted apart
    async with aiohttp.ClientSession() as session, session.get(f"{fleet['url']}/metrics") as r:
        metrics = await r.text()
    for name in ("small", "qwen", "smol"):
        assert f'chatd:kv_blocks{{model_name="{name}"}}' in metrics
        served = [line for line in metrics.splitlines() if line.startswith("chatd:request_success_total{")
                  and f'model_name="{name}"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in served) > 0, name
    with sqlite3.connect(fleet["db"]) as db:
        billed = {model for (model,) in db.execute("SELECT DISTINCT model FROM usage_events")}
    assert {"small", "qwen", "smol"} <= billed


async def test_sighup_changes_an_alias_s_weights_without_a_restart_and_a_bad_config_changes_nothing(fleet):
    alice, config = client(fleet, "alice"), fleet["config"]
    original = config.read_text()
    before = (await cards(fleet))["small"]["chatd"]["loads"]
    try:
        config.write_text(original.replace("targets = { small = 80, qwen = 20 }", "targets = { small = 0, qwen = 100 }"))
        fleet["proc"].send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while (await cards(fleet))["chat"]["targets"] != {"small": 0.0, "qwen": 100.0}:
            assert time.monotonic() < deadline, "the new weights never showed in /v1/models"
            await asyncio.sleep(0.1)
        drawn = [(await alice.post("/conversations", cast_to=dict, body={"model": "chat"}))["model"] for _ in range(30)]
        assert drawn == ["qwen"] * 30
        # An alias naming a model this process does not serve: logged, and the weights stay.
        config.write_text(original.replace("targets = { small = 80, qwen = 20 }", "targets = { small = 1, qwen = 1 }")
                          .replace('name = "smol"', 'name = "smol2"'))
        fleet["proc"].send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "the config was not reloaded" not in fleet["log"].read_text():
            assert time.monotonic() < deadline, "the refused reload was never logged"
            await asyncio.sleep(0.1)
        assert (await cards(fleet))["chat"]["targets"] == {"small": 0.0, "qwen": 100.0}
        assert (await cards(fleet))["small"]["chatd"]["loads"] == before  # nothing was loaded again
    finally:
        config.write_text(original)


async def test_the_admin_key_alone_loads_and_unloads_a_model_and_a_model_in_use_is_not_unloaded(fleet):
    bob = client(fleet, "bob")
    url = fleet["url"]

    async def admin(action: str, model: str, key: str | None = "operator-secret") -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as session, session.post(f"{url}/admin/models/{model}/{action}",
                                                                    headers=headers) as r:
            return r.status, await r.json()

    assert (await admin("load", "qwen", None))[0] == 401
    status, body = await admin("load", "qwen", fleet["keys"]["bob"])  # a tenant's key is not the admin key
    assert status == 401 and body["error"]["code"] == "invalid_admin_key"
    status, body = await admin("load", "nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, card = await admin("load", "qwen")
    assert status == 200 and card["status"] == "loaded" and card["id"] == "qwen"
    stream = await bob.completions.create(model="qwen", prompt="Count:", max_tokens=1900, stream=True,
                                          extra_body={"ignore_eos": True})
    await stream.__anext__()
    status, body = await admin("unload", "qwen")
    assert status == 409 and body["error"]["code"] == "model_in_use"
    [chunk async for chunk in stream]
    status, card = await admin("unload", "qwen")
    assert status == 200 and card["status"] == "unloaded"
    assert (await cards(fleet))["qwen"]["status"] == "unloaded"
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines()
                   if line.startswith("chatd:model_")}
    assert metrics['chatd:model_unloads_total{model_name="qwen",reason="admin"}'] == 1
    assert metrics['chatd:model_loads_total{model_name="qwen",outcome="loaded"}'] == card["chatd"]["loads"]
    assert metrics['chatd:model_load_seconds_count{model_name="qwen"}'] == card["chatd"]["loads"]


async def test_langchain_picks_a_model_by_name_and_through_an_alias(fleet):
    langchain_openai = pytest.importorskip("langchain_openai")
    settings = dict(base_url=f"{fleet['url']}/v1", api_key=fleet["keys"]["alice"], max_tokens=3, temperature=0,
                    max_retries=0)
    reply = await langchain_openai.ChatOpenAI(model="qwen", **settings).ainvoke("hello")
    assert reply.response_metadata["model_name"] == "qwen"
    reply = await langchain_openai.ChatOpenAI(model="auto", **settings).ainvoke("hello")
    assert reply.response_metadata["model_name"] == "small"  # a short chat stays on the small model

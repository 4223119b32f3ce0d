"""Structured output through the OpenAI SDK against a real `chatd serve` on the random demo model:
whatever the weights, a schema request's reply parses and validates (the server masks the rest).

Schemas here bound every string and number: a random model ends an unbounded string only by
luck, and a reply cut by max_tokens is incomplete JSON, on OpenAI as here.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.http.serving import start_server, stop_server, tenants_server
from tests.http.test_isolation import engine_is_empty
from chatd.engine.models.demo import build_demo_model


class Weather(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: int = Field(ge=-40, le=50)
    summary: str = Field(max_length=12)


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["city", "days", "tags"], "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    proc, url, _ = start_server(root, build_demo_model(root / "demo"), "[cache]\nnum_blocks = 1024\n")
    yield url
    stop_server(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_sdk_parse_with_a_pydantic_model(client):
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(model="demo", messages=ASK, response_format=Weather,
                                                   temperature=temperature, seed=1, max_completion_tokens=200)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Weather)  # the SDK validated it with pydantic


def test_json_schema_whole_and_streamed_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER_SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="demo", messages=ASK, response_format=fmt, n=3, temperature=1.0,
                                           seed=2, max_tokens=200)
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content), WEATHER_SCHEMA)
    stream = client.chat.completions.create(model="demo", messages=ASK, response_format=fmt, temperature=1.0, seed=2,
                                            max_tokens=200, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content  # same seed, same reply, streamed or not


def test_json_object_gives_an_object(client):
    # Any object: its keys are unbounded strings, so these prompts are ones where the demo model's
    # greedy reply closes the object within max_tokens (others write one long key until cut).
    for prompt in ("Hello", "hi", "List things"):
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                               response_format={"type": "json_object"}, temperature=0, max_tokens=100)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_extras_regex_choice_and_structured_outputs(client):
    def ask(**extra) -> str:
        return client.chat.completions.create(model="demo", messages=ASK, temperature=1.0, seed=4, max_tokens=60,
                                              extra_body=extra).choices[0].message.content

    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", ask(guided_regex=r"[A-Z]{2}-[0-9]{4}"))
    assert ask(guided_choice=["sunny", "rainy"]) in ("sunny", "rainy")
    assert ask(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    jsonschema.validate(json.loads(ask(guided_json=WEATHER_SCHEMA)), WEATHER_SCHEMA)
    text = client.completions.create(model="demo", prompt="Numbers:", max_tokens=30, temperature=1.0, seed=3,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}(,[0-9]{3}){2}"}}).choices[0].text
    assert re.fullmatch(r"[0-9]{3}(,[0-9]{3}){2}", text)


def test_responses_text_format(client):
    response = client.responses.parse(model="demo", input="Weather?", text_format=Weather, max_output_tokens=200,
                                      temperature=1.0)
    assert isinstance(response.output_parsed, Weather)
    assert response.text.format.type == "json_schema"
    kept = client.responses.retrieve(response.id)
    Weather.model_validate_json(kept.output_text)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "response_format.json_schema.schema", "objectx"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}),
     "response_format.json_schema.name", "a-z"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}),
     "response_format.json_schema.schema", "not"),
    (dict(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex", "not both"),
    (dict(extra_body={"guided_regex": "[a-"}), "guided_regex", "regex"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: nothing_here"}}), "structured_outputs.grammar", "nothing_here"),
])
def test_bad_formats_are_400s_naming_the_field(server, client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=ASK, max_tokens=5, **kwargs)
    body = err.value.body
    assert body["param"] == param and words in body["message"], body
    assert asyncio.run(engine_is_empty(server)) == (0, 0, 0, 0)


def test_conversation_turn_with_a_structured_extra(server):
    import httpx

    with httpx.Client(base_url=server, timeout=60) as http:
        conversation = http.post("/v1/conversations", json={}).json()
        turn = http.post(f"/v1/conversations/{conversation['id']}/messages",
                         json={"content": "Pick one", "structured_outputs": {"choice": ["left", "right"]}, "max_tokens": 10})
        assert turn.status_code == 200, turn.text
        assert turn.json()["choices"][0]["message"]["content"] in ("left", "right")


@pytest.mark.slow
async def test_two_tenants_schemas_stay_their_own(tmp_path):
    """Concurrent requests of two tenants with different schemas: each reply follows its own schema only."""
    other = {"type": "object", "properties": {"bob": {"type": "boolean"}}, "required": ["bob"], "additionalProperties": False}
    with tenants_server(tmp_path) as srv:
        clients = {who: openai.AsyncOpenAI(base_url=f"{srv['url']}/v1", api_key=key, max_retries=0)
                   for who, key in srv["keys"].items()}
        schemas = {"alice": WEATHER_SCHEMA, "bob": other}

        async def ask(who: str, seed: int) -> tuple[str, str]:
            fmt = {"type": "json_schema", "json_schema": {"name": who, "schema": schemas[who]}}
            reply = await clients[who].chat.completions.create(model="demo", messages=ASK, response_format=fmt,
                                                               temperature=1.0, seed=seed, max_tokens=120)
            return who, reply.choices[0].message.content

        replies = await asyncio.gather(*(ask(who, seed) for seed in range(4) for who in ("alice", "bob")))
        for who, text in replies:
            jsonschema.validate(json.loads(text), schemas[who])
        for client in clients.values():
            await client.close()


def test_objects_that_list_properties_get_no_others(client):
    """As vLLM's xgrammar backend: an object schema that lists properties and says nothing of others
    is generated closed (a model is not led to invent keys), while staying valid for the schema as sent."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "inner": {"type": "object", "properties": {"n": {"enum": [1, 2]}}}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "open", "schema": schema}}
    for seed in range(4):
        text = client.chat.completions.create(model="demo", messages=ASK, response_format=fmt, temperature=1.0, seed=seed,
                                              max_tokens=60).choices[0].message.content
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert set(value) <= {"ok", "inner"} and set(value.get("inner", {})) <= {"n"}


def test_depth_is_measured_without_recursion_and_checked_before_any_walk():
    from chatd.http.errors import APIError
    from chatd.http.tools.structured import MAX_SCHEMA_DEPTH, extras, json_depth

    deep: dict = {"type": "string"}
    for _ in range(100_000):  # far past Python's recursion limit
        deep = {"type": "array", "items": deep}
    assert json_depth(deep, 10**6) == 100_001
    assert json_depth(deep, MAX_SCHEMA_DEPTH) == MAX_SCHEMA_DEPTH + 1  # the walk stops there
    assert json_depth([[1], [[2]], {"a": [3]}], 10) == 3 and json_depth("x", 10) == 0
    at_limit, past_limit = {"type": "string"}, None
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        at_limit = {"type": "array", "items": at_limit}
    past_limit = {"type": "array", "items": at_limit}
    assert extras({"guided_json": at_limit}).json_schema
    for schema in (past_limit, deep):
        with pytest.raises(APIError) as err:
            extras({"guided_json": schema})
        assert err.value.param == "guided_json" and f"the limit is {MAX_SCHEMA_DEPTH}" in str(err.value)


def test_grammars_that_fail_are_400s_naming_the_field_and_are_refused_again(server):
    """Issue 36: a grammar whose lexer gave up was a 500, and the same one sent again was a 200
    with empty content and finish_reason stop (its broken compile was served from the cache)."""
    import time

    import httpx

    mid_reply = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                 "required": ["x", "y"], "additionalProperties": False}
    cases = [({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),  # its probe fails
             ({"guided_json": mid_reply, "n": 4, "temperature": 1.0, "seed": 1, "max_tokens": 60}, "guided_json")]  # mid-reply
    with httpx.Client(base_url=server, timeout=120) as http:
        for fields, param in cases:
            for attempt in range(2):
                started = time.monotonic()
                reply = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 20, **fields})
                assert reply.status_code == 400, (fields, attempt, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param and "is too complex to follow" in error["message"], error
            assert time.monotonic() - started < 5  # the second time from what the first taught
    assert asyncio.run(engine_is_empty(server)) == (0, 0, 0, 0)


async def test_a_costly_grammar_is_refused_by_its_limit_while_another_stream_runs_on(server):
    """Issue 36: `a{100000}` with n=16 ran 25-60 s and paused another client's stream 3.3-3.6 s a token."""
    import time

    import httpx

    async with httpx.AsyncClient(base_url=server, timeout=120) as http:
        async def other() -> list[float]:
            arrivals = []
            async with http.stream("POST", "/v1/chat/completions", json={
                    "messages": ASK, "max_tokens": 40, "ignore_eos": True, "stream": True}) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
            return [b - a for a, b in zip(arrivals, arrivals[1:])]

        streaming = asyncio.ensure_future(other())
        refused = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 64, "n": 16,
                                                                "guided_regex": "a{100000}"})
        gaps = await streaming
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "guided_regex"
    assert "repeats something 100000 times" in refused.json()["error"]["message"]
    assert "the limit is 10000" in refused.json()["error"]["message"]
    assert max(gaps) < 2.0, max(gaps)
    assert await engine_is_empty(server) == (0, 0, 0, 0)

"""Malformed transport, fuzzed, against a real `chatd serve` (auth on): no request gets a 5xx;
every error chatd's code answers is JSON in OpenAI's shape; afterwards the server serves and
holds no stream and no KV block. The generators are in tests/http/fuzzing.py;
`benchmarks/fuzz.py` sends thousands of them.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine.models.demo import build_demo_model

from tests.http.fuzzing import (FUZZ_CONFIG, REFUSED_BY_THE_PARSER, Raw, Tally, exchange, field_sweep, first_turn,
                                raw_requests, send_all, to_json)
from tests.http.serving import create_key, start_server, stop_server
from tests.http.test_isolation import engine_is_empty


# -- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve with auth on and small limits; a key, and a conversation with one finished reply."""
    root = tmp_path_factory.mktemp("fuzz")
    model_dir = build_demo_model(root / "demo")
    config = f'[store]\ndb_path = "{root / "chatd.db"}"\n' + FUZZ_CONFIG
    (root / "config.toml").write_text(config)
    key = create_key(root / "config.toml", "fuzzer")
    proc, url, log_path = start_server(root, model_dir, config)
    targets = asyncio.run(first_turn(url, key))
    yield {"url": url, "targets": targets, "log": log_path}
    stop_server(proc)


async def chat(server, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server['targets'].key}"}) as session:
        async with session.post(f"{server['url']}{path}", data=to_json(body), headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


async def test_a_role_that_is_not_a_string_is_a_400_naming_it(server):
    """It was a 500: a list or an object cannot be looked up in the set of roles."""
    for role in ([], ["user"], {"a": 1}, Raw(b"[" * 1000 + b"]" * 1000), 7, None):
        status, body = await chat(server, {"messages": [{"role": role, "content": "hi"}], "max_tokens": 1})
        assert status == 400 and body["error"]["param"] == "messages[0].role", (role, body)
        assert "must be one of system, user, assistant, developer" in body["error"]["message"]


async def test_values_nested_a_thousand_deep_are_named_not_echoed(server):
    """They were 500s: the error message quoted them with repr(), which gives up past ~1,000 levels."""
    deep_object, deep_list = Raw(b'{"a":' * 1000 + b"{}" + b"}" * 1000), Raw(b"[" * 1000 + b"]" * 1000)
    for body, param, named in [
        ({"messages": [{"role": "user", "content": [{"type": deep_object}]}]}, "messages[0].content", "of type an object"),
        ({"messages": [{"role": "user", "content": [deep_list]}]}, "messages[0].content", "got a list"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": deep_list}}, "response_format.type", "a list"),
    ]:
        status, error = await chat(server, body)
        assert status == 400 and error["error"]["param"] == param, error
        assert named in error["error"]["message"] and len(error["error"]["message"]) < 200


async def test_metadata_deeper_than_the_limit_is_a_400_naming_it(server):
    """Deeper than orjson writes (254 levels) it was a 500; now the limit is 32 levels, and said."""
    def nested(levels: int) -> dict:
        metadata = {}
        for _ in range(levels - 1):
            metadata = {"a": metadata}
        return metadata

    for levels, told in [(33, "metadata nests 33 levels deep"), (300, "metadata nests more than 254 levels deep")]:
        status, body = await chat(server, {"metadata": nested(levels)}, "/v1/conversations")
        assert status == 400 and body["error"]["param"] == "metadata", body
        assert body["error"]["message"] == f"{told}; the limit is 32"
    status, body = await chat(server, {"metadata": nested(32)}, "/v1/conversations")
    assert status == 200 and body["metadata"] == nested(32)


@pytest.mark.slow
def test_every_field_with_every_wrong_json_type_is_refused_by_name_or_served(server):
    """~800 requests: each body field of each route (nested ones too) set to each of WRONG_TYPES.

    No 5xx, errors in OpenAI's shape, and a 400 for a body that parses names the field it was
    about (a body orjson cannot parse is refused as a whole).
    """
    sweep = field_sweep()
    tally = Tally()
    answers = asyncio.run(send_all(server["targets"], [request for request, _, _ in sweep], 8, tally))
    assert not tally.problems, "\n".join(tally.problems[:10])
    misnamed = []
    for (_, field_path, value), responses in zip(sweep, answers):
        [response] = responses
        if response.status == 400 and value not in REFUSED_BY_THE_PARSER:
            error = json.loads(response.body)["error"]
            param = error["param"] or ""
            if not param.startswith(field_path[0]):
                misnamed.append(f"{field_path}: {response.body[:200]!r}")
    assert not misnamed, "\n".join(misnamed[:10])
    assert tally.statuses[400] > len(sweep) // 2 and tally.statuses[200] > 0, tally.statuses


async def test_an_expect_that_is_not_utf8_is_a_417_and_100_continue_still_works(server):
    """aiohttp's own Expect handler runs before any middleware and answered a non-UTF-8 value with a 500."""
    targets = server["targets"]
    for path in (b"/health", b"/no/such/path"):
        responses, _ = await exchange(targets.host, targets.port,
                                      b"GET " + path + b" HTTP/1.1\r\nHost: chatd\r\nConnection: close\r\nExpect: \xff\xfe\r\n\r\n")
        assert responses[0].status == 417, responses[0]
        assert json.loads(responses[0].body)["error"]["param"] == "Expect"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {targets.key}"}) as session:
        async with session.post(f"{server['url']}/v1/chat/completions", expect100=True,
                                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
            assert r.status == 200


async def test_deleting_a_conversation_ends_the_reply_being_generated_in_it(server):
    """Found while fuzzing DELETE next to a turn: the reply never ended, nor did a request waiting for it."""
    targets = server["targets"]
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {targets.key}"}) as session:
        conversation = await targets.new_conversation()
        async with session.post(f"{server['url']}/v1/conversations/{conversation}/messages",
                                json={"content": "talk", "max_tokens": 230, "ignore_eos": True, "stream": True}) as r:
            await r.content.readuntil(b"\n\n")  # the reply has started
            async with session.delete(f"{server['url']}/v1/conversations/{conversation}") as deleted:
                assert deleted.status == 200
            async with asyncio.timeout(3):  # a whole reply takes longer than this on CPU
                rest = await r.content.read()
        assert b"conversation_deleted" in rest
        # A client waiting for the whole reply is told at once, with a 409: its own delete cut it short.
        conversation = await targets.new_conversation()
        turn = asyncio.ensure_future(session.post(f"{server['url']}/v1/conversations/{conversation}/messages",
                                                  json={"content": "talk", "max_tokens": 230, "ignore_eos": True}))
        for _ in range(100):  # until the reply has started (its row is written before generation)
            async with session.get(f"{server['url']}/v1/conversations/{conversation}") as r:
                if len((await r.json())["messages"]) == 2:
                    break
            await asyncio.sleep(0.02)
        async with session.delete(f"{server['url']}/v1/conversations/{conversation}") as deleted:
            assert deleted.status == 200
        async with asyncio.timeout(3):
            response = await turn
        assert response.status == 409 and (await response.json())["error"]["code"] == "conversation_deleted"


@pytest.mark.slow
def test_fuzzed_requests_get_a_4xx_in_openai_shape_and_leave_nothing_behind(server):
    """300 generated requests, four at a time; then a normal chat works and the engine holds nothing."""
    targets, tally = server["targets"], Tally()
    log_start = len(server["log"].read_text())

    @settings(max_examples=75, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(batch=st.lists(raw_requests(), min_size=4, max_size=4, unique=True))
    def fuzz(batch):
        asyncio.run(send_all(targets, batch, 4, tally))

    fuzz()
    assert not tally.problems, "\n".join(tally.problems[:10])
    # The fuzzer got past the transport into the handlers, and was refused for many fields.
    assert {200, 400, 401, 404, 405} <= set(tally.statuses), tally.statuses
    assert len(tally.params) >= 10, tally.params

    async def afterwards():
        status, body = await chat(server, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        return await engine_is_empty(server["url"])

    assert asyncio.run(afterwards()) == (0, 0, 0, 0)
    # Nothing failed out of sight (a background task, a reply), and the requests aiohttp's parser
    # refused did not flood the log with tracebacks (they are logged at DEBUG).
    log = server["log"].read_text()[log_start:]
    assert " ERROR " not in log and "Traceback" not in log


# -- hostile grammars (issue 36): any schema, regex, grammar or tool list is served or a 400 ----------


def _nested(kind: str, depth: int, leaf: str) -> str:
    """JSON text of a schema nested `depth` levels around `leaf` (JSON text): arrays of arrays,
    objects in properties, or a chain of $refs. Text, not objects: nothing recursive writes or prints it."""
    if kind == "refs":
        defs = ", ".join(f'"d{i}": {{"$ref": "#/$defs/d{i + 1}"}}' for i in range(depth))
        return f'{{"$defs": {{{defs}, "d{depth}": {leaf}}}, "$ref": "#/$defs/d0"}}'
    if kind == "array":
        return '{"type": "array", "items": ' * depth + leaf + "}" * depth
    return '{"type": "object", "required": ["k"], "properties": {"k": ' * depth + leaf + "}}" * depth


def _repeats(counts: list[int]) -> str:
    """A regex of nested counted repetitions: (((a){n1}){n2})..."""
    regex = "a"
    for count in counts:
        regex = f"({regex}){{{count}}}"
    return regex


def _tools(depth: int, count: int) -> str:
    """JSON text of a tool list: one function whose parameter is nested `depth` levels, and `count` more."""
    parameter = _nested("array", depth, '{"type": "integer"}')
    deep = ('{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": '
            + parameter + "}}}}")
    more = [f'{{"type": "function", "function": {{"name": "g{i}", "parameters": {{"type": "object"}}}}}}' for i in range(count)]
    return "[" + ", ".join([deep, *more]) + "]"


hostile_fields = st.one_of(  # (the fields' JSON text, a short name hypothesis can print)
    st.builds(lambda kind, depth, count: (f'"guided_json": {_nested(kind, depth, json.dumps({"type": "string", "pattern": f"^a{{{count}}}$"}))}',
                                          f"guided_json {kind} x{depth}, a{{{count}}}"),
              st.sampled_from(["array", "object", "refs"]), st.sampled_from([1, 5, 40, 64, 65, 300, 2000]),
              st.sampled_from([3, 1000, 10_000, 100_000])),
    st.builds(lambda counts: (f'"guided_regex": {json.dumps(_repeats(counts))}', _repeats(counts)),
              st.lists(st.sampled_from([2, 10, 100, 1000, 10_000, 100_000]), min_size=1, max_size=3)),
    st.builds(lambda rules: (f'"guided_grammar": ' + json.dumps("start: r0\n" + "\n".join(
        f'r{i}: "x" r{i + 1} | "y"' for i in range(rules)) + f'\nr{rules}: "z"'), f"lark chain of {rules}"),
        st.sampled_from([1, 100, 2800])),
    st.builds(lambda depth, count, n: (f'"tools": {_tools(depth, count)}, "tool_choice": "auto", "n": {n}',
                                       f"tools x{count + 1}, parameters {depth} deep, n={n}"),
              st.sampled_from([1, 62, 63, 300]), st.sampled_from([0, 127, 200]), st.sampled_from([1, 4])),
    st.builds(lambda text: ('"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
                            '{"type": "object", "properties": {"k": {"enum": ' + json.dumps([text, text + "x"]) + "}}}}}",
                            "enum"), st.text(max_size=40)),
)


@pytest.mark.slow
def test_hostile_grammars_are_served_or_refused_by_name_and_leave_nothing_behind(server):
    """Schemas nested up to 2,000 levels (arrays, objects, $ref chains), patterns and regexes of
    counted repetitions up to 10^15, Lark chains of 2,800 rules, tool lists of 200 functions with
    deep parameters: each answer is a 200 or a 400 that names what it refused, in bounded time; the
    server stays up and holds nothing afterwards."""
    seen = []

    async def send(fields: str) -> tuple[int, dict, float]:
        body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1.0, ' + fields + "}"
        started = asyncio.get_running_loop().time()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server['targets'].key}"}) as session:
            async with session.post(f"{server['url']}/v1/chat/completions", data=body.encode(),
                                    headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json(), asyncio.get_running_loop().time() - started

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=hostile_fields)
    def fuzz(case):
        fields, name = case
        status, answer, seconds = asyncio.run(send(fields))
        assert status in (200, 400), (name, status, answer)
        if status == 400:  # the field, or (a body nested past 1,024 levels) the limit
            assert answer["error"]["param"] or "the limit is 1024" in answer["error"]["message"], (name, answer)
        assert seconds < 60, (name, seconds)
        seen.append(status)

    fuzz()
    assert {200, 400} <= set(seen), seen
    assert asyncio.run(engine_is_empty(server["url"])) == (0, 0, 0, 0)
    assert "Traceback" not in server["log"].read_text()

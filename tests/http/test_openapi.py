"""GET /openapi.json: the document describes every route and every body the handlers check, and a
real `chatd serve`'s responses (whole, streamed, errors) validate against the schemas it documents."""

from __future__ import annotations

import http.client
import inspect
import json
import re
import urllib.parse

import pytest
from jsonschema import Draft202012Validator

from types import SimpleNamespace

from chatd.config import Config, ConversationsConfig
from chatd.engine import ParamError
from chatd.engine.models.demo import build_demo_model
from chatd.http import app
from chatd.http.openai import conversation_request, items, protocol, response_request
from chatd.http.openapi import openapi, openapi_bodies
from chatd.http.routes import conversations, responses
from chatd.http.routes.conversations import MAX_NEW_ITEMS
from chatd.http.errors import APIError
from chatd.http.openapi.openapi_components import ref
from tests.http.serving import start_server, stop_server

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about paged attention."}]
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def build_document() -> dict:
    return openapi.build_document(app.ROUTES, "demo")


def template(path: str) -> str:
    """A route table path as OpenAPI writes it: `{name:regex}` becomes `{name}`."""
    return openapi.PATH_PARAMETER.sub(r"{\1}", path)


def validator(document: dict, schema: dict) -> Draft202012Validator:
    """A validator for one schema of the document, its `#/components/...` references resolvable."""
    return Draft202012Validator({**schema, "components": document["components"]})


def resolve(document: dict, reference: str) -> dict:
    node = document
    for part in reference.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def response_schema(document: dict, method: str, path: str, status: int, media: str = "application/json") -> dict:
    """The schema documented for `status` of an operation (a `4XX` range where no exact status is listed)."""
    responses = document["paths"][path][method.lower()]["responses"]
    response = responses.get(str(status)) or responses[f"{status // 100}XX"]
    if "$ref" in response:
        response = resolve(document, response["$ref"])
    content = response["content"][media]
    return content["x-sse-data"] if media == "text/event-stream" else content["schema"]


def request_schema(document: dict, method: str, path: str) -> dict:
    return document["paths"][path][method.lower()]["requestBody"]["content"]["application/json"]["schema"]


def schemas_in(node):
    """Every schema the document holds outside components: bodies, parameters, SSE data."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("schema", "x-sse-data"):
                yield value
            else:
                yield from schemas_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from schemas_in(value)


def references_in(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            yield from references_in(value)
    elif isinstance(node, list):
        for value in node:
            yield from references_in(value)


# -- the document -------------------------------------------------------------------------------


def test_document_has_the_structure_of_openapi_3_1():
    document = build_document()
    assert document["openapi"] == "3.1.0" and document["info"]["title"] and document["info"]["version"]
    operation_ids = []
    for path, item in document["paths"].items():
        assert path.startswith("/") and ":" not in path, path
        for method, operation in item.items():
            assert method in METHODS, (path, method)
            operation_ids.append(operation["operationId"])
            assert operation["summary"] and "\n" not in operation["summary"]
            declared = [p["name"] for p in operation.get("parameters", []) if p["in"] == "path"]
            assert declared == re.findall(r"\{(\w+)\}", path), (path, method)
            assert all(p["in"] in ("path", "query", "header") and "schema" in p for p in operation.get("parameters", []))
            assert "200" in operation["responses"] and "4XX" in operation["responses"] and "5XX" in operation["responses"]
            for status, response in operation["responses"].items():
                assert re.fullmatch(r"[1-5](\d\d|XX)", status) and ("description" in response or "$ref" in response)
    assert len(operation_ids) == len(set(operation_ids)), "operationIds must be unique"
    for reference in references_in(document):
        assert reference.startswith("#/components/") and resolve(document, reference), reference
    for schema in [*document["components"]["schemas"].values(), *schemas_in(document["paths"])]:
        Draft202012Validator.check_schema(schema)


def test_every_route_is_documented_with_its_handlers_summary_and_a_response():
    document = build_document()  # a route with no response schema in OPERATIONS fails the build
    for method, path, handler in app.ROUTES:
        operation = document["paths"][template(path)][method.lower()]
        assert operation["summary"] == inspect.getdoc(handler).splitlines()[0]
        assert operation["responses"]["200"]["content"], f"{method} {path}"


def test_every_operations_entry_is_a_route():
    routes = {(method, template(path)) for method, path, _ in app.ROUTES}
    stale = sorted(f"{method} {path}" for method, path in set(openapi.OPERATIONS) - routes)
    assert not stale, f"openapi.OPERATIONS describes routes that app.ROUTES no longer has: {', '.join(stale)}"


# The modules whose parsers check bodies against field sets (`*_FIELDS`).
PARSING_MODULES = (protocol, responses)


def field_sets() -> dict[str, set]:
    return {f"{module.__name__}.{name}": value for module in PARSING_MODULES for name, value in vars(module).items()
            if name.endswith("_FIELDS") and isinstance(value, (set, frozenset))}


def test_every_field_a_parser_allows_has_a_schema():
    assert field_sets()
    for name, fields in field_sets().items():
        missing = sorted(fields - set(openapi_bodies.FIELD_SCHEMAS))
        assert not missing, f"{name} allows fields with no schema in openapi_bodies.FIELD_SCHEMAS: {', '.join(missing)}"


def test_item_schemas_take_the_keys_items_py_takes():
    assert set(openapi_bodies.MESSAGE_ITEM["properties"]) == items.MESSAGE_KEYS
    assert set(openapi_bodies.CALL_ITEM["properties"]) == items.CALL_KEYS
    assert set(openapi_bodies.OUTPUT_ITEM["properties"]) == items.OUTPUT_KEYS
    assert set(openapi_bodies.RESPONSE_TOOL["properties"]) == response_request.TOOL_KEYS
    assert set(openapi_bodies.ITEM_PART["properties"]) == items.PART_KEYS
    assert openapi_bodies.FIELD_SCHEMAS["items"]["maxItems"] == MAX_NEW_ITEMS


def test_a_field_or_handler_without_documentation_fails_the_build():
    with pytest.raises(openapi_bodies.UndocumentedError, match="made_up"):
        openapi_bodies.body_schema(openapi_bodies.Fields(protocol.CHAT_FIELDS | {"made_up"}), "demo")

    async def undocumented(request):
        pass

    with pytest.raises(openapi_bodies.UndocumentedError, match="undocumented"):
        openapi.build_document([("GET", "/x", undocumented)], "demo")

    async def no_response_schema(request):
        """A route OPERATIONS does not describe."""

    with pytest.raises(openapi_bodies.UndocumentedError, match="no response schema"):
        openapi.build_document([("GET", "/x", no_response_schema)], "demo")


# parse_response reads only the server's limits and the model's sampling defaults.
SERVER_STATE = SimpleNamespace(config=Config(), model=SimpleNamespace(sampling_defaults={}))


# The parsers of the bodies the handlers check against field sets, each with the smallest body it accepts.
PARSERS = {
    ("POST", "/v1/chat/completions"): (lambda body: protocol.parse_chat(body, 100), {"messages": MESSAGES}),
    ("POST", "/v1/completions"): (lambda body: protocol.parse_completion(body, 4096), {"prompt": "Once"}),
    ("POST", "/v1/conversations/{conversation_id}/messages"): (lambda body: protocol.parse_turn(body, 10_000), {"content": "hi"}),
    ("POST", "/v1/responses"): (lambda body: responses.parse_response(body, SERVER_STATE.config.server.max_messages), {"input": "hi"}),
    ("POST", "/v1/conversations"): (lambda body: conversations.parse_conversation(body, SERVER_STATE), {}),
    ("POST", "/v1/conversations/{conversation_id}"): (
        lambda body: conversation_request.parse_conversation_update(body, ConversationsConfig()), {"title": "t"}),
}
# Rules between fields that a field's schema cannot say: what each needs beside it to be checked alone
# (where the body has that field).
COMPANIONS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "min_tokens": {"max_tokens": 2**63}}
# Where a parser and the document disagree because the parser is wrong (to remove once it is fixed).
PARSER_BUGS: dict = {}  # (operation, field) -> values a parser takes against its documentation (none now)
# Values of every JSON type, at and past the limits the schemas document.
CANDIDATES = [None, True, False, 0, 1, 2, -1, 1.5, 2.5, -2.5, 17, 21, 2**63, "x", "", "low", "auto",
              ["x"], [1], [], {}, {"type": "text"}, {"k": "v"}, {"k": 1}]


def test_every_body_a_parser_checks_is_checked_against_its_parser():
    sets = list(field_sets().values())
    parsed = {key for key, entry in openapi.OPERATIONS.items()
              if isinstance(entry.get("request"), openapi_bodies.Fields) and any(entry["request"].allowed is s for s in sets)}
    assert parsed and parsed <= set(PARSERS)


@pytest.mark.parametrize("key", sorted(PARSERS), ids=lambda key: key[1])
def test_documented_field_schemas_agree_with_protocol_checks(key):
    """A value the document calls valid is accepted by the parser, and one it calls invalid refused."""
    parse, base = PARSERS[key]
    schema = request_schema(build_document(), *key)
    check = Draft202012Validator(schema)
    disagreements = []
    for name in sorted(schema["properties"]):
        companions = {k: v for k, v in COMPANIONS.get(name, {}).items() if k in schema["properties"]}
        for value in CANDIDATES:
            body = {**base, **companions, name: value}
            try:
                parse(body)
                accepted = True
            except (APIError, ParamError):
                accepted = False
            known = any(type(bug) is type(value) and bug == value for bug in PARSER_BUGS.get((key, name), []))
            if check.is_valid(body) != accepted and not known:
                disagreements.append(f"{name}={value!r}: documented {'valid' if check.is_valid(body) else 'invalid'}, "
                                     f"the parser {'accepts' if accepted else 'refuses'} it")
    assert not disagreements, "\n".join(disagreements)


# -- live responses -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """chatd serve on the demo model; yields its base URL."""
    root = tmp_path_factory.mktemp("openapi")
    proc, url, _ = start_server(root, build_demo_model(root / "demo"), "[cache]\nnum_blocks = 256\n")
    yield url
    stop_server(proc)


def call(url: str, method: str, path: str, body=None) -> tuple[int, str, bytes]:
    """One request; returns its status, Content-Type and body."""
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=60)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, None if body is None else json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def served(server):
    """The document the server serves (no API key needed)."""
    status, content_type, raw = call(server, "GET", "/openapi.json")
    assert status == 200 and content_type.startswith("application/json")
    return json.loads(raw)


def test_served_document_is_built_from_the_route_table(served):
    assert served == json.loads(json.dumps(build_document()))


WHOLE = [
    ("POST", "/v1/chat/completions", {"model": "demo", "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                                      "logprobs": True, "top_logprobs": 2}),
    ("POST", "/v1/completions", {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "stop": ["."]}),
    ("POST", "/v1/completions", {"prompt": ["Once upon", "a time"], "echo": True, "logprobs": 1, "max_tokens": 0,
                                 "prompt_logprobs": 2}),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/demo", None),
    ("GET", "/v1/usage", None),
    ("GET", "/live", None),
    ("GET", "/health", None),
    ("GET", "/ready", None),
    ("GET", "/version", None),
    ("POST", "/tokenize", {"messages": MESSAGES}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
]


def operation_path(document: dict, method: str, path: str) -> str:
    """The document's path that a request's path (and query) falls under."""
    path = path.partition("?")[0]
    for documented, item in document["paths"].items():
        pattern = re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(documented))
        if method.lower() in item and re.fullmatch(pattern, path):
            return documented
    raise AssertionError(f"the document has no {method} {path}")


@pytest.mark.parametrize(("method", "path", "body"), WHOLE, ids=lambda v: v if isinstance(v, str) else "")
def test_response_matches_its_documented_schema(server, served, method, path, body):
    documented = operation_path(served, method, path)
    if body is not None:
        validator(served, request_schema(served, method, documented)).validate(body)
    status, _, raw = call(server, method, path, body)
    assert status == 200 or (path == "/ready" and status == 503), raw
    validator(served, response_schema(served, method, documented, status)).validate(json.loads(raw))


def exchange(url: str, document: dict, method: str, path: str, body=None) -> dict:
    """A request whose JSON body and 200 answer must match the document; returns the answer."""
    documented = operation_path(document, method, path)
    if body is not None:
        validator(document, request_schema(document, method, documented)).validate(body)
    status, content_type, raw = call(url, method, path, body)
    assert status == 200 and content_type.startswith("application/json"), raw
    answer = json.loads(raw)
    validator(document, response_schema(document, method, documented, 200)).validate(answer)
    return answer


def sse_events(raw: bytes) -> list[dict]:
    """A stream's events as their fields (`id`, `event`, `data`), keep-alive comments left out."""
    events = []
    for block in raw.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields:
            events.append(fields)
    return events


def streamed(url: str, document: dict, method: str, path: str, body=None) -> list[dict]:
    """A streamed answer's events, each `data:` but [DONE] parsed and checked against the documented x-sse-data."""
    documented = operation_path(document, method, path)
    if body is not None:
        validator(document, request_schema(document, method, documented)).validate(body)
    status, content_type, raw = call(url, method, path, body)
    assert status == 200 and content_type.startswith("text/event-stream"), raw
    check = validator(document, response_schema(document, method, documented, 200, "text/event-stream"))
    events = sse_events(raw)
    for event in events:
        if event["data"] != "[DONE]":
            event["data"] = json.loads(event["data"])
            check.validate(event["data"])
    return events


def test_conversation_routes_match_their_documented_schemas(server, served):
    new = {"title": "Paging", "system_prompt": "You are terse.", "metadata": {"topic": "kv", "tags": ["a"]},
           "items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
                     {"role": "assistant", "content": "Hi."}]}
    conversation = exchange(server, served, "POST", "/v1/conversations", new)
    at = f"/v1/conversations/{conversation['id']}"
    exchange(server, served, "POST", "/v1/conversations")  # no body at all
    listed = exchange(server, served, "GET", "/v1/conversations?limit=1")
    assert listed["has_more"] and len(listed["data"]) == 1
    updated = exchange(server, served, "POST", at, {"title": None, "metadata": {"topic": "paging"}})
    assert updated["title"] is None and updated["metadata"] == {"topic": "paging"}
    [added] = exchange(server, served, "POST", f"{at}/items", {"items": [{"role": "developer", "content": "Be brief."}]})["data"]
    page = exchange(server, served, "GET", f"{at}/items?order=asc&limit=2")
    assert page["has_more"] and [i["role"] for i in page["data"]] == ["user", "assistant"]
    exchange(server, served, "GET", f"{at}/items?after={page['last_id']}&order=asc")
    assert exchange(server, served, "GET", f"{at}/items/{added['id']}") == added

    reply = exchange(server, served, "POST", f"{at}/messages", {"content": "Tell me more.", "max_tokens": 4, "temperature": 0})
    assert reply["conversation_id"] == conversation["id"]
    events = streamed(server, served, "POST", f"{at}/messages", {"content": "And more?", "max_tokens": 4, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
    assert [e["id"] for e in events] == [str(i) for i in range(1, len(events) + 1)]
    assert events[-1]["data"] == "[DONE]" and "event" not in events[0]
    replayed = streamed(server, served, "GET", f"{at}/messages/{events[0]['data']['id']}/stream?after=0")
    assert replayed[-1]["data"] == "[DONE]"
    cancelled = exchange(server, served, "POST", f"{at}/messages/{reply['id']}/cancel")  # it has ended: as saved
    assert cancelled["role"] == "assistant" and cancelled["status"] == "complete"
    whole = exchange(server, served, "GET", at)
    assert [m["role"] for m in whole["messages"]] == ["user", "assistant", "developer", "user", "assistant", "user", "assistant"]

    assert exchange(server, served, "DELETE", f"{at}/items/{added['id']}")["id"] == conversation["id"]
    assert exchange(server, served, "DELETE", at) == {"id": conversation["id"], "object": "conversation.deleted", "deleted": True}
    status, _, raw = call(server, "GET", at)
    assert status == 404
    validator(served, response_schema(served, "GET", operation_path(served, "GET", at), 404)).validate(json.loads(raw))


def test_response_routes_match_their_documented_schemas(server, served):
    first = exchange(server, served, "POST", "/v1/responses", {
        "model": "demo", "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is a KV block?"}]}],
        "instructions": "Be terse.", "max_output_tokens": 4, "ignore_eos": True, "metadata": {"topic": "kv"},
        "truncation": "auto", "text": {"format": {"type": "text"}, "verbosity": "low"}, "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": False, "reasoning": {"effort": None}, "include": [], "store": True, "user": "u1",
    })
    assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
    at = f"/v1/responses/{first['id']}"
    assert exchange(server, served, "GET", at)["output"] == first["output"]
    inputs = exchange(server, served, "GET", f"{at}/input_items?order=asc&limit=1")
    assert [i["role"] for i in inputs["data"]] == ["user"] and not inputs["has_more"]
    again = [first["output"][0], {"role": "user", "content": "More?"}]  # its output item, sent back as it came
    follow_up = exchange(server, served, "POST", "/v1/responses",
                         {"input": again, "previous_response_id": first["id"], "max_output_tokens": 2})
    assert follow_up["previous_response_id"] == first["id"]
    assert exchange(server, served, "POST", f"{at}/cancel")["status"] == "incomplete"  # it has ended: as saved
    conversation = exchange(server, served, "POST", "/v1/conversations", {})
    in_conversation = exchange(server, served, "POST", "/v1/responses",
                               {"input": "hi", "conversation": {"id": conversation["id"]}, "max_output_tokens": 2})
    assert in_conversation["conversation"] == {"id": conversation["id"]}
    tools = [{"type": "function", "name": "pick", "description": "Pick one", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}]
    picked = exchange(server, served, "POST", "/v1/responses", {
        "input": "Pick.", "tools": tools, "tool_choice": {"type": "function", "name": "pick"}, "max_output_tokens": 60,
        "conversation": conversation["id"]})
    [made] = picked["output"]
    assert made["type"] == "function_call" and picked["tools"][0]["name"] == "pick"
    answered = exchange(server, served, "POST", "/v1/responses", {
        "input": [{"type": "function_call_output", "call_id": made["call_id"], "output": "a"}], "tools": tools,
        "max_output_tokens": 2, "conversation": conversation["id"]})
    items_at = f"/v1/conversations/{conversation['id']}/items?order=asc"
    kinds = [item["type"] for item in exchange(server, served, "GET", items_at)["data"]]
    assert kinds[-4:] == ["message", "function_call", "function_call_output", "message"]
    given = exchange(server, served, "GET", f"/v1/responses/{answered['id']}/input_items")["data"]
    assert [item["type"] for item in given] == ["function_call_output"]
    not_kept = exchange(server, served, "POST", "/v1/responses", {"input": "hi", "store": False, "max_output_tokens": 2})
    assert not_kept["store"] is False
    assert exchange(server, served, "DELETE", at) == {"id": first["id"], "object": "response", "deleted": True}
    status, _, raw = call(server, "GET", at)
    assert status == 404
    validator(served, response_schema(served, "GET", operation_path(served, "GET", at), 404)).validate(json.loads(raw))


def test_each_streamed_response_event_matches_the_documented_events(server, served):
    """Every event type a live response can send; response.failed needs generation to fail, which it does not here."""
    body = {"input": "hi", "stream": True, "stream_options": {}}
    incomplete = streamed(server, served, "POST", "/v1/responses", {**body, "max_output_tokens": 3, "ignore_eos": True})
    # A reply that ends on its own: sampled at temperature 1, the demo model's EOS comes within 64 tokens
    # for some seeds (37 on this prompt; the others are there should sampling change).
    completed = None
    for seed in (37, *range(100)):
        sampled = {**body, "max_output_tokens": 64, "temperature": 1, "seed": seed}
        events = streamed(server, served, "POST", "/v1/responses", sampled)
        if events[-1]["event"] == "response.completed":
            completed = events
            break
    assert completed, "no seed gave a reply that ends before max_output_tokens"
    tools = [{"type": "function", "name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"], "additionalProperties": False}}]
    called = streamed(server, served, "POST", "/v1/responses", {**body, "max_output_tokens": 60, "tools": tools,
                                                                "tool_choice": "required", "parallel_tool_calls": False})
    assert called[-1]["event"] == "response.completed"
    for events in (incomplete, completed, called):
        assert all(e["event"] == e["data"]["type"] and int(e["id"]) == e["data"]["sequence_number"] + 1 for e in events)
        assert [e["data"]["sequence_number"] for e in events] == list(range(len(events)))
        assert all(e["data"] != "[DONE]" for e in events)  # Responses' streams carry none
    assert incomplete[-1]["event"] == "response.incomplete"
    kinds = served["components"]["schemas"]["ResponseStreamEvent"]["oneOf"]
    documented = {kind["properties"]["type"]["const"] for kind in kinds}
    assert {e["event"] for e in incomplete + completed + called} == documented - {"response.failed"}
    # Retrieved as a stream: its events again, after the one given.
    response_id = completed[0]["data"]["response"]["id"]
    replayed = streamed(server, served, "GET", f"/v1/responses/{response_id}?stream=true&starting_after=1")
    assert [e["data"]["type"] for e in replayed] == [e["data"]["type"] for e in completed[2:]]


STREAMS = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                              "logprobs": True, "top_logprobs": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True, "n": 2}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "stream": True, "logprobs": 1,
                         "stream_options": {"include_usage": True}}),
]


@pytest.mark.parametrize(("path", "body"), STREAMS, ids=lambda v: v if isinstance(v, str) else "")
def test_each_streamed_chunk_matches_the_documented_chunk(server, served, path, body):
    validator(served, request_schema(served, "POST", path)).validate(body)
    status, content_type, raw = call(server, "POST", path, body)
    assert status == 200 and content_type.startswith("text/event-stream")
    data = [line.removeprefix("data: ") for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    check = validator(served, response_schema(served, "POST", path, 200, "text/event-stream"))
    for chunk in chunks:
        check.validate(chunk)
    assert any(c["choices"] for c in chunks)
    assert ("usage" in chunks[-1] and chunks[-1]["usage"] is not None) == ("stream_options" in body)


ERRORS = [
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "web_search"}]}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "model": "nope"}, 404),
    ("GET", "/v1/usage?period=year", None, 400),
    ("POST", "/v1/completions", "not an object", 400),
    ("GET", "/v1/conversations/conv_nope", None, 404),
    ("GET", "/v1/conversations/conv_nope/items/msg_nope", None, 404),
    ("GET", "/v1/conversations?limit=0", None, 400),
    ("POST", "/v1/conversations", {"topic": "kv"}, 400),
    ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "hi"}] * (MAX_NEW_ITEMS + 1)}, 400),
    ("POST", "/v1/conversations/conv_nope/items", {"items": [{"role": "user", "content": "hi"}]}, 404),
    ("GET", "/v1/responses/resp_nope", None, 404),
    ("GET", "/v1/responses/resp_nope/input_items", None, 404),
    ("DELETE", "/v1/responses/resp_nope", None, 404),
    ("POST", "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("POST", "/v1/responses", {"input": [{"type": "function_call_output", "output": "1"}]}, 400),
    ("POST", "/v1/responses", {"input": [{"type": "reasoning", "summary": []}]}, 400),
    ("POST", "/v1/responses", {"input": "hi", "truncation": "middle"}, 400),
    ("POST", "/v1/responses", {"input": "hi", "background": True}, 400),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"}, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "expected"), ERRORS, ids=lambda v: v if isinstance(v, str) else "")
def test_errors_match_the_documented_error_shape(server, served, method, path, body, expected):
    status, content_type, raw = call(server, method, path, body)
    assert status == expected and content_type.startswith("application/json"), raw
    documented = operation_path(served, method, path)
    if isinstance(body, dict):  # the document calls a 400's body invalid too, and a 404's valid
        assert validator(served, request_schema(served, method, documented)).is_valid(body) == (expected != 400)
    validator(served, response_schema(served, method, documented, status)).validate(json.loads(raw))


@pytest.mark.parametrize(("method", "path", "expected"), [("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405),
                                                          ("PUT", "/openapi.json", 405)])
def test_unrouted_requests_answer_the_error_component(server, served, method, path, expected):
    status, _, raw = call(server, method, path)
    assert status == expected
    validator(served, ref("Error")).validate(json.loads(raw))

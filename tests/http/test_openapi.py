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

from chatd.engine import ParamError
from chatd.engine.models.demo import build_demo_model
from chatd.http import app, openapi, protocol
from chatd.http.errors import APIError
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
            assert all(p["in"] in ("path", "query") and "schema" in p for p in operation.get("parameters", []))
            assert "200" in operation["responses"] and "4XX" in operation["responses"] and "5XX" in operation["responses"]
            for status, response in operation["responses"].items():
                assert re.fullmatch(r"[1-5](\d\d|XX)", status) and ("description" in response or "$ref" in response)
    assert len(operation_ids) == len(set(operation_ids)), "operationIds must be unique"
    for reference in references_in(document):
        assert reference.startswith("#/components/") and resolve(document, reference), reference
    for schema in [*document["components"]["schemas"].values(), *schemas_in(document["paths"])]:
        Draft202012Validator.check_schema(schema)


def test_every_route_is_documented_with_its_handlers_summary():
    document = build_document()
    for method, path, handler in app.ROUTES:
        operation = document["paths"][template(path)][method.lower()]
        assert operation["summary"] == inspect.getdoc(handler).splitlines()[0]
    lacking = sorted(f"{method} {path}" for method, path, _ in app.ROUTES
                     if "response" not in openapi.OPERATIONS.get((method, template(path)), {})
                     and not path.startswith(openapi.UNDOCUMENTED_FOR_NOW))
    assert not lacking, f"routes with no response schema in openapi.OPERATIONS: {', '.join(lacking)}"


def test_every_operations_entry_is_a_route():
    routes = {(method, template(path)) for method, path, _ in app.ROUTES}
    stale = sorted(f"{method} {path}" for method, path in set(openapi.OPERATIONS) - routes)
    assert not stale, f"openapi.OPERATIONS describes routes that app.ROUTES no longer has: {', '.join(stale)}"


def test_every_field_protocol_allows_has_a_schema():
    field_sets = {name: value for name, value in vars(protocol).items() if name.endswith("_FIELDS") and isinstance(value, (set, frozenset))}
    assert field_sets
    for name, fields in field_sets.items():
        missing = sorted(fields - set(openapi.FIELD_SCHEMAS))
        assert not missing, f"protocol.{name} allows fields with no schema in openapi.FIELD_SCHEMAS: {', '.join(missing)}"


def test_a_field_or_handler_without_documentation_fails_the_build():
    with pytest.raises(openapi.UndocumentedError, match="made_up"):
        openapi.body_schema(openapi.Fields(protocol.CHAT_FIELDS | {"made_up"}), "demo")

    async def undocumented(request):
        pass

    with pytest.raises(openapi.UndocumentedError, match="undocumented"):
        openapi.build_document([("GET", "/x", undocumented)], "demo")


# The parsers of protocol.py's bodies, each with the smallest body it accepts.
PARSERS = {
    ("POST", "/v1/chat/completions"): (lambda body: protocol.parse_chat(body, 100), {"messages": MESSAGES}),
    ("POST", "/v1/completions"): (lambda body: protocol.parse_completion(body, 4096), {"prompt": "Once"}),
    ("POST", "/v1/conversations/{conversation_id}/messages"): (lambda body: protocol.parse_turn(body, 10_000), {"content": "hi"}),
}
# Rules between fields that a field's schema cannot say: what each needs beside it to be checked alone.
COMPANIONS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "min_tokens": {"max_tokens": 2**63}}
# Values of every JSON type, at and past the limits the schemas document.
CANDIDATES = [None, True, False, 0, 1, 2, -1, 1.5, 2.5, -2.5, 17, 21, 2**63, "x", "", "low", "auto",
              ["x"], [1], [], {}, {"type": "text"}, {"k": "v"}]


def test_every_body_protocol_parses_is_checked_against_its_parser():
    protocol_sets = [value for name, value in vars(protocol).items() if name.endswith("_FIELDS")]
    parsed = {key for key, entry in openapi.OPERATIONS.items()
              if isinstance(entry.get("request"), openapi.Fields) and any(entry["request"].allowed is s for s in protocol_sets)}
    assert parsed == set(PARSERS)


@pytest.mark.parametrize("key", sorted(PARSERS), ids=lambda key: key[1])
def test_documented_field_schemas_agree_with_protocol_checks(key):
    """A value the document calls valid is accepted by protocol.py, and one it calls invalid refused."""
    parse, base = PARSERS[key]
    schema = request_schema(build_document(), *key)
    check = Draft202012Validator(schema)
    disagreements = []
    for name in sorted(schema["properties"]):
        for value in CANDIDATES:
            body = {**base, **COMPANIONS.get(name, {}), name: value}
            try:
                parse(body)
                accepted = True
            except (APIError, ParamError):
                accepted = False
            if check.is_valid(body) != accepted:
                disagreements.append(f"{name}={value!r}: documented {'valid' if check.is_valid(body) else 'invalid'}, "
                                     f"protocol.py {'accepts' if accepted else 'refuses'} it")
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
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/demo", None),
    ("GET", "/v1/usage", None),
    ("GET", "/health", None),
    ("GET", "/ready", None),
    ("POST", "/tokenize", {"messages": MESSAGES}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
]


@pytest.mark.parametrize(("method", "path", "body"), WHOLE, ids=lambda v: v if isinstance(v, str) else "")
def test_response_matches_its_documented_schema(server, served, method, path, body):
    operation_path = "/v1/models/{model}" if path.startswith("/v1/models/") else path
    if body is not None:
        validator(served, request_schema(served, method, operation_path)).validate(body)
    status, _, raw = call(server, method, path, body)
    assert status == 200 or (path == "/ready" and status == 503), raw
    validator(served, response_schema(served, method, operation_path, status)).validate(json.loads(raw))


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
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "tools": []}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "model": "nope"}, 404),
    ("GET", "/v1/usage?period=year", None, 400),
    ("POST", "/v1/completions", "not an object", 400),
]


@pytest.mark.parametrize(("method", "path", "body", "expected"), ERRORS, ids=lambda v: v if isinstance(v, str) else "")
def test_errors_match_the_documented_error_shape(server, served, method, path, body, expected):
    status, content_type, raw = call(server, method, path, body)
    assert status == expected and content_type.startswith("application/json")
    operation_path = path.partition("?")[0]
    if isinstance(body, dict) and expected == 400:  # the document calls the body invalid too
        assert not validator(served, request_schema(served, method, operation_path)).is_valid(body)
    validator(served, response_schema(served, method, operation_path, status)).validate(json.loads(raw))


@pytest.mark.parametrize(("method", "path", "expected"), [("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405),
                                                          ("PUT", "/openapi.json", 405)])
def test_unrouted_requests_answer_the_error_component(server, served, method, path, expected):
    status, _, raw = call(server, method, path)
    assert status == expected
    validator(served, openapi.ref("Error")).validate(json.loads(raw))

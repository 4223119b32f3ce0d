"""This server's OpenAPI 3.1 document (`GET /openapi.json`), generated from what the handlers use.

Paths and methods come from the route table, each summary from its handler's docstring. What each
route takes and answers is declared once here, in OPERATIONS: a body that a parser checks against a
field set is built from that set (openapi_bodies.py), each response shape is one of the named
schemas of openapi_components.py, and a route with no response schema is an error at build time,
not a gap in the document. tests/http/test_openapi.py checks live responses, streamed events and
errors against them.

It knows nothing of the engine; it reads the app only for its routes and the served model's name.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any, TypedDict

import orjson
from aiohttp import web

import chatd
from chatd.engine import MAX_LOGPROBS
from chatd.http.routes import embeddings, feedback, moderation, responses
from chatd.http.server.auth import is_guarded
from chatd.http.openai.items import MAX_PAGE
from chatd.http.openapi.openapi_bodies import (FIELD_SCHEMAS, KEPT_METADATA, NOT_EMPTY_STRING, RESPONSE_TOOL, TOKEN_IDS, Fields,
                                      UndocumentedError, body_schema)
from chatd.http.openapi.openapi_components import COMPONENTS, COUNT, STRING, Schema, nullable, object_, ref
from chatd.http.openai.protocol import CHAT_FIELDS, COMPLETION_FIELDS, TURN_FIELDS, UNSUPPORTED
from chatd.http.server.state import STATE
from chatd.http.routes.tokens import DETOKENIZE_FIELDS, TOKENIZE_FIELDS
from chatd.http.tools.tools import MAX_TOOLS

Route = tuple[str, str, Callable]  # (method, path, handler), as app.ROUTES lists them


# -- operations ---------------------------------------------------------------------------------


class Operation(TypedDict, total=False):
    """What OPERATIONS says about one route beyond its table entry and docstring."""

    request: Schema | Fields | None  # the JSON body
    body_optional: bool  # the body may be left out
    response: Schema  # the 200's body (a route that only streams has none)
    stream: Schema | None  # each SSE `data:` when the request asks for a stream
    events: Schema  # the event stream itself, when not SSE_CHUNKS
    content_type: str  # the 200's, when not application/json
    query: dict[str, Schema]  # query parameters, all optional
    headers: dict[str, Schema]  # request headers it reads, all optional
    statuses: dict[int, Schema]  # other statuses whose JSON body is not the error shape


# openai/protocol.py's bodies: a field it does not implement is refused, never ignored.
REFUSED = f"Unknown fields are refused, and so are these, which chatd does not implement: {', '.join(sorted(UNSUPPORTED))}."
RESPONSE_REFUSED = ("Unknown fields are refused, and so are these, which chatd does not implement: "
                    f"{', '.join(sorted(responses.UNSUPPORTED))}. Give previous_response_id or conversation, not both.")
TIMESTAMP = {"type": "string", "description": "unix seconds or an ISO 8601 date (UTC unless it says)"}
PAGE = {"limit": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 20},
        "after": {"type": "string", "description": "the last id of the page before"}}
ORDERED_PAGE = {**PAGE, "order": {"enum": ["asc", "desc"], "default": "desc", "description": "desc: newest first"}}
# The SSE streams: the `data:` of each event is documented as the operation's x-sse-data.
SSE_CHUNKS = {"type": "string", "description": "server-sent events: each `data:` is one JSON object (x-sse-data), "
                                               "the last `data: [DONE]`"}
SSE_REPLY = {"type": "string", "description": "server-sent events, each with an `id:` (1, 2, ...; reconnect to "
                                              "`.../messages/{message_id}/stream` with Last-Event-ID): each `data:` is "
                                              "one JSON object (x-sse-data), the last `data: [DONE]`, or an error "
                                              "object when the reply failed or was cut short"}
SSE_NAMED = {"type": "string", "description": "server-sent events as Responses streams them: each has an `event:` "
                                              "line naming it (its data's `type`), an `id:` (its sequence_number + 1) "
                                              "and one `data:` JSON object (x-sse-data). There is no `data: [DONE]`: "
                                              "the stream ends after response.completed, response.incomplete or "
                                              "response.failed"}


def or_error(schema: Schema) -> Schema:
    """An event of a stream that sends an error, as one more event, when it fails after it began."""
    return {"anyOf": [schema, ref("Error")]}


CHAT_REFUSED = f"{REFUSED} echo is /v1/completions' only."
# A completion may ask for no tokens only to have its prompt echoed (and scored).
ECHO_FOR_NO_TOKENS = {"if": {"not": {"properties": {"echo": {"const": True}}, "required": ["echo"]}},
                      "then": {"properties": {"max_tokens": {"minimum": 1}}}}

CONVERSATION_PATH = "/v1/conversations/{conversation_id}"
RESPONSE_PATH = "/v1/responses/{response_id}"
REPLY_CHUNK = or_error(ref("ConversationReplyChunk"))

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): {"request": Fields(CHAT_FIELDS, ("messages",), description=CHAT_REFUSED),
                                       "response": ref("ChatCompletion"), "stream": or_error(ref("ChatCompletionChunk"))},
    ("POST", "/v1/completions"): {
        "request": Fields(COMPLETION_FIELDS, ("prompt",), {
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                         "description": "alternatives per token; with echo, more than 0 is refused while the server "
                                        "checks outputs"},
            "max_tokens": {**FIELD_SCHEMAS["max_tokens"], "minimum": 0, "default": 16,
                           "description": "the reply's length limit in tokens; 0 (with echo): the prompt alone"},
            "store": {"const": False, "description": "not supported: conversations are stored by /v1/conversations"},
        }, description=REFUSED, rules=(ECHO_FOR_NO_TOKENS,)),
        "response": ref("TextCompletion"), "stream": or_error(ref("TextCompletionChunk")),
    },
    ("POST", "/v1/embeddings"): {
        "request": Fields(embeddings.FIELDS, ("input",), {
            "input": {"anyOf": [NOT_EMPTY_STRING, {"type": "array", "items": NOT_EMPTY_STRING, "minItems": 1},
                                TOKEN_IDS, {"type": "array", "items": TOKEN_IDS, "minItems": 1}],
                      "description": "a text, texts, the model's own token ids (its special tokens included, as "
                                     "/tokenize would not add them), or lists of them; at most [embeddings] "
                                     "max_inputs (2048) entries, each at most the model's input length (never cut)"},
            "model": {"type": "string", "description": "the embedding model's served name ([embeddings] served_name)"},
            "encoding_format": {"enum": list(embeddings.ENCODINGS), "default": "float",
                                "description": "base64: float32 little-endian bytes"},
            "dimensions": {"type": "integer", "minimum": 1, "description": "keep the first N numbers, renormalized "
                                                                          "(meaningful for Matryoshka-trained models)"},
            "user": {"type": "string", "description": "accepted, not used"},
        }),
        "response": ref("EmbeddingList"),
    },
    ("GET", "/v1/models"): {"response": ref("ModelList")},
    ("GET", "/v1/models/{model}"): {"response": ref("Model")},
    ("GET", "/v1/usage"): {"response": ref("TenantUsage"), "query": {
        "period": {"enum": ["day", "month"], "default": "month", "description": "the current UTC day or month"},
        "start": TIMESTAMP, "end": TIMESTAMP,
    }},
    ("POST", "/v1/conversations"): {
        # conversation_request.parse_new_conversation's fields, and the items create_conversation takes first.
        "request": Fields({"model", "title", "system_prompt", "metadata", "items"}, overrides={"metadata": KEPT_METADATA}),
        "body_optional": True, "response": ref("Conversation"),
    },
    ("GET", "/v1/conversations"): {"response": ref("ConversationList"), "query": PAGE},
    ("GET", CONVERSATION_PATH): {"response": ref("ConversationWithMessages")},
    ("POST", CONVERSATION_PATH): {
        "request": Fields({"title", "metadata", "system_prompt"},
                          overrides={"metadata": {**KEPT_METADATA, "description": "replaces it"},
                                     "system_prompt": {"type": ["string", "null"], "description": "from the next turn on"}},
                          at_least_one_of=("title", "metadata", "system_prompt"),
                          description="title or system_prompt: null clears it"),
        "response": ref("Conversation"),
    },
    ("DELETE", CONVERSATION_PATH): {"response": ref("ConversationDeleted")},
    ("POST", CONVERSATION_PATH + "/items"): {"request": Fields({"items", "include"}, ("items",)),
                                            "response": ref("ConversationItemList")},
    ("GET", CONVERSATION_PATH + "/items"): {"response": ref("ConversationItemList"), "query": ORDERED_PAGE},
    ("GET", CONVERSATION_PATH + "/items/{item_id}"): {"response": ref("ConversationItem")},
    ("DELETE", CONVERSATION_PATH + "/items/{item_id}"): {"response": ref("Conversation")},
    ("POST", CONVERSATION_PATH + "/messages"): {
        "request": Fields(TURN_FIELDS, ("content",), {"n": {"const": 1, "description": "one reply per message"}},
                          description=REFUSED),
        "response": ref("ConversationReply"), "stream": REPLY_CHUNK, "events": SSE_REPLY,
    },
    ("GET", CONVERSATION_PATH + "/messages/{message_id}/stream"): {
        "stream": REPLY_CHUNK, "events": SSE_REPLY,
        "query": {"after": {**COUNT, "default": 0, "description": "the last event id received (as Last-Event-ID)"}},
        "headers": {"Last-Event-ID": {**COUNT, "description": "the last event id received; wins over `after`"}},
    },
    ("POST", CONVERSATION_PATH + "/messages/{message_id}/cancel"): {"response": ref("ConversationMessage")},
    ("POST", "/v1/responses"): {
        "request": Fields(responses.RESPONSE_FIELDS, ("input",), {
            "store": {"type": "boolean", "default": True,
                      "description": "false: keep only a record that it existed (it cannot be retrieved or continued)"},
            "service_tier": {"enum": list(responses.SERVICE_TIERS), "description": "accepted; the response says default"},
            "stream_options": {"type": "object", "description": "only with stream: true; accepted, not used"},
            "tools": {"type": "array", "items": RESPONSE_TOOL, "maxItems": MAX_TOOLS,
                      "description": "function tools; each call is a function_call output item"},
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                                      {"type": "object", "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                                       "required": ["type", "name"], "additionalProperties": False}],
                            "default": "auto"},
            "parallel_tool_calls": {"type": "boolean", "default": True, "description": "false: at most one call"},
        }, description=RESPONSE_REFUSED),
        "response": ref("Response"), "stream": ref("ResponseStreamEvent"), "events": SSE_NAMED,
    },
    ("GET", RESPONSE_PATH): {
        "response": ref("Response"), "stream": ref("ResponseStreamEvent"), "events": SSE_NAMED, "query": {
            "stream": {"type": "boolean", "default": False, "description": "replay its events, live while it runs"},
            "starting_after": {"type": "integer", "minimum": -1, "default": -1,
                               "description": "with stream: the sequence_number after which to start"},
        },
    },
    ("DELETE", RESPONSE_PATH): {"response": ref("ResponseDeleted")},
    ("POST", RESPONSE_PATH + "/cancel"): {"response": ref("Response")},
    ("GET", RESPONSE_PATH + "/input_items"): {"response": ref("ConversationItemList"), "query": ORDERED_PAGE},
    ("GET", "/"): {"response": STRING, "content_type": "text/html"},
    ("GET", "/static/{name}"): {"response": STRING, "content_type": "*/*"},
    ("GET", "/live"): {"response": ref("Live")},
    ("GET", "/health"): {"response": ref("Health"), "statuses": {503: ref("Unavailable")}},
    ("GET", "/ready"): {"response": ref("Ready"), "statuses": {503: ref("Unavailable")}},
    ("GET", "/metrics"): {"response": STRING, "content_type": "text/plain"},
    ("GET", "/version"): {"response": {"type": "object", "properties": {"version": STRING}, "required": ["version"]}},
    ("POST", "/tokenize"): {
        "request": Fields(TOKENIZE_FIELDS, overrides={"prompt": {"type": "string"}}, exactly_one_of=("prompt", "messages")),
        "response": ref("Tokenized"),
    },
    ("POST", "/detokenize"): {"request": Fields(DETOKENIZE_FIELDS, ("tokens",)), "response": ref("Detokenized")},
    ("GET", "/openapi.json"): {"response": {"type": "object", "description": "this document"}},
    ("POST", "/v1/moderations"): {
        "request": Fields({"input", "model"}, ("input",), {
            "input": {"anyOf": [STRING, {"type": "array", "minItems": 1, "maxItems": moderation.MAX_INPUTS, "items": {
                "anyOf": [STRING, object_({"type": {"const": "text"}, "text": STRING})]}}],
                "description": "a text, or a list of texts or text parts (images are refused)"},
            "model": {"type": "string", "description": "accepted and echoed; chatd's own checks answer"},
        }),
        "response": ref("Moderation"),
    },
    ("POST", "/v1/appeals"): {
        "request": Fields({"appeal_id", "reason"}, ("appeal_id", "reason"), {
            "appeal_id": {"type": "string", "description": "the appeal id a refusal (or a cut reply's record) gave"},
            "reason": {"type": "string", "minLength": 1, "maxLength": moderation.MAX_REASON_CHARS},
        }),
        "response": ref("Appeal"),
    },
    ("GET", "/v1/appeals/{appeal_id}"): {"response": ref("Appeal")},
    ("POST", "/v1/feedback"): {
        "request": Fields({"id", "rating", "comment"}, ("id", "rating"), {
            "id": {"type": "string", "minLength": 1, "maxLength": feedback.MAX_ID_CHARS,
                   "description": "a reply of yours: a message (msg_), a response (resp_), a completion (chatcmpl-, cmpl-)"},
            "rating": {"enum": ["up", "down"]},
            "comment": nullable({"type": "string", "maxLength": feedback.MAX_COMMENT_CHARS}),
        }),
        "response": ref("Feedback"),
    },
    ("POST", "/admin/models/{model}/load"): {"response": ref("Model"), "statuses": {503: ref("Error")}},
    ("POST", "/admin/models/{model}/unload"): {"response": ref("Model"), "statuses": {409: ref("Error")}},
    ("GET", "/admin/canaries"): {"response": {"type": "object", "description": "every canary ramp, with its history"}},
    ("POST", "/admin/canaries/{alias}/rollback"): {"response": {"type": "object", "description": "the ramp, at 0%"}},
    ("POST", "/admin/canaries/{alias}/restart"): {"response": {"type": "object", "description": "the ramp, restarted"}},
}
ERROR_RESPONSE = {"description": "OpenAI's error shape", "content": {"application/json": {"schema": ref("Error")}}}
# {name} or aiohttp's {name:regex} in a route's path; OpenAPI's template is {name}.
PATH_PARAMETER = re.compile(r"\{(\w+)(?::[^}]*)?\}")


def build_document(routes: Iterable[Route], model_name: str) -> dict:
    """The OpenAPI document of these routes; UndocumentedError for a handler or field it cannot describe."""
    paths: dict[str, dict] = {}
    operation_ids: set[str] = set()
    for method, path, handler in routes:
        template = PATH_PARAMETER.sub(r"{\1}", path)
        operation = _operation(method, template, handler, OPERATIONS.get((method, template), {}), model_name)
        if operation["operationId"] in operation_ids:  # one handler's name used twice: name it by its module too
            operation["operationId"] = f"{handler.__module__.rsplit('.', 1)[-1]}_{operation['operationId']}"
        operation_ids.add(operation["operationId"])
        paths.setdefault(template, {})[method.lower()] = operation
    model = COMPONENTS["Model"]
    model = {**model, "properties": {**model["properties"], "id": {"type": "string", "examples": [model_name]}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "chatd", "version": chatd.__version__,
                 "description": "A self-hosted, OpenAI-compatible LLM server serving one model."},
        "paths": paths,
        "components": {
            "schemas": {**COMPONENTS, "Model": model},
            "responses": {"Error": ERROR_RESPONSE},
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description":
                                           "the server's --api-key or a key from `chatd keys create`, when auth is on"}},
        },
    }


def _operation(method: str, path: str, handler: Callable, entry: Operation, model_name: str) -> dict:
    doc = inspect.getdoc(handler)
    if not doc:
        raise UndocumentedError(f"{method} {path}: its handler {handler.__qualname__} has no docstring to summarize it")
    summary, _, description = doc.partition("\n")
    operation: dict[str, Any] = {"operationId": handler.__name__, "summary": summary.strip()}
    if description.strip():
        operation["description"] = description.strip()
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in PATH_PARAMETER.findall(path)]
    parameters += [{"name": name, "in": "query", "required": False, "schema": schema}
                   for name, schema in entry.get("query", {}).items()]
    parameters += [{"name": name, "in": "header", "required": False, "schema": schema}
                   for name, schema in entry.get("headers", {}).items()]
    if parameters:
        operation["parameters"] = parameters
    request = entry.get("request")
    if isinstance(request, Fields):
        request = body_schema(request, model_name)
    if request is not None:
        operation["requestBody"] = {"required": not entry.get("body_optional", False),
                                    "content": {"application/json": {"schema": request}}}
    if "response" not in entry and entry.get("stream") is None:
        raise UndocumentedError(f"{method} {path}: openapi.OPERATIONS has no response schema for it")
    content = {}
    if "response" in entry:
        content[entry.get("content_type", "application/json")] = {"schema": entry["response"]}
    if entry.get("stream") is not None:
        content["text/event-stream"] = {"schema": entry.get("events", SSE_CHUNKS), "x-sse-data": entry["stream"]}
    statuses = {"200": {"description": "OK", "content": content}}
    for status, schema in entry.get("statuses", {}).items():
        statuses[str(status)] = {"description": "not available", "content": {"application/json": {"schema": schema}}}
    statuses["4XX"] = statuses["5XX"] = {"$ref": "#/components/responses/Error"}
    operation["responses"] = statuses
    if is_guarded(path):  # a bearer key when auth is on, nothing when it is off
        operation["security"] = [{"apiKey": []}, {}]
    return operation


# -- the route ----------------------------------------------------------------------------------


async def openapi_document(request: web.Request) -> web.Response:
    """This server's OpenAPI 3.1 document: every route, its parameters, bodies and responses."""
    # Read from the app's router, not imported from app.py (which imports this module); each GET's
    # implied HEAD and the catch-all for unknown paths are left out.
    routes = tuple((route.method, route.resource.canonical, route.handler) for route in request.app.router.routes()
                   if route.method not in ("HEAD", "*"))
    return web.Response(body=_document_bytes(routes, request.app[STATE].model_name), content_type="application/json")


@functools.lru_cache(maxsize=4)
def _document_bytes(routes: tuple[Route, ...], model_name: str) -> bytes:
    """Built once per app (its routes and model never change while it runs)."""
    return orjson.dumps(build_document(routes, model_name))

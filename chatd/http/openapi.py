"""This server's OpenAPI 3.1 document (`GET /openapi.json`), generated from what the handlers use.

Paths and methods come from the route table, each summary from its handler's docstring. A body
that protocol.py or responses.py parses is built from the very field set it checks against, each
field's schema taken from FIELD_SCHEMAS: a field with none is an error at build time, not a gap in
the document, and so is a route with no response schema. Other bodies and every response shape
are declared once here, in OPERATIONS and COMPONENTS, and tests/http/test_openapi.py checks live
responses, streamed events and errors against them.

It knows nothing of the engine; it reads the app only for its routes and the served model's name.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import orjson
from aiohttp import web

import chatd
from chatd.engine import MAX_LOGPROBS, MAX_N
from chatd.http import moderation, responses
from chatd.http.auth import is_guarded
from chatd.http.chat_messages import ROLES
from chatd.http.conversation_request import MAX_METADATA_DEPTH
from chatd.http.conversations import MAX_NEW_ITEMS
from chatd.http.items import MAX_PAGE, TEXT_PARTS
from chatd.http.items import ROLES as ITEM_ROLES
from chatd.http.protocol import (
    CHAT_FIELDS, COMPLETION_FIELDS, MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS,
    MAX_PROMPTS, MAX_STOP, SERVICE_TIERS, TURN_FIELDS, UNSUPPORTED, VERBOSITIES,
)
from chatd.http.state import STATE
from chatd.http.tokens import DETOKENIZE_FIELDS, TOKENIZE_FIELDS
from chatd.http.tools import MAX_TOOLS
from chatd.safety.rules import CATEGORIES as MODERATION_CATEGORIES
from chatd.store.db import STATUSES

Schema = dict[str, Any]
Route = tuple[str, str, Callable]  # (method, path, handler), as app.ROUTES lists them


def ref(name: str) -> Schema:
    """A reference to one of COMPONENTS."""
    return {"$ref": f"#/components/schemas/{name}"}


def _object(properties: Schema, required: Iterable[str] | None = None) -> Schema:
    """An object with these properties, all required unless `required` says which; extras allowed."""
    return {"type": "object", "properties": properties, "required": list(properties if required is None else required)}


def nullable(schema: Schema) -> Schema:
    """`schema` or null."""
    return {"anyOf": [schema, {"type": "null"}]}


# -- request fields -----------------------------------------------------------------------------

TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
             "required": ["type", "text"]}
TOOL_CALL = {"type": "object", "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                  "arguments": {"type": "string", "description": "a JSON object"}},
                 "required": ["name"]}}, "required": ["function"]}
MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": sorted(ROLES), "description": "developer is read as system; tool: a function's result"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, {"type": "null"}],
                    "description": "a string, or text parts (joined); null only beside tool_calls"},
        "name": {"type": "string", "description": "the participant's name"},
        "tool_calls": {"type": "array", "items": TOOL_CALL, "minItems": 1, "description": "assistant messages only"},
        "tool_call_id": {"type": "string", "minLength": 1, "description": "tool messages only: the call answered"},
        "refusal": {"type": "null", "description": "assistant messages only; accepted back"},
    },
    "required": ["role"],
    "additionalProperties": False,
}
FUNCTION_TOOL = {"type": "object", "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema; a call's arguments always validate against it"},
        "strict": {"type": "boolean"}}, "required": ["name"]}}, "required": ["type", "function"]}
TOKEN_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
NOT_EMPTY_STRING = {"type": "string", "minLength": 1}
STRING = {"type": "string"}
PENALTY = {"type": "number", "minimum": -2, "maximum": 2}
# Messages as the Responses and Conversations APIs send them (items.py): text only. An earlier
# response's output item may come back as it came, with its id, status and annotations.
ITEM_PART = {
    "type": "object",
    "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"},
                   "annotations": {"description": "accepted back, ignored"},
                   "logprobs": {"description": "accepted back, ignored"}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
INPUT_ITEM = {
    "type": "object",
    "properties": {
        "type": {"const": "message", "description": "chatd takes message items only (no tool calls, reasoning, references)"},
        "role": {"enum": list(ITEM_ROLES), "description": "developer is read as system"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": ITEM_PART}],
                    "description": "a string, or text parts (joined)"},
        "id": {"description": "accepted back, ignored"}, "status": {"description": "accepted back, ignored"},
        "phase": {"description": "accepted back, ignored"},
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}
# A conversation's metadata (conversation_request._metadata): any object, kept and returned.
KEPT_METADATA = {"type": "object", "description": f"any JSON object, at most the server's `max_metadata_bytes` as JSON "
                                                  f"and {MAX_METADATA_DEPTH} levels deep; kept and returned"}

# Structured output (structured.py): a named JSON schema, in chat's and in Responses' shape.
_SCHEMA_FORMAT_FIELDS = {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
                         "schema": {"type": "object"}, "strict": nullable({"type": "boolean"})}
JSON_SCHEMA_FORMAT = _object(_SCHEMA_FORMAT_FIELDS, ["name", "schema"])
TEXT_FORMAT = {"anyOf": [_object({"type": {"enum": ["text", "json_object"]}}, ["type"]),
                         _object({"type": {"const": "json_schema"}, **_SCHEMA_FORMAT_FIELDS}, ["type", "name", "schema"])]}

# Every field of a body checked against a field set (protocol.py's, tokens.py's, ...), by name. A field
# a set allows that is missing here makes build_document raise: it is documented before it is served.
FIELD_SCHEMAS: dict[str, Schema] = {
    "model": {"type": "string", "description": "the served model's name; may be left out"},
    "messages": {"type": "array", "items": MESSAGE, "minItems": 1,
                 "description": "at most the server's `max_messages`"},
    "prompt": {"anyOf": [{"type": "string"}, TOKEN_IDS, {"type": "array", "items": {"anyOf": [{"type": "string"}, TOKEN_IDS]},
                                                         "minItems": 1, "maxItems": MAX_PROMPTS}],
               "description": "text or token ids; or a list of them, each prompt its own choices"},
    "content": {"anyOf": [NOT_EMPTY_STRING, {"type": "array", "items": TEXT_PART, "minItems": 1}],
                "description": "the user's message: a string, or text parts (joined)"},
    "role": {"const": "user", "description": "the server writes the assistant's replies"},
    "max_tokens": {"type": "integer", "minimum": 1, "description": "the reply's length limit in tokens"},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "description": "as max_tokens, which it overrides"},
    "min_tokens": {"type": "integer", "minimum": 0, "description": "tokens generated before a stop may end the reply"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "description": "0: off"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "description": "the number of choices"},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    "stop": {"anyOf": [NOT_EMPTY_STRING, {"type": "array", "items": NOT_EMPTY_STRING, "maxItems": MAX_STOP}]},
    "stream": {"type": "boolean", "description": "answer with server-sent events"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                       "description": "only with stream: true"},
    "logprobs": {"type": "boolean", "description": "return each token's log-probability"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                     "description": "alternatives per token; needs logprobs: true"},
    "response_format": {"anyOf": [
        _object({"type": {"enum": ["text", "json_object"]}}, ["type"]),
        _object({"type": {"const": "json_schema"}, "json_schema": JSON_SCHEMA_FORMAT}, ["type", "json_schema"]),
    ], "description": "json_object: any JSON object; json_schema: JSON valid against the schema, enforced token by token"},
    "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False, "properties": {
        "json": {"type": "object", "description": "a JSON schema (or its JSON text)"}, "regex": NOT_EMPTY_STRING,
        "choice": {"type": "array", "items": NOT_EMPTY_STRING, "minItems": 1}, "grammar": NOT_EMPTY_STRING,
        "json_object": {"type": "boolean"}},
        "description": "chatd (vLLM) extension: output that matches a JSON schema, a regex, one of the choices, or a "
                       "Lark grammar (llguidance's dialect)"},
    "guided_json": {"type": "object", "description": "as structured_outputs.json: a JSON schema (or its JSON text)"},
    "guided_regex": {**NOT_EMPTY_STRING, "description": "as structured_outputs.regex"},
    "guided_choice": {"type": "array", "items": NOT_EMPTY_STRING, "minItems": 1, "description": "as structured_outputs.choice"},
    "guided_grammar": {**NOT_EMPTY_STRING, "description": "as structured_outputs.grammar"},
    "ignore_eos": {"type": "boolean", "description": "generate past the end-of-sequence token"},
    "priority": {"type": "integer", "description": "lower is scheduled first; with API keys it is added to the "
                 "tier's priority, so it can only lower a request's place"},
    "user": {"type": "string"},
    "logit_bias": {"type": "object", "maxProperties": 0, "description": "not supported: only an empty object"},
    "store": {"type": "boolean", "description": "accepted; chatd keeps no completion to retrieve"},
    "metadata": {"type": "object", "maxProperties": MAX_METADATA_KEYS, "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
                 "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
                 "description": "tags for the caller; accepted, not used"},
    "service_tier": {"enum": list(SERVICE_TIERS), "description": "accepted; every request is served the same way"},
    "verbosity": {"enum": list(VERBOSITIES), "description": "accepted, not used"},
    "prompt_cache_key": {"type": "string", "description": "logged; the prefix cache finds shared prefixes by itself"},
    "safety_identifier": {"type": "string", "description": "accepted, not used"},
    "add_generation_prompt": {"type": "boolean", "default": True, "description": "end with the assistant's turn opening"},
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}, "description": "token ids of the served model"},
    # Conversations (conversation_request.parse_new_conversation, conversations.create_items) and responses (responses.py).
    "title": {"type": "string", "description": "at most the server's `max_title_chars`"},
    "system_prompt": {"type": "string", "description": "the conversation's system message, before every turn"},
    "items": {"type": "array", "items": INPUT_ITEM, "minItems": 1, "maxItems": MAX_NEW_ITEMS,
              "description": "messages added in order; each at most the server's `max_message_chars`"},
    "input": {"anyOf": [NOT_EMPTY_STRING, {"type": "array", "items": INPUT_ITEM, "minItems": 1,
                                           "maxItems": responses.MAX_INPUT_ITEMS}],
              "description": "a user message, or message items (at most the server's `max_messages`)"},
    "instructions": {"type": "string", "description": "this response's system message; not carried to the next"},
    "max_output_tokens": {"type": "integer", "minimum": 1, "description": "the reply's length limit in tokens"},
    "previous_response_id": {"type": "string", "description": "continue this stored, finished response's chain"},
    "conversation": {"anyOf": [{"type": "string"},
                               {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}],
                     "description": "continue this conversation (its id, or an object with it); the response's "
                                    "input and output are added to it"},
    "truncation": {"enum": ["auto", "disabled"], "default": "disabled",
                   "description": "auto: leave out the oldest turns of too long a history; disabled: a 400"},
    "text": {"type": "object", "properties": {
        "format": nullable(TEXT_FORMAT),
        "verbosity": nullable({"enum": list(VERBOSITIES)}),
    }, "description": "format: text, json_object or json_schema (enforced token by token); verbosity is accepted, not used"},
    "tools": {"type": "array", "items": FUNCTION_TOOL, "maxItems": MAX_TOOLS,
              "description": "functions the model may call, shown to it through its chat template"},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                              _object({"type": {"const": "function"}, "function": _object({"name": {"type": "string"}})})],
                    "description": "required or a named function: the reply is a call; auto: text or calls. Every "
                                   "call names an offered function with arguments that match its schema (a grammar)"},
    "parallel_tool_calls": {"type": "boolean", "default": True, "description": "false: at most one call"},
    "include": {"type": "array", "maxItems": 0, "description": "not supported: items carry only their text"},
    "reasoning": {"type": "object", "additionalProperties": {"type": "null"},
                  "description": "chatd's models take no reasoning options: only nulls"},
    "background": {"const": False, "description": "not supported: stream, or wait for the response"},
}


@dataclass(frozen=True)
class Fields:
    """A body checked against a field set (protocol.py's, tokens.py's, responses.py's): the set, the
    fields it requires, or of which it requires exactly one or at least one, and the schemas that
    differ in this body from FIELD_SCHEMAS (a completion's logprobs is a count, a chat's a boolean)."""

    allowed: Iterable[str]
    required: tuple[str, ...] = ()
    overrides: Mapping[str, Schema] = field(default_factory=dict)
    exactly_one_of: tuple[str, ...] = ()
    at_least_one_of: tuple[str, ...] = ()
    description: str = ""


class UndocumentedError(LookupError):
    """A route or an allowed field the document cannot describe: a bug to fix before serving it."""


def body_schema(fields: Fields, model_name: str) -> Schema:
    """The JSON Schema of a body checked against `fields`; UndocumentedError for a field with no schema."""
    missing = sorted(name for name in fields.allowed if name not in fields.overrides and name not in FIELD_SCHEMAS)
    if missing:
        raise UndocumentedError(f"allowed fields have no schema in openapi.FIELD_SCHEMAS: {', '.join(missing)}")
    properties = {}
    for name in sorted(fields.allowed):
        schema = fields.overrides.get(name) or FIELD_SCHEMAS[name]
        if name == "model":
            schema = {**schema, "examples": [model_name]}
        # A null reads as a field left out, so an optional field may be null.
        optional = name not in fields.required and name not in fields.exactly_one_of
        properties[name] = nullable(schema) if optional else schema
    body: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if fields.required:
        body["required"] = list(fields.required)
    if fields.exactly_one_of:
        body["oneOf"] = [{"required": [name]} for name in fields.exactly_one_of]
    if fields.at_least_one_of:
        body["anyOf"] = [{"required": [name]} for name in fields.at_least_one_of]
    if fields.description:
        body["description"] = fields.description
    return body


# -- response shapes ----------------------------------------------------------------------------

COUNT = {"type": "integer", "minimum": 0}
FINISH_REASON = {"enum": ["stop", "length", "tool_calls", "content_filter"]}


def _completion(object_name: str, choice: Schema, chunk: bool) -> Schema:
    """openai_format.py's envelope: a whole response carries usage, a chunk carries it only when asked."""
    properties = {"id": {"type": "string"}, "object": {"const": object_name}, "created": {"type": "integer"},
                  "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                  "usage": nullable(ref("Usage")) if chunk else ref("Usage"),
                  "service_tier": {"type": "string", "description": "when the request named one"}}
    if not chunk:
        return _object(properties, ["id", "object", "created", "model", "choices", "usage"])
    return {**_object(properties, ["id", "object", "created", "model", "choices"]),
            "description": "a chunk with no choices and the whole usage ends a stream that asked for include_usage"}


def _choice(body: Schema, logprobs: str, chunk: bool) -> Schema:
    return _object({"index": COUNT, **body, "logprobs": nullable(ref(logprobs)),
                    "finish_reason": nullable(FINISH_REASON) if chunk else FINISH_REASON})


TOKEN_LOGPROB = {"token": {"type": "string"}, "logprob": {"type": "number"}, "bytes": {"type": "array", "items": COUNT}}
ASSISTANT = _object({"role": {"const": "assistant"}, "content": nullable({"type": "string"}),
                     "tool_calls": {"type": "array", "items": _object({
                         "id": STRING, "type": {"const": "function"},
                         "function": _object({"name": STRING, "arguments": STRING})}),
                         "description": "the functions the reply calls (its content is then null when it says nothing else)"}},
                    ["role", "content"])
TOOL_CALL_DELTA = _object({"index": COUNT, "id": STRING, "type": {"const": "function"},
                           "function": {"type": "object", "properties": {"name": STRING, "arguments": STRING}}},
                          ["index", "function"])
TEXT_CHOICE = {"text": {"type": "string"}}
STORE_STATUS = _object({"writable": {"type": "boolean"}, "pending_writes": COUNT, "error": nullable({"type": "string"})})
UNIX_SECONDS = {"type": "integer", "description": "unix seconds"}
NOTHING = {"type": "array", "maxItems": 0}


def _page(item: str) -> Schema:
    """A page of a list, as OpenAI lists items (items.item_page)."""
    return _object({"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)},
                    "first_id": nullable(STRING), "last_id": nullable(STRING), "has_more": {"type": "boolean"}})


# conversations.py's shapes: OpenAI's conversation object with chatd's extras, and chatd's messages.
CONVERSATION = {"id": STRING, "object": {"const": "conversation"}, "created_at": UNIX_SECONDS,
                "updated_at": UNIX_SECONDS, "model": STRING, "title": nullable(STRING),
                "system_prompt": nullable(STRING), "metadata": {"type": "object"}}
CONVERSATION_MESSAGE = {
    **_object({"id": STRING, "object": {"const": "conversation.message"}, "role": {"enum": list(ITEM_ROLES)},
               "content": STRING, "status": {"enum": list(STATUSES), "description": "partial: cut short, or still "
                                                                                 "being generated"},
               "created_at": UNIX_SECONDS, "finish_reason": nullable(FINISH_REASON), "usage": ref("Usage"),
               "cost": {"type": "number", "description": "USD"}},
              ["id", "object", "role", "content", "status", "created_at"]),
    "if": {"properties": {"role": {"const": "assistant"}}},
    "then": {"required": ["finish_reason", "usage", "cost"]},
    "description": "chatd's message; an assistant's also says how it ended, its usage and its cost",
}
MESSAGES_OMITTED = _object({"messages_omitted": {**COUNT, "description": "the oldest messages left out of the prompt"}})
# Items (items.item_json): a message with one text part, output_text for the assistant's.
INPUT_TEXT = _object({"type": {"const": "input_text"}, "text": STRING})
OUTPUT_TEXT = _object({"type": {"const": "output_text"}, "text": STRING, "annotations": NOTHING, "logprobs": NOTHING})

# responses.py's shapes: its `response` object (response_object) and its stream's events (ResponseEvents).
RESPONSE_STATUSES = ["in_progress", "completed", "incomplete", "cancelled", "failed"]
RESPONSE = {
    "id": STRING, "object": {"const": "response"}, "created_at": UNIX_SECONDS, "status": {"enum": RESPONSE_STATUSES},
    "completed_at": nullable({**UNIX_SECONDS, "description": "once it has ended"}),
    "error": nullable(_object({"code": {"const": "server_error"}, "message": STRING})),
    "incomplete_details": nullable(_object({"reason": {"const": "max_output_tokens"}})),
    "instructions": nullable(STRING), "max_output_tokens": nullable(COUNT), "model": STRING,
    "output": {"type": "array", "items": ref("ConversationItem"), "maxItems": 1,
               "description": "the reply's message; empty until it begins"},
    "parallel_tool_calls": {"type": "boolean"}, "previous_response_id": nullable(STRING),
    "conversation": nullable(_object({"id": STRING})),
    "temperature": nullable({"type": "number"}), "top_p": nullable({"type": "number"}),
    "tool_choice": {"enum": ["none", "auto"]}, "tools": NOTHING,
    "text": _object({"format": TEXT_FORMAT, "verbosity": {"enum": list(VERBOSITIES)}}, ["format"]),
    "truncation": {"enum": ["auto", "disabled"]},
    "reasoning": _object({"effort": {"type": "null"}, "summary": {"type": "null"}}),
    "background": {"const": False}, "service_tier": {"const": "default"}, "store": {"type": "boolean"},
    "metadata": {"type": "object"}, "user": nullable(STRING), "safety_identifier": nullable(STRING),
    "prompt_cache_key": nullable(STRING), "usage": nullable(ref("ResponseUsage")),
    "chatd": _object({"items_omitted": {**COUNT, "description": "the oldest items left out (truncation: auto)"},
                      "output_deleted": {"type": "boolean", "description": "its output item was deleted from its "
                                                                           "conversation"}}),
}
AT_PART = {"item_id": STRING, "output_index": {"const": 0}, "content_index": {"const": 0}}


def _event(kind: str, **properties: Schema) -> Schema:
    """One of a Responses stream's events: its `type` (also its SSE `event:` name) and sequence_number from 0."""
    return _object({"type": {"const": kind}, "sequence_number": COUNT, **properties})


def _response_as(*statuses: str) -> Schema:
    return {"allOf": [ref("Response"), {"properties": {"status": {"enum": list(statuses)}}}]}


RESPONSE_EVENTS = [
    _event("response.created", response=_response_as("in_progress")),
    _event("response.in_progress", response=_response_as("in_progress")),
    _event("response.output_item.added", output_index={"const": 0}, item=ref("ConversationItem")),
    _event("response.content_part.added", **AT_PART, part=OUTPUT_TEXT),
    _event("response.output_text.delta", **AT_PART, delta=STRING, logprobs=NOTHING),
    _event("response.output_text.done", **AT_PART, text=STRING, logprobs=NOTHING),
    _event("response.content_part.done", **AT_PART, part=OUTPUT_TEXT),
    _event("response.output_item.done", output_index={"const": 0}, item=ref("ConversationItem")),
    _event("response.completed", response=_response_as("completed")),
    _event("response.incomplete", response=_response_as("incomplete", "cancelled")),
    _event("response.failed", response=_response_as("failed")),
]

COMPONENTS: dict[str, Schema] = {
    "Error": _object({"error": _object({"message": {"type": "string"}, "type": {"type": "string"},
                                        "param": nullable({"type": "string"}), "code": nullable({"type": "string"})})}),
    "Usage": _object({"prompt_tokens": COUNT, "completion_tokens": COUNT, "total_tokens": COUNT,
                      "prompt_tokens_details": _object({"cached_tokens": COUNT})}),
    "ChatLogprobs": _object({"content": {"type": "array", "items": _object(
        {**TOKEN_LOGPROB, "top_logprobs": {"type": "array", "items": _object(TOKEN_LOGPROB)}})}}),
    "CompletionLogprobs": _object({
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number"}}},
    }),
    "ChatCompletion": _completion("chat.completion", _choice({"message": ASSISTANT}, "ChatLogprobs", False), False),
    "ChatCompletionChunk": _completion("chat.completion.chunk", _choice(
        {"delta": _object({**ASSISTANT["properties"], "tool_calls": {"type": "array", "items": TOOL_CALL_DELTA}}, ())},
        "ChatLogprobs", True), True),
    "TextCompletion": _completion("text_completion", _choice(TEXT_CHOICE, "CompletionLogprobs", False), False),
    "TextCompletionChunk": _completion("text_completion", _choice(TEXT_CHOICE, "CompletionLogprobs", True), True),
    "Model": _object({"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                      "owned_by": {"type": "string"}, "root": {"type": "string", "description": "the served model's name"},
                      "context_length": COUNT,
                      "chatd": {"type": "object", "description": "chatd's facts about the model: dtype, device, KV blocks..."}}),
    "ModelList": _object({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}),
    "TenantUsage": _object({
        "object": {"const": "usage"}, "tenant": {"type": "string"}, "tier": {"type": "string"},
        "start": {"type": "number", "description": "unix seconds"}, "end": {"type": "number", "description": "unix seconds"},
        "requests": COUNT, "input_tokens": COUNT, "cached_tokens": COUNT, "output_tokens": COUNT,
        "cost": {"type": "number"}, "currency": {"const": "USD"},
        "limits": {"type": "object", "description": "the tier's limits and what is left of them now; `limited` false when "
                   "nothing limits the caller (auth off); a limit of null is none", "properties": {
                       "limited": {"type": "boolean"}, "requests_per_minute": nullable(COUNT),
                       "remaining_requests": nullable(COUNT), "tokens_per_minute": nullable(COUNT),
                       "remaining_tokens": nullable(COUNT), "max_concurrent_requests": nullable(COUNT),
                       "in_flight_requests": COUNT, "max_tokens": nullable(COUNT)},
                   "required": ["limited"]},
    }),
    "Tokenized": _object({"tokens": {"type": "array", "items": COUNT}, "count": COUNT, "max_model_len": COUNT}),
    "Detokenized": _object({"prompt": {"type": "string"}}),
    "Health": {"anyOf": [_object({"status": {"const": "ok"}, "store": STORE_STATUS}),
                         _object({"status": {"const": "engine stopped"}, "error": {"type": "string"}})]},
    "Ready": {"anyOf": [_object({"status": {"enum": ["ready", "warming up"]}}),
                        _object({"status": {"const": "store cannot write"}, "store": STORE_STATUS})]},
    "Conversation": _object(CONVERSATION),
    "ConversationWithMessages": _object({**CONVERSATION, "messages": {"type": "array", "items": ref("ConversationMessage")}}),
    "ConversationList": {**_page("Conversation"), "description": "newest first"},
    "ConversationDeleted": _object({"id": STRING, "object": {"const": "conversation.deleted"}, "deleted": {"const": True}}),
    "ConversationMessage": CONVERSATION_MESSAGE,
    "ConversationReply": {"allOf": [ref("ChatCompletion"), _object({"conversation_id": STRING, "chatd": MESSAGES_OMITTED})],
                          "description": "a chat completion whose id is the reply's message id"},
    "ConversationReplyChunk": {"allOf": [ref("ChatCompletionChunk"),
                                         _object({"conversation_id": STRING, "chatd": MESSAGES_OMITTED}, ["conversation_id"])],
                               "description": "a chat completion chunk whose id is the reply's message id; the first "
                                              "says how many messages were left out"},
    "ConversationItem": _object({
        "type": {"const": "message"}, "id": STRING, "status": {"enum": ["completed", "in_progress", "incomplete"]},
        "role": {"enum": list(ITEM_ROLES)},
        "content": {"type": "array", "items": {"anyOf": [INPUT_TEXT, OUTPUT_TEXT]}, "maxItems": 1,
                    "description": "one text part (output_text for the assistant's); none in response.output_item.added"},
    }),
    "ConversationItemList": _page("ConversationItem"),
    "Response": _object(RESPONSE),
    "ResponseUsage": _object({"input_tokens": COUNT, "input_tokens_details": _object({"cached_tokens": COUNT}),
                              "output_tokens": COUNT, "output_tokens_details": _object({"reasoning_tokens": COUNT}),
                              "total_tokens": COUNT}),
    "ResponseStreamEvent": {"oneOf": RESPONSE_EVENTS, "description": "the events of a Responses stream, by `type`"},
    "ResponseDeleted": _object({"id": STRING, "object": {"const": "response"}, "deleted": {"const": True}}),
    "Moderation": _object({"id": STRING, "model": STRING, "results": {"type": "array", "items": _object({
        "flagged": {"type": "boolean"},
        "categories": _object({c: {"type": "boolean"} for c in MODERATION_CATEGORIES}),
        "category_scores": _object({c: {"type": "number", "minimum": 0, "maximum": 1} for c in MODERATION_CATEGORIES}),
        "category_applied_input_types": _object({c: {"type": "array", "items": {"const": "text"}}
                                                 for c in MODERATION_CATEGORIES}),
    })}}),
    "Appeal": _object({
        "id": STRING, "object": {"const": "appeal"}, "status": {"enum": ["open", "appealed", "upheld", "overturned"]},
        "stage": {"enum": ["input", "output"]}, "action": {"enum": ["blocked", "flagged", "redacted", "guard_failed"]},
        "categories": {"type": "array", "items": STRING}, "created_at": UNIX_SECONDS,
        "appealed_at": nullable(UNIX_SECONDS), "resolved_at": nullable(UNIX_SECONDS), "resolution_note": nullable(STRING),
    }),
}


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


# protocol.py's bodies: a field it does not implement is refused, never ignored.
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


CONVERSATION_PATH = "/v1/conversations/{conversation_id}"
RESPONSE_PATH = "/v1/responses/{response_id}"
REPLY_CHUNK = or_error(ref("ConversationReplyChunk"))

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): {"request": Fields(CHAT_FIELDS, ("messages",), description=REFUSED),
                                       "response": ref("ChatCompletion"), "stream": or_error(ref("ChatCompletionChunk"))},
    ("POST", "/v1/completions"): {
        "request": Fields(COMPLETION_FIELDS, ("prompt",), {
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "description": "alternatives per token"},
            "max_tokens": {**FIELD_SCHEMAS["max_tokens"], "default": 16},
            "store": {"const": False, "description": "not supported: conversations are stored by /v1/conversations"},
        }, description=REFUSED),
        "response": ref("TextCompletion"), "stream": or_error(ref("TextCompletionChunk")),
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
        "request": Fields({"title", "metadata"}, overrides={"metadata": {**KEPT_METADATA, "description": "replaces it"}},
                          at_least_one_of=("title", "metadata"), description="title: null clears it"),
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
            "tools": {"type": "array", "maxItems": 0, "description": "not supported on responses yet: only an empty list"},
            "tool_choice": {"enum": ["none", "auto"], "description": "there are no tools to call"},
            "parallel_tool_calls": {"type": "boolean", "description": "accepted; there are no tools"},
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
    ("GET", "/health"): {"response": ref("Health"), "statuses": {503: ref("Health")}},
    ("GET", "/ready"): {"response": ref("Ready"), "statuses": {503: ref("Ready")}},
    ("GET", "/metrics"): {"response": STRING, "content_type": "text/plain"},
    ("POST", "/tokenize"): {
        "request": Fields(TOKENIZE_FIELDS, overrides={"prompt": {"type": "string"}}, exactly_one_of=("prompt", "messages")),
        "response": ref("Tokenized"),
    },
    ("POST", "/detokenize"): {"request": Fields(DETOKENIZE_FIELDS, ("tokens",)), "response": ref("Detokenized")},
    ("GET", "/openapi.json"): {"response": {"type": "object", "description": "this document"}},
    ("POST", "/v1/moderations"): {
        "request": Fields({"input", "model"}, ("input",), {
            "input": {"anyOf": [STRING, {"type": "array", "minItems": 1, "maxItems": moderation.MAX_INPUTS, "items": {
                "anyOf": [STRING, _object({"type": {"const": "text"}, "text": STRING})]}}],
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

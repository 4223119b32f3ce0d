"""The named schemas of the OpenAPI document (openapi.py): every response shape, in COMPONENTS,
and the building blocks the request and response schemas share (`ref`, `object_`, `nullable`).

Each shape is declared once here, as openai/openai_format.py, routes/conversations.py, openai/items.py and routes/responses.py
write it; tests/http/test_openapi.py checks live responses and streamed events against them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from chatd.http.openai.items import ROLES as ITEM_ROLES
from chatd.http.openai.protocol import VERBOSITIES
from chatd.safety.rules import CATEGORIES as MODERATION_CATEGORIES
from chatd.store.db import STATUSES

Schema = dict[str, Any]


def ref(name: str) -> Schema:
    """A reference to one of COMPONENTS."""
    return {"$ref": f"#/components/schemas/{name}"}


def object_(properties: Schema, required: Iterable[str] | None = None) -> Schema:
    """An object's schema: these properties, all required unless `required` says which; extras allowed."""
    return {"type": "object", "properties": properties, "required": list(properties if required is None else required)}


def nullable(schema: Schema) -> Schema:
    """`schema` or null."""
    return {"anyOf": [schema, {"type": "null"}]}


STRING = {"type": "string"}
COUNT = {"type": "integer", "minimum": 0}

# Structured output (tools/structured.py): a named JSON schema, in chat's and in Responses' shape.
_SCHEMA_FORMAT_FIELDS = {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
                         "schema": {"type": "object"}, "strict": nullable({"type": "boolean"})}
JSON_SCHEMA_FORMAT = object_(_SCHEMA_FORMAT_FIELDS, ["name", "schema"])
TEXT_FORMAT = {"anyOf": [object_({"type": {"enum": ["text", "json_object"]}}, ["type"]),
                         object_({"type": {"const": "json_schema"}, **_SCHEMA_FORMAT_FIELDS}, ["type", "name", "schema"])]}


# -- response shapes ----------------------------------------------------------------------------

FINISH_REASON = {"enum": ["stop", "length", "tool_calls", "content_filter"]}


def _completion(object_name: str, choice: Schema, chunk: bool) -> Schema:
    """openai/openai_format.py's envelope: a whole response carries usage, a chunk carries it only when asked."""
    properties = {"id": {"type": "string"}, "object": {"const": object_name}, "created": {"type": "integer"},
                  "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                  "usage": nullable(ref("Usage")) if chunk else ref("Usage"),
                  "service_tier": {"type": "string", "description": "when the request named one"}}
    if not chunk:
        return object_(properties, ["id", "object", "created", "model", "choices", "usage"])
    return {**object_(properties, ["id", "object", "created", "model", "choices"]),
            "description": "a chunk with no choices and the whole usage ends a stream that asked for include_usage"}


def _choice(body: Schema, logprobs: str, chunk: bool, optional: Schema | None = None) -> Schema:
    """A choice: its body, logprobs and finish reason, and `optional` properties it may have."""
    choice = object_({"index": COUNT, **body, "logprobs": nullable(ref(logprobs)),
                      "finish_reason": nullable(FINISH_REASON) if chunk else FINISH_REASON})
    return {**choice, "properties": {**choice["properties"], **(optional or {})}}


def _with_prompt_logprobs(schema: Schema) -> Schema:
    """A chat reply, or its first chunk, with vLLM's prompt_logprobs when asked."""
    return {**schema, "properties": {**schema["properties"], "prompt_logprobs": nullable(ref("PromptLogprobs"))}}


TOKEN_LOGPROB = {"token": {"type": "string"}, "logprob": {"type": "number"}, "bytes": {"type": "array", "items": COUNT}}
ASSISTANT = object_({"role": {"const": "assistant"}, "content": nullable({"type": "string"}),
                     "tool_calls": {"type": "array", "items": object_({
                         "id": STRING, "type": {"const": "function"},
                         "function": object_({"name": STRING, "arguments": STRING})}),
                         "description": "the functions the reply calls (its content is then null when it says nothing else)"}},
                    ["role", "content"])
TOOL_CALL_DELTA = object_({"index": COUNT, "id": STRING, "type": {"const": "function"},
                           "function": {"type": "object", "properties": {"name": STRING, "arguments": STRING}}},
                          ["index", "function"])
TEXT_CHOICE = {"text": {"type": "string", "description": "with echo, the prompt's text first"}}
# vLLM's prompt_logprobs: per prompt token (the first null), its own token and its likeliest alternatives by id.
PROMPT_TOKEN = {"type": "object", "additionalProperties": object_({
    "logprob": {"type": "number"}, "rank": nullable({"type": "integer", "minimum": 1}), "decoded_token": STRING})}
PHASE = {"enum": ["loading", "warming up", "serving", "draining", "stopped"]}
STORE_STATUS = object_({"writable": {"type": "boolean"}, "pending_writes": COUNT, "error": nullable({"type": "string"})})
UNIX_SECONDS = {"type": "integer", "description": "unix seconds"}
NOTHING = {"type": "array", "maxItems": 0}


def _page(item: str) -> Schema:
    """A page of a list, as OpenAI lists items (items.item_page)."""
    return object_({"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)},
                    "first_id": nullable(STRING), "last_id": nullable(STRING), "has_more": {"type": "boolean"}})


# routes/conversations.py's shapes: OpenAI's conversation object with chatd's extras, and chatd's messages.
CONVERSATION = {"id": STRING, "object": {"const": "conversation"}, "created_at": UNIX_SECONDS,
                "updated_at": UNIX_SECONDS, "model": STRING, "title": nullable(STRING),
                "system_prompt": nullable(STRING), "metadata": {"type": "object"}}
CONVERSATION_MESSAGE = {
    **object_({"id": STRING, "object": {"const": "conversation.message"}, "role": {"enum": [*ITEM_ROLES, "tool"]},
               "content": STRING, "status": {"enum": list(STATUSES), "description": "partial: cut short, or still "
                                                                                 "being generated"},
               "created_at": UNIX_SECONDS, "finish_reason": nullable(FINISH_REASON), "usage": ref("Usage"),
               "cost": {"type": "number", "description": "USD"},
               "call": {**object_({"call_id": STRING, "name": STRING}, ["call_id"]),
                        "description": "a function call (its arguments are the content) or, role tool, its output"}},
              ["id", "object", "role", "content", "status", "created_at"]),
    "if": {"properties": {"role": {"const": "assistant"}}},
    "then": {"required": ["finish_reason", "usage", "cost"]},
    "description": "chatd's message; an assistant's also says how it ended, its usage and its cost",
}
MESSAGES_OMITTED = object_({"messages_omitted": {**COUNT, "description": "the oldest messages left out of the prompt"}})
# Items (items.item_json): a message with one text part, output_text for the assistant's.
INPUT_TEXT = object_({"type": {"const": "input_text"}, "text": STRING})
ITEM_STATUS = {"enum": ["completed", "in_progress", "incomplete"]}
OUTPUT_TEXT = object_({"type": {"const": "output_text"}, "text": STRING, "annotations": NOTHING, "logprobs": NOTHING})

# routes/responses.py's shapes: its `response` object (response_object) and its stream's events (ResponseEvents).
RESPONSE_STATUSES = ["in_progress", "completed", "incomplete", "cancelled", "failed"]
RESPONSE = {
    "id": STRING, "object": {"const": "response"}, "created_at": UNIX_SECONDS, "status": {"enum": RESPONSE_STATUSES},
    "completed_at": nullable({**UNIX_SECONDS, "description": "once it has ended"}),
    "error": nullable(object_({"code": {"const": "server_error"}, "message": STRING})),
    "incomplete_details": nullable(object_({"reason": {"const": "max_output_tokens"}})),
    "instructions": nullable(STRING), "max_output_tokens": nullable(COUNT), "model": STRING,
    "output": {"type": "array", "items": ref("ConversationItem"),
               "description": "the reply's message, or the function calls it made (after its text, if any); empty "
                              "until it begins"},
    "parallel_tool_calls": {"type": "boolean"}, "previous_response_id": nullable(STRING),
    "conversation": nullable(object_({"id": STRING})),
    "temperature": nullable({"type": "number"}), "top_p": nullable({"type": "number"}),
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]},
                              object_({"type": {"const": "function"}, "name": STRING})]},
    "tools": {"type": "array", "items": object_({"type": {"const": "function"}, "name": STRING,
                                                 "description": nullable(STRING), "parameters": nullable({"type": "object"}),
                                                 "strict": {"type": "boolean"}})},
    "text": object_({"format": TEXT_FORMAT, "verbosity": {"enum": list(VERBOSITIES)}}, ["format"]),
    "truncation": {"enum": ["auto", "disabled"]},
    "reasoning": object_({"effort": {"type": "null"}, "summary": {"type": "null"}}),
    "background": {"const": False}, "service_tier": {"const": "default"}, "store": {"type": "boolean"},
    "metadata": {"type": "object"}, "user": nullable(STRING), "safety_identifier": nullable(STRING),
    "prompt_cache_key": nullable(STRING), "usage": nullable(ref("ResponseUsage")),
    "chatd": object_({"items_omitted": {**COUNT, "description": "the oldest items left out (truncation: auto)"},
                      "output_deleted": {"type": "boolean", "description": "its output item was deleted from its "
                                                                           "conversation"}}),
}
AT_PART = {"item_id": STRING, "output_index": COUNT, "content_index": {"const": 0}}
AT_CALL = {"item_id": STRING, "output_index": COUNT}


def _event(kind: str, **properties: Schema) -> Schema:
    """One of a Responses stream's events: its `type` (also its SSE `event:` name) and sequence_number from 0."""
    return object_({"type": {"const": kind}, "sequence_number": COUNT, **properties})


def _response_as(*statuses: str) -> Schema:
    return {"allOf": [ref("Response"), {"properties": {"status": {"enum": list(statuses)}}}]}


RESPONSE_EVENTS = [
    _event("response.created", response=_response_as("in_progress")),
    _event("response.in_progress", response=_response_as("in_progress")),
    _event("response.output_item.added", output_index=COUNT, item=ref("ConversationItem")),
    _event("response.content_part.added", **AT_PART, part=OUTPUT_TEXT),
    _event("response.output_text.delta", **AT_PART, delta=STRING, logprobs=NOTHING),
    _event("response.output_text.done", **AT_PART, text=STRING, logprobs=NOTHING),
    _event("response.content_part.done", **AT_PART, part=OUTPUT_TEXT),
    _event("response.function_call_arguments.delta", **AT_CALL, delta=STRING),
    _event("response.function_call_arguments.done", **AT_CALL, name=STRING, arguments=STRING),
    _event("response.output_item.done", output_index=COUNT, item=ref("ConversationItem")),
    _event("response.completed", response=_response_as("completed")),
    _event("response.incomplete", response=_response_as("incomplete", "cancelled")),
    _event("response.failed", response=_response_as("failed")),
]

COMPONENTS: dict[str, Schema] = {
    "Error": object_({"error": object_({"message": {"type": "string"}, "type": {"type": "string"},
                                        "param": nullable({"type": "string"}), "code": nullable({"type": "string"})})}),
    "Usage": object_({"prompt_tokens": COUNT, "completion_tokens": COUNT, "total_tokens": COUNT,
                      "prompt_tokens_details": object_({"cached_tokens": COUNT})}),
    "ChatLogprobs": object_({"content": {"type": "array", "items": object_(
        {**TOKEN_LOGPROB, "top_logprobs": {"type": "array", "items": object_(TOKEN_LOGPROB)}})}}),
    "CompletionLogprobs": {**object_({
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": nullable({"type": "number"})},
        "top_logprobs": {"type": "array", "items": nullable({"type": "object", "additionalProperties": {"type": "number"}})},
        "text_offset": {"type": "array", "items": COUNT},
    }), "description": "with echo, the prompt's tokens first (the first with null logprobs); text_offset: the length "
                       "of the token texts before each, from the start of `text`"},
    "PromptLogprobs": {"type": "array", "items": nullable(PROMPT_TOKEN),
                       "description": "vLLM's: per prompt token (the first null) its own logprob and rank and its "
                                      "prompt_logprobs likeliest alternatives, by token id"},
    "ChatCompletion": _with_prompt_logprobs(
        _completion("chat.completion", _choice({"message": ASSISTANT}, "ChatLogprobs", False), False)),
    "ChatCompletionChunk": _with_prompt_logprobs(_completion("chat.completion.chunk", _choice(
        {"delta": object_({**ASSISTANT["properties"], "tool_calls": {"type": "array", "items": TOOL_CALL_DELTA}}, ())},
        "ChatLogprobs", True), True)),
    "TextCompletion": _completion("text_completion", _choice(
        TEXT_CHOICE, "CompletionLogprobs", False, {"prompt_logprobs": nullable(ref("PromptLogprobs"))}), False),
    "TextCompletionChunk": _completion("text_completion", _choice(
        TEXT_CHOICE, "CompletionLogprobs", True, {"prompt_logprobs": nullable(ref("PromptLogprobs"))}), True),
    "Model": object_({"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                      "owned_by": {"type": "string"},
                      "root": nullable({"type": "string", "description": "the model this name serves (null: an alias)"}),
                      "status": {"enum": ["loaded", "loading", "unloaded"],
                                 "description": "a chat model's: one that is not loaded loads on its first request"},
                      "context_length": COUNT,
                      "targets": {"type": "object", "description": "an alias split by weight: each model's weight"},
                      "load_error": {"type": "string", "description": "why its last load failed"},
                      "chatd": {"type": "object", "description": "chatd's facts about the model: dtype, device, KV "
                                "blocks, keep_alive, loads..."}}, required=("id", "object", "created", "owned_by")),
    "ModelList": object_({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}),
    "TenantUsage": object_({
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
    "EmbeddingList": object_({
        "object": {"const": "list"}, "model": STRING,
        "data": {"type": "array", "items": object_({
            "object": {"const": "embedding"}, "index": COUNT,
            "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                    {"type": "string", "description": "base64 of float32 little-endian numbers"}]}})},
        "usage": object_({"prompt_tokens": COUNT, "total_tokens": COUNT})}),
    "Tokenized": object_({"tokens": {"type": "array", "items": COUNT}, "count": COUNT, "max_model_len": COUNT}),
    "Detokenized": object_({"prompt": {"type": "string"}}),
    "Live": object_({"status": {"const": "alive"}, "phase": PHASE}),
    "Health": object_({"status": {"const": "ok"}, "phase": {"const": "serving"}, "store": STORE_STATUS}),
    "Ready": object_({"status": {"const": "ready"}}),
    "Unavailable": {**object_({"status": {"type": "string"}, "phase": PHASE}),
                    "description": "503 while this replica must get no traffic: status says why (error: the engine's "
                                   "failure; store: while it cannot write); Retry-After unless the engine died"},
    "Conversation": object_(CONVERSATION),
    "ConversationWithMessages": object_({**CONVERSATION, "messages": {"type": "array", "items": ref("ConversationMessage")}}),
    "ConversationList": {**_page("Conversation"), "description": "newest first"},
    "ConversationDeleted": object_({"id": STRING, "object": {"const": "conversation.deleted"}, "deleted": {"const": True}}),
    "ConversationMessage": CONVERSATION_MESSAGE,
    "ConversationReply": {"allOf": [ref("ChatCompletion"), object_({"conversation_id": STRING, "chatd": MESSAGES_OMITTED})],
                          "description": "a chat completion whose id is the reply's message id"},
    "ConversationReplyChunk": {"allOf": [ref("ChatCompletionChunk"),
                                         object_({"conversation_id": STRING, "chatd": MESSAGES_OMITTED}, ["conversation_id"])],
                               "description": "a chat completion chunk whose id is the reply's message id; the first "
                                              "says how many messages were left out"},
    "ConversationItem": {"oneOf": [
        object_({
            "type": {"const": "message"}, "id": STRING, "status": ITEM_STATUS, "role": {"enum": list(ITEM_ROLES)},
            "content": {"type": "array", "items": {"anyOf": [INPUT_TEXT, OUTPUT_TEXT]}, "maxItems": 1,
                        "description": "one text part (output_text for the assistant's); none in "
                                       "response.output_item.added"},
        }),
        object_({"type": {"const": "function_call"}, "id": STRING, "status": ITEM_STATUS, "call_id": STRING,
                 "name": STRING, "arguments": {"type": "string", "description": "JSON text; \"\" in "
                                                                                "response.output_item.added"}}),
        object_({"type": {"const": "function_call_output"}, "id": STRING, "status": ITEM_STATUS, "call_id": STRING,
                 "output": STRING}),
    ], "description": "a message, a function call the model made, or a call's output"},
    "ConversationItemList": _page("ConversationItem"),
    "Response": object_(RESPONSE),
    "ResponseUsage": object_({"input_tokens": COUNT, "input_tokens_details": object_({"cached_tokens": COUNT}),
                              "output_tokens": COUNT, "output_tokens_details": object_({"reasoning_tokens": COUNT}),
                              "total_tokens": COUNT}),
    "ResponseStreamEvent": {"oneOf": RESPONSE_EVENTS, "description": "the events of a Responses stream, by `type`"},
    "ResponseDeleted": object_({"id": STRING, "object": {"const": "response"}, "deleted": {"const": True}}),
    "Moderation": object_({"id": STRING, "model": STRING, "results": {"type": "array", "items": object_({
        "flagged": {"type": "boolean"},
        "categories": object_({c: {"type": "boolean"} for c in MODERATION_CATEGORIES}),
        "category_scores": object_({c: {"type": "number", "minimum": 0, "maximum": 1} for c in MODERATION_CATEGORIES}),
        "category_applied_input_types": object_({c: {"type": "array", "items": {"const": "text"}}
                                                 for c in MODERATION_CATEGORIES}),
    })}}),
    "Appeal": object_({
        "id": STRING, "object": {"const": "appeal"}, "status": {"enum": ["open", "appealed", "upheld", "overturned"]},
        "stage": {"enum": ["input", "output"]}, "action": {"enum": ["blocked", "flagged", "redacted", "guard_failed"]},
        "categories": {"type": "array", "items": STRING}, "created_at": UNIX_SECONDS,
        "appealed_at": nullable(UNIX_SECONDS), "resolved_at": nullable(UNIX_SECONDS), "resolution_note": nullable(STRING),
    }),
    "Feedback": object_({
        "object": {"const": "feedback"}, "id": STRING, "reply_id": STRING,
        "reply_type": {"enum": ["message", "response", "completion"]}, "model": STRING,
        "rating": {"enum": ["up", "down"]}, "comment": nullable(STRING), "created_at": UNIX_SECONDS,
        "updated_at": UNIX_SECONDS,
    }),
}


"""Request bodies in the OpenAPI document (openapi.py): each field's schema by name, and the
schema of a body that a parser checks against a field set.

A body that openai/protocol.py, routes/responses.py or routes/tokens.py parses is documented from the very field set it
checks against (Fields), each field's schema taken from FIELD_SCHEMAS: a field with none is an
error at build time (UndocumentedError), not a gap in the document.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chatd.engine import MAX_LOGPROBS, MAX_N
from chatd.http.routes import responses
from chatd.http.openai.chat_messages import ROLES
from chatd.http.openai.conversation_request import MAX_METADATA_DEPTH
from chatd.http.routes.conversations import MAX_NEW_ITEMS
from chatd.http.openai.items import ROLES as ITEM_ROLES
from chatd.http.openai.items import MAX_CALL_ID_CHARS, TEXT_PARTS
from chatd.http.openapi.openapi_components import JSON_SCHEMA_FORMAT, STRING, TEXT_FORMAT, Schema, nullable, object_
from chatd.http.openai.protocol import (
    MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS, MAX_PROMPTS, MAX_STOP, SERVICE_TIERS, VERBOSITIES,
)
from chatd.http.tools.tools import MAX_TOOLS

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
RESPONSE_TOOL = {"type": "object", "properties": {  # the Responses API's: chat's function, flat
    "type": {"const": "function", "description": "chatd runs no built-in tools"},
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object", "description": "a JSON schema; a call's arguments always validate against it"},
    "strict": {"type": "boolean"}}, "required": ["type", "name"], "additionalProperties": False}
FUNCTION_TOOL = {"type": "object", "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema; a call's arguments always validate against it"},
        "strict": {"type": "boolean"}}, "required": ["name"]}}, "required": ["type", "function"]}
TOKEN_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
NOT_EMPTY_STRING = {"type": "string", "minLength": 1}
PENALTY = {"type": "number", "minimum": -2, "maximum": 2}
# Messages as the Responses and Conversations APIs send them (openai/items.py): text only. An earlier
# response's output item may come back as it came, with its id, status and annotations.
ITEM_PART = {
    "type": "object",
    "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"},
                   "annotations": {"description": "accepted back, ignored"},
                   "logprobs": {"description": "accepted back, ignored"}},
    "required": ["type", "text"],
    "additionalProperties": False,
}
MESSAGE_ITEM = {
    "type": "object",
    "properties": {
        "type": {"const": "message", "description": "may be left out"},
        "role": {"enum": list(ITEM_ROLES), "description": "developer is read as system"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": ITEM_PART}],
                    "description": "a string, or text parts (joined)"},
        "id": {"description": "accepted back, ignored"}, "status": {"description": "accepted back, ignored"},
        "phase": {"description": "accepted back, ignored"},
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}
ACCEPTED_BACK = {"description": "accepted back, ignored"}
CALL_ID = {"type": "string", "minLength": 1, "maxLength": MAX_CALL_ID_CHARS}
CALL_ITEM = {  # a call the model made, sent back as it came (a client that keeps its own history)
    "type": "object",
    "properties": {"type": {"const": "function_call"}, "call_id": CALL_ID,
                   "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                   "arguments": {"type": "string", "description": "JSON text"}, "id": ACCEPTED_BACK,
                   "status": ACCEPTED_BACK},
    "required": ["type", "call_id", "name", "arguments"],
    "additionalProperties": False,
}
OUTPUT_ITEM = {  # a call's result
    "type": "object",
    "properties": {"type": {"const": "function_call_output"}, "call_id": {**CALL_ID, "description": "the call it answers"},
                   "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": ITEM_PART}]},
                   "id": ACCEPTED_BACK, "status": ACCEPTED_BACK},
    "required": ["type", "call_id", "output"],
    "additionalProperties": False,
}
INPUT_ITEM = {"anyOf": [MESSAGE_ITEM, CALL_ITEM, OUTPUT_ITEM],
              "description": "a message, a function call, or a call's output (no built-in tools, reasoning, references)"}
# A conversation's metadata (conversation_request._metadata): any object, kept and returned.
KEPT_METADATA = {"type": "object", "description": f"any JSON object, at most the server's `max_metadata_bytes` as JSON "
                                                  f"and {MAX_METADATA_DEPTH} levels deep; kept and returned"}

# Every field of a body checked against a field set (openai/protocol.py's, routes/tokens.py's, ...), by name. A field
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
    "top_k": {"type": "integer", "minimum": -1, "description": "0 or -1: off"},
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
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                        "description": "vLLM's: each prompt token's logprob, rank and this many likeliest alternatives "
                                       "(the reply's `prompt_logprobs`); more than 0 is refused while the server "
                                       "checks outputs"},
    "echo": {"type": "boolean", "description": "give the prompt back before the reply's text, and with logprobs its "
                                               "tokens' logprobs first (the first token's null)"},
    "response_format": {"anyOf": [
        object_({"type": {"enum": ["text", "json_object"]}}, ["type"]),
        object_({"type": {"const": "json_schema"}, "json_schema": JSON_SCHEMA_FORMAT}, ["type", "json_schema"]),
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
    "keep_alive": {"anyOf": [{"type": "string"}, {"type": "number"}],
                   "description": "Ollama's: how long the model stays loaded after this request (\"5m\", seconds, 0 "
                   "unloads it after the reply, -1 keeps it); only without API keys (the operator's otherwise)"},
    "safety_identifier": {"type": "string", "description": "accepted, not used"},
    "add_generation_prompt": {"type": "boolean", "default": True, "description": "end with the assistant's turn opening"},
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}, "description": "token ids of the served model"},
    # Conversations (openai/conversation_request.py, conversations.create_items) and responses (routes/responses.py).
    "title": {"type": "string", "description": "at most the server's `max_title_chars`"},
    "system_prompt": {"type": "string", "description": "the conversation's system message, before every turn"},
    "items": {"type": "array", "items": INPUT_ITEM, "minItems": 1, "maxItems": MAX_NEW_ITEMS,
              "description": "items added in order; each at most the server's `max_message_chars`"},
    "input": {"anyOf": [NOT_EMPTY_STRING, {"type": "array", "items": INPUT_ITEM, "minItems": 1,
                                           "maxItems": responses.MAX_INPUT_ITEMS}],
              "description": "a user message, or items (at most the server's `max_messages`); a function_call_output "
                             "answers a call made before it, in the history or in this input"},
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
                              object_({"type": {"const": "function"}, "function": object_({"name": {"type": "string"}})})],
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
    """A body checked against a field set (openai/protocol.py's, routes/tokens.py's, routes/responses.py's): the set, the
    fields it requires, or of which it requires exactly one or at least one, and the schemas that
    differ in this body from FIELD_SCHEMAS (a completion's logprobs is a count, a chat's a boolean)."""

    allowed: Iterable[str]
    required: tuple[str, ...] = ()
    overrides: Mapping[str, Schema] = field(default_factory=dict)
    exactly_one_of: tuple[str, ...] = ()
    at_least_one_of: tuple[str, ...] = ()
    description: str = ""
    rules: tuple[Schema, ...] = ()  # what holds between fields (a completion's max_tokens 0 needs echo)


class UndocumentedError(LookupError):
    """A route or an allowed field the document cannot describe: a bug to fix before serving it."""


def body_schema(fields: Fields, model_name: str) -> Schema:
    """The JSON Schema of a body checked against `fields`; UndocumentedError for a field with no schema."""
    missing = sorted(name for name in fields.allowed if name not in fields.overrides and name not in FIELD_SCHEMAS)
    if missing:
        raise UndocumentedError(f"allowed fields have no schema in openapi_bodies.FIELD_SCHEMAS: {', '.join(missing)}")
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
    if fields.rules:
        body["allOf"] = list(fields.rules)
    if fields.description:
        body["description"] = fields.description
    return body

"""A `POST /v1/responses` body, validated: what chatd reads of it (ResponseRequest) and a 400 naming
the field for anything it does not support. It knows nothing of how a response is generated or
stored: routes/responses.py does both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from chatd.http.tools import structured
from chatd.http.errors import APIError
from chatd.http.openai.items import Item, parse_items
from chatd.http.openai.protocol import (SERVICE_TIERS, GenerationRequest, _get, _object, _request, _request_metadata,
                                 check_keep_alive, shown)
from chatd.http.tools.tools import ToolRequest, parse_tools

# The request fields chatd reads; the sampling ones are chatd's extras beyond OpenAI's.
SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos", "priority",
            "min_tokens", "stream", "user")
RESPONSE_FIELDS = {
    *SAMPLING, "input", "instructions", "max_output_tokens", "store", "previous_response_id", "conversation",
    "stream_options", "metadata", "safety_identifier", "prompt_cache_key", "service_tier", "truncation", "text", "tools",
    "tool_choice", "parallel_tool_calls", "include", "reasoning", "background", "keep_alive",
}
# Fields of OpenAI's that would change the answer, and what chatd would have to support for them.
UNSUPPORTED = {"prompt": "stored prompts", "max_tool_calls": "a cap on tool calls", "top_logprobs": "logprobs on responses",
               "context_management": "context management", "prompt_cache_retention": "prompt cache retention"}
MAX_INPUT_ITEMS = 2048


@dataclass
class ResponseRequest:
    """A validated `POST /v1/responses` body."""

    inputs: list[Item]  # (role, text, call)
    gen: GenerationRequest
    instructions: str | None
    store: bool
    truncation: str
    previous_response_id: str | None
    conversation_id: str | None
    echo: dict = field(default_factory=dict)  # what the response object repeats of the request


def parse_response(body, max_messages: int, defaults: Mapping[str, float] = MappingProxyType({})) -> ResponseRequest:
    """Validate a `POST /v1/responses` body; 400s name the field."""
    body = _object(body)
    for name in body:
        if name in UNSUPPORTED:
            raise APIError(400, f"{name} is not supported by chatd ({UNSUPPORTED[name]})", name)
        if name not in RESPONSE_FIELDS:
            raise APIError(400, f"unknown field {name!r}", name)
    if body.get("input") is None:
        raise APIError(400, "input is required: a string or a list of items", "input")
    inputs = parse_items(body["input"], "input", allow_string=True, limit=min(MAX_INPUT_ITEMS, max_messages))
    tools = parse_response_tools(body)
    if _get(body, "background", bool, False):
        raise APIError(400, "background responses are not supported by chatd; stream, or wait for the response", "background")
    if _get(body, "include", list, []):
        raise APIError(400, "include is not supported by chatd (outputs carry only their text)", "include")
    reasoning = _get(body, "reasoning", dict, {})
    if any(v is not None for v in reasoning.values()):
        raise APIError(400, "reasoning options are not supported by chatd's models", "reasoning")
    text = _get(body, "text", dict, {})
    output_format = structured.text_format(text)
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise APIError(400, f"text.verbosity must be low, medium or high, got {shown(verbosity)}", "text.verbosity")
    stream_options = _get(body, "stream_options", dict, None)
    if stream_options is not None and not _get(body, "stream", bool, False):
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    for name in ("safety_identifier", "prompt_cache_key"):
        _get(body, name, str, None)
    service_tier = _get(body, "service_tier", str, None)
    if service_tier is not None and service_tier not in SERVICE_TIERS:
        raise APIError(400, f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {shown(service_tier)}",
                       "service_tier")
    truncation = _get(body, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise APIError(400, f"truncation must be auto or disabled, got {shown(truncation)}", "truncation")
    max_output_tokens = _get(body, "max_output_tokens", int, None)
    if max_output_tokens is not None and max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be an integer >= 1, got {max_output_tokens}", "max_output_tokens")
    conversation = body.get("conversation")
    if isinstance(conversation, dict) and isinstance(conversation.get("id"), str):  # else a 400, not no conversation
        conversation = conversation["id"]
    if conversation is not None and not isinstance(conversation, str):
        raise APIError(400, "conversation must be a conversation id or an object with its id", "conversation")
    previous = _get(body, "previous_response_id", str, None)
    if conversation is not None and previous is not None:
        raise APIError(400, "give previous_response_id or conversation, not both", "previous_response_id")
    store = _get(body, "store", bool, True)
    if conversation is not None and not store:
        raise APIError(400, "a response with store=false adds nothing to a conversation: leave out conversation, "
                            "or store it", "store")
    instructions = _get(body, "instructions", str, None)
    gen = _request({k: body[k] for k in SAMPLING if k in body}, [], max_output_tokens, None, defaults,
                   output_format=output_format)
    gen.max_tokens_field = "max_output_tokens"
    gen.tools = tools
    _request_metadata(body)  # as OpenAI: at most 16 string values under short keys
    check_keep_alive(body)
    metadata = _get(body, "metadata", dict, {})
    echo = {"max_output_tokens": max_output_tokens, "temperature": gen.params.temperature, "top_p": gen.params.top_p,
            "metadata": metadata, "user": gen.user, "truncation": truncation,
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": verbosity or "medium"},
            "parallel_tool_calls": _get(body, "parallel_tool_calls", bool, True),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "safety_identifier": body.get("safety_identifier"), "prompt_cache_key": body.get("prompt_cache_key")}
    return ResponseRequest(inputs, gen, instructions, store, truncation, previous, conversation, echo)


# What a function tool of the Responses API may hold (it is chat's `function` object, flattened).
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def parse_response_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` in the Responses API's shapes (a function
    tool is flat: `{"type": "function", "name": ...}`), checked as chat's are; 400s name the
    Responses field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list):
        tools = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if isinstance(choice, dict) and choice.get("type") == "function":
        if set(choice) - {"type", "name"}:
            raise APIError(400, "tool_choice naming a function is {'type': 'function', 'name': ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict):
        raise APIError(400, f"tool_choice {shown(choice)} is not supported: give none, auto, required, or "
                            "{'type': 'function', 'name': ...}", "tool_choice")
    try:
        return parse_tools({"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls")})
    except APIError as exc:  # chat's names, where the Responses API has flat tools
        flat = re.compile(r"(tools\[\d+\])\.function\b")
        raise APIError(exc.status, flat.sub(r"\1", exc.message).replace("{'type': 'function', 'function': {...}}",
                                                                          "{'type': 'function', 'name': ...}"),
                       flat.sub(r"\1", exc.param) if exc.param else exc.param, exc.code) from None


def _chat_tool(tool: Any, where: str) -> Any:
    """A Responses function tool as chat's (`{"type": "function", "function": {...}}`); a built-in
    tool (web search, file search, ...) is refused by name."""
    if not isinstance(tool, dict):
        return tool  # parse_tools says what it must be
    kind = tool.get("type")
    if kind != "function":
        raise APIError(400, f"{where}.type {shown(kind)} is not supported: chatd runs no built-in tools; give function "
                            "tools ({'type': 'function', 'name': ..., 'parameters': {...}})", f"{where}.type")
    if "function" in tool:
        raise APIError(400, f"{where} is a chat completions tool; the Responses API's is flat: "
                            "{'type': 'function', 'name': ..., 'parameters': {...}}", f"{where}.function")
    extra = sorted(set(tool) - TOOL_KEYS)
    if extra:
        raise APIError(400, f"{where} has fields chatd does not support: {', '.join(extra)}", f"{where}.{extra[0]}")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}

"""The bodies that create and change a conversation: its model, title, system prompt and metadata.

A conversation's metadata is any JSON object, kept and returned, so it is bounded by its size as
JSON and by its depth; a request's `metadata` (tags, never stored) is protocol.py's. The messages
of a conversation are parsed by protocol.parse_turn, its items by items.py.
"""

from __future__ import annotations

from typing import Any

import orjson

from chatd.config import ConversationsConfig
from chatd.http.tools import structured
from chatd.http.errors import APIError
from chatd.http.openai.protocol import _check_fields, _get, _object

# Conversation metadata is stored as JSON by orjson, which writes at most 254 levels; real
# metadata is a flat map of tags, so the limit is far below that.
MAX_METADATA_DEPTH = 32


def parse_new_conversation(body: Any, limits: ConversationsConfig) -> dict:
    """Validate a POST /v1/conversations body; returns model, title, system_prompt and metadata."""
    body = {} if body is None else _object(body)
    _check_fields(body, {"model", "title", "system_prompt", "metadata"})
    return {"model": _get(body, "model", str, None), "title": _title(body, limits),
            "system_prompt": _system_prompt(body, limits), "metadata": _metadata(body, limits)}


def parse_conversation_update(body: Any, limits: ConversationsConfig) -> dict:
    """Validate a POST /v1/conversations/{id} body: the fields given of `title`, `system_prompt`
    (null clears either) and `metadata`. A new system prompt applies from the next turn on."""
    body = _object(body)
    _check_fields(body, {"title", "system_prompt", "metadata"})
    fields = {}
    if "title" in body:
        fields["title"] = _title(body, limits)
    if "system_prompt" in body:
        fields["system_prompt"] = _system_prompt(body, limits)
    if "metadata" in body:
        fields["metadata"] = _metadata(body, limits)
    if not fields:
        raise APIError(400, "give title, system_prompt or metadata to change", None)
    return fields


def _system_prompt(body: dict, limits: ConversationsConfig) -> str | None:
    system_prompt = _get(body, "system_prompt", str, None)
    if system_prompt is not None and len(system_prompt) > limits.max_message_chars:
        raise APIError(400, f"system_prompt has {len(system_prompt)} characters; the limit is {limits.max_message_chars}",
                       "system_prompt")
    return system_prompt


def _title(body: dict, limits: ConversationsConfig) -> str | None:
    title = _get(body, "title", str, None)
    if title is not None and len(title) > limits.max_title_chars:
        raise APIError(400, f"title has {len(title)} characters; the limit is {limits.max_title_chars}", "title")
    return title


def _metadata(body: dict, limits: ConversationsConfig) -> dict:
    metadata = _get(body, "metadata", dict, {})
    try:
        size = len(orjson.dumps(metadata))
    except orjson.JSONEncodeError:  # what orjson read it writes back, except nesting past its limit
        raise APIError(400, f"metadata nests more than {structured.ORJSON_MAX_DEPTH} levels deep; the limit is {MAX_METADATA_DEPTH}",
                       "metadata") from None
    if size > limits.max_metadata_bytes:
        raise APIError(400, f"metadata takes {size} bytes as JSON; the limit is {limits.max_metadata_bytes}", "metadata")
    depth = _depth(metadata)  # after the size check: walking a few KB in Python is cheap, a 4 MB body is not
    if depth > MAX_METADATA_DEPTH:
        raise APIError(400, f"metadata nests {depth} levels deep; the limit is {MAX_METADATA_DEPTH}", "metadata")
    return metadata


def _depth(value: Any) -> int:
    """How many levels of objects and lists a JSON value has (without recursion: orjson reads up to 1,024)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))
    return deepest

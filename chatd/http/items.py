"""Items, as OpenAI's Responses and Conversations APIs name messages: parsing the items a client
sends (a response's `input`, a conversation's `items`) and the shape of the items chatd returns.

chatd's items are text messages. A message item has a role (user, assistant, system, developer)
and text parts (`input_text`, or `output_text` for the assistant's); a client may send the
content as a plain string, and may send back the output items of an earlier response as they
came (with their ids, statuses and annotations). Other item types (tool calls, reasoning, item
references) and other parts (images, files) are refused with a 400 that names the field.

Plain shaping of dicts: it knows nothing of HTTP or the store beyond the Message record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatd.http.errors import APIError
from chatd.http.protocol import shown
from chatd.store.records import Message

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}  # what a message item may carry
PART_KEYS = {"type", "text", "annotations", "logprobs"}
# Item types of OpenAI's that chatd does not take, and what they are for.
UNSUPPORTED_TYPES = {
    "function_call": "tool calling", "function_call_output": "tool calling", "custom_tool_call": "tool calling",
    "custom_tool_call_output": "tool calling", "file_search_call": "tools", "web_search_call": "tools",
    "computer_call": "tools", "computer_call_output": "tools", "code_interpreter_call": "tools",
    "image_generation_call": "tools", "local_shell_call": "tools", "mcp_call": "tools",
    "reasoning": "reasoning items", "item_reference": "item references",
}


def parse_items(value: Any, field: str, *, allow_string: bool, limit: int) -> list[tuple[str, str]]:
    """A client's items as (role, text) pairs; a string (where allowed) is one user message."""
    if isinstance(value, str) and allow_string:
        if not value:
            raise APIError(400, f"{field} must not be empty", field)
        return [("user", value)]
    if not isinstance(value, list):
        kinds = "a string or a list of items" if allow_string else "a list of items"
        raise APIError(400, f"{field} must be {kinds}", field)
    if not value:
        raise APIError(400, f"{field} must have at least one item", field)
    if len(value) > limit:
        raise APIError(400, f"{field} has {len(value)} items; the limit is {limit}", field)
    return [_message(item, f"{field}[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> tuple[str, str]:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an item object, got {shown(item)}", where)
    kind = item.get("type", "message")
    if kind != "message":
        what = UNSUPPORTED_TYPES.get(kind) if isinstance(kind, str) else None
        reason = f"chatd does not support {what}" if what else "chatd takes only message items"
        raise APIError(400, f"{where}.type {shown(kind)} is not supported: {reason}", f"{where}.type")
    extra = sorted(set(item) - MESSAGE_KEYS)
    if extra:
        raise APIError(400, f"{where} has fields chatd does not support: {', '.join(extra)}", f"{where}.{extra[0]}")
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {shown(role)}", f"{where}.role")
    return role, _text(item.get("content"), f"{where}.content")


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise APIError(400, f"{at} must be a part like {{'type': 'input_text', 'text': ...}}, got {shown(part)}", at)
        if part.get("type") not in TEXT_PARTS:
            raise APIError(400, f"{at}.type {shown(part.get('type'))} is not supported; chatd takes text parts "
                                f"({', '.join(TEXT_PARTS[:2])})", f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{at}.text must be a string", f"{at}.text")
        extra = sorted(set(part) - PART_KEYS)
        if extra:
            raise APIError(400, f"{at} has fields chatd does not support: {', '.join(extra)}", f"{at}.{extra[0]}")
        texts.append(part["text"])
    return "".join(texts)


def item_json(message: Message, live: bool = False) -> dict:
    """A stored message as a message item; `live`: its reply is still being generated."""
    if message.role == "assistant":
        part = {"type": "output_text", "text": message.content, "annotations": [], "logprobs": []}
    else:
        part = {"type": "input_text", "text": message.content}
    if message.status == "complete":
        status = "completed"
    else:
        status = "in_progress" if live else "incomplete"
    return {"type": "message", "id": message.id, "status": status, "role": message.role, "content": [part]}


def item_page(items: list[dict], has_more: bool) -> dict:
    """A page of items, as OpenAI lists them."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


MAX_PAGE = 100


def page_params(query: Mapping[str, str], default_order: str = "desc") -> tuple[int, str | None, str]:
    """A list route's `limit` (1..100, default 20), `after` and `order` (asc or desc)."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise APIError(400, f"limit must be an integer, got {shown(query['limit'])}", "limit") from None
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit must be in [1, {MAX_PAGE}], got {limit}", "limit")
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, got {shown(order)}", "order")
    if any(query.get(name) for name in ("include", "include[]")):  # the openai SDK sends `include[]=...`
        raise APIError(400, "include is not supported by chatd (items carry only their text)", "include")
    return limit, query.get("after"), order

"""Items, as OpenAI's Responses and Conversations APIs name messages: parsing the items a client
sends (a response's `input`, a conversation's `items`) and the shape of the items chatd returns.

chatd's items are text messages and function tools' items. A message item has a role (user,
assistant, system, developer) and text parts (`input_text`, or `output_text` for the assistant's);
a client may send the content as a plain string, and may send back the output items of an earlier
response as they came (with their ids, statuses and annotations). A `function_call` item is a call
the model made (its `call_id`, `name` and `arguments`); a `function_call_output` item is its result,
answering the call by `call_id`. Other item types (built-in tools, reasoning, item references) and
other parts (images, files) are refused with a 400 that names the field.

A parsed item is `(role, text, call)`, as the store writes it: a call is an assistant item whose
text is its arguments, an output a `tool` item whose text is the output; `call` holds their ids.

Plain shaping of dicts: it knows nothing of HTTP or the store beyond the Message record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatd.http.errors import APIError
from chatd.http.openai.protocol import shown
from chatd.http.tools.structured import check_name
from chatd.http.tools.tools import assistant_tool_calls
from chatd.store.records import Message

Item = tuple[str, str, dict | None]  # (role, text, call): as the store's add_items takes it

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}  # what a message item may carry
PART_KEYS = {"type", "text", "annotations", "logprobs"}
# Item types of OpenAI's that chatd does not take, and what they are for.
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
MAX_CALL_ID_CHARS = 256
UNSUPPORTED_TYPES = {
    "custom_tool_call": "custom tools",
    "custom_tool_call_output": "tool calling", "file_search_call": "tools", "web_search_call": "tools",
    "computer_call": "tools", "computer_call_output": "tools", "code_interpreter_call": "tools",
    "image_generation_call": "tools", "local_shell_call": "tools", "mcp_call": "tools",
    "reasoning": "reasoning items", "item_reference": "item references",
}


def parse_items(value: Any, field: str, *, allow_string: bool, limit: int) -> list[Item]:
    """A client's items as (role, text, call); a string (where allowed) is one user message."""
    if isinstance(value, str) and allow_string:
        if not value:
            raise APIError(400, f"{field} must not be empty", field)
        return [("user", value, None)]
    if not isinstance(value, list):
        kinds = "a string or a list of items" if allow_string else "a list of items"
        raise APIError(400, f"{field} must be {kinds}", field)
    if not value:
        raise APIError(400, f"{field} must have at least one item", field)
    if len(value) > limit:
        raise APIError(400, f"{field} has {len(value)} items; the limit is {limit}", field)
    return [_item(item, f"{field}[{i}]") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> Item:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an item object, got {shown(item)}", where)
    kind = item.get("type", "message")
    readers = {"message": _message, "function_call": _call, "function_call_output": _output}
    if not isinstance(kind, str) or kind not in readers:
        what = UNSUPPORTED_TYPES.get(kind) if isinstance(kind, str) else None
        reason = f"chatd does not support {what}" if what else f"chatd takes {', '.join(readers)} items"
        raise APIError(400, f"{where}.type {shown(kind)} is not supported: {reason}", f"{where}.type")
    return readers[kind](item, where)


def _message(item: dict, where: str) -> Item:
    _check_keys(item, MESSAGE_KEYS, where)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {shown(role)}", f"{where}.role")
    return role, _text(item.get("content"), f"{where}.content"), None


def _call(item: dict, where: str) -> Item:
    """A call the model made, sent back as it came (a client that keeps its own history)."""
    _check_keys(item, CALL_KEYS, where)
    call_id = _call_id(item, where)
    name = check_name(item.get("name"), f"{where}.name")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise APIError(400, f"{where}.arguments must be a string of JSON", f"{where}.arguments")
    try:  # shaped as a chat template reads it, to refuse here what could not be rendered later
        assistant_tool_calls([{"id": call_id, "function": {"name": name, "arguments": arguments}}], where)
    except APIError as exc:
        raise APIError(400, exc.message.replace(f"{where}[0].function.", f"{where}."), f"{where}.arguments") from None
    return "assistant", arguments, {"call_id": call_id, "name": name}


def _output(item: dict, where: str) -> Item:
    """A call's result: its output (a string, or text parts) answering the call `call_id`."""
    _check_keys(item, OUTPUT_KEYS, where)
    call_id = _call_id(item, where)
    return "tool", _text(item.get("output"), f"{where}.output"), {"call_id": call_id}


def _call_id(item: dict, where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise APIError(400, f"{where}.call_id must be a non-empty string, got {shown(call_id)}", f"{where}.call_id")
    if len(call_id) > MAX_CALL_ID_CHARS:
        raise APIError(400, f"{where}.call_id has {len(call_id)} characters; the limit is {MAX_CALL_ID_CHARS}",
                       f"{where}.call_id")
    return call_id


def _check_keys(item: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise APIError(400, f"{where} has fields chatd does not support: {', '.join(extra)}", f"{where}.{extra[0]}")


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
    """A stored item as OpenAI shapes its kind; `live`: its reply is still being generated."""
    if message.status == "complete":
        status = "completed"
    else:
        status = "in_progress" if live else "incomplete"
    if message.kind == "function_call":
        return {"type": "function_call", "id": message.id, "call_id": message.call["call_id"],
                "name": message.call["name"], "arguments": message.content, "status": status}
    if message.kind == "function_call_output":
        return {"type": "function_call_output", "id": message.id, "call_id": message.call["call_id"],
                "output": message.content, "status": status}
    if message.role == "assistant":
        part = {"type": "output_text", "text": message.content, "annotations": [], "logprobs": []}
    else:
        part = {"type": "input_text", "text": message.content}
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

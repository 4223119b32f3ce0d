"""A chat body's messages: each one's role, content and tool calls checked, and made what the chat
template renders (developer messages as system, tool results named after the call they answer).

Only text is understood: a content part of another type is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from chatd.http.errors import APIError, shown
from chatd.http.tools.tools import assistant_tool_calls

ROLES = ("system", "user", "assistant", "developer", "tool")
# What a message may carry besides role and content, by role (`refusal` comes back in SDK echoes).
MESSAGE_FIELDS = {"assistant": {"name", "tool_calls", "refusal"}, "tool": {"tool_call_id"}}


def parse_messages(messages: list) -> list[dict]:
    """A chat body's `messages`, each checked and rendered for the chat template."""
    return _name_tool_results([_message(message, i) for i, message in enumerate(messages)])


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{where} must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or an object cannot even be looked up in ROLES
        raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {shown(role)}", f"{where}.role")
    extra = sorted(set(message) - {"role", "content"} - MESSAGE_FIELDS.get(role, {"name"}))
    if extra:
        raise APIError(400, f"{where} has fields chatd does not support for a {role} message: {', '.join(extra)}", where)
    calls = message.get("tool_calls") if role == "assistant" else None
    # An assistant message that calls tools may have no content.
    content = "" if calls is not None and message.get("content") is None else text_content(message.get("content"), f"{where}.content")
    # OpenAI's developer messages are instructions, what chat templates call system messages.
    rendered = {"role": "system" if role == "developer" else role, "content": content}
    if calls is not None:
        rendered["tool_calls"] = assistant_tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise APIError(400, f"{where}.tool_call_id must name the call this is the result of", f"{where}.tool_call_id")
        rendered["tool_call_id"] = call_id
    name = message.get("name")
    if name is not None:  # the participant's name: templates that render names show it
        if not isinstance(name, str):
            raise APIError(400, f"{where}.name must be a string, got {shown(name)}", f"{where}.name")
        rendered["name"] = name
    return rendered


def _name_tool_results(messages: list[dict]) -> list[dict]:
    """Give each tool result the name of the function whose call it answers (templates that show
    it read `name`); a result whose call is not in the messages keeps none."""
    names = {call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls", ())}
    for message in messages:
        if message["role"] == "tool" and message["tool_call_id"] in names:
            message.setdefault("name", names[message["tool_call_id"]])
    return messages


def text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, list):  # a list of parts: only text parts are understood
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                if not isinstance(part, dict):
                    raise APIError(400, f"{where}[{j}] must be a part like {{'type': 'text', 'text': ...}}, got {shown(part)}",
                                   where)
                raise APIError(400, f"{where}[{j}] of type {shown(part.get('type'))} is not supported; only text parts", where)
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise APIError(400, f"{where} must be a string or a list of text parts", where)
    return content

"""Tool calling as clients ask for it: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and the
messages that carry calls and their results back (assistant `tool_calls`, `tool` messages).

The tools reach the model through its own chat template (`apply_chat_template(tools=...)`); a
template that takes no tools (SmolLM2's, the demo model's) gets them described in a system
message in the Hermes format instead, and its calls are read in that format. What the model
writes is parsed back into OpenAI's `tool_calls` by the parser of its template's family
(tool_calls.py). `required` and a named function are enforced with a grammar: the reply is then
a call, its arguments valid against the function's JSON schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from chatd.engine import StructuredOutput
from chatd.http.errors import APIError, shown
from chatd.http.structured import check_name, closed
from chatd.http.tool_calls import PARSERS, ToolParser, parser_for_template

MAX_TOOLS = 128  # OpenAI's limit on functions per request
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolRequest:
    """The tools of one request and how the model may use them."""

    tools: list[dict]  # OpenAI function tools, as sent (checked)
    choice: str  # none | auto | required | function
    function: str | None  # the function `choice == "function"` names
    parallel: bool

    @property
    def offered(self) -> list[dict]:
        """The tools the model is shown: none for `none`, only the named one for a named choice."""
        if self.choice == "none":
            return []
        if self.choice == "function":
            return [t for t in self.tools if t["function"]["name"] == self.function]
        return self.tools


def parse_tools(body: dict) -> ToolRequest | None:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls` (None when there are no tools)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, f"parallel_tool_calls must be a boolean, got {shown(parallel)}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice is not None and choice not in ("none", "auto"):
            raise APIError(400, "tool_choice needs tools to choose from", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools has {len(tools)} entries; the limit is {MAX_TOOLS}", "tools")
    names = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    seen = set()
    for i, name in enumerate(names):
        if name in seen:
            raise APIError(400, f"tools[{i}] repeats the function name {name!r}", f"tools[{i}].function.name")
        seen.add(name)
    function = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(function, str):
            raise APIError(400, "tool_choice must be none, auto, required, or {'type': 'function', 'function': {'name': ...}}",
                           "tool_choice")
        if function not in seen:
            raise APIError(400, f"tool_choice names the function {function!r}, which is not in tools", "tool_choice")
        choice = "function"
    elif choice not in TOOL_CHOICES:
        raise APIError(400, f"tool_choice must be none, auto, required or a function; got {shown(choice)}", "tool_choice")
    return ToolRequest(tools, choice, function, True if parallel is None else parallel)


def _tool(tool: Any, where: str) -> str:
    """Check one function tool; return its name."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}; chatd runs no built-in tools",
                       f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"{where}.function must be an object", f"{where}.function")
    name = check_name(function.get("name"), f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.function.description must be a string", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.function.strict must be a boolean", f"{where}.function.strict")
    return name


# -- messages ------------------------------------------------------------------------------------


def assistant_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked, in the shape chat templates read: the
    arguments as an object where they parse (templates write them with `tojson`)."""
    if not isinstance(calls, list) or not calls:
        raise APIError(400, f"{where} must be a non-empty list of tool calls", where)
    shaped = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                f"'arguments': ...}}}}", at)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise APIError(400, f"{at}.function.arguments must be a string of JSON", f"{at}.function.arguments")
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = arguments  # passed on as written: the model sees what it (or the client) wrote
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(400, f"{at}.id must be a string", f"{at}.id")
        shaped.append({"id": call_id or f"call_{j}", "type": "function",
                       "function": {"name": function["name"], "arguments": parsed}})
    return shaped


def described_in_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template that takes no tools: the tools described in the system message, calls and
    results written out as text, all in the Hermes format that the hermes parser reads back."""
    lines = [orjson.dumps(tool).decode() for tool in tools]
    guide = ("You can call functions to help answer. They are described in JSON inside <tools></tools>:\n<tools>\n"
             + "\n".join(lines) + "\n</tools>\nTo call one, reply with its name and arguments as a JSON object inside "
             "<tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
             '{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>')
    out = []
    if tools:
        if messages and messages[0]["role"] == "system":
            out.append({**messages[0], "content": messages[0]["content"] + "\n\n" + guide})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": guide})
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            blocks = [orjson.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}).decode()
                      for c in message["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
            content = (message.get("content") or "") + ("\n" if message.get("content") else "") + text
            out.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append(message)
    return out


@dataclass
class ToolUse:
    """How one chat request with tools is rendered and read back."""

    messages: list[dict]  # to render (tools described in them when the template takes none)
    shown: list[dict] | None  # the tools handed to the chat template
    parser: ToolParser | None  # reads calls out of the reply; None when the model may call none
    grammar: StructuredOutput | None  # the call format and the functions' schemas, checked for every request
    enforced: bool  # the reply must follow `grammar` (required, or a named function)


def tool_use(request: ToolRequest | None, messages: list[dict], parser: ToolParser, template_takes_tools: bool,
             special_token_ids: dict[str, int]) -> ToolUse:
    """Render tools through the template where it takes them, else into the messages; make the call grammar."""
    if request is None:
        return ToolUse(messages, None, None, None, False)
    offered = request.offered
    if offered and template_takes_tools:
        shown_tools, rendered = offered, messages
    else:
        shown_tools, rendered = None, described_in_messages(messages, offered)
    grammar = None
    if offered:  # compiled for every request, so a schema that cannot be is a 400 under auto too
        parallel = request.parallel and request.choice != "function"  # a named function is one call, as on OpenAI
        held = [_closed_tool(tool) for tool in offered]
        grammar = StructuredOutput(grammar=parser.call_grammar(held, parallel, special_token_ids), param="tools")
    return ToolUse(rendered, shown_tools, parser if offered else None, grammar, request.choice in ("required", "function"))


def _closed_tool(tool: dict) -> dict:
    function = tool["function"]
    if function.get("parameters") is None:
        return tool
    return {**tool, "function": {**function, "parameters": closed(function["parameters"])}}


def tool_parser(configured: str, template: str) -> ToolParser:
    """The parser for the served model: the configured one, or the one its template implies
    (hermes when the template takes no tools: chatd then describes them in that format)."""
    if configured != "auto":
        return PARSERS[configured]
    return PARSERS[parser_for_template(template) if "tools" in template else "hermes"]

"""Tool calling as clients ask for it: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and the
messages that carry calls and their results back (assistant `tool_calls`, `tool` messages).

The tools reach the model through its own chat template (`apply_chat_template(tools=...)`); a
template that takes no tools (SmolLM2's, the demo model's) gets them described in a system
message in the Hermes format instead, and its calls are read in that format. What the model
writes is parsed back into OpenAI's `tool_calls` by the parser of its template's family
(tool_calls.py). Every reply that may call is constrained by a grammar: under `required` and a
named function it is a call; under `auto` it is text in which no call marker appears, or text and
then calls. Either way a call names an offered function and its arguments are valid against that
function's JSON schema (the parser, bound to the offered names, reads no other call; bound to one
call when `parallel_tool_calls` is false, it reads no second). Whatever the choice, a reply holds no
two identical calls, and one cut by max_tokens shows no half call (tool_stream.py says why).

Tools are measured before they are walked: each tool's JSON length by orjson when it is parsed
(C speed, on the event loop), and against the context window before the walks in Python (`tool_use`:
depth checks, closing schemas, the grammar, the system message), which callers run off the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from chatd.engine import StructuredOutput
from chatd.http.errors import APIError, shown
from chatd.http.tools.structured import (MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, ORJSON_MAX_DEPTH, check_name,
                                   check_schema_depth, closed, schema_length)
from chatd.http.tools.tool_calls import PARSERS, ToolParser, json_rule, parser_for_template

MAX_TOOLS = 128  # OpenAI's limit on functions per request
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolRequest:
    """The tools of one request and how the model may use them."""

    tools: list[dict]  # OpenAI function tools, as sent (checked)
    choice: str  # none | auto | required | function
    function: str | None  # the function `choice == "function"` names
    parallel: bool
    json_chars: dict[str, int]  # each function's tool: its length as JSON (about what a template renders of it)

    @property
    def offered(self) -> list[dict]:
        """The tools the model is shown: none for `none`, only the named one for a named choice."""
        if self.choice == "none":
            return []
        if self.choice == "function":
            return [t for t in self.tools if t["function"]["name"] == self.function]
        return self.tools

    @property
    def offered_chars(self) -> int:
        """The offered tools' length as JSON."""
        return sum(self.json_chars[tool["function"]["name"]] for tool in self.offered)


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
    measured = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [name for name, _ in measured]
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
    return ToolRequest(tools, choice, function, True if parallel is None else parallel, dict(measured))


def _tool(tool: Any, where: str) -> tuple[str, int]:
    """Check one function tool; return its name and its length as JSON."""
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
    return name, _json_length(tool, parameters, where)


def _json_length(tool: dict, parameters: dict | None, where: str) -> int:
    """A tool's length as JSON, measured by orjson (no walk in Python yet): its parameters within
    MAX_SCHEMA_BYTES, and nothing nested past what orjson writes (400s naming the field)."""
    try:
        length = len(orjson.dumps(tool))
    except orjson.JSONEncodeError:  # nested past orjson's limit: in its parameters, or somewhere else
        length = None
    if parameters is not None and (length is None or length > MAX_SCHEMA_BYTES):
        schema_length(parameters, f"{where}.function.parameters")
    if length is None:
        raise APIError(400, f"{where} nests more than {ORJSON_MAX_DEPTH} levels deep; the limit is {ORJSON_MAX_DEPTH}",
                       where)
    return length


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
        if _nests_deeper_than(parsed, MAX_SCHEMA_DEPTH):
            raise APIError(400, f"{at}.function.arguments nests more than {MAX_SCHEMA_DEPTH} levels of objects and "
                                f"lists; the limit is {MAX_SCHEMA_DEPTH}", f"{at}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise APIError(400, f"{at}.id must be a string", f"{at}.id")
        shaped.append({"id": call_id or f"call_{j}", "type": "function",
                       "function": {"name": function["name"], "arguments": parsed}})
    return shaped


def _nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether a JSON value nests more than `limit` levels, found by orjson at C speed (a walk in Python
    over a 4 MB body would hold the event loop): orjson writes at most ORJSON_MAX_DEPTH levels, so the
    value inside ORJSON_MAX_DEPTH - limit lists fails to write exactly when it nests deeper."""
    for _ in range(ORJSON_MAX_DEPTH - limit):
        value = [value]
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return True
    return False


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
    parser: ToolParser | None  # reads calls to the offered functions out of the reply; None when it may call none
    grammar: StructuredOutput | None  # what the reply must follow when it may call


def tool_use(request: ToolRequest | None, messages: list[dict], parser: ToolParser, template_takes_tools: bool,
             special_token_ids: dict[str, int], reply_format: StructuredOutput | None = None) -> ToolUse:
    """Render tools through the template where it takes them, else into the messages; make the grammar
    of the reply: calls (required, a named function), or text or calls (auto; `reply_format`, the
    request's own format, in place of the text). Walks the tools in Python: run it off the event loop."""
    if request is None:
        return ToolUse(messages, None, None, None)
    offered = request.offered
    names = {tool["function"]["name"] for tool in offered}
    for i, tool in enumerate(request.tools):  # before anything recursive walks a schema
        if tool["function"]["name"] in names and tool["function"].get("parameters") is not None:
            check_schema_depth(tool["function"]["parameters"], f"tools[{i}].function.parameters")
    if offered and template_takes_tools:
        shown_tools, rendered = offered, messages
    else:
        shown_tools, rendered = None, described_in_messages(messages, offered)
    if not offered:
        return ToolUse(rendered, shown_tools, None, None)
    held = [_closed_tool(tool) for tool in offered]
    parallel = request.parallel and request.choice != "function"  # a named function is one call, as on OpenAI
    if request.choice == "auto":
        fmt = None if reply_format is None else _as_lark(reply_format)
        grammar = parser.auto_grammar(held, parallel, special_token_ids, fmt)
    else:
        grammar = parser.call_grammar(held, parallel, special_token_ids)
    return ToolUse(rendered, shown_tools, parser.for_tools(names, parallel),
                   StructuredOutput(grammar=grammar, param="tools"))


def _as_lark(spec: StructuredOutput) -> str:
    """A request's JSON format (the only kind parse_chat lets beside tools the model may call) as a
    Lark expression, to stand beside the calls in the auto grammar."""
    return json_rule(orjson.loads(spec.json_schema) if spec.json_schema is not None else {"type": "object"})


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

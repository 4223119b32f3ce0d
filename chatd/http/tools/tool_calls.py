"""Tool-call formats by model family: hermes (`<tool_call>` blocks), llama3_json (bare JSON objects),
mistral (`[TOOL_CALLS]`). Each `ToolParser` says how its calls look, so that tool_stream.py can read
them (`parse`, `stream`), and makes the grammars that constrain what a model may write:
`call_grammar` a call (required, a named function), `auto_grammar` text or calls (auto), where the
text cannot contain a call marker, so that every marker the model writes starts a real call whose
arguments match the function's schema. A parser bound to a request's functions (`for_tools`) reads
only calls to them, and with `parallel=False` at most one call, as its grammar writes. All families
get OpenAI-style ids, also mistral (whose templates want 9 alphanumerics: the caller maps them).
This module knows nothing about HTTP or tokenizers.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping

from chatd.http.tools.tool_stream import BARE_NAME, CALL_OBJECT, VALUE, WS, ToolCall, ToolCallDelta, ToolCallStream

__all__ = ["PARSERS", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser", "json_rule", "parser_for_template"]


_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_TEXT = "/(?s:.*)/"  # any text (valid UTF-8, newlines too)


class ToolParser:
    """A family's tool-call format: reading it (`parse`, `stream`) and forcing it (`call_grammar`, `auto_grammar`)."""

    name: str
    offered: frozenset[str] | None = None  # the functions a call may name; None (unbound): any
    parallel: bool = True  # False: the reply's first call is its only one (later ones are dropped)
    needs_special_tokens: bool  # its markers are special tokens, so detokenizing must keep them
    markers: dict[str, list[list]]  # a marker -> the heads that may follow it (ending at the arguments)
    start_heads: list[list] = []  # heads that need no marker at the reply's start
    after: list[list]  # what may follow a call's arguments: its close, or the head of the next call

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """The reply's content (None when the reply is only tool calls / only whitespace besides them) and its
        calls; a reply `cut` by max_tokens loses the call markup it had not finished (tool_stream.py)."""
        stream = self.stream()
        content = stream.feed(text)[0] + stream.finish(cut)[0]
        if not content or (stream.calls and content.isspace()):
            return None, stream.calls
        return content, stream.calls

    def stream(self) -> ToolCallStream:
        """A reader for one streamed reply."""
        return ToolCallStream(self)

    def for_tools(self, names: Iterable[str], parallel: bool = True) -> ToolParser:
        """This parser, reading calls only to these functions (a call to any other stays content), and
        without `parallel` only the first call (as the grammar allows: a second line)."""
        bound = copy.copy(self)
        bound.offered, bound.parallel = frozenset(names), parallel
        return bound

    def call_grammar(self, tools: list[dict], parallel: bool, special_token_ids: Mapping[str, int]) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (or, with parallel, one or
        more calls) of one of `tools`, in this family's format, its arguments matching the function's schema."""
        marker, rest, rules = self._calls(tools, parallel, special_token_ids)
        opening = f"{_marker(marker, special_token_ids)} " if marker else ""
        return "\n".join([f"start: {opening}{rest}", *rules])

    def auto_grammar(self, tools: list[dict], parallel: bool, special_token_ids: Mapping[str, int],
                     reply_format: str | None = None) -> str:
        """A grammar whose sentences are text in which no call marker appears, or such text followed by
        calls as `call_grammar` has them: every marker the model writes starts a real call. With
        `reply_format` (a Lark expression: the format the request asked for), a reply is that or calls."""
        marker, rest, rules = self._calls(tools, parallel, special_token_ids)
        if reply_format is not None:
            opening = f"{_marker(marker, special_token_ids)} " if marker else ""
            return "\n".join([f"start: reply_format | {opening}{rest}", f"reply_format: {reply_format}", *rules])
        text = [f"TEXT: {self._free_text()}"]
        if marker is None:
            start = f"start: TEXT | {rest}"
        elif marker in special_token_ids:  # text cannot produce a special token: the marker ends it
            start = f"start: TEXT | TEXT {_marker(marker, special_token_ids)} {rest}"
        else:
            # One terminal up to the marker: TEXT alone would be lexed past the marker's first bytes.
            start, text = f"start: TEXT | HEAD {rest}", [*text, f"HEAD: TEXT {json.dumps(marker)}"]
        return "\n".join([start, *text, *rules])

    def _free_text(self) -> str:
        """A terminal for text in which none of this family's markers appears (spelled out in plain
        tokens either: the parser reads text, not token ids)."""
        return " & ".join([_ANY_TEXT, *(f"~({_ANY_TEXT} {json.dumps(m)} {_ANY_TEXT})" for m in self.markers)])

    def _calls(self, tools: list[dict], parallel: bool, special_token_ids: Mapping[str, int]) -> tuple[str | None, str, list[str]]:
        """Calls in this family's format: the marker that opens them (None: they need none), the Lark
        expression that follows it, and the rules that expression uses."""
        raise NotImplementedError


def _parameters(tool: dict) -> tuple[dict, dict]:
    """A tool's parameters schema, and its definitions (to move to the root, where `#/$defs/...` points)."""
    params = dict(tool["function"].get("parameters") or {"type": "object"})
    return params, {key: params.pop(key) for key in ("$defs", "definitions") if key in params}


def json_rule(schema: dict) -> str:
    """A schema as a Lark `%json` expression, its JSON written as chatd writes JSON (compact, one line)."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT_JSON})


def _call_objects(tools: list[dict], arguments_key: str) -> list[str]:
    """Rules `fn_0: %json {...}`, one per tool: {"name": NAME, arguments_key: PARAMS}, in that order."""
    rules = []
    for i, tool in enumerate(tools):
        params, defs = _parameters(tool)
        schema = {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: params},
                  "required": ["name", arguments_key], "additionalProperties": False, **defs}
        rules.append(f"fn_{i}: {json_rule(schema)}")
    return [f"fn: {' | '.join(f'fn_{i}' for i in range(len(tools)))}", *rules]


def _marker(text: str, special_token_ids: Mapping[str, int]) -> str:
    """A marker in a grammar: its special token where it is one (text cannot match a special token), else text."""
    return f"<[{special_token_ids[text]}]>" if text in special_token_ids else json.dumps(text)


class HermesParser(ToolParser):
    """Hermes 2 Pro, Qwen2.5/Qwen3, SmolLM3: content, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks."""

    name = "hermes"
    needs_special_tokens = False  # <tool_call> is an ordinary added token in these tokenizers
    markers = {"<tool_call>": [CALL_OBJECT]}
    after = [[WS, "}", WS, "</tool_call>"], [WS, "}"]]

    def _calls(self, tools, parallel, special_token_ids):
        rest = f'"\\n" fn "\\n" {_marker("</tool_call>", special_token_ids)}'
        rules = _call_objects(tools, "arguments")
        if parallel:
            rules.append(f'call: {_marker("<tool_call>", special_token_ids)} {rest}')
            rest += ' ("\\n" call)*'
        return "<tool_call>", rest, rules


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: the reply is `{"name": ..., "parameters": {...}}` (optionally after
    <|python_tag|>), several separated by "; ". A JSON object after other content is content."""

    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is one
    markers = {"<|python_tag|>": [CALL_OBJECT]}
    start_heads = [CALL_OBJECT]
    after = [[WS, "}", WS, ";", *CALL_OBJECT], [WS, "}"]]

    def _calls(self, tools, parallel, special_token_ids):
        # Bare JSON, as Meta documents the format for custom tools; the parser also reads <|python_tag|>.
        return None, "fn" + (' ("; " fn)*' if parallel else ""), _call_objects(tools, "parameters")

    def _free_text(self):
        # A reply that starts with a JSON object is a call (the parser reads it so): text cannot.
        return f"{super()._free_text()} & ~/[ \\t\\n\\r]*\\{{(?s:.*)/"


class MistralParser(ToolParser):
    """Mistral v0.3, Nemo, Small: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, and the newer
    `[TOOL_CALLS]name[ARGS]{...}`, repeated for several calls."""

    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a control token
    markers = {"[TOOL_CALLS]": [[WS, "[", *CALL_OBJECT], [BARE_NAME, "[ARGS]", VALUE]]}
    after = [[WS, "}", WS, ",", *CALL_OBJECT], [WS, "}", WS, "]"], [WS, "}"]]

    def _calls(self, tools, parallel, special_token_ids):
        if "[ARGS]" not in special_token_ids:  # a tokenizer without [ARGS] predates the newer format
            return "[TOOL_CALLS]", '"[" fn' + (' (", " fn)*' if parallel else "") + ' "]"', _call_objects(tools, "arguments")
        rules = [f"fn: {' | '.join(f'fn_{i}' for i in range(len(tools)))}"]
        for i, tool in enumerate(tools):
            rules.append(f'fn_{i}: {json.dumps(tool["function"]["name"])} {_marker("[ARGS]", special_token_ids)} args_{i}')
            rules.append(f"args_{i}: {json_rule(tool['function'].get('parameters') or {'type': 'object'})}")
        more = f' ({_marker("[TOOL_CALLS]", special_token_ids)} fn)*' if parallel else ""
        return "[TOOL_CALLS]", "fn" + more, rules


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def parser_for_template(template_source: str) -> str:
    """The family a chat template's source implies, by the marker it writes calls with: `[TOOL_CALLS]`
    is mistral, `<tool_call>` hermes; a Llama 3 header template that knows `<|python_tag|>` or the
    `ipython` role is llama3_json. "hermes" when nothing matches."""
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|start_header_id|>" in template_source and ("<|python_tag|>" in template_source or "ipython" in template_source):
        return "llama3_json"
    return "hermes"

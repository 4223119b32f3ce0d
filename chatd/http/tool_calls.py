"""Reads tool calls out of what a model writes, in its family's format, and makes the grammar that
forces one: hermes (`<tool_call>` blocks), llama3_json (bare JSON objects), mistral (`[TOOL_CALLS]`).

One state machine serves whole replies and streams (`parse` is a stream fed the whole text), so both
give the same content and calls. A call is committed once its name and the first character of its
arguments are read; the arguments then pass through as written (only braces and strings are tracked,
to find their end), and a reply that breaks off keeps what it wrote. Text that breaks off earlier, or
strays from the format, stays content; whitespace between content and a call is dropped. All families
get OpenAI-style ids, also mistral (whose templates want 9 alphanumerics: the caller maps them).
This module knows nothing about HTTP or tokenizers.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class ToolCall:
    """One complete call."""

    id: str  # "call_" + 24 random url-safe characters, made by the parser
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class ToolCallDelta:
    """One piece of a streamed call, as OpenAI's `delta.tool_calls[i]`."""

    index: int  # which call (0, 1, ...) in this reply
    id: str | None = None  # set on a call's first delta only
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""  # the next piece of the arguments text


# A call's format is a list of pieces, matched in order: a literal (or a tuple of alternative
# literals), or one of these.
WS = "<whitespace>"  # any whitespace, none included
NAME = "<name>"  # a JSON string: the function's name
BARE_NAME = "<bare name>"  # the function's name unquoted (Mistral's [ARGS] format)
VALUE = "<value>"  # the first character of the arguments: `{` (an object) or `"` (JSON text in a string)
MATCH, PARTIAL, FAIL = "match", "partial", "fail"

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_STRING_START = re.compile(r'"(?:[^"\\]|\\.)*\\?', re.S)
_BARE = re.compile(r"[\w.\-]+")
# A string's text in whole units, so that pieces decoded one by one join into the decoded whole.
_STRING_UNIT = re.compile(r'[^"\\]+|\\u[0-9a-fA-F]{4}|\\[^u]', re.S)
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_ESCAPE = re.compile(r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|\\u([0-9a-fA-F]{4})|\\(.)", re.S)
_ESCAPED = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

CALL_OBJECT = [WS, "{", WS, '"name"', WS, ":", WS, NAME, WS, ",", WS, ('"arguments"', '"parameters"'), WS, ":", WS, VALUE]


def _unescape(match: re.Match) -> str:
    high, low, code, char = match.groups()
    if high:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00)
    if code:
        value = int(code, 16)
        return "\ufffd" if 0xD800 <= value < 0xE000 else chr(value)  # a lone surrogate cannot be sent as UTF-8
    return _ESCAPED.get(char, "\\" + char)  # an unknown escape is kept as written


def _decode(raw: str) -> str:
    """The text of JSON string contents (whole units); unknown escapes are kept as written."""
    return _ESCAPE.sub(_unescape, raw)


def _match(pieces: list, text: str, pos: int) -> tuple[str, int, str | None]:
    """Match pieces at text[pos:]: (MATCH, end, name), (PARTIAL, ...) when more text could still make
    them match, or (FAIL, ...). A match never ends on something more text could extend."""
    name = None
    for piece in pieces:
        if piece == WS:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                return PARTIAL, pos, name
        elif piece == NAME:
            found = _JSON_STRING.match(text, pos)
            if found is None:
                return (PARTIAL if _JSON_STRING_START.fullmatch(text, pos) else FAIL), pos, name
            name, pos = _decode(found.group()[1:-1]), found.end()
            if not name:
                return FAIL, pos, name
        elif piece == BARE_NAME:
            found = _BARE.match(text, pos)
            if found is None or found.end() == len(text):
                return (FAIL if found is None else PARTIAL), pos, name
            name, pos = found.group(), found.end()
        elif piece == VALUE:
            if pos == len(text):
                return PARTIAL, pos, name
            return (MATCH if text[pos] in '{"' else FAIL), pos, name
        else:
            options = piece if isinstance(piece, tuple) else (piece,)
            literal = next((lit for lit in options if text.startswith(lit, pos)), None)
            if literal is None:
                rest = text[pos:]
                partial = any(len(rest) < len(lit) and lit.startswith(rest) for lit in options)
                return (PARTIAL if partial else FAIL), pos, name
            pos += len(literal)
    return MATCH, pos, name


def _first_match(alternatives: list[list], text: str, final: bool) -> tuple[str, int, str | None, list]:
    """The longest of the alternatives that matches at text's start; PARTIAL while one of them
    still could (until the reply is final), so the choice never depends on where a stream was split."""
    results = [(*_match(pieces, text, 0), pieces) for pieces in alternatives]
    if not final and any(r[0] == PARTIAL for r in results):
        return PARTIAL, 0, None, []
    matches = [r for r in results if r[0] == MATCH]
    return max(matches, key=lambda r: r[1]) if matches else (FAIL, 0, None, [])


class ToolCallStream:
    """Reads one reply's text as it arrives: content, and tool-call deltas as soon as each is certain."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.calls: list[ToolCall] = []  # the calls so far (ids equal those sent in deltas)
        self._buf = ""  # text read but not yet decided
        self._state = "text"  # text | head (after a marker) | arguments | after (the arguments ended)
        self._marker = ""  # the marker a head follows, content again if no call follows it
        self._at_start = True  # nothing but whitespace read yet (llama3 calls need no marker there)
        self._held_ws = ""  # whitespace after content: dropped if a call follows it
        self._skip_ws = False  # whitespace right after a call is dropped too
        self._depth = 0  # the arguments object's brace depth,
        self._in_string = self._escaped = False  # and where in a JSON string it is
        self._string_arguments = False  # the arguments are JSON text in a JSON string
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Next text delta of the reply -> (content to send now, tool-call deltas to send now)."""
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The reply ended: what was held back (a marker's start that no call followed) becomes content."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        steps = {"text": self._text, "head": self._head, "arguments": self._arguments, "after": self._after}
        while steps[self._state](final):
            pass
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    # Each step reads what it can of self._buf and says whether to go on.

    def _text(self, final: bool) -> bool:
        if self._at_start and self.parser.start_heads:
            status, end, name, _ = _first_match(self.parser.start_heads, self._buf, final)
            if status == PARTIAL:
                return False
            self._at_start = False
            if status == MATCH:
                return self._commit(name, end)
        found = [(self._buf.find(marker), marker) for marker in self.parser.markers]
        found = [(i, marker) for i, marker in found if i >= 0]
        if not found:
            # Hold back only what could be the start of a marker.
            longest = min(len(self._buf), max(map(len, self.parser.markers)) - 1)
            keep = 0 if final else next((k for k in range(longest, 0, -1)
                                         if any(m.startswith(self._buf[-k:]) for m in self.parser.markers)), 0)
            self._emit_content(self._buf[:len(self._buf) - keep], final)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        i, self._marker = min(found)
        self._emit_content(self._buf[:i], final=False)
        self._buf, self._state = self._buf[i + len(self._marker):], "head"
        return True

    def _head(self, final: bool) -> bool:
        status, end, name, _ = _first_match(self.parser.markers[self._marker], self._buf, final)
        if status == PARTIAL:
            return False
        self._state = "text"
        if status == MATCH:
            return self._commit(name, end)
        self._emit_content(self._marker, final)  # not a call: the marker was text; what follows is read again
        return True

    def _commit(self, name: str, end: int) -> bool:
        self._held_ws, self._at_start, self._state = "", False, "arguments"
        self._string_arguments = self._buf[end] == '"'
        self._buf = self._buf[end + 1:] if self._string_arguments else self._buf[end:]
        self._depth, self._in_string, self._escaped = 0, False, False
        call = ToolCall("call_" + secrets.token_urlsafe(18), name, "")
        self.calls.append(call)
        self._deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
        return True

    def _arguments(self, final: bool) -> bool:
        if self._string_arguments:
            return self._string_piece(final)
        end = None
        for i, char in enumerate(self._buf):
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped, self._in_string = char == "\\", char != '"'
            elif char == '"':
                self._in_string = True
            elif char == "{":
                self._depth += 1
            elif char == "}":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = self._buf if end is None else self._buf[:end]
        self._emit_arguments(piece)
        self._buf = self._buf[len(piece):]
        if end is not None:
            self._state = "after"
        return end is not None

    def _string_piece(self, final: bool) -> bool:
        # Send whole units only, and a surrogate pair's two halves together.
        i = cut = 0
        while i < len(self._buf) and self._buf[i] != '"':
            unit = _STRING_UNIT.match(self._buf, i)
            if unit is None:
                break  # half an escape: wait for the rest
            i = unit.end()
            if not _HIGH_SURROGATE.fullmatch(unit.group()):
                cut = i
        closed = i < len(self._buf) and self._buf[i] == '"'
        if closed or final:
            cut = i if closed else len(self._buf)
        self._emit_arguments(_decode(self._buf[:cut]))
        self._buf = self._buf[cut + 1 if closed else cut:]
        if closed:
            self._state = "after"
        return closed

    def _after(self, final: bool) -> bool:
        status, end, name, pieces = _first_match(self.parser.after, self._buf, final)
        if status == PARTIAL:
            return False
        self._state, self._skip_ws = "text", True
        if status == MATCH and VALUE in pieces:
            return self._commit(name, end)
        if status == MATCH:
            self._buf = self._buf[end:]
        return True

    def _emit_content(self, text: str, final: bool) -> None:
        text = self._held_ws + text
        if self._skip_ws:
            text = text.lstrip()
            self._skip_ws = not text
        body = text if final else text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._content.append(body)

    def _emit_arguments(self, piece: str) -> None:
        if not piece:
            return
        self.calls[-1].arguments += piece
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == len(self.calls) - 1:
            last.arguments += piece  # one delta per call per feed
        else:
            self._deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))


_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolParser:
    """A family's tool-call format: reading it (`parse`, `stream`) and forcing it (`call_grammar`)."""

    name: str
    needs_special_tokens: bool  # its markers are special tokens, so detokenizing must keep them
    markers: dict[str, list[list]]  # a marker -> the heads that may follow it (ending at the arguments)
    start_heads: list[list] = []  # heads that need no marker at the reply's start
    after: list[list]  # what may follow a call's arguments: its close, or the head of the next call

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content (None when the reply is only tool calls / only whitespace besides them) and its calls."""
        stream = self.stream()
        content = stream.feed(text)[0] + stream.finish()[0]
        if not content or (stream.calls and content.isspace()):
            return None, stream.calls
        return content, stream.calls

    def stream(self) -> ToolCallStream:
        """A reader for one streamed reply."""
        return ToolCallStream(self)

    def call_grammar(self, tools: list[dict], parallel: bool, special_token_ids: Mapping[str, int]) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (or, with parallel, one or
        more calls) of one of `tools`, in this family's format, its arguments matching the function's schema."""
        raise NotImplementedError


def _parameters(tool: dict) -> tuple[dict, dict]:
    """A tool's parameters schema, and its definitions (to move to the root, where `#/$defs/...` points)."""
    params = dict(tool["function"].get("parameters") or {"type": "object"})
    return params, {key: params.pop(key) for key in ("$defs", "definitions") if key in params}


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT_JSON})


def _call_objects(tools: list[dict], arguments_key: str) -> list[str]:
    """Rules `fn_0: %json {...}`, one per tool: {"name": NAME, arguments_key: PARAMS}, in that order."""
    rules = []
    for i, tool in enumerate(tools):
        params, defs = _parameters(tool)
        schema = {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: params},
                  "required": ["name", arguments_key], "additionalProperties": False, **defs}
        rules.append(f"fn_{i}: {_json_rule(schema)}")
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

    def call_grammar(self, tools, parallel, special_token_ids):
        opening, closing = _marker("<tool_call>", special_token_ids), _marker("</tool_call>", special_token_ids)
        more = ' ("\\n" call)*' if parallel else ""
        return "\n".join([f"start: call{more}", f'call: {opening} "\\n" fn "\\n" {closing}',
                          *_call_objects(tools, "arguments")])


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: the reply is `{"name": ..., "parameters": {...}}` (optionally after
    <|python_tag|>), several separated by "; ". A JSON object after other content is content."""

    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is one
    markers = {"<|python_tag|>": [CALL_OBJECT]}
    start_heads = [CALL_OBJECT]
    after = [[WS, "}", WS, ";", *CALL_OBJECT], [WS, "}"]]

    def call_grammar(self, tools, parallel, special_token_ids):
        # Bare JSON, as Meta documents the format for custom tools; the parser also reads <|python_tag|>.
        more = ' ("; " fn)*' if parallel else ""
        return "\n".join([f"start: fn{more}", *_call_objects(tools, "parameters")])


class MistralParser(ToolParser):
    """Mistral v0.3, Nemo, Small: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, and the newer
    `[TOOL_CALLS]name[ARGS]{...}`, repeated for several calls."""

    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a control token
    markers = {"[TOOL_CALLS]": [[WS, "[", *CALL_OBJECT], [BARE_NAME, "[ARGS]", VALUE]]}
    after = [[WS, "}", WS, ",", *CALL_OBJECT], [WS, "}", WS, "]"], [WS, "}"]]

    def call_grammar(self, tools, parallel, special_token_ids):
        calls = _marker("[TOOL_CALLS]", special_token_ids)
        if "[ARGS]" not in special_token_ids:  # a tokenizer without [ARGS] predates the newer format
            more = ' (", " fn)*' if parallel else ""
            return "\n".join([f'start: {calls} "[" fn{more} "]"', *_call_objects(tools, "arguments")])
        rules = [f'start: call{"+" if parallel else ""}', f"call: {calls} ({' | '.join(f'fn_{i}' for i in range(len(tools)))})"]
        for i, tool in enumerate(tools):
            rules.append(f'fn_{i}: {json.dumps(tool["function"]["name"])} {_marker("[ARGS]", special_token_ids)} args_{i}')
            rules.append(f"args_{i}: {_json_rule(tool['function'].get('parameters') or {'type': 'object'})}")
        return "\n".join(rules)


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

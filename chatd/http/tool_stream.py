"""Reads tool calls out of what a model writes, as it streams, in its family's format (the formats are
tool_calls.py's): content, and OpenAI's `tool_calls` deltas as soon as each is certain.

One state machine serves whole replies and streams (`ToolParser.parse` is a stream fed the whole text),
so both give the same content and calls. A call is committed once its name and the first character of
its arguments are read; the arguments then pass through as written (only braces and strings are
tracked, to find their end), and a reply that breaks off keeps what it wrote. Text that breaks off
earlier, or strays from the format, stays content; whitespace between content and a call is dropped.
A parser bound to a request's functions commits only calls that name one of them; a call to another
stays content. All families get OpenAI-style ids (`call_` + 24 random characters).
This module knows nothing about HTTP, tokenizers or grammars.
"""

from __future__ import annotations

import re
import secrets
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
WS = "<whitespace>"  # any JSON whitespace (space, tab, newline, return), none included
NAME = "<name>"  # a JSON string: the function's name
BARE_NAME = "<bare name>"  # the function's name unquoted (Mistral's [ARGS] format)
VALUE = "<value>"  # the first character of the arguments: `{` (an object) or `"` (JSON text in a string)
MATCH, PARTIAL, FAIL = "match", "partial", "fail"

_JSON_WS = " \t\n\r"  # as JSON has it: what the grammars can exclude exactly (not str.isspace's many more)
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
            while pos < len(text) and text[pos] in _JSON_WS:
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


def _first_match(alternatives: list[list], text: str, final: bool,
                 offered: frozenset[str] | None = None) -> tuple[str, int, str | None, list]:
    """The longest of the alternatives that matches at text's start; PARTIAL while one of them
    still could (until the reply is final), so the choice never depends on where a stream was split.
    A match that names a function not `offered` (None: any is) is no match."""
    results = [(*_match(pieces, text, 0), pieces) for pieces in alternatives]
    if offered is not None:
        results = [(FAIL, *r[1:]) if r[0] == MATCH and r[2] is not None and r[2] not in offered else r for r in results]
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
            status, end, name, _ = _first_match(self.parser.start_heads, self._buf, final, self.parser.offered)
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
        status, end, name, _ = _first_match(self.parser.markers[self._marker], self._buf, final, self.parser.offered)
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
        status, end, name, pieces = _first_match(self.parser.after, self._buf, final, self.parser.offered)
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

"""Reads tool calls out of what a model writes, as it streams, in its family's format (the formats are
tool_calls.py's): content, and OpenAI's `tool_calls` deltas as soon as each is certain.

One state machine serves whole replies and streams (`ToolParser.parse` is a stream fed the whole text),
so both give the same content and calls (but for a cut call a stream had sent: below). A call is
committed once its name and the first character of its arguments are read; the arguments then pass
through as written (only braces and strings are tracked, to find their end). Text that strays from
the format stays content; whitespace between content and a call is dropped. A parser bound to a
request's functions commits only calls that name one of them; a call to another stays content. All
families get OpenAI-style ids (`call_` + 24 random characters).

Where a reply ends decides what its unfinished tail is. A reply that stops (a stop string, an abort)
keeps what it wrote: a marker's start that no call followed is content, a call keeps its arguments
so far. A reply cut by max_tokens (`finish(cut=True)`) was stopped by the budget, not by the model,
so what the reader still holds at its end is call markup the model had not finished: a marker's
start, a call's head or its close, and a call whose arguments had not closed are dropped, neither
content nor a call (its arguments would not parse). A stream cannot take back what it sent: a cut
call's arguments already streamed stay sent (as on OpenAI; `finish_reason: length` says the last
call broke off), and only the whole reply leaves the call out.

A reply never holds two identical calls (the same name and the same arguments, as written): a later
one is dropped. Models repeat themselves, most under `required`, whose grammar lets the calls go on;
the grammar cannot say "differ from the call before", so the reader does it. Two identical calls in
one reply ask for the same result twice, and a client cannot tell them apart but by their ids: a
function meant to run twice (a dice roll) is asked for again in the next turn, or takes a count.
While a call could still turn out a repeat (its name was called before and its arguments so far
begin that call's), its deltas wait; once they differ, they are sent and the rest streams as usual.
A parser bound to one call (`parallel_tool_calls: false`, a named function) reads further calls
to their end and drops them (its grammar writes none: this is a second line).
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
        self.calls: list[ToolCall] = []  # the calls so far (once finished: the reply's calls)
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
        self._held: list[ToolCallDelta] | None = None  # the current call's deltas while it may be a repeat, or extra

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Next text delta of the reply -> (content to send now, tool-call deltas to send now)."""
        self._buf += text
        return self._advance(final=False)

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The reply ended: what was held back (a marker's start that no call followed) becomes content;
        where max_tokens `cut` it, the unfinished call markup at its end is dropped instead."""
        if cut:
            self._drop_unfinished()
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        steps = {"text": self._text, "head": self._head, "arguments": self._arguments, "after": self._after}
        while steps[self._state](final):
            pass
        if final and self._state == "arguments":  # it broke off (not cut): it keeps what it wrote
            self._end_call(closed=False)
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

    def _drop_unfinished(self) -> None:
        """At a cut: drop the tail the reply had not finished (what is left to read is call markup)."""
        if self._state == "arguments":
            self.calls.pop()  # its arguments never closed; deltas already sent stay sent
            self._held = None
        if self._buf or self._state != "text":
            self._held_ws = ""  # it only separated content from the dropped markup
        self._buf, self._state = "", "text"

    def _commit(self, name: str, end: int) -> bool:
        self._held_ws, self._at_start, self._state = "", False, "arguments"
        self._string_arguments = self._buf[end] == '"'
        self._buf = self._buf[end + 1:] if self._string_arguments else self._buf[end:]
        self._depth, self._in_string, self._escaped = 0, False, False
        call = ToolCall("call_" + secrets.token_urlsafe(18), name, "")
        self.calls.append(call)
        first = ToolCallDelta(len(self.calls) - 1, call.id, call.name)
        if self._over_limit() or any(earlier.name == name for earlier in self.calls[:-1]):
            self._held = [first]  # extra, or maybe a repeat: it waits
        else:
            self._deltas.append(first)
        return True

    def _over_limit(self) -> bool:
        """Whether the call being read is one more than a parser bound to one call reads."""
        return not self.parser.parallel and len(self.calls) > 1

    def _repeats(self, call: ToolCall, closed: bool) -> bool:
        """Whether `call` is an earlier call again (closed: exactly; else: so far)."""
        return any(earlier.name == call.name and (earlier.arguments == call.arguments if closed
                                                  else earlier.arguments.startswith(call.arguments))
                   for earlier in self.calls[:-1])

    def _end_call(self, closed: bool) -> None:
        """The current call's arguments ended (or the reply did): a held call is dropped or sent."""
        if self._held is not None:
            if self._over_limit() or (closed and self._repeats(self.calls[-1], closed=True)):
                self.calls.pop()
            else:
                self._deltas.extend(self._held)
            self._held = None

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
            self._end_call(closed=True)
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
            self._end_call(closed=True)
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
        call = self.calls[-1]
        call.arguments += piece
        if self._held is not None and not self._over_limit() and not self._repeats(call, closed=False):
            self._deltas.extend(self._held)  # no repeat after all: what waited goes out, the rest streams
            self._held = None
        deltas = self._deltas if self._held is None else self._held
        last = deltas[-1] if deltas else None
        if last is not None and last.index == len(self.calls) - 1:
            last.arguments += piece  # one delta per call per feed
        else:
            deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))

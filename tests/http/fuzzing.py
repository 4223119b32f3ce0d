"""Request generators for fuzzing a real `chatd serve`: every route, with wrong JSON types in
every field, numbers no JSON library writes, bytes that are not UTF-8, deep nesting, odd
framing, queries, ids and headers; raw exchanges over a socket and the checks on what comes
back. Used by tests/http/test_fuzz.py and benchmarks/fuzz.py.
"""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import quote

import aiohttp
from hypothesis import strategies as st


# Small limits so that "too large" and "too slow" are cheap to reach; a short context window
# bounds the longest reply a fuzzed request can ask for.
MAX_BODY_BYTES = 262_144
FUZZ_CONFIG = (
    "[auth]\nenabled = true\n[model]\nmax_model_len = 256\n[cache]\nnum_blocks = 512\n"
    f"[server]\nheartbeat_seconds = 0.5\nheader_timeout_seconds = 1\nbody_timeout_seconds = 1\nmax_body_bytes = {MAX_BODY_BYTES}\n"
)


# -- JSON as bytes, including what no JSON library writes ---------------------------------------


class Raw(bytes):
    """A JSON fragment sent as is: literals no encoder writes (1e400, NaN), bytes that are not UTF-8."""


def to_json(value) -> bytes:
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, dict):
        return b"{" + b",".join(to_json(str(k)) + b":" + to_json(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(to_json(v) for v in value) + b"]"
    # The standard library writes NaN and Infinity as bare literals and ints of any size.
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


ODD_LITERALS = [
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1e-400", b"-0", b"-0.0", b"18446744073709551616",
    b"-9223372036854775809", b"1" + b"0" * 400, b"0x10", b"+1", b"01", b".5",
    b'"\xff\xfe"', b'"\xc3("', b'"\xed\xa0\x80"', b'"\\ud800"', b'"\\udc00\\ud800"', b'"a\x00b"', b'"\\q"', b"'single'",
    b"[" * 5000 + b"]" * 5000,  # deeper than any parser should follow
    b'{"a":' * 300 + b"{}" + b"}" * 300,  # parses, but is deeper than orjson writes
    b"[" * 1000 + b"]" * 1000, b'{"a":' * 1000 + b"{}" + b"}" * 1000,  # parses, but is deeper than repr() goes
]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=12))
odd_values = st.one_of(
    scalars,
    st.sampled_from([2**63, 2**64, -2**63 - 1, 0, -1, "", " ", "0", "true", "null", [], {}]),
    st.sampled_from([1000, 100_000, 300_000]).map(lambda n: "x" * n),
    st.lists(scalars, max_size=3),
    st.dictionaries(st.text(max_size=5), scalars, max_size=3),
    st.sampled_from(ODD_LITERALS).map(Raw),
)
DROP = object()  # a field mutated into absence


def mostly(common: st.SearchStrategy, rare: st.SearchStrategy, one_in: int = 4) -> st.SearchStrategy:
    """`common`, except one draw in `one_in` from `rare` (hypothesis draws 0 most often, so 0 is the common case)."""
    return st.integers(0, one_in - 1).flatmap(lambda i: rare if i == one_in - 1 else common)


# -- request bodies, per route ------------------------------------------------------------------

floats = st.floats  # valid ranges below; odd_values brings the invalid ones
SAMPLING = {
    "max_tokens": st.integers(1, 4), "temperature": floats(0, 2), "top_p": floats(0.05, 1), "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=5)),
    "seed": st.integers(0, 2**63 - 1), "presence_penalty": floats(-2, 2), "frequency_penalty": floats(-2, 2),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=8), "top_k": st.integers(0, 50), "min_p": floats(0, 1), "repetition_penalty": floats(0.5, 2),
    "ignore_eos": st.booleans(), "priority": st.integers(-5, 5), "min_tokens": st.integers(0, 1),
    "model": st.sampled_from(["demo", "gpt-4o"]), "logit_bias": st.just({}), "store": st.just(False),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2), "service_tier": st.just("auto"),
}
@st.composite
def mutated(draw, base: st.SearchStrategy, extra_fields: tuple[str, ...] = ("name", "type")) -> dict:
    """An object from `base`, and one time in two one of its fields set to an odd value or dropped."""
    value = dict(draw(base))
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(value) + list(extra_fields)))
        new = draw(mostly(odd_values, st.just(DROP)))
        if new is DROP:
            value.pop(name, None)
        else:
            value[name] = new
    return value


ROLES = mostly(st.sampled_from(["user", "system", "assistant", "developer"]),
                st.sampled_from(["tool", "function", "", "USER", "user\x00", " user"]) | odd_values)
PARTS = st.lists(mostly(mutated(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})),
                        st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}) | odd_values), max_size=3)
CONTENT = mostly(st.text(max_size=30), PARTS | odd_values, 3)
MESSAGE = mostly(mutated(st.fixed_dictionaries({"role": ROLES, "content": CONTENT}), ("name", "tool_calls")), odd_values)
MESSAGES = mostly(st.lists(MESSAGE, min_size=1, max_size=4), odd_values
                  | st.just(3000).map(lambda n: [{"role": "user", "content": "hi"}] * n))  # more than max_messages

BODIES = {  # route kind -> (required fields, optional fields), all valid before mutation
    "chat": ({"messages": mostly(st.just([{"role": "user", "content": "hi"}]), MESSAGES, 2), "max_tokens": SAMPLING["max_tokens"]},
             {**SAMPLING, "max_completion_tokens": st.integers(1, 4), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
              "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})}),
    "completion": ({"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(0, 999), min_size=1, max_size=8)),
                    "max_tokens": SAMPLING["max_tokens"]}, {**SAMPLING, "logprobs": st.integers(0, 5)}),
    "turn": ({"content": CONTENT, "max_tokens": SAMPLING["max_tokens"]},
             {**{k: v for k, v in SAMPLING.items() if k not in ("store", "metadata", "n")}, "role": st.just("user"),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}),
    "new_conversation": ({}, {"title": st.text(max_size=20), "system_prompt": st.text(max_size=20), "model": st.just("demo"),
                              "metadata": st.dictionaries(st.text(max_size=4), scalars, max_size=3)}),
    "rename": ({"title": st.text(max_size=20)}, {"metadata": st.dictionaries(st.text(max_size=4), scalars, max_size=3)}),
}
EXTRA_FIELDS = ["tools", "functions", "suffix", "unknown_field", "", "MESSAGES", "messages\x00"]


@st.composite
def json_bodies(draw, kind: str) -> bytes:
    """A valid body for the route (its required fields, up to 3 optional ones) with 1-3 fields set
    to odd values or dropped; or no JSON object at all."""
    shape = draw(mostly(st.just("object"), st.sampled_from(["value", "garbage", "truncated", "empty", "duplicate keys"]), 6))
    if shape == "value":
        return to_json(draw(odd_values))
    if shape == "garbage":
        return draw(st.binary(max_size=40))
    if shape == "empty":
        return b""
    required, optional = BODIES[kind]
    body = draw(st.fixed_dictionaries(required))
    # Few valid optional fields: each is one more check a mutated field would have to get past.
    for name in draw(st.lists(st.sampled_from(sorted(set(optional) - set(required))), max_size=3, unique=True)):
        body[name] = draw(optional[name])
    fields = st.sampled_from(sorted({*required, *optional}) + EXTRA_FIELDS)
    for name in draw(mostly(st.lists(fields, min_size=1, max_size=3, unique=True), st.just([]))):
        value = draw(mostly(odd_values, st.just(DROP)))
        if value is DROP:
            body.pop(name, None)
        else:
            body[name] = value
    encoded = to_json(body)
    if shape == "truncated":
        return encoded[: draw(st.integers(0, max(0, len(encoded) - 1)))]
    if shape == "duplicate keys" and encoded != b"{}":
        return encoded[:-1] + b',"max_tokens":"again","messages":null}'
    return encoded


# -- the request: method, target, headers, framing ----------------------------------------------


@dataclass(frozen=True)
class Route:
    """One of chatd's routes (app.py), with the body and query parameters it reads."""

    method: bytes
    path: bytes  # {id} and {message} are filled in by the generator
    body: str | None = None  # key of BODIES
    query: dict[str, list[str]] | None = None


TIMES = ["0", "1700000000", "-1", "1e308", "-1e308", "1e400", "nan", "inf", "-inf", "-0", "", " ", "9" * 400,
         "2024-01-01", "2024-01-01T00:00:00+14:00", "0001-01-01", "9999-12-31T23:59:59-23:59", "2024-13-45", "now", "%FF", "\x00"]
COUNTS = ["1", "20", "100", "101", "0", "-1", "1e3", "9" * 50, "9" * 5000, " 5", "\u0665", "", "0x10", "%FF", "null"]
ROUTES = [
    Route(b"POST", b"/v1/chat/completions", "chat"),
    Route(b"POST", b"/v1/completions", "completion"),
    Route(b"GET", b"/v1/models"),
    Route(b"GET", b"/v1/usage", query={"start": TIMES, "end": TIMES, "period": ["day", "month", "year", "", "DAY", "%00"]}),
    Route(b"POST", b"/v1/conversations", "new_conversation"),
    Route(b"GET", b"/v1/conversations", query={"limit": COUNTS, "after": ["{{conversation}}", "conv_0", "", "%FF", "'--"]}),
    Route(b"GET", b"/v1/conversations/{id}"),
    Route(b"POST", b"/v1/conversations/{id}", "rename"),
    Route(b"DELETE", b"/v1/conversations/{id}"),
    Route(b"POST", b"/v1/conversations/{id}/messages", "turn"),
    Route(b"GET", b"/v1/conversations/{id}/messages/{message}/stream", query={"after": COUNTS}),
    Route(b"POST", b"/v1/conversations/{id}/messages/{message}/cancel"),
    Route(b"GET", b"/live"), Route(b"GET", b"/health"), Route(b"GET", b"/ready"), Route(b"GET", b"/metrics"),
]
# Routes that read a body or a query come up more often: that is where the validation is.
WEIGHTED_ROUTES = [route for route in ROUTES for _ in range(4 if route.body else 2 if route.query else 1)]
# {{key}}, {{conversation}}, {{message}}, {{user_message}} and {{fresh}} (a new conversation) are
# filled in at send time (Targets.resolve): they exist only once the server runs.
ODD_IDS = [b"", b"conv_", b"conv_" + b"0" * 24, b"%FF", b"%00", b"%ED%A0%80", b"..", b"x" * 1000, b"%27%3B--", b"{{user_message}}"]
UNKNOWN_PATHS = [b"/", b"/v1", b"/v1/", b"/v1/chat/completion", b"//v1/models", b"/v1/models/", b"/v1/models/demo", b"/%2e%2e/health",
                 b"/v1/models%00", b"/v1/%FF", b"/v1/conversations/{{conversation}}/messages", b"*", b"http://x/v1/models",
                 b"/" + b"a" * 9000]
METHODS = [b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"HEAD", b"OPTIONS", b"TRACE", b"FOO"]
AUTHS = [b"Bearer {{key}}"] * 40 + [None, b"Bearer", b"Bearer ", b"Basic {{key}}", b"bearer    {{key}}  ", b"Token {{key}}",
                                    b"Bearer chatd_000000000000_unknown", b"Bearer chatd_\xff\xfe", b"Bearer {{key}}x"]
CONTENT_TYPES = [b"application/json"] * 6 + [None, b"text/plain", b"application/json; charset=latin-1", b"\xff/\xfe", b"",
                                             b"multipart/form-data; boundary=x", b"application/x-www-form-urlencoded"]
HEADER_NAMES = [b"X-Request-Id", b"Last-Event-ID", b"Accept", b"Accept-Encoding", b"Cookie", b"Origin", b"Range",
                b"X-Forwarded-For", b"Upgrade", b"Host", b"Transfer-Encoding", b"Content-Encoding"]
HEADER_VALUES = [b"0", b"3", b"-1", b"9" * 5000, b"1e3", b"\xff\xfe", b"100-continue", b"garbage", b"websocket", b"", b" ",
                 b"gzip", b"chunked", b"NaN"]
ENCODINGS = ["identity"] * 24 + ["gzip", "deflate", "gzip but plain", "br", "gzip, gzip", "\xff", "x-gzip", "identity, gzip"]
FRAMINGS = ["none", "short", "long", "chunked", "bad chunks", "length and chunked", "two lengths", "bad length"]
# What only a broken client sends: most of it aiohttp's parser refuses before chatd sees it.
ODD_METHODS = [b"get", b"G\xffT", b"", b"GET GET"]
ODD_VERSIONS = [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x", b"http/1.1", b"HTTP/1.10", b""]
ODD_HEADERS = st.one_of(
    st.tuples(st.binary(max_size=8), st.binary(max_size=20)),
    # chatd's Expect handler runs before any middleware (a 417 in OpenAI's shape for anything
    # but 100-continue); aiohttp's own had answered a value that is not UTF-8 with a 500.
    st.tuples(st.just(b"Expect"), st.sampled_from(HEADER_VALUES)),
    st.tuples(st.sampled_from(HEADER_NAMES + [b"Authorization", b"Content-Length"]),
              st.sampled_from([b"a\r\nX-Injected: 1", b"\x00", b"\x7f", b"x" * 9000, b"\r\n\r\n"])),
    st.just((b"X-Many", b"1" * 100)).map(lambda header: [header] * 200),  # more headers than aiohttp takes
)


@st.composite
def targets(draw, route: Route, odd: bool) -> bytes:
    """A request target: the route's path with ids (mostly live ones) and a query, or a path chatd does not serve."""
    # Hypothesis draws small numbers most often: 0 is the common case throughout.
    if draw(st.integers(0, 9)) == 9:
        return draw(st.sampled_from(UNKNOWN_PATHS))
    ids = [b"{{fresh}}"] if route.method == b"DELETE" else [b"{{conversation}}"] * 3 + [b"{{fresh}}"]
    path = route.path.replace(b"{id}", draw(mostly(st.sampled_from(ids), st.sampled_from(ODD_IDS), 3)))
    path = path.replace(b"{message}", draw(mostly(st.just(b"{{message}}"), st.sampled_from(ODD_IDS), 3)))
    keys = list(route.query or {}) + ["x", "", "limit"]
    pairs = draw(st.lists(st.tuples(st.sampled_from(keys), st.booleans() if odd else st.just(False)), max_size=3))
    if not pairs:
        return path
    fields = []
    for key, raw in pairs:
        value = draw(st.sampled_from((route.query or {}).get(key, ["1", "%FF"])) | st.text(max_size=6))
        # Quoted, or as typed (a broken client): "%FF" then reaches the server as the bytes it names.
        value = value.encode("utf-8") if raw else quote(value, safe="").encode()
        fields.append(key.encode() + b"=" + value)
    return path + b"?" + b"&".join(fields)


@st.composite
def framed(draw, body: bytes, odd: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Content-Encoding, and Content-Length or chunks: right, or (odd) wrong in one of many ways."""
    headers = []
    encoding = draw(st.sampled_from(ENCODINGS))
    if encoding in ("gzip", "x-gzip"):
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if encoding != "identity" or draw(st.integers(0, 9)) == 9:
        headers.append((b"Content-Encoding", ("gzip" if encoding == "gzip but plain" else encoding).encode("latin-1")))
    framing = draw(st.sampled_from(FRAMINGS)) if odd else "length"
    chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    if framing == "length":
        headers.append((b"Content-Length", str(len(body)).encode()))
    elif framing == "short":  # the rest arrives as the start of a next request
        headers.append((b"Content-Length", str(max(0, len(body) - 3)).encode()))
    elif framing == "long":  # the body never ends: 408 after body_timeout_seconds
        headers.append((b"Content-Length", str(len(body) + 5).encode()))
    elif framing in ("chunked", "bad chunks", "length and chunked"):
        headers.append((b"Transfer-Encoding", b"chunked"))
        if framing == "length and chunked":
            headers.append((b"Content-Length", str(len(body)).encode()))
        body = chunks if framing != "bad chunks" else b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    elif framing == "two lengths":
        headers += [(b"Content-Length", str(len(body)).encode()), (b"Content-Length", str(len(body) + 1).encode())]
    elif framing == "bad length":
        headers.append((b"Content-Length", draw(st.sampled_from([b"-1", b"abc", b"1e3", b"9" * 30, b" 12", b"0x10", b"\xff"]))))
    return headers, body


@st.composite
def raw_requests(draw) -> bytes:
    """One connection's bytes: a request to one of chatd's routes (or none of them), odd somewhere or not.

    One in four is odd at the transport too (framing, request line, header bytes); the rest are
    well-formed HTTP with the oddities inside (body, query, ids, header values), so that most
    reach chatd's handlers.
    """
    odd = draw(st.integers(0, 3)) == 3
    route = draw(st.sampled_from(WEIGHTED_ROUTES))
    method = route.method
    if draw(st.integers(0, 5)) == 5:
        method = draw(st.sampled_from(METHODS + ODD_METHODS if odd else METHODS))
    target = draw(targets(route, odd))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 3 + ODD_VERSIONS)) if odd else b"HTTP/1.1"
    headers = [(b"Host", b"chatd"), (b"Connection", b"close")]
    auth = draw(st.sampled_from(AUTHS))
    if auth is not None:
        headers.append((b"Authorization", auth))
    body = b""
    if route.body is not None and method == route.method:
        body = draw(json_bodies(route.body))
    elif draw(st.integers(0, 9)) == 9:
        body = draw(st.binary(max_size=20))
    if body or method in (b"POST", b"PUT", b"PATCH"):
        content_type = draw(st.sampled_from(CONTENT_TYPES))
        if content_type is not None:
            headers.append((b"Content-Type", content_type))
        framing, body = draw(framed(body, odd))
        headers += framing
    header = st.tuples(st.sampled_from(HEADER_NAMES), st.sampled_from(HEADER_VALUES)) | st.just((b"Expect", b"100-continue"))
    headers += draw(st.lists(header, max_size=2))
    if odd:
        for extra in draw(st.lists(ODD_HEADERS, max_size=2)):
            headers += extra if isinstance(extra, list) else [extra]
    head = method + b" " + target + b" " + version + b"\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    return head + b"\r\n" + body


# -- every field with every JSON type, in turn -------------------------------------------------

# One of each JSON type, the numbers at and past the edges of 64 bits, and literals orjson refuses.
WRONG_TYPES = [None, True, -1, 2**64 - 1, -2**63 - 1, 0.5, Raw(b"-0"), Raw(b"1e400"), Raw(b"NaN"), "", "x" * 1000, [], {"a": 1},
               Raw(b"[" * 1000 + b"]" * 1000), Raw(b'{"a":' * 1000 + b"{}" + b"}" * 1000)]
REFUSED_BY_THE_PARSER = (Raw(b"1e400"), Raw(b"NaN"))


def field_sweep() -> list[tuple[bytes, tuple, object]]:
    """(request, field path, value) for every body field of every route, set to each of WRONG_TYPES in turn.

    The sampling fields, which chat, completions and conversation turns read with the same code,
    are swept on completions; each route's own fields (nested ones too) on that route.
    """
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 1}
    turn = {"content": "hi", "max_tokens": 1}
    cases = [("/v1/completions", {"prompt": "hi", "max_tokens": 1}, (name,)) for name in ("prompt", "logprobs", *SAMPLING)]
    cases += [("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, ("prompt", 0))]
    chat_fields = [(chat, (name,)) for name in ("messages", "max_tokens", "max_completion_tokens", "logprobs", "response_format")]
    chat_fields += [({**chat, "logprobs": True}, ("top_logprobs",)), (chat, ("messages", 0)),
                    ({**chat, "response_format": {"type": "text"}}, ("response_format", "type")),
                    ({**chat, "stream": True, "stream_options": {}}, ("stream_options", "include_usage"))]
    chat_fields += [(chat, ("messages", 0, name)) for name in ("role", "content", "name")]
    chat_fields += [(parts, ("messages", 0, "content", 0)), *((parts, ("messages", 0, "content", 0, name)) for name in ("type", "text"))]
    cases += [("/v1/chat/completions", body, where) for body, where in chat_fields]
    cases += [("/v1/conversations", {"title": "t"}, (name,)) for name in ("title", "system_prompt", "metadata", "model")]
    cases += [("/v1/conversations", {"metadata": {"k": "v"}}, ("metadata", "k"))]
    cases += [("/v1/conversations/{{conversation}}/messages", turn, (name,))
              for name in ("content", "role", "n", "stream", "max_tokens", "max_completion_tokens", "logprobs")]
    cases += [("/v1/conversations/{{conversation}}/messages", {**turn, "logprobs": True}, ("top_logprobs",))]
    sweep = []
    for path, body, field_path in cases:
        for value in WRONG_TYPES:
            changed = copy.deepcopy(body)
            node = changed
            for step in field_path[:-1]:
                node = node[step]
            node[field_path[-1]] = value
            sweep.append((post(path, to_json(changed)), field_path, value))
    return sweep


def post(path: str, body: bytes) -> bytes:
    """A well-formed POST of a JSON body with the test tenant's key."""
    return (f"POST {path} HTTP/1.1\r\nHost: chatd\r\nConnection: close\r\nAuthorization: Bearer {{{{key}}}}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


# -- sending, and what comes back ---------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Targets:
    """The live server and what its placeholders stand for: a key, a conversation, a finished reply in it."""

    host: str
    port: int
    key: str
    conversation: str
    message: str
    user_message: str

    async def resolve(self, request: bytes) -> bytes:
        for name in ("key", "conversation", "message", "user_message"):
            request = request.replace(b"{{%s}}" % name.encode(), getattr(self, name).encode())
        while b"{{fresh}}" in request:  # a conversation of its own, e.g. to delete
            request = request.replace(b"{{fresh}}", (await self.new_conversation()).encode(), 1)
        return request

    async def new_conversation(self) -> str:
        responses, _ = await exchange(self.host, self.port, await self.resolve(post("/v1/conversations", b"{}")))
        return json.loads(responses[0].body)["id"]


async def exchange(host: str, port: int, request: bytes, timeout: float = 120.0, linger: float = 1.0) -> tuple[list[Response], str]:
    """Send one connection's bytes; every response that comes back, and how the connection ended.

    It reads until the server closes, or until `linger` seconds pass with only whole responses
    received: after answering early (a 404 before the body), aiohttp keeps a connection open for
    up to 10 s to drain a body that may never come.
    """
    head_only = request.startswith(b"HEAD ")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    reader, writer = await asyncio.open_connection(host, port)
    received, ended, answered = bytearray(), "closed", False
    try:
        try:
            async with asyncio.timeout_at(deadline):
                writer.write(request)
                await writer.drain()
        except ConnectionError:
            ended = "reset while sending"
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await reader.read(65536)
            except TimeoutError:
                ended = "left open after its answer" if answered else f"no end within {timeout:g} s"
                break
            except ConnectionError:
                ended = "reset"
                break
            if not chunk:
                break
            received += chunk
            responses, rest = parse_responses(bytes(received), head_only)
            if responses and not rest and not answered:
                deadline, answered = min(deadline, loop.time() + linger), True
    finally:
        writer.transport.abort()
    return parse_responses(bytes(received), head_only)[0], ended


def parse_responses(data: bytes, head_only: bool = False) -> tuple[list[Response], bytes]:
    """The whole HTTP/1.x responses in what a connection received (interim 1xx ones left out), and what follows them."""
    responses = []
    while data:
        head, separator, rest = data.partition(b"\r\n\r\n")
        if not separator:
            break
        status_line, *lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ")[1])
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        if 100 <= status < 200:
            data = rest
            continue
        if head_only:
            body, rest = b"", b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size_line, separator, rest = rest.partition(b"\r\n")
                if not separator:
                    return responses, data
                size = int(size_line.split(b";")[0] or b"0", 16)
                if len(rest) < size + 2:
                    return responses, data
                body += rest[:size]
                rest = rest[size + 2:]
                if size == 0:
                    break
            body = bytes(body)
        elif "content-length" in headers:
            size = int(headers["content-length"])
            if len(rest) < size:
                break
            body, rest = rest[:size], rest[size:]
        else:  # until the connection closes
            body, rest = rest, b""
        responses.append(Response(status, headers, body))
        data = rest
    return responses, data


ERROR_SHAPE = {"message": str, "type": str, "param": (str, type(None)), "code": (str, type(None))}


def problems(request: bytes, responses: list[Response]) -> list[str]:
    """What is wrong with how the server answered one connection (empty: nothing)."""
    found = []
    for response in responses:
        if response.status >= 500:
            found.append(f"{response.status}: {response.body[:300]!r}")
        reached_chatd = "x-request-id" in response.headers  # chatd's first middleware sets it on every response
        if response.status >= 400 and reached_chatd and not request.startswith(b"HEAD "):
            try:
                error = json.loads(response.body)["error"]
                shape_ok = set(error) == set(ERROR_SHAPE) and all(isinstance(error[k], t) for k, t in ERROR_SHAPE.items())
            except (ValueError, KeyError, TypeError):
                shape_ok = False
            if not shape_ok or not response.headers.get("content-type", "").startswith("application/json"):
                found.append(f"{response.status} not in OpenAI's error shape: {response.body[:300]!r}")
        # A request head that aiohttp itself refuses (a malformed request line, a header block over
        # 8 KiB, bytes not allowed in a header, a broken Content-Length) is answered by aiohttp's
        # parser in plain text before any middleware runs, so chatd cannot shape it: it must
        # still be a 4xx.
        if not reached_chatd and not 400 <= response.status < 500:
            found.append(f"{response.status} without reaching chatd: {response.body[:300]!r}")
        if 200 <= response.status < 300 and b'"server_error"' in response.body:
            found.append(f"a server error inside a {response.status}: {response.body[:300]!r}")
    return found


def shown(request: bytes, limit: int = 1200) -> str:
    """A request as a report shows it: its bytes, the middle left out when long."""
    if len(request) <= limit:
        return repr(request)
    return f"{request[:limit // 2]!r} ...{len(request) - limit} bytes... {request[-limit // 2:]!r}"


@dataclass
class Tally:
    """What a run saw: answers per status, the fields chatd's 400s named, and each problem with its request."""

    statuses: Counter = field(default_factory=Counter)
    params: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str]] = field(default_factory=list)  # the five slowest exchanges

    def record(self, request: bytes, responses: list[Response], ended: str, seconds: float) -> None:
        if not responses:
            self.statuses[f"no answer ({ended})"] += 1
        # Every request head gets an answer, unless the server stopped reading a body too large
        # while it was still being sent: then the kernel may drop the answer with the connection.
        if not responses and ended != "reset while sending":
            self.problems.append(f"no answer ({ended})\n  for {shown(request)}")
        for response in responses:
            self.statuses[response.status] += 1
            if response.status == 400 and "x-request-id" in response.headers and response.body:  # (a HEAD's has none)
                self.params[json.loads(response.body)["error"]["param"]] += 1
        self.problems.extend(f"{problem}\n  for {shown(request)}" for problem in problems(request, responses))
        self.slowest = sorted([*self.slowest, (seconds, shown(request, 300))], reverse=True)[:5]


async def send_all(targets: Targets, requests: list[bytes], concurrency: int, tally: Tally) -> list[list[Response]]:
    """Send each request on its own connection, `concurrency` at a time; their responses, in order."""
    slots = asyncio.Semaphore(concurrency)

    async def send(request: bytes) -> list[Response]:
        async with slots:
            request = await targets.resolve(request)
            started = time.perf_counter()
            responses, ended = await exchange(targets.host, targets.port, request)
            tally.record(request, responses, ended, time.perf_counter() - started)
            return responses

    return await asyncio.gather(*(send(request) for request in requests))


async def first_turn(url: str, key: str) -> Targets:
    """A conversation with one finished reply, for the ids the generators use."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    targets = Targets(host, int(port), key, "", "", "")
    targets.conversation = await targets.new_conversation()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        async with session.post(f"{url}/v1/conversations/{targets.conversation}/messages",
                                json={"content": "hello", "max_tokens": 3}) as r:
            targets.message = (await r.json())["id"]
        async with session.get(f"{url}/v1/conversations/{targets.conversation}") as r:
            targets.user_message = (await r.json())["messages"][0]["id"]
    return targets

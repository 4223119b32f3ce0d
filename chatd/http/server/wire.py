"""The bytes of a request and of a stream: reading a body within the server's limits (time,
size once decoded, Content-Encoding, JSON), JSON bodies, and writing Server-Sent Events within
the limits on output held for a client that does not read.

It knows nothing of OpenAI's shapes (openai/openai_format.py) or the engine; every route module uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import struct
import sys
import termios
import zlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import orjson
from aiohttp import web

from chatd.http.errors import MAX_BODY_BYTES, REQUEST_ID, APIError, BodyTimeout
from chatd.http.server.state import STATE

JSON_MAX_DEPTH = 1024  # how deep orjson reads
# A body up to this size (decoded) is checked on the event loop: walking it in Python takes well
# under a millisecond. A bigger one (a schema of thousands of nodes, thousands of token ids or
# messages: up to max_body_bytes) is checked on a tokenizing thread, whose Python gives the GIL
# back to the loop every switch interval (5 ms), so one request's walk never stalls the others.
INLINE_BODY_BYTES = 16 * 1024
BODY_BYTES = web.RequestKey("body_bytes", int)  # the size of the body read_json decoded

log = logging.getLogger("chatd.http")
T = TypeVar("T")


# Content-Encodings a body may arrive in, as zlib's wbits. The server runs with aiohttp's
# auto_decompress off so that a body that does not decode is a 400 here (aiohttp's own decoding
# raised it as a 500) and the decoded size is bounded by max_body_bytes (no zip bombs).
BODY_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


async def read_json(request: web.Request):
    """The body as JSON; a body that does not arrive within body_timeout_seconds is a 408 (connection closed)."""
    timeout = request.app[STATE].config.server.body_timeout_seconds
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise BodyTimeout(timeout) from None
    except web.RequestPayloadError as exc:
        raise APIError(400, f"the request body could not be read: {exc}") from None
    decoded = _decoded(request, raw)
    request[BODY_BYTES] = len(decoded)
    try:
        # orjson holds the GIL while it reads (a thread would not free the loop): it is C, and the
        # body's size (max_body_bytes) and depth (JSON_MAX_DEPTH) bound it before any Python walks it.
        return orjson.loads(decoded)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc):  # orjson reads at most 1,024 levels: no field of any route may nest that deep
            raise APIError(400, f"the request body nests more than {JSON_MAX_DEPTH} levels of objects and lists; "
                                f"the limit is {JSON_MAX_DEPTH}") from exc
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc


async def checked(request: web.Request, check: Callable[..., T], body, *args) -> T:
    """`check(body, *args)`: a route's parsing of the body read_json read, on the event loop for a
    small body and on a tokenizing thread for a large one (INLINE_BODY_BYTES)."""
    if request.get(BODY_BYTES, 0) <= INLINE_BODY_BYTES:
        return check(body, *args)
    return await request.app[STATE].off_loop(check, body, *args)


def _decoded(request: web.Request, raw: bytes) -> bytes:
    """The body without its Content-Encoding; 400/413/415 naming the header when it cannot be."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in BODY_ENCODINGS:
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported; send the body as is, or as gzip or deflate",
                       "Content-Encoding", "unsupported_content_encoding")
    limit = request.app[MAX_BODY_BYTES]
    decoder = zlib.decompressobj(BODY_ENCODINGS[encoding])
    try:
        body = decoder.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise APIError(400, f"the request body is not valid {encoding} data ({exc})", "Content-Encoding") from None
    if len(body) > limit:
        raise APIError(413, f"the request body is larger than the limit of {limit} bytes once decoded", None, "request_too_large")
    if not decoder.eof:
        raise APIError(400, f"the request body ends in the middle of its {encoding} data", "Content-Encoding")
    return body


def json_response(body, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with orjson (fast for long histories and logprobs)."""
    return web.json_response(body, headers=headers, dumps=_json_text)


def _json_text(value) -> str:
    return orjson.dumps(value).decode()


def sse_event(payload: dict | bytes, event_id: int | None = None, name: str | None = None) -> bytes:
    """One Server-Sent Event: optional `id:` and `event:` lines, one `data:` line (a dict is JSON-encoded)."""
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    head = b"" if event_id is None else b"id: %d\n" % event_id
    if name is not None:
        head += b"event: " + name.encode() + b"\n"
    return head + b"data: " + data + b"\n\n"


DONE = b"[DONE]"


class SlowClient(Exception):
    """A streaming client that stopped reading: it is dropped so it cannot hold memory or its request."""


async def send(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """Write to a stream within the server's limits on output held for its client; SlowClient if not.

    Deltas merge while a write waits, so a client that falls behind gets bigger events; what
    is held for it is what it has not taken yet (the kernel's send queue and aiohttp's buffer)
    plus the next event. Past stream_buffer_bytes, or with a write not taken in
    send_timeout_seconds, it is a SlowClient.
    """
    limits = request.app[STATE].config.server
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away")
    held = response.get(_HELD_AT_MOST)
    if held is None or held + len(data) > limits.stream_buffer_bytes:  # it might be over: count it
        held = _untaken_bytes(transport)
    held += len(data)
    if held > limits.stream_buffer_bytes:
        raise SlowClient(f"{held} bytes of output are waiting for a client that does not read "
                         f"(stream_buffer_bytes is {limits.stream_buffer_bytes})")
    response[_HELD_AT_MOST] = held
    if transport.get_write_buffer_size() + len(data) <= transport.get_write_buffer_limits()[1]:
        # Nothing waits: the write stays under the transport's high-water mark, so it cannot
        # pause (this is every event of a client that keeps up: no timer a token).
        await response.write(data)
        return
    try:
        async with asyncio.timeout(limits.send_timeout_seconds):
            await response.write(data)
    except TimeoutError:
        raise SlowClient(f"the client took no output for {limits.send_timeout_seconds:g} s (send_timeout_seconds)") from None


def writable_now(request: web.Request) -> bool:
    """Whether a stream's client has taken everything written to it so far (and is still there):
    then `write_now` may write; otherwise `send`, which waits for a client that fell behind and
    drops one that stopped reading."""
    transport = request.transport
    return transport is not None and not transport.is_closing() and not transport.get_write_buffer_size()


def write_now(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """Write an event at once to a chunked response whose headers are out and whose client is
    `writable_now`. This is a stream's hot path, a call per token (from the engine's per-step
    hand-out, with no task to wake): it frames the HTTP chunk itself, one system call."""
    request.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
    held = response.get(_HELD_AT_MOST)
    if held is not None:  # counted as `send` counts what a client holds
        response[_HELD_AT_MOST] = held + len(data)


async def stream_events(request: web.Request, events: AsyncIterator[bytes],
                        headers: dict[str, str] | None = None) -> tuple[web.StreamResponse, bool]:
    """Write ready SSE events to the client as they come; the response, and whether the client
    took them all (False: it went away, or stopped reading and was dropped)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **(headers or {})})
    await response.prepare(request)
    try:
        async for event in events:
            await send(request, response, event)
        await response.write_eof()  # a client gone by now is as one gone earlier, not a server error
    except SlowClient as exc:
        drop_slow_client(request, exc)
        return response, False
    except ConnectionError:
        return response, False
    return response, True


# A stream's output its client has not taken, at most: what was counted last (`_untaken_bytes`, on
# the response's first event) plus everything written since, as neither buffer grows but by our
# writes. Counted again only when that could pass the limit: counting is a system call, ~20 us an
# event on a cold cache.
_HELD_AT_MOST = web.ResponseKey("chatd_held_at_most", int)


def _untaken_bytes(transport) -> int:
    """Bytes written for a client that it has not received yet: aiohttp's buffer plus the kernel's send queue."""
    held = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and _SEND_QUEUE_IOCTL is not None:
        with contextlib.suppress(OSError):
            held += struct.unpack("i", fcntl.ioctl(sock.fileno(), _SEND_QUEUE_IOCTL, b"\0" * 4))[0]
    return held


# Linux's SIOCOUTQ: bytes in a socket's send queue not yet acknowledged by the peer (elsewhere: not counted).
_SEND_QUEUE_IOCTL = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None


def drop_slow_client(request: web.Request, exc: SlowClient) -> None:
    """Close a slow client's connection now, discarding what it did not read."""
    log.warning("dropping a client that does not read: %s", exc, extra={"request_id": request.get(REQUEST_ID)})
    if request.transport is not None:
        request.transport.abort()

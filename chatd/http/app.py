"""The aiohttp application factory: middleware (request id, errors, CORS, auth) and routes.

The app holds ServerState (STATE) and the conversation turns under way (TURNS); it knows the
engine only through ServerState. Starting and stopping the engine and the listening socket is
the job of `serve.py`.
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid

from aiohttp import web

from chatd.http.openapi import openapi
from chatd.http.routes import (admin, completions, conversations, embeddings, feedback, moderation, page, responses, status,
                               tokens)
from chatd.http.server.auth import TENANT, auth_middleware
from chatd.http.server.cors import Cors
from chatd.http.server.request_log import request_log_middleware
from chatd.http.telemetry.tracing import add_traceparent
from chatd.http.errors import MAX_BODY_BYTES, REQUEST_ID, APIError, error_middleware, error_response
from chatd.http.server.state import STATE, ServerState
from chatd.http.generation.turns import TURNS, Turns


# What a client's X-Request-Id may look like to be logged and echoed: visible ASCII, short.
CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Take the client's X-Request-Id for logs and the echo, or make one.

    It is only a label: the engine names requests itself, so an id a client reuses (its own or
    another tenant's) can neither read nor abort anyone's request. An id that is not short
    visible ASCII (control characters, bytes that are not UTF-8) is replaced, never echoed.
    """
    given = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = given if CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    return await handler(request)


@web.middleware
async def store_middleware(request: web.Request, handler) -> web.StreamResponse:
    """A store that cannot write now (its file or disk full) under any route is a 503 with
    Retry-After, not a bug: the ledger hears of it, and new work waits until writes succeed."""
    state = request.app[STATE]
    try:
        return await handler(request)
    except Exception as exc:
        if state.store_failed(exc):
            raise state.store_unavailable() from None
        raise


@web.middleware
async def draining_middleware(request: web.Request, handler) -> web.StreamResponse:
    """After SIGTERM the port stays open while replies in flight finish: a new request gets a 503
    with Retry-After (a load balancer or client retries elsewhere or later), not "connection
    refused". Probes, metrics and resuming a reply already under way go on."""
    state = request.app[STATE]
    if state.draining_until is None or _goes_on_while_draining(request):
        state.num_in_flight += 1  # serve.py's drain waits for these, streams' last writes included
        try:
            return await handler(request)
        finally:
            state.num_in_flight -= 1
    left = max(1, math.ceil(state.draining_until - asyncio.get_running_loop().time()))
    return error_response(503, f"the server is shutting down; retry in {left} s", None, "server_shutting_down",
                          {"Retry-After": str(left)})


def _goes_on_while_draining(request: web.Request) -> bool:
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else ""
    return path in ("/live", "/health", "/ready", "/metrics") or path == REPLY + "/stream"


CONVERSATION = "/v1/conversations/{conversation_id}"
REPLY = CONVERSATION + "/messages/{message_id}"
ITEM = CONVERSATION + "/items/{item_id}"
RESPONSE = "/v1/responses/{response_id}"

# The route table: (method, path, handler).
ROUTES = [
    ("POST", "/v1/chat/completions", completions.chat_completions),
    ("POST", "/v1/completions", completions.completions),
    ("POST", "/v1/embeddings", embeddings.embeddings),
    ("GET", "/v1/models", status.models),
    ("GET", "/v1/models/{model:.+}", status.model),  # .+: ids like Qwen/Qwen3-8B hold a slash
    ("GET", "/v1/usage", status.usage),
    ("POST", "/v1/conversations", conversations.create_conversation),
    ("GET", "/v1/conversations", conversations.list_conversations),
    ("GET", CONVERSATION, conversations.get_conversation),
    ("POST", CONVERSATION, conversations.update_conversation),
    ("DELETE", CONVERSATION, conversations.delete_conversation),
    ("POST", CONVERSATION + "/items", conversations.create_items),
    ("GET", CONVERSATION + "/items", conversations.list_items),
    ("GET", ITEM, conversations.get_item),
    ("DELETE", ITEM, conversations.delete_item),
    ("POST", "/v1/responses", responses.create_response),
    ("GET", RESPONSE, responses.get_response),
    ("DELETE", RESPONSE, responses.delete_response),
    ("POST", RESPONSE + "/cancel", responses.cancel_response),
    ("GET", RESPONSE + "/input_items", responses.list_input_items),
    ("POST", CONVERSATION + "/messages", conversations.post_message),
    ("GET", REPLY + "/stream", conversations.stream_message),
    ("POST", REPLY + "/cancel", conversations.cancel_message),
    ("GET", "/", page.chat_page),
    ("GET", "/static/{name:.+}", page.static_file),
    ("GET", "/live", status.live),
    ("GET", "/health", status.health),
    ("GET", "/ready", status.ready),
    ("GET", "/metrics", status.metrics),
    ("GET", "/version", status.version),
    ("GET", "/openapi.json", openapi.openapi_document),
    ("POST", "/v1/moderations", moderation.moderations),
    ("POST", "/v1/appeals", moderation.create_appeal),
    ("GET", "/v1/appeals/{appeal_id}", moderation.get_appeal),
    ("POST", "/v1/feedback", feedback.post_feedback),
    ("POST", "/tokenize", tokens.tokenize),
    ("POST", "/detokenize", tokens.detokenize),
    ("POST", "/admin/models/{model:.+}/load", admin.load_model),
    ("POST", "/admin/models/{model:.+}/unload", admin.unload_model),
    ("GET", "/admin/canaries", admin.canaries),
    ("POST", "/admin/canaries/{alias}/rollback", admin.roll_back_canary),
    ("POST", "/admin/canaries/{alias}/restart", admin.restart_canary),
]


def create_app(state: ServerState, max_body_bytes: int = 4 * 2**20) -> web.Application:
    """Build the app around a started engine."""
    cors = Cors(state.config.server.allowed_origins)
    middlewares = [request_id_middleware, request_log_middleware, draining_middleware, error_middleware,
                   *cors.middlewares, store_middleware, auth_middleware]
    if state.tracing.enabled:  # off by default; then nothing of it runs
        middlewares.insert(1, state.tracing.middleware(lambda request: request.get(TENANT)))
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[STATE] = state
    app[TURNS] = Turns(state)
    app[MAX_BODY_BYTES] = max_body_bytes
    app[page.STATIC] = page.load_static()
    app.on_response_prepare.append(_echo_request_id)
    if state.tracing.enabled:
        app.on_response_prepare.append(add_traceparent)
    if state.limits.enabled:
        app.on_response_prepare.append(_rate_limit_headers)
    if cors.enabled:  # off by default, and then nothing of it runs
        app.on_response_prepare.append(cors.add_headers)
    # Every route gets chatd's Expect handler: aiohttp runs it before any middleware, and its own
    # answered a value that is not UTF-8 with a 500.
    for method, path, handler in ROUTES:
        for each in ("HEAD", "GET") if method == "GET" else (method,):  # as aiohttp's add_get: HEAD too
            app.router.add_route(each, path, handler, expect_handler=expect)
    # Last, every other path and method: aiohttp's own 404 and 405 would use its Expect handler.
    app.router.add_route("*", "/{path:.*}", no_route, expect_handler=expect)
    return app


async def expect(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` gets its interim answer; any other expectation a 417 in OpenAI's shape."""
    value = request.headers.get("Expect", "")
    if value.lower() == "100-continue":
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the interim answer is not part of the response (as aiohttp's own does)
        return None
    shown = value.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")[:80]
    return error_response(417, f"Expect {shown!r} is not supported; only 100-continue", "Expect", "expectation_failed")


async def no_route(request: web.Request) -> web.Response:
    """404 for a path chatd does not serve, 405 naming the methods it allows on one it does."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            _, methods = await resource.resolve(request)
            allowed |= methods
    if allowed:
        raise APIError(405, f"method {request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(allowed))}")
    raise APIError(404, f"no route for {request.method} {request.path}", None, "not_found")


async def _rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's x-ratelimit-* headers on every response to a limited tenant, as of when it goes out."""
    tenant = request.get(TENANT)
    if tenant is not None:
        response.headers.update(request.app[STATE].limits.headers(tenant))


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Streams send their headers before the handler returns: add the id as they go out."""
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]

"""The aiohttp application factory: middleware (request id, errors, auth) and routes.

The app knows the engine only through ServerState; starting and stopping the engine and the
listening socket is the job of `serve.py`.
"""

from __future__ import annotations

import re
import uuid

from aiohttp import web

from chatd.http import conversations, views
from chatd.http.auth import auth_middleware
from chatd.http.errors import LEDGER, MAX_BODY_BYTES, REQUEST_ID, error_middleware
from chatd.http.state import STATE, ServerState


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


def create_app(state: ServerState, max_body_bytes: int = 4 * 2**20) -> web.Application:
    """Build the app around a started engine."""
    app = web.Application(middlewares=[request_id_middleware, error_middleware, auth_middleware], client_max_size=max_body_bytes)
    app[STATE] = state
    app[MAX_BODY_BYTES] = max_body_bytes
    app[LEDGER] = state.ledger
    app.on_response_prepare.append(_echo_request_id)
    app.router.add_post("/v1/chat/completions", views.chat_completions)
    app.router.add_post("/v1/completions", views.completions)
    app.router.add_get("/v1/models", views.models)
    app.router.add_get("/v1/usage", views.usage)
    app.router.add_post("/v1/conversations", conversations.create_conversation)
    app.router.add_get("/v1/conversations", conversations.list_conversations)
    app.router.add_get("/v1/conversations/{conversation_id}", conversations.get_conversation)
    app.router.add_delete("/v1/conversations/{conversation_id}", conversations.delete_conversation)
    app.router.add_post("/v1/conversations/{conversation_id}/messages", conversations.post_message)
    app.router.add_get("/v1/conversations/{conversation_id}/messages/{message_id}/stream", conversations.stream_message)
    app.router.add_get("/health", views.health)
    app.router.add_get("/ready", views.ready)
    app.router.add_get("/metrics", views.metrics)
    return app


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Streams send their headers before the handler returns: add the id as they go out."""
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]

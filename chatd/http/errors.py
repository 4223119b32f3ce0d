"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the right status.

Every error leaves the server as JSON, including aiohttp's own 404/405/413 and unexpected
exceptions (500, traceback only in the log, next to the request id).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from aiohttp import web

from chatd.engine import EngineUnavailable, ParamError

log = logging.getLogger("chatd.http")

MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
# Typed request keys arrived in aiohttp 3.13; a plain string works (with a warning) before that.
REQUEST_ID = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
         408: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
         417: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def shown(value: Any) -> str:
    """A client's value as an error message quotes it: never the whole of a huge string, never the
    repr of a nested list or object (a thousand levels deep, repr itself fails)."""
    if isinstance(value, str):
        return repr(value if len(value) <= 80 else value[:80] + "...")
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    return orjson.dumps(value).decode()  # null, true, 1.5: as the client wrote it


def loggable(text: str) -> str:
    """A client's string (a path, a cache key) as a log line may carry it: printable and short as it
    is, else quoted and cut, so a client can neither flood the log nor forge a line in it."""
    return text if text.isprintable() and len(text) <= 128 else shown(text)


class APIError(Exception):
    """An error a client caused (or must hear about), answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict | None = None) -> None:
        """`extra`: chatd's own fields beside OpenAI's in the error object (a refusal's categories)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        body = error_body(self.status, self.message, self.param, self.code)
        body["error"].update(self.extra)
        return body


class BodyTimeout(Exception):
    """The client sent a request head but not its body in time: 408, and the connection is closed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g} seconds")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(status, message, param, code)),
                        content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI-shaped JSON error."""
    try:
        return await handler(request)
    except APIError as exc:
        return web.Response(status=exc.status, body=orjson.dumps(exc.body()), content_type="application/json",
                            headers=exc.headers)
    except ParamError as exc:
        return error_response(400, str(exc), exc.param)
    except EngineUnavailable as exc:  # the engine stopped or a tensor-parallel rank failed: /health says the same
        return error_response(503, str(exc), None, "engine_unavailable")
    except BodyTimeout as exc:
        response = error_response(408, str(exc), None, "request_timeout")
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        # Closed now: aiohttp would otherwise linger reading what is left of the body (10 s).
        if request.transport is not None:
            request.transport.close()
        return response
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_BYTES]
        return error_response(413, f"request body is larger than the limit of {limit} bytes", None, "request_too_large")
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"method {request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.allowed_methods))}")
    except web.HTTPNotFound:
        return error_response(404, f"no route for {request.method} {request.path}", None, "not_found")
    except web.HTTPException as exc:
        return error_response(exc.status, exc.reason or "error")
    except Exception:
        log.exception("internal error handling %s %s (request id %s)", request.method, loggable(request.path),
                      request.get(REQUEST_ID))
        return error_response(500, f"internal server error (request id {request.get(REQUEST_ID)})")

"""CORS: which web pages on other origins may call the API from a browser ([server] allowed_origins).

Off by default: chatd's own page (routes/page.py) is same-origin and needs none, and with no allowed
origin nothing here is installed, so responses and OPTIONS (a 405) are as they were. With
origins allowed, a response to a request from one of them names it in
Access-Control-Allow-Origin (streams too: the headers are added as a response is prepared), and
a preflight from one is answered 204; a preflight from any other origin is refused with 403,
and its responses carry no CORS headers, so the browser keeps them from the page.

CORS is not access control: it only decides which pages a browser lets read the answers. With
auth on every request still needs its API key, which is why no cookies (credentials) are allowed.
"""

from __future__ import annotations

import re

from aiohttp import web

from chatd.http.errors import APIError

ALLOWED_METHODS = "GET, POST, DELETE"
ALLOWED_HEADERS = "Authorization, Content-Type, Last-Event-ID, X-Request-Id"
# Response headers a page may read besides the always-safe ones (Content-Type, Cache-Control...).
EXPOSED_HEADERS = "X-Request-Id, X-Chatd-Messages-Omitted, Retry-After"
# A header name a preflight asks for (Access-Control-Request-Headers) that the answer allows too:
# SDKs add their own (the OpenAI SDK's x-stainless-*). CORS is not access control, so any
# well-formed name is fine; a bounded number of them, each short.
HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
MAX_REQUESTED_HEADERS = 32
MAX_AGE_SECONDS = 600  # browsers cache a preflight's answer this long (Chromium caps it at 7200)


class Cors:
    """The allowed origins, and the middleware (preflights) and response hook (headers) that apply them."""

    def __init__(self, allowed_origins: tuple[str, ...]) -> None:
        self.any_origin = "*" in allowed_origins
        # Browsers send scheme and host in lower case; a configured "https://Chat.Example.com" still matches.
        self.origins = frozenset(origin.lower() for origin in allowed_origins if origin != "*")

    @property
    def enabled(self) -> bool:
        return self.any_origin or bool(self.origins)

    def allows(self, origin: str) -> bool:
        return bool(origin) and (self.any_origin or origin.lower() in self.origins)

    @property
    def middlewares(self) -> list:
        """The preflight middleware, to run after the error middleware (its 403 is JSON) and before auth."""
        return [self.preflight_middleware] if self.enabled else []

    @web.middleware
    async def preflight_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """A browser's preflight (OPTIONS with Access-Control-Request-Method) is answered here, before
        auth: it carries no API key. Any other OPTIONS goes on to the routes (a 405)."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin", "")
        if not self.allows(origin):
            raise APIError(403, f"origin {origin[:200]!r} is not allowed to call this server from a browser; "
                                "add it to [server] allowed_origins", "Origin", "origin_not_allowed")
        return web.Response(status=204)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """An allowed origin is named in the response; a preflight's answer also says what may be sent."""
        origin = request.headers.get("Origin", "")
        if not self.allows(origin):
            return
        headers = response.headers
        headers["Access-Control-Allow-Origin"] = "*" if self.any_origin else origin
        headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        vary = headers.get("Vary", "")
        if "origin" not in vary.lower():  # caches must not hand this answer to a page on another origin
            headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
        if request.method == "OPTIONS" and response.status == 204:
            headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
            headers["Access-Control-Allow-Headers"] = allowed_headers(request.headers.get("Access-Control-Request-Headers", ""))
            headers["Access-Control-Max-Age"] = str(MAX_AGE_SECONDS)


def allowed_headers(requested: str) -> str:
    """chatd's own request headers, and the well-formed ones a preflight asks for besides."""
    names = [name.strip() for name in requested.split(",")[:MAX_REQUESTED_HEADERS]]
    known = {name.strip().lower() for name in ALLOWED_HEADERS.split(",")}
    extra = [name for name in names if HEADER_NAME.fullmatch(name) and name.lower() not in known]
    return ", ".join([ALLOWED_HEADERS, *dict.fromkeys(extra)])

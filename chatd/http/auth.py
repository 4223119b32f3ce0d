"""Who is calling: the tenant behind a request's API key, or the one local user while auth is off.

With `[auth] enabled = false` (the laptop default) every request is the local tenant and any
Authorization header is ignored, so an OpenAI SDK configured with a dummy key just works. With
auth on, every /v1/ route needs `Authorization: Bearer KEY` naming a live key from
`chatd keys create`; the key decides the tenant and its tier. /health, /ready and /metrics stay
open (they are for the operator's probes, and carry no tenant data).
"""

from __future__ import annotations

from aiohttp import web

from chatd.http.errors import APIError
from chatd.http.state import STATE
from chatd.store.db import Tenant

TENANT = web.RequestKey("tenant", Tenant) if hasattr(web, "RequestKey") else "tenant"


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    if not request.path.startswith("/v1/"):
        return await handler(request)
    if not state.config.auth.enabled:
        request[TENANT] = state.local_tenant
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "missing API key: send it as 'Authorization: Bearer KEY' (create one with `chatd keys create`)",
                       None, "invalid_api_key")
    tenant = await state.store.authenticate(key.strip())
    if tenant is None:
        raise APIError(401, "invalid API key", None, "invalid_api_key")
    request[TENANT] = tenant
    return await handler(request)

"""Who is calling: the tenant behind a request's API key, or the one local user.

Three modes, from `[auth]`:

- Off (the laptop default): every request is the local tenant and any Authorization header is
  ignored, so an OpenAI SDK configured with a dummy key just works.
- One shared key (`api_key`, `chatd serve --api-key KEY` or CHATD_API_KEY, as `vllm serve
  --api-key`): each guarded route needs `Authorization: Bearer KEY` with that key, compared in
  constant time. There is no key database: every caller is the local tenant (one usage total,
  one prefix cache, one set of conversations), so it suits one user or one trusted team.
- The key database (`enabled = true`): a live key from `chatd keys create`; the key decides the
  tenant and its tier.

The shared key and the key database exclude each other: config.py refuses both at startup,
naming both settings. Accepting either would let the one shared key reach the local tenant's
conversations beside per-tenant keys, a door easy to forget is open.

Guarded routes are every /v1/ route and /tokenize, /detokenize (they run the model's tokenizer).
/live, /health, /ready and /metrics stay open (they are for the operator's probes, and carry no tenant
data), as do the chat page, its static files and /openapi.json (no tenant data either). With
`public_models`, so does `GET /v1/models` for a caller that sends no key: a gateway (the SGLang
Model Gateway) learns the served model's name there.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from chatd.http.errors import APIError
from chatd.http.server.state import STATE
from chatd.store.db import Tenant

TENANT = web.RequestKey("tenant", Tenant) if hasattr(web, "RequestKey") else "tenant"

# Where the one shared key comes from, said in its 401s (the chat page shows it to whoever must type it).
SHARED_KEY_HINT = "the key given to `chatd serve --api-key` or CHATD_API_KEY"

# Routes outside /v1/ that still need the caller's key (vLLM serves these at the root too).
GUARDED_OUTSIDE_V1 = frozenset({"/tokenize", "/detokenize"})


def is_guarded(path: str) -> bool:
    """Whether a path needs the caller's API key when auth is on."""
    return path.startswith("/v1/") or path in GUARDED_OUTSIDE_V1


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    if not is_guarded(request.path):
        return await handler(request)
    state = request.app[STATE]
    auth = state.config.auth
    if auth.public_models and _model_list_without_key(request):
        request[TENANT] = state.local_tenant  # it sees the models the local tier ([auth] local_tier) may use
        return await handler(request)
    if auth.api_key:
        key = _bearer_key(request, SHARED_KEY_HINT)
        # Constant time: how long a wrong key takes says nothing of how much of it was right.
        if not hmac.compare_digest(key.encode("utf-8", "surrogatepass"), auth.api_key.encode()):
            raise APIError(401, f"invalid API key ({SHARED_KEY_HINT})", None, "invalid_api_key")
        request[TENANT] = state.local_tenant
    elif auth.enabled:
        tenant = await state.store.authenticate(_bearer_key(request, "create one with `chatd keys create`"))
        if tenant is None:
            raise APIError(401, "invalid API key", None, "invalid_api_key")
        request[TENANT] = tenant
    else:
        request[TENANT] = state.local_tenant
    return await handler(request)


def _model_list_without_key(request: web.Request) -> bool:
    return request.method == "GET" and request.path == "/v1/models" and "Authorization" not in request.headers


def _bearer_key(request: web.Request, where_from: str) -> str:
    """The key in `Authorization: Bearer KEY`; 401 when there is none."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, f"missing API key: send it as 'Authorization: Bearer KEY' ({where_from})", None,
                       "invalid_api_key")
    return key.strip()

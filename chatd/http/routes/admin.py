"""The operator's routes: load or unload one model of the fleet now, by name; see where each canary
ramp stands, roll one back or start it again (models/canary.py).

They are off (404) unless `[auth] admin_key` (or CHATD_ADMIN_KEY) is set, and need that key as
`Authorization: Bearer KEY`, compared in constant time; no tenant's key opens them, and they sit
outside /v1/, which tenants' keys guard. A model is loaded as a request would load it (making room
under the memory budget first); one that requests hold is not unloaded (409).
"""

from __future__ import annotations

import hmac

from aiohttp import web

from chatd.http.errors import APIError
from chatd.http.models.served_model import LOADED
from chatd.http.server.state import STATE, ServerState
from chatd.http.server.wire import json_response


async def load_model(request: web.Request) -> web.Response:
    """Load a model now (the admin key's route); its card once it is loaded."""
    state = _admin(request)
    served = _served(state, request.match_info["model"])
    async with served.in_use():  # loads it, or waits for the load under way
        pass
    return json_response(served.card())


async def unload_model(request: web.Request) -> web.Response:
    """Unload a model now (the admin key's route), unless requests hold it; its card."""
    state = _admin(request)
    served = _served(state, request.match_info["model"])
    if served.status == LOADED:
        if served.busy():
            raise APIError(409, f"the model {served.name!r} is in use (requests are being admitted or generated, or its "
                                "steps compile); unload it when they are done", "model", "model_in_use")
        await served.unload("admin", "an admin asked")
    return json_response(served.card())


async def canaries(request: web.Request) -> web.Response:
    """Every canary ramp: its step, weight and state, what it measured in this step, its history."""
    state = _admin(request)
    ramps = state.canaries.ramps
    return json_response({"object": "list", "data": [await state.canaries.describe(name) for name in sorted(ramps)]})


async def roll_back_canary(request: web.Request) -> web.Response:
    """Send a canary back to 0% now (an operator's call, logged as theirs)."""
    state = _admin(request)
    name = _ramped(state, request.match_info["alias"])
    await state.canaries.roll_back(name, "rolled back by an operator")
    return json_response(await state.canaries.describe(name))


async def restart_canary(request: web.Request) -> web.Response:
    """Start a canary's ramp again from its first step."""
    state = _admin(request)
    name = _ramped(state, request.match_info["alias"])
    await state.canaries.restart(name)
    return json_response(await state.canaries.describe(name))


def _ramped(state: ServerState, alias: str) -> str:
    if alias not in state.canaries.ramps:
        ramped = ", ".join(repr(name) for name in sorted(state.canaries.ramps)) or "none"
        raise APIError(404, f"no canary ramp on an alias {alias!r}; ramped aliases: {ramped}", "alias", "not_found")
    return alias


def _admin(request: web.Request) -> ServerState:
    """The state, for a request with the admin key; 404 while admin routes are off, 401 without the key."""
    state = request.app[STATE]
    admin_key = state.config.auth.admin_key
    if not admin_key:
        raise APIError(404, f"no route for {request.method} {request.path} (admin routes are off: set [auth] admin_key "
                            "or CHATD_ADMIN_KEY)", None, "not_found")
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode("utf-8", "surrogatepass"),
                                                            admin_key.encode()):
        raise APIError(401, "this route needs the admin key ([auth] admin_key) as 'Authorization: Bearer KEY'", None,
                       "invalid_admin_key")
    return state


def _served(state: ServerState, name: str):
    served = state.fleet.by_name(name)
    if served is None:
        raise APIError(404, f"no model is served as {name!r}; models: {', '.join(repr(m.name) for m in state.fleet.models)}",
                       "model", "model_not_found")
    return served

"""The small routes that report and change nothing: the models served (`/v1/models`,
`/v1/models/{model}`), a caller's usage (`/v1/usage`), liveness, health, readiness and metrics.

They read the engine's health and stats and the store's totals; they never generate. The
generating routes are completions.py and conversations.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime, timedelta, timezone

from aiohttp import web

import chatd
from chatd.http.server.auth import TENANT
from chatd.http.routes.embeddings import model_card as embedding_card
from chatd.http.errors import APIError
from chatd.http.server.starting import RETRY_AFTER_SECONDS
from chatd.http.server.state import STATE, ServerState
from chatd.http.server.wire import json_response


async def models(request: web.Request) -> web.Response:
    """The models this server serves, as OpenAI lists models: a card per name it answers to.

    One card per name (as vLLM lists --served-model-name), not one card with an alias field:
    OpenAI's model object has none, and SDK users and UIs pick a model from the listed ids, so
    every name a request may use must be an id. `root` on each card names the model it is; an
    alias split across models ([aliases]) has its targets' weights instead. `status` says whether
    a model is loaded, loading or unloaded (it loads on its first request).
    """
    state, tenant = request.app[STATE], request[TENANT]
    names = [name for name in state.model_names if state.limits.may_use(tenant, name)]  # what the tier may use
    cards = [_card(state, name) for name in names]
    if state.embedder is not None and state.limits.may_use(tenant, state.embedder.name):
        cards.append(embedding_card(state.embedder))  # OpenAI lists every model, embedding models too
    return json_response({"object": "list", "data": cards})


async def model(request: web.Request) -> web.Response:
    """One model's card by any of its names (`client.models.retrieve`); 404 model_not_found otherwise."""
    state = request.app[STATE]
    name = request.match_info["model"]
    if state.embedder is not None and name == state.embedder.name:
        state.limits.check_model(request[TENANT], name)
        return json_response(embedding_card(state.embedder))
    if name in state.fleet.aliases:
        state.limits.check_model(request[TENANT], name)
        return json_response(_card(state, name))
    state.pick_model(name, request[TENANT])  # 404 for a name not served, 403 for one the tier may not use
    return json_response(_card(state, name))


def _card(state: ServerState, name: str) -> dict:
    alias = state.fleet.aliases.get(name)
    if alias is None:
        return state.fleet.by_name(name).card(name)
    return {"id": name, "object": "model", "created": 0, "owned_by": "chatd", "root": None,
            "targets": dict(alias.targets)}


async def usage(request: web.Request) -> web.Response:
    """The caller's token and cost totals over `?start=&end=` (unix seconds or ISO 8601, UTC) or `?period=day|month`."""
    state, tenant = request.app[STATE], request[TENANT]
    start, end = _usage_window(request.query)
    totals = await state.store.usage(tenant.id, start, end)
    return json_response({
        "object": "usage",
        "tenant": tenant.name,
        "tier": tenant.tier,
        "start": start,
        "end": end,
        "requests": totals.requests,
        "input_tokens": totals.input_tokens,
        "cached_tokens": totals.cached_tokens,
        "output_tokens": totals.output_tokens,
        "cost": round(totals.cost, 10),
        "currency": "USD",
        "limits": state.limits.remaining(tenant),  # the tier's limits and what is left of them now
    })


def _usage_window(query) -> tuple[float, float]:
    period = query.get("period")
    if period is not None and ("start" in query or "end" in query):
        raise APIError(400, "give either period or start/end, not both", "period")
    if "start" in query or "end" in query:
        start = _timestamp(query.get("start"), "start", 0.0)
        end = _timestamp(query.get("end"), "end", time.time() + 1)
        if end <= start:
            raise APIError(400, f"end ({end}) must be after start ({start})", "end")
        return start, end
    now = datetime.now(timezone.utc)
    if period in (None, "month"):
        first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        following = first.replace(year=first.year + 1, month=1) if first.month == 12 else first.replace(month=first.month + 1)
    elif period == "day":
        first = now.replace(hour=0, minute=0, second=0, microsecond=0)
        following = first + timedelta(days=1)
    else:
        raise APIError(400, f"period must be 'day' or 'month', got {period!r}", "period")
    return first.timestamp(), following.timestamp()


def _timestamp(value: str | None, name: str, default: float) -> float:
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise APIError(400, f"{name} must be a finite number of unix seconds or an ISO 8601 date, got {value!r}", name)
        return seconds
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise APIError(400, f"{name} must be unix seconds or an ISO 8601 date, got {value!r}", name) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


async def live(request: web.Request) -> web.Response:
    """Whether the process runs: 200 always, for a supervisor that restarts what stopped answering
    (a liveness probe). Whether to send it traffic is /health's answer, not this one's."""
    return web.json_response({"status": "alive", "phase": "draining" if request.app[STATE].draining_until else "serving"})


async def health(request: web.Request) -> web.Response:
    """Whether this replica can take traffic now: 200 only then; 503 with the phase and (where
    waiting helps) Retry-After while it warms up, drains, cannot record usage, or once its engine
    died. Gateways (SGLang's smg, HAProxy) probe this path and send traffic only on a 2xx."""
    state = request.app[STATE]
    refused = _unavailable(state)
    if refused is not None:
        return refused
    return web.json_response({"status": "ok", "phase": "serving", "compiled_steps": _compiled_steps(state),
                              "store": _store_status(state), "models": _model_states(state), **_loading(state)})


async def version(request: web.Request) -> web.Response:
    """The chatd release serving (vLLM's route of the same name: deployment tools read it)."""
    return web.json_response({"version": chatd.__version__})


async def ready(request: web.Request) -> web.Response:
    """Whether to send it traffic: /health's answer, with a shorter 200 (kept for the probes written
    before /health said the same)."""
    state = request.app[STATE]
    refused = _unavailable(state)
    if refused is not None:
        return refused
    # Steps still compiling (CPU, worker/fast_steps/compile_job.py) serve, eagerly: ready, and it says so.
    return web.json_response({"status": "ready", "compiled_steps": _compiled_steps(state),
                              "models": _model_states(state), **_loading(state)})


def _compiled_steps(state: ServerState) -> str:
    """The first model's compiled steps (on a CPU they compile while it serves)."""
    first = state.fleet.primary.engine
    return first.compile_state() if first is not None else "off"


def _model_states(state: ServerState) -> dict[str, str]:
    """Each chat model's state: loaded, loading or unloaded (one that is unloaded loads on its next request)."""
    return {model.name: model.status for model in state.fleet.models}


def _loading(state: ServerState) -> dict:
    """{"loading": {model: its load's progress}} while some model loads; {} otherwise."""
    now = time.monotonic()
    loading = {model.name: progress for model in state.fleet.models if (progress := model.load_progress(now))}
    return {"loading": loading} if loading else {}


def _unavailable(state: ServerState) -> web.Response | None:
    """The 503 /health and /ready answer while this replica must get no traffic; None while it can serve.

    `phase` is the server's (server/starting.py: loading and warming up are answered there); `status` says
    why. A dead engine gets no Retry-After: it will not come back by itself.
    """
    if state.draining_until is not None:
        left = max(1, math.ceil(state.draining_until - asyncio.get_running_loop().time()))
        return _refusal("draining", "draining", left)
    if not state.ready:
        return _refusal("warming up", "warming up", RETRY_AFTER_SECONDS)
    first = state.fleet.primary.engine  # (loaded again, after a crash, it is another engine than state.engine)
    problem = first.health() if first is not None else None
    if problem is not None:
        return _refusal("engine stopped", "stopped", None, error=problem)
    if not state.ledger.healthy:
        return _refusal("store cannot write", "serving", state.ledger.retry_after, store=_store_status(state))
    return None


def _refusal(status: str, phase: str, retry_after: int | None, **details) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"status": status, "phase": phase, **details}, status=503, headers=headers)


def _store_status(state: ServerState) -> dict:
    ledger = state.ledger
    # The error's kind only: its text names the store's address, which /health (open to anyone who
    # reaches the port) must not tell; the log has it whole.
    return {"writable": ledger.healthy, "pending_writes": ledger.num_pending,
            "error": None if ledger.healthy else ledger.last_error_kind}


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: the server's request metrics and the engine's latest stats."""
    state = request.app[STATE]
    for served in state.fleet.models:
        engine, info = served.engine, served.info
        if engine is not None:
            state.metrics.update_engine(engine.stats(), engine.stage_times(), served.name, info.kv_bytes_per_token,
                                        info.block_size)
        else:
            state.metrics.update_engine(None, {}, served.name)
    shared = state.limits.shared
    failed = {served.name: served.engine is not None and served.engine.health() is not None
              for served in state.fleet.models}
    state.metrics.update_health(state.ledger.healthy, state.ledger.num_pending,
                                shared is None or shared.down_since is None, failed)
    body, content_type = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})

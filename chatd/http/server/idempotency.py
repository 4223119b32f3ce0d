"""`Idempotency-Key` on the routes that store a turn (a conversation's messages, stored
Responses): a client that lost a reply retries with the same key, on this replica or another,
and the turn is stored once and billed once (store/idempotency.py decides what each try does).

    claimed = await claim(state, tenant, request, scope, body)   # None: no key was sent
    if claimed and claimed.outcome == "replay": answer with the stored reply
    async with released_if_refused(state, tenant, claimed): start the turn, bound to the key

A try whose turn is refused before its rows are written (the store cannot write, an unknown or
unfinished response or conversation to continue, limits, safety, a bad field) gives its key back,
so a retry runs anew: the same body is refused the same way, a corrected one is served. Routes
therefore claim the key first and run every later check inside `released_if_refused`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import web

from chatd.http.errors import APIError
from chatd.http.server.state import ServerState
from chatd.store.db import Claim, Tenant

log = logging.getLogger("chatd.http")

MAX_KEY = 255  # characters, as Stripe allows
# How the reply is delivered, not what it is: a retry may take whole the reply it lost mid-stream.
DELIVERY_FIELDS = ("stream", "stream_options")


@dataclass(frozen=True)
class Claimed:
    """A request's key and what its try does (`outcome`: new or replay)."""

    key: str
    outcome: str
    message_id: str | None  # replay: the reply
    response_id: str | None  # replay: the response (Responses)


def idempotency_key(request: web.Request) -> str | None:
    """The request's Idempotency-Key header, checked: 1 to 255 visible ASCII characters; None without one."""
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_KEY or not key.isascii() or not key.isprintable() or " " in key:
        raise APIError(400, f"Idempotency-Key must be 1 to {MAX_KEY} visible ASCII characters", "Idempotency-Key",
                       "invalid_idempotency_key")
    return key


async def claim(state: ServerState, tenant: Tenant, request: web.Request, scope: str, body: dict) -> Claimed | None:
    """Claim the request's key for this replica (None: it sent none). 409 while another live try
    runs it, 422 if the key was used for another request; `scope` (the conversation, or the route)
    is part of what the request was."""
    key = idempotency_key(request)
    if key is None:
        return None
    asked = {name: value for name, value in body.items() if name not in DELIVERY_FIELDS}
    digest = hashlib.sha256(orjson.dumps([scope, asked], option=orjson.OPT_SORT_KEYS)).hexdigest()
    got = await state.store.claim_key(tenant.id, key, digest, state.replica, state.config.store.replica_timeout_seconds)
    _refuse(got)
    return Claimed(key, got.outcome, got.message_id, got.response_id)


@contextlib.asynccontextmanager
async def released_if_refused(state: ServerState, tenant: Tenant, claimed: Claimed | None) -> AsyncIterator[None]:
    """Give the key back if starting the turn fails: no row of it was written, so a retry runs anew."""
    try:
        yield
    except BaseException:
        if claimed is not None:
            try:
                await asyncio.shield(state.store.release_key(tenant.id, claimed.key))
            except Exception:  # the client hears of the refusal, not of this; the key is held until purged
                log.exception("could not give back the Idempotency-Key of a refused request (tenant %s)", tenant.id)
        raise


def _refuse(got: Claim) -> None:
    if got.outcome == "busy":
        raise APIError(409, "a request with this Idempotency-Key is being answered; retry after it ends",
                       "Idempotency-Key", "idempotency_key_in_use", headers={"Retry-After": str(math.ceil(got.retry_after))})
    if got.outcome == "mismatch":
        raise APIError(422, "this Idempotency-Key was used for a different request", "Idempotency-Key",
                       "idempotency_key_reused")

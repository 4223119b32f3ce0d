"""OpenAI's `POST /v1/moderations`, and chatd's appeals of what the safety pipeline decided.

`/v1/moderations` runs the same rules and guard model as the input check, over every OpenAI
category whatever the policies say, and answers in OpenAI's shape (`client.moderations.create`).
It records nothing: it judges text a client asks about, it refuses no one.

`POST /v1/appeals` contests one decision by its appeal id (the one a refusal gave); `GET
/v1/appeals/{appeal_id}` tells where the appeal stands. A tenant reaches only its own decisions:
anyone else's id is a 404, exactly like an id that does not exist. The operator resolves
appeals with `chatd moderation list|show|resolve`.
"""

from __future__ import annotations

import uuid

from aiohttp import web

from chatd.http.server.auth import TENANT
from chatd.http.errors import APIError
from chatd.http.openai.protocol import json_body
from chatd.http.server.state import STATE
from chatd.http.server.wire import json_response, read_json
from chatd.safety.rules import CATEGORIES
from chatd.store.records import ModerationEvent

MAX_INPUTS = 32  # texts in one moderation request (and [conversations] max_message_chars in all)
MAX_REASON_CHARS = 2000


async def moderations(request: web.Request) -> web.Response:
    """OpenAI's moderation of one text or a list: per text, whether it is flagged and by which categories."""
    state = request.app[STATE]
    body = json_body(await read_json(request), {"input", "model"})
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise APIError(400, "model must be a string", "model")
    texts = _inputs(body.get("input"), state.config.conversations.max_message_chars)
    try:
        results = await state.safety.pipeline.moderate(texts)
    except Exception as exc:  # the guard failed: no answer is better than a wrong "not flagged"
        state.metrics.guard_failed()
        raise APIError(503, f"the moderation check could not run ({exc}); try again shortly", None,
                       "safety_check_unavailable", headers={"Retry-After": "5"}) from None
    for result in results:
        for category in result.categories:
            state.metrics.safety_action(category, "moderations", "flag")
    return json_response({
        "id": f"modr-{uuid.uuid4().hex}",
        "model": body.get("model") or _model_name(state),
        "results": [{
            "flagged": result.flagged,
            "categories": {c: c in result.categories for c in CATEGORIES},
            "category_scores": result.scores,
            "category_applied_input_types": {c: ["text"] for c in CATEGORIES},
        } for result in results],
    })


def _model_name(state) -> str:
    return "chatd-rules" + ("+guard" if state.safety.pipeline.guard is not None else "")


def _inputs(given, max_chars: int) -> list[str]:
    """The texts to moderate: a string, a list of strings, or a list of OpenAI's input parts (text only)."""
    if isinstance(given, str):
        texts = [given]
    elif isinstance(given, list) and given:
        texts = []
        for i, part in enumerate(given):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "image_url":
                raise APIError(400, f"input[{i}] is an image; chatd moderates text only", f"input[{i}]")
            else:
                raise APIError(400, f"input[{i}] must be a string or a {{\"type\": \"text\", \"text\": ...}} part",
                               f"input[{i}]")
    else:
        raise APIError(400, "input must be a string or a non-empty list of strings or text parts", "input")
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"input has {len(texts)} texts; the limit is {MAX_INPUTS}", "input")
    # One limit for all the texts together: a request's checks cost time in proportion to it.
    total = sum(map(len, texts))
    if total > max_chars:
        raise APIError(400, f"input has {total} characters in all; the limit is {max_chars}", "input")
    return texts


async def create_appeal(request: web.Request) -> web.Response:
    """Contest one of the safety pipeline's decisions about the caller: `{"appeal_id", "reason"}`."""
    state, tenant = request.app[STATE], request[TENANT]
    body = json_body(await read_json(request), {"appeal_id", "reason"})
    appeal_id, reason = body.get("appeal_id"), body.get("reason")
    if not isinstance(appeal_id, str) or not appeal_id:
        raise APIError(400, "appeal_id must be the id a refusal gave (\"modr_...\")", "appeal_id")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON_CHARS:
        raise APIError(400, f"reason must be a non-empty string of at most {MAX_REASON_CHARS} characters", "reason")
    state.check_store_writable()
    try:
        event = await state.store.appeal_moderation_event(appeal_id, tenant.id, reason)
    except LookupError:
        raise _not_found(appeal_id) from None
    except ValueError as exc:
        raise APIError(409, f"appeal {appeal_id!r} cannot be appealed again: {exc}", "appeal_id", "appeal_closed") from None
    state.metrics.appeal_filed(event.stage)
    return json_response(appeal_json(event))


async def get_appeal(request: web.Request) -> web.Response:
    """Where one of the caller's decisions stands: open, appealed, upheld or overturned."""
    state, tenant = request.app[STATE], request[TENANT]
    appeal_id = request.match_info["appeal_id"]
    event = await state.store.get_moderation_event(appeal_id, tenant.id)
    if event is None:
        raise _not_found(appeal_id)
    return json_response(appeal_json(event))


def appeal_json(event: ModerationEvent) -> dict:
    """What a tenant may see of a decision about it (never another tenant's, never the audit's text)."""
    return {
        "id": event.id, "object": "appeal", "status": event.status, "stage": event.stage, "action": event.action,
        "categories": list(event.categories), "created_at": int(event.created_at),
        "appealed_at": None if event.appealed_at is None else int(event.appealed_at),
        "resolved_at": None if event.resolved_at is None else int(event.resolved_at),
        "resolution_note": event.resolution_note,
    }


def _not_found(appeal_id: str) -> APIError:
    return APIError(404, f"no decision {appeal_id!r} to appeal", "appeal_id", "not_found")

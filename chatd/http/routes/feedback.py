"""`POST /v1/feedback`: a user's thumbs up or down (and a comment) on a reply they were given.

The reply is named by its id: an assistant message of a conversation or of a Responses chain
("msg_..."), a stored response ("resp_..."), or a chat or text completion ("chatcmpl-...",
"cmpl-...": chatd keeps no text of those, only their usage row, which names the model). Only the
caller's own replies can be rated: another tenant's id is a 404 like an unknown one. Rating a
reply again replaces the rating. Each rating is counted in /metrics under the model that served
the reply (`chatd:feedback_total{model_name, rating}`), once per reply and rating (sending the same
rating again adds nothing); the operator reads them with
`chatd feedback list` and `export`.
"""

from __future__ import annotations

from aiohttp import web

from chatd.http.server.auth import TENANT
from chatd.http.errors import APIError, shown
from chatd.http.openai.protocol import json_body
from chatd.http.server.state import STATE
from chatd.http.server.wire import json_response, read_json
from chatd.store.feedback import MAX_COMMENT_CHARS, RATINGS, Rating

MAX_ID_CHARS = 128  # longer than any id chatd gives


async def post_feedback(request: web.Request) -> web.Response:
    """Rate one of the caller's replies: `{"id": ..., "rating": "up" | "down", "comment": ...}`."""
    state, tenant = request.app[STATE], request[TENANT]
    body = json_body(await read_json(request), {"id", "rating", "comment"})
    reply_id, rating, comment = body.get("id"), body.get("rating"), body.get("comment")
    if not isinstance(reply_id, str) or not 0 < len(reply_id) <= MAX_ID_CHARS:
        raise APIError(400, "id must be the id of a reply you were given (a message's \"msg_...\", a response's "
                            "\"resp_...\", a completion's \"chatcmpl-...\" or \"cmpl-...\")", "id")
    if rating not in RATINGS:
        raise APIError(400, f"rating must be \"up\" or \"down\", got {shown(rating)}", "rating")
    if comment is not None and (not isinstance(comment, str) or len(comment) > MAX_COMMENT_CHARS):
        raise APIError(400, f"comment must be a string of at most {MAX_COMMENT_CHARS} characters", "comment")
    state.check_store_writable()
    found = await state.store.rated_reply(tenant.id, reply_id)
    if found is None:
        raise APIError(404, f"you have no reply {shown(reply_id)} to rate", "id", "not_found")
    target, model = found
    before = await state.store.rating_of(tenant.id, reply_id)
    rated = await state.store.rate(tenant.id, reply_id, target, model, rating, comment or None)
    if before != rating:  # the same rating again (a comment added) is not one more: it would inflate
        state.metrics.feedback_given(model, rating)  # the counts a canary ramp is judged by
    return json_response(feedback_json(rated))


def feedback_json(rated: Rating) -> dict:
    """A rating as the API shows it to the tenant who gave it."""
    return {"object": "feedback", "id": rated.id, "reply_id": rated.target_id, "reply_type": rated.target,
            "model": rated.model, "rating": rated.rating, "comment": rated.comment,
            "created_at": int(rated.created_at), "updated_at": int(rated.updated_at)}

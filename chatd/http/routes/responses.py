"""OpenAI's Responses API on chatd's store: `POST /v1/responses`, and a stored response's
retrieve, input items, cancel and delete.

A response's history comes from the server, as in a conversation: `previous_response_id`
continues a chain of responses (their input items and outputs, oldest first) and
`conversation` continues a conversation (its items; the response's input and output are added
to it). Either way the history renders to the same tokens as last time, so the prefix cache
serves it and a turn computes only its new tokens. `instructions` are the system message of
this response only (they are not carried to the next one, as OpenAI does); a conversation's
chatd system prompt comes before them.

A response is a turn (generation/turns.py): generated in the background and saved even if its client
leaves, streamed with OpenAI's event types (`response.created` ... `response.completed`),
reconnected to with `GET /v1/responses/{id}?stream=true&starting_after=N`. `store: false`
keeps no text: only a record that the response existed (so continuing it is a clear 400), and
its usage; its generation stops when its client leaves.

Function tools work as on chat completions (tools/tools.py: the same grammar, the same parser), in the
Responses API's shapes: each call the model makes is a `function_call` output item, and a
`function_call_output` input item answers it by `call_id`, in the next response of the chain or
conversation (or in a client's own history, with store=false). Calls and outputs are stored as
items like messages, so `input_items` and a conversation's items list them.

Too long a history is a 400 (`truncation: "disabled"`, OpenAI's default); with
`truncation: "auto"` the oldest turns are left out, as in a conversation, and the response says
how many (`chatd.items_omitted`). The body is validated by openai/response_request.py; the turn and its
events are generation/response_turn.py's.
"""

from __future__ import annotations

from aiohttp import web

from chatd.engine import ParamError
from chatd.http.server import idempotency
from chatd.http.generation import pipeline
from chatd.http.server.auth import TENANT
from chatd.http.errors import REQUEST_ID, APIError
from chatd.http.openai.items import item_json, item_page, page_params
from chatd.http.routes.conversations import move_if_needed
from chatd.http.models.escalation import request_traits
from chatd.http.openai.protocol import requested_model, shown
from chatd.http.server.request_log import REQUEST_LOG
# The body's parsing. openapi/openapi.py (and test_openapi.py) read its fields and limits as responses.X: kept here.
from chatd.http.openai.response_request import (MAX_INPUT_ITEMS, RESPONSE_FIELDS, SERVICE_TIERS, UNSUPPORTED,  # noqa: F401
                                         ResponseRequest, parse_response)
from chatd.http.generation.response_turn import ResponseTurn, replayed, response_object
from chatd.http.server.state import STATE, ServerState
from chatd.http.tools.tool_calls import ToolParser
from chatd.http.generation.turns import ROUTING_KEY_HEADER, TURNS, ReplyStream, Turns
from chatd.http.server.wire import checked, json_response, read_json, stream_events
from chatd.store.db import Conversation, Message, Tenant
from chatd.store.records import Response

# -- routes ---------------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    """Generate a response to `input`, after a chain of responses or a conversation's items; whole or streamed."""
    state, tenant = request.app[STATE], request[TENANT]
    body = await read_json(request)
    # The model of the chain or conversation it continues, unless it names another (an alias keeps it when it can).
    thread_model, num_stored = await _thread(state, tenant, body)
    served = await pipeline.pick(state, requested_model(body), tenant, thread_model,
                                 request_traits(body).with_history(num_stored))
    state.take_keep_alive(served, body)
    async with served.in_use():
        req = await checked(request, parse_response, body, state.config.server.max_messages,
                              served.info.sampling_defaults)
        # A store=false response keeps no rows to give back: its key, if any, is not claimed.
        claimed = await idempotency.claim(state, tenant, request, "responses", body) if req.store else None
        if claimed is not None and claimed.outcome == "replay":
            return await _replay(request, state, tenant, claimed.response_id, req.gen.stream)
        turns = request.app[TURNS]
        # Every refusal from here until the turn's rows are written gives the key back: a retry of
        # the same body is refused the same way, a corrected one is served.
        async with idempotency.released_if_refused(state, tenant, claimed):
            state.check_store_writable()
            conversation, previous = await _continued(state, turns, tenant, req)
            if conversation is not None:
                conversation = await move_if_needed(state, tenant, conversation, served)
            job = ResponseTurn(state, served, tenant, req, conversation, previous, claimed and claimed.key)
            try:
                reply, _ = await turns.start(tenant, job, request[REQUEST_ID], request.get(REQUEST_LOG))
            except ParamError as exc:  # named as the client named it
                if exc.param == "max_tokens":
                    raise APIError(400, str(exc).replace("max_tokens", "max_output_tokens"), "max_output_tokens") from None
                raise APIError(400, str(exc), "input" if exc.param == "prompt" else exc.param) from None
    routing = {ROUTING_KEY_HEADER: conversation.id if conversation is not None
               else await state.store.chain_root(previous.id) if previous is not None else job.record.id}
    if req.gen.stream:
        return await _stream(request, state, turns, reply, 0, cancel_on_leave=not req.store, headers=routing)
    try:
        async for _ in reply.follow(len(reply.events), 3600.0):  # returns when the reply has ended
            pass
    finally:
        if not req.store and not reply.done:  # nobody can come back for it
            turns.cancel_reply(reply.message_id)
    message = reply.message
    if message.status == "error":
        raise reply.failure()
    if message.status == "partial" and reply.stopped_by is None:
        raise reply.interruption()  # the server is stopping
    return json_response(response_object(job.record, [message, *reply.calls], stopped_by=reply.stopped_by),
                         headers=routing)


async def _replay(request: web.Request, state: ServerState, tenant, response_id: str | None,
                  stream: bool) -> web.StreamResponse:
    """A keyed response that was answered, again: as GET /v1/responses/{id} gives it (events
    rebuilt from its rows when streamed)."""
    record = await state.store.get_response(tenant.id, response_id) if response_id is not None else None
    if record is None:  # deleted since
        raise APIError(404, "the response to this Idempotency-Key no longer exists", "Idempotency-Key", "not_found")
    turns = request.app[TURNS]
    outputs = await _outputs(state, record)
    headers = {"Idempotent-Replayed": "true"}
    if stream:
        reply = turns.reply(record.output_message_id) or replayed(_replay_parser(state, record), record, outputs)[0]
        return await _stream(request, state, turns, reply, 0, cancel_on_leave=False, headers=headers)
    return json_response(response_object(record, outputs), headers=headers)


async def get_response(request: web.Request) -> web.StreamResponse:
    """A stored response; `?stream=true` replays its events (after `starting_after`), live while it runs."""
    state, tenant, turns = request.app[STATE], request[TENANT], request.app[TURNS]
    record = await _own_response(state, tenant, request.match_info["response_id"])
    outputs = await _outputs(state, record)
    reply = turns.reply(record.output_message_id)
    if request.query.get("stream", "false").lower() == "true":
        raw = request.query.get("starting_after", "-1")
        try:
            after = int(raw)
        except ValueError:
            raise APIError(400, f"starting_after must be an integer, got {shown(raw)}", "starting_after") from None
        if reply is None:
            reply, exact = replayed(_replay_parser(state, record), record, outputs)
            # Rebuilt, each item's text is one delta: past the events before the first delta its numbers
            # are not the ones the client saw, and the events after its `starting_after` would miss or
            # repeat text.
            if exact < len(reply.events) and after >= exact:
                raise APIError(400, f"the events of response {record.id} are no longer kept (stream_replay_seconds), only "
                                    f"its text: stream it from the start (starting_after below {exact}) or "
                                    "retrieve it whole", "starting_after")
        if after < -1 or after >= len(reply.events) and reply.done:
            raise APIError(400, f"starting_after {after} is beyond this response's events", "starting_after")
        return await _stream(request, state, turns, reply, after + 1, cancel_on_leave=False)
    if reply is not None and reply.done:
        outputs = [reply.message, *reply.calls]
    live = reply is not None and not reply.done
    return json_response(response_object(record, outputs, live=live,
                                         stopped_by=reply.stopped_by if reply else None,
                                         error=reply.error if reply else None,
                                         output_deleted=not outputs and reply is None))


async def list_input_items(request: web.Request) -> web.Response:
    """The items a stored response was given, newest first (`order=asc`: oldest first)."""
    state, tenant = request.app[STATE], request[TENANT]
    record = await _own_response(state, tenant, request.match_info["response_id"])
    limit, after, order = page_params(request.query)
    messages = await state.store.response_messages(record.id)
    outputs = {m.id for m in await _outputs(state, record)}
    inputs = [m for m in messages if m.id not in outputs and m.id != record.output_message_id]
    if order == "desc":
        inputs.reverse()
    start = 0
    if after is not None:
        ids = [m.id for m in inputs]
        if after not in ids:
            raise APIError(400, f"after names no input item of this response: {shown(after)}", "after")
        start = ids.index(after) + 1
    page = inputs[start:start + limit]
    return json_response(item_page([item_json(m) for m in page], start + limit < len(inputs)))


async def cancel_response(request: web.Request) -> web.Response:
    """Stop a response being generated; the response as saved (`cancelled`, with what was generated)."""
    state, tenant, turns = request.app[STATE], request[TENANT], request.app[TURNS]
    record = await _own_response(state, tenant, request.match_info["response_id"])
    reply = turns.cancel_reply(record.output_message_id)
    if reply is not None:
        async for _ in reply.follow(len(reply.events), state.heartbeat_seconds):  # returns once the reply is saved
            pass
        return json_response(response_object(record, [reply.message, *reply.calls], stopped_by=reply.stopped_by,
                                             error=reply.error))
    outputs = await _outputs(state, record)
    return json_response(response_object(record, outputs, output_deleted=not outputs))


async def delete_response(request: web.Request) -> web.Response:
    """Delete a stored response (purged after the retention period); one being generated is stopped."""
    state, tenant = request.app[STATE], request[TENANT]
    response_id = request.match_info["response_id"]
    record = await _own_response(state, tenant, response_id)
    if not await state.store.delete_response(tenant.id, record.id):
        raise _not_found(response_id)
    request.app[TURNS].cancel_reply(record.output_message_id, "delete")
    return json_response({"id": record.id, "object": "response", "deleted": True})


# -- lookups and streams --------------------------------------------------------------------------


async def _own_response(state: ServerState, tenant: Tenant, response_id: str) -> Response:
    """The tenant's stored response; anything else (another tenant's, deleted, store=false) is a 404."""
    record = await state.store.get_response(tenant.id, response_id)
    if record is None:
        raise _not_found(response_id)
    if not record.stored:
        raise APIError(404, f"response {response_id!r} was created with store=false: it was not kept", "response_id",
                       "not_found")
    return record


async def _continued(state: ServerState, turns: Turns, tenant: Tenant,
                     req: ResponseRequest) -> tuple[Conversation | None, Response | None]:
    """The conversation and the previous response a new response continues (either may be None)."""
    conversation = previous = None
    if req.conversation_id is not None:
        conversation = await state.store.get_conversation(tenant.id, req.conversation_id)
        if conversation is None:
            raise APIError(404, f"no conversation {req.conversation_id!r}", "conversation", "not_found")
    if req.previous_response_id is not None:
        previous = await _previous(state, turns, tenant, req.previous_response_id)
    return conversation, previous


async def _thread(state: ServerState, tenant: Tenant, body) -> tuple[str | None, int]:
    """The model of the conversation or previous response a body names, and how many messages it
    holds, read before the body is parsed (parsing needs the model's defaults); (None, 0) when it
    names neither, or one that is not the caller's (parsing and `_continued` refuse those by name)."""
    if not isinstance(body, dict):
        return None, 0
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if isinstance(conversation, str):
        found = await state.store.get_conversation(tenant.id, conversation)
        if found is None:
            return None, 0
        return found.model, await state.store.count_messages(found.id)
    previous = body.get("previous_response_id")
    if isinstance(previous, str):
        record = await state.store.get_response(tenant.id, previous)
        if record is None:
            return None, 0
        return record.model, await state.store.chain_length(record.id)
    return None, 0


async def _previous(state: ServerState, turns: Turns, tenant: Tenant, response_id: str) -> Response:
    """The response a new one continues: the tenant's, stored, and finished."""
    record = await state.store.get_response(tenant.id, response_id)
    if record is None:
        raise APIError(404, f"no response {response_id!r}", "previous_response_id", "not_found")
    if not record.stored:
        raise APIError(400, f"response {response_id!r} was created with store=false, so it cannot be continued: send "
                            "its history as input, or create it with store=true", "previous_response_id")
    reply = turns.reply(record.output_message_id)
    if reply is not None and not reply.done:
        raise APIError(409, f"response {response_id!r} is still being generated; continue it once it has finished",
                       "previous_response_id", "response_in_progress")
    return record


def _replay_parser(state: ServerState, record: Response) -> ToolParser:
    """How the model that made a response reads tool calls (the first model's while it is unloaded)."""
    served = state.fleet.by_name(record.model)
    return (served if served is not None and served.tokenizer is not None else state.fleet.primary).tool_parser


async def _outputs(state: ServerState, record: Response) -> list[Message]:
    """A response's output rows: its reply's and the calls after it ([] once its reply's row was deleted)."""
    messages = await state.store.response_messages(record.id)
    at = next((i for i, m in enumerate(messages) if m.id == record.output_message_id), None)
    return [] if at is None else messages[at:at + 1] + [m for m in messages[at + 1:] if m.kind == "function_call"]


async def _stream(request: web.Request, state: ServerState, turns: Turns, reply: ReplyStream, after: int, *,
                  cancel_on_leave: bool, headers: dict | None = None) -> web.StreamResponse:
    """Follow a reply from event `after`. A stored one goes on and is saved when its follower leaves;
    with `cancel_on_leave` (store=false: nobody can come back for it) it is stopped."""
    whole = False
    try:
        response, whole = await stream_events(request, reply.follow(after, state.heartbeat_seconds), headers)
    finally:  # also when aiohttp cancels the handler of a client that went away
        if not whole and cancel_on_leave:
            turns.cancel_reply(reply.message_id)
    return response


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r}", "response_id", "not_found")

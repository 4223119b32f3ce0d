"""OpenAI's Responses API on chatd's store: `POST /v1/responses`, and a stored response's
retrieve, input items, cancel and delete.

A response's history comes from the server, as in a conversation: `previous_response_id`
continues a chain of responses (their input items and outputs, oldest first) and
`conversation` continues a conversation (its items; the response's input and output are added
to it). Either way the history renders to the same tokens as last time, so the prefix cache
serves it and a turn computes only its new tokens. `instructions` are the system message of
this response only (they are not carried to the next one, as OpenAI does); a conversation's
chatd system prompt comes before them.

A response is a turn (turns.py): generated in the background and saved even if its client
leaves, streamed with OpenAI's event types (`response.created` ... `response.completed`),
reconnected to with `GET /v1/responses/{id}?stream=true&starting_after=N`. `store: false`
keeps no text: only a record that the response existed (so continuing it is a clear 400), and
its usage; its generation stops when its client leaves.

Too long a history is a 400 (`truncation: "disabled"`, OpenAI's default); with
`truncation: "auto"` the oldest turns are left out, as in a conversation, and the response says
how many (`chatd.items_omitted`). The body is validated by response_request.py.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from aiohttp import web

from chatd.engine import ParamError, RequestOutput
from chatd.http.auth import TENANT
from chatd.http.errors import REQUEST_ID, APIError
from chatd.http.history import render_history
from chatd.http.items import item_json, item_page, page_params
from chatd.http.protocol import shown
from chatd.http.request_log import REQUEST_LOG
# The body's parsing. openapi.py (and test_openapi.py) read its fields and limits as responses.X: kept here.
from chatd.http.response_request import (MAX_INPUT_ITEMS, RESPONSE_FIELDS, SERVICE_TIERS, UNSUPPORTED,  # noqa: F401
                                         ResponseRequest, parse_response)
from chatd.http.state import STATE, ServerState
from chatd.http.turns import TURNS, ReplyEvents, ReplyStream, Turns, conversation_not_found
from chatd.http.wire import json_response, read_json, stream_events
from chatd.store.db import Conversation, Message, Tenant
from chatd.store.records import Response

# -- the turn -------------------------------------------------------------------------------------


class ResponseTurn:
    """One response as a turn: its history rendered, its rows (or, with store=false, only its
    record), its reply told as Responses' events."""

    named_events, endpoint, route = True, "responses", "responses"

    def __init__(self, state: ServerState, tenant: Tenant, req: ResponseRequest, conversation: Conversation | None,
                 previous: Response | None) -> None:
        self.state, self.tenant, self.req = state, tenant, req
        self.conversation, self.previous = conversation, previous
        self.gen, self.stored = req.gen, req.store
        self.busy_key = conversation.id if conversation is not None else None
        self.record: Response | None = None
        self.omitted = 0

    async def input_texts(self) -> list[str]:
        return [text for _, text in self.req.inputs] + ([self.req.instructions] if self.req.instructions else [])

    def use_input_texts(self, texts: list[str]) -> None:
        inputs = [(role, text) for (role, _), text in zip(self.req.inputs, texts)]
        instructions = texts[len(inputs)] if self.req.instructions else None
        self.req = dataclasses.replace(self.req, inputs=inputs, instructions=instructions)

    async def prompts(self) -> dict[str, list[int]]:
        store, system = self.state.store, None
        if self.conversation is not None:
            history, system = await store.list_messages(self.conversation.id), self.conversation.system_prompt
        elif self.previous is not None:
            history = await store.chain_messages(self.previous.id)
        else:
            history = []
        system = "\n\n".join(s for s in (system, self.req.instructions) if s) or None
        new = [{"role": "system" if role == "developer" else role, "content": text} for role, text in self.req.inputs]
        # Rendering a long history and tokenizing it is CPU work: off the event loop.
        render = functools.partial(render_history, trim=self.req.truncation == "auto", param="input")
        prompt, self.omitted = await self.state.off_loop(render, self.state, system, history, new, self.gen)
        return {"input": prompt}

    async def begin(self) -> Message:
        req = self.req
        self.record, output = await self.state.store.create_response(
            self.tenant.id, model=self.state.model_name, stored=req.store, inputs=req.inputs,
            conversation_id=req.conversation_id, previous_response_id=req.previous_response_id,
            instructions=req.instructions, request={**req.echo, "items_omitted": self.omitted})
        if output is None:  # store=false: the output has no row
            now = time.time()
            output = Message(f"msg_{self.record.id[5:]}", None, "assistant", "", "partial", None, 0, 0, 0, 0.0, now, now)
        return output

    def events(self, assistant: Message, omitted: int) -> ReplyEvents:
        return ResponseEvents(self.state, self.record, assistant)

    def not_found(self) -> APIError:
        return conversation_not_found(self.req.conversation_id)


class ResponseEvents:
    """A response's reply as OpenAI's Responses stream events, each with its sequence_number."""

    def __init__(self, state: ServerState, record: Response, assistant: Message) -> None:
        self.state, self.record, self.assistant = state, record, assistant
        self.sequence = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self.assistant.id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[dict]:
        response = response_object(self.state, self.record, None)
        item = {"type": "message", "id": self.assistant.id, "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response),
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self._where(), part=_text_part(""))]

    def delta(self, out: RequestOutput) -> list[dict]:
        return self.text(out.outputs[0].text if out.outputs else "")

    def text(self, text: str) -> list[dict]:
        return [self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])] if text else []

    def closing(self, message: Message, merged: RequestOutput | None, reply: ReplyStream) -> list[dict]:
        response = response_object(self.state, self.record, message, stopped_by=reply.stopped_by, error=reply.error)
        if response["status"] == "failed":
            return [self._event("response.failed", response=response)]
        item = response["output"][0]
        return [self._event("response.output_text.done", **self._where(), text=message.content, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed" if response["status"] == "completed" else "response.incomplete",
                            response=response)]


def response_object(state: ServerState, record: Response, output: Message | None, *, live: bool = False,
                    stopped_by: str | None = None, error: str | None = None, output_deleted: bool = False) -> dict:
    """A response as OpenAI's `response` object; `output` None or `live`: still being generated, unless
    `output_deleted` (its output item was deleted from its conversation: it ended, how is no longer known)."""
    request = record.request
    status, incomplete, failure, usage = "in_progress", None, None, None
    if output_deleted:
        status = "incomplete"
    if output is not None and not live:
        usage = {"input_tokens": output.prompt_tokens, "input_tokens_details": {"cached_tokens": output.cached_tokens},
                 "output_tokens": output.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": output.prompt_tokens + output.completion_tokens}
        if output.status == "complete":
            status = "incomplete" if output.finish_reason in ("length", "content_filter") else "completed"
            if status == "incomplete":  # OpenAI's two reasons, as its output item is cut short
                incomplete = {"reason": "max_output_tokens" if output.finish_reason == "length" else "content_filter"}
        elif output.status == "partial":
            status = "cancelled" if stopped_by in ("cancel", "delete") else "incomplete"
        else:
            status = "failed"
            failure = {"code": "server_error", "message": f"generation failed: {error}" if error else "generation failed"}
    items = []
    if output is not None:
        item = item_json(output, live)
        if status in ("cancelled", "incomplete"):
            item["status"] = "incomplete"  # as OpenAI marks an output cut short (max_output_tokens included)
        items = [item]
    return {
        "id": record.id, "object": "response", "created_at": int(record.created_at), "status": status,
        "completed_at": int(output.updated_at) if usage is not None else None,
        "error": failure, "incomplete_details": incomplete, "instructions": record.instructions,
        "max_output_tokens": request.get("max_output_tokens"), "model": record.model, "output": items,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": record.previous_response_id,
        "conversation": {"id": record.conversation_id} if record.conversation_id else None,
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "tool_choice": request.get("tool_choice", "auto"), "tools": [],
        "text": request.get("text", {"format": {"type": "text"}}), "truncation": request.get("truncation", "disabled"),
        "reasoning": {"effort": None, "summary": None}, "background": False, "service_tier": "default",
        "store": record.stored, "metadata": request.get("metadata", {}), "user": request.get("user"),
        "safety_identifier": request.get("safety_identifier"), "prompt_cache_key": request.get("prompt_cache_key"),
        "usage": usage, "chatd": {"items_omitted": request.get("items_omitted", 0), "output_deleted": output_deleted},
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


# -- routes ---------------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    """Generate a response to `input`, after a chain of responses or a conversation's items; whole or streamed."""
    state, tenant = request.app[STATE], request[TENANT]
    req = parse_response(await read_json(request), state)
    state.check_model(req.gen.model, tenant)
    state.check_store_writable()
    conversation = previous = None
    if req.conversation_id is not None:
        conversation = await state.store.get_conversation(tenant.id, req.conversation_id)
        if conversation is None:
            raise APIError(404, f"no conversation {req.conversation_id!r}", "conversation", "not_found")
    if req.previous_response_id is not None:
        previous = await _previous(state, request.app[TURNS], tenant, req.previous_response_id)
    turns = request.app[TURNS]
    job = ResponseTurn(state, tenant, req, conversation, previous)
    try:
        reply, _ = await turns.start(tenant, job, request[REQUEST_ID], request.get(REQUEST_LOG))
    except ParamError as exc:  # named as the client named it
        if exc.param == "max_tokens":
            raise APIError(400, str(exc).replace("max_tokens", "max_output_tokens"), "max_output_tokens") from None
        raise APIError(400, str(exc), "input" if exc.param == "prompt" else exc.param) from None
    if req.gen.stream:
        return await _stream(request, state, turns, reply, 0, cancel_on_leave=not req.store)
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
    return json_response(response_object(state, job.record, message, stopped_by=reply.stopped_by))


async def get_response(request: web.Request) -> web.StreamResponse:
    """A stored response; `?stream=true` replays its events (after `starting_after`), live while it runs."""
    state, tenant, turns = request.app[STATE], request[TENANT], request.app[TURNS]
    record = await _own_response(state, tenant, request.match_info["response_id"])
    output = await _output(state, record)
    reply = turns.reply(record.output_message_id)
    if request.query.get("stream", "false").lower() == "true":
        raw = request.query.get("starting_after", "-1")
        try:
            after = int(raw)
        except ValueError:
            raise APIError(400, f"starting_after must be an integer, got {shown(raw)}", "starting_after") from None
        if reply is None:
            reply = _replay(state, record, output)
            # Rebuilt, its text is one delta: past the opening events its numbers are not the ones the
            # client saw, and the events after its `starting_after` would miss or repeat text.
            if after >= REPLAY_EXACT_EVENTS and output.content:
                raise APIError(400, f"the events of response {record.id} are no longer kept (stream_replay_seconds), only "
                                    f"its text: stream it from the start (starting_after below {REPLAY_EXACT_EVENTS}) or "
                                    "retrieve it whole", "starting_after")
        if after < -1 or after >= len(reply.events) and reply.done:
            raise APIError(400, f"starting_after {after} is beyond this response's events", "starting_after")
        return await _stream(request, state, turns, reply, after + 1, cancel_on_leave=False)
    if reply is not None and reply.done:
        output = reply.message
    live = reply is not None and not reply.done
    return json_response(response_object(state, record, output, live=live,
                                         stopped_by=reply.stopped_by if reply else None,
                                         error=reply.error if reply else None,
                                         output_deleted=output is None and reply is None))


async def list_input_items(request: web.Request) -> web.Response:
    """The items a stored response was given, newest first (`order=asc`: oldest first)."""
    state, tenant = request.app[STATE], request[TENANT]
    record = await _own_response(state, tenant, request.match_info["response_id"])
    limit, after, order = page_params(request.query)
    inputs = [m for m in await state.store.response_messages(record.id) if m.id != record.output_message_id]
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
        return json_response(response_object(state, record, reply.message, stopped_by=reply.stopped_by,
                                             error=reply.error))
    output = await _output(state, record)
    return json_response(response_object(state, record, output, output_deleted=output is None))


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


async def _output(state: ServerState, record: Response) -> Message | None:
    messages = await state.store.response_messages(record.id)
    return next((m for m in messages if m.id == record.output_message_id), None)


REPLAY_EXACT_EVENTS = 4  # the opening events, numbered the same in a rebuilt replay as in the original stream


def _replay(state: ServerState, record: Response, output: Message | None) -> ReplyStream:
    """A finished response's events rebuilt from its rows (after a restart, or once its stream left memory)."""
    reply = ReplyStream(record.conversation_id, record.output_message_id, named=True)
    if output is None:  # its conversation's items were deleted
        raise APIError(404, f"response {record.id} has no output to stream", "response_id", "not_found")
    events = ResponseEvents(state, record, output)
    for payload in [*events.opening(), *events.text(output.content), *events.closing(output, None, reply)]:
        reply.publish(payload)
    reply.finish(output)
    return reply


async def _stream(request: web.Request, state: ServerState, turns: Turns, reply: ReplyStream, after: int, *,
                  cancel_on_leave: bool) -> web.StreamResponse:
    """Follow a reply from event `after`. A stored one goes on and is saved when its follower leaves;
    with `cancel_on_leave` (store=false: nobody can come back for it) it is stopped."""
    whole = False
    try:
        response, whole = await stream_events(request, reply.follow(after, state.heartbeat_seconds))
    finally:  # also when aiohttp cancels the handler of a client that went away
        if not whole and cancel_on_leave:
            turns.cancel_reply(reply.message_id)
    return response


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r}", "response_id", "not_found")

"""A response of OpenAI's Responses API as a turn (turns.py): its prompt (the history it continues
and its input items, with the tools it may call), its rows, and its reply told as the Responses
stream's events; and `response_object`, the response as OpenAI shapes it, from its rows.

The routes are routes/responses.py's; the request body is openai/response_request.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from chatd.engine import CompletionOutput, RequestOutput
from chatd.http.generation import pipeline
from chatd.http.errors import APIError
from chatd.http.models.served_model import ServedModel
from chatd.http.generation.history import Tools, render_history, template_messages
from chatd.http.openai.items import item_json
from chatd.http.openai.openai_format import CUT_SHORT
from chatd.http.openai.protocol import shown
from chatd.http.openai.response_request import ResponseRequest
from chatd.http.server.safety import input_strings
from chatd.http.server.state import ServerState
from chatd.http.tools.tool_calls import ToolParser
from chatd.http.tools.tool_stream import ToolCallDelta
from chatd.http.generation.turns import ReplyEvents, ReplyStream, conversation_not_found
from chatd.store.db import Conversation, Message, Tenant
from chatd.store.messages import Call
from chatd.store.records import Response, new_id


class ResponseTurn:
    """One response as a turn: its history rendered, its rows (or, with store=false, only its
    record), its reply told as Responses' events."""

    named_events, endpoint, route = True, "responses", "responses"

    def __init__(self, state: ServerState, served: ServedModel, tenant: Tenant, req: ResponseRequest,
                 conversation: Conversation | None, previous: Response | None, idempotency_key: str | None = None) -> None:
        self.state, self.served, self.tenant, self.req = state, served, tenant, req
        self.idempotency_key = idempotency_key  # claimed by the route; a stored response's rows are bound to it
        self.conversation, self.previous = conversation, previous
        self.gen, self.stored = req.gen, req.store
        self.busy_key = conversation.id if conversation is not None else None
        self.record: Response | None = None
        self.omitted = 0
        self.parser: ToolParser | None = None  # reads the reply's calls, when it may make some
        self._screened: list[dict] = []
        self._write_back: Callable[[list[str]], None] | None = None

    async def input_texts(self) -> list[str]:
        """The items' texts and the instructions, then the tools offered (names, descriptions, schemas)."""
        req = self.req
        self._screened = [{"role": "user", "content": text} for _, text, _ in req.inputs]
        if req.instructions:
            self._screened.append({"role": "system", "content": req.instructions})
        offered = req.gen.tools.offered if req.gen.tools is not None else None
        texts, self._write_back = await self.state.off_loop(input_strings, self._screened, offered)
        return texts

    def use_input_texts(self, texts: list[str]) -> None:
        self._write_back(texts)
        checked = [m["content"] for m in self._screened]
        inputs = [(role, text, call) for (role, _, call), text in zip(self.req.inputs, checked)]
        instructions = checked[len(inputs)] if self.req.instructions else None
        self.req = dataclasses.replace(self.req, inputs=inputs, instructions=instructions)

    async def prompts(self) -> dict[str, list[int]]:
        served, gen, store, system = self.served, self.gen, self.state.store, None
        if self.conversation is not None:
            history, system = await store.list_messages(self.conversation.id), self.conversation.system_prompt
        elif self.previous is not None:
            history = await store.chain_messages(self.previous.id, model=served.name)
        else:
            history = []
        _check_call_ids(history, self.req.inputs)
        system = "\n\n".join(s for s in (system, self.req.instructions) if s) or None
        new, _ = template_messages(self.req.inputs)
        tools = Tools([], served.tokenizer.template_takes_tools)
        if gen.tools is not None:
            # Tools are walked in Python (schemas checked and closed, the grammar written): off the event loop.
            use = await served.off_loop(served.tool_use, gen.tools, [], gen.params.structured)
            tools = Tools(gen.tools.offered, served.tokenizer.template_takes_tools)
            if use.grammar is not None:  # every reply that may call follows it, auto too
                if gen.params.structured is not None:  # the request's own format, checked alone: its errors name it
                    await pipeline.check_structured(served, gen.params.structured, self.tenant)
                gen.params = replace(gen.params, structured=use.grammar)
            if use.parser is not None and use.parser.needs_special_tokens:  # its markers must reach the parser
                gen.params = replace(gen.params, skip_special_tokens=False)
            self.parser = use.parser
        # Rendering a long history and tokenizing it is CPU work: off the event loop.
        render = functools.partial(render_history, trim=self.req.truncation == "auto", param="input", tools=tools)
        prompt, self.omitted = await served.off_loop(render, served, system, history, new, gen)
        return {"input": prompt}

    async def begin(self) -> Message:
        req = self.req
        self.record, output = await self.state.store.create_response(
            self.tenant.id, model=self.served.name, stored=req.store, inputs=req.inputs,
            conversation_id=req.conversation_id, previous_response_id=req.previous_response_id,
            instructions=req.instructions, request={**req.echo, "items_omitted": self.omitted},
            idempotency_key=self.idempotency_key)
        if output is None:  # store=false: the output has no row
            now = time.time()
            output = Message(f"msg_{self.record.id[5:]}", None, "assistant", "", "partial", None, 0, 0, 0, 0.0, now, now)
        return output

    def events(self, assistant: Message, omitted: int) -> ReplyEvents:
        return ResponseEvents(self.record, assistant, self.parser)

    def not_found(self) -> APIError:
        return conversation_not_found(self.req.conversation_id)


def _check_call_ids(history: list[Message], inputs: list) -> None:
    """Each function_call_output answers a call made before it (in the history or the input), as OpenAI checks."""
    made = {m.call["call_id"] for m in history if m.kind == "function_call"}
    for i, (role, _, call) in enumerate(inputs):
        if call is None:
            continue
        if role == "assistant":
            made.add(call["call_id"])
        elif call["call_id"] not in made:
            raise APIError(400, f"input[{i}] answers no function call made before it: no call has call_id "
                                f"{shown(call['call_id'])}", f"input[{i}].call_id")


@dataclass
class _Open:
    """An output item whose events are under way."""

    kind: str  # message | function_call
    id: str
    index: int  # its output_index
    text: str = ""  # a message's text, a call's arguments so far
    call_id: str = ""
    name: str = ""
    done: bool = False  # its closing events are sent


class ResponseEvents:
    """A response's reply as OpenAI's Responses stream events, each with its sequence_number.

    Without tools the reply is one message item, opened before the first token. With tools the
    reply's text is read by the tool-call parser as it streams: a message item opens at the first
    text, and each call is a `function_call` item opened as soon as it is certain (its arguments
    then stream as `response.function_call_arguments.delta`). An item's id is the reply's own for
    the first item, a fresh one for each later call: the ids the rows are saved under."""

    def __init__(self, record: Response, assistant: Message, parser: ToolParser | None = None,
                 ids: list[str] = ()) -> None:
        self.record, self.assistant = record, assistant
        self._ids = list(ids)  # the ids of the items after the first, in order (a replay's rows)
        self.sequence = 0
        self.stream = parser.stream() if parser is not None else None
        self.items: list[_Open] = []
        self._calls: dict[int, _Open] = {}  # the parser's call index -> its item
        self._pending: list[dict] = []  # the events of the parser's last words, sent with the closing ones

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _where(self, item: _Open) -> dict:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    def opening(self) -> list[dict]:
        response = response_object(self.record, None)
        events = [self._event("response.created", response=response),
                  self._event("response.in_progress", response=response)]
        return events + (self._open_message() if self.stream is None else [])

    def _open(self, kind: str, **fields) -> _Open:
        if not self.items:
            item_id = self.assistant.id
        else:
            item_id = self._ids.pop(0) if self._ids else new_id("msg_" if kind == "message" else "fc_", 12)
        item = _Open(kind, item_id, len(self.items), **fields)
        self.items.append(item)
        return item

    def _open_message(self) -> list[dict]:
        item = self._open("message")
        shown = {"type": "message", "id": item.id, "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.output_item.added", output_index=item.index, item=shown),
                self._event("response.content_part.added", **self._where(item), part=_text_part(""))]

    def delta(self, out: RequestOutput) -> list[dict]:
        text = out.outputs[0].text if out.outputs else ""
        if self.stream is None:
            return self.text(text)
        return self._parsed(*self.stream.feed(text)) if text else []

    def text(self, text: str) -> list[dict]:
        if not text:
            return []
        message = self.items[-1] if self.items and self.items[-1].kind == "message" else None
        events = []
        if message is None:
            events, message = self._open_message(), self.items[-1]
        message.text += text
        return events + [self._event("response.output_text.delta", **self._where(message), delta=text, logprobs=[])]

    def _parsed(self, content: str, deltas: list[ToolCallDelta]) -> list[dict]:
        events = self.text(content)
        for delta in deltas:
            if delta.id is not None:  # a call begins
                events += self._close_open()
                item = self._calls[delta.index] = self._open("function_call", call_id=delta.id, name=delta.name)
                shown = {"type": "function_call", "id": item.id, "call_id": item.call_id, "name": item.name,
                         "arguments": "", "status": "in_progress"}
                events.append(self._event("response.output_item.added", output_index=item.index, item=shown))
            item = self._calls[delta.index]
            if delta.arguments:
                item.text += delta.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                          output_index=item.index, delta=delta.arguments))
        return events

    def _close_open(self) -> list[dict]:
        """A message ends where a call begins: its text is done (a reply's calls come after its text)."""
        item = self.items[-1] if self.items else None
        if item is None or item.kind != "message" or item.done:
            return []
        item.done = True
        part = _text_part(item.text)
        shown = {"type": "message", "id": item.id, "status": "completed", "role": "assistant", "content": [part]}
        return [self._event("response.output_text.done", **self._where(item), text=item.text, logprobs=[]),
                self._event("response.content_part.done", **self._where(item), part=part),
                self._event("response.output_item.done", output_index=item.index, item=shown)]

    def saved(self, output: CompletionOutput | None, finish: str | None) -> tuple[str, list[Call]]:
        if self.stream is None:
            return (output.text if output is not None else ""), []
        self._pending = self._parsed(*self.stream.finish(cut=finish in CUT_SHORT))
        items = {item.call_id: item for item in self._calls.values()}
        calls = [Call(items[c.id].id, c.id, c.name, c.arguments) for c in self.stream.calls]
        return "".join(item.text for item in self.items if item.kind == "message"), calls

    def closing(self, message: Message, merged: RequestOutput | None, reply: ReplyStream) -> list[dict]:
        response = response_object(self.record, [message, *reply.calls], stopped_by=reply.stopped_by,
                                   error=reply.error)
        if response["status"] == "failed":
            return [self._event("response.failed", response=response)]
        events = self._pending
        if not self.items:  # nothing was said: an empty message, as saved
            events += self._open_message()
        shapes = {item["id"]: item for item in response["output"]}
        for item in (item for item in self.items if not item.done):
            shape = shapes.get(item.id)
            if shape is None or shape["type"] != item.kind:  # a call the reply did not keep
                shape = _dropped(item)
            if item.kind == "message":
                events += [self._event("response.output_text.done", **self._where(item), text=shape["content"][0]["text"],
                                       logprobs=[]),
                           self._event("response.content_part.done", **self._where(item), part=shape["content"][0])]
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                          output_index=item.index, name=item.name, arguments=shape["arguments"]))
            events.append(self._event("response.output_item.done", output_index=item.index, item=shape))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]


def _dropped(item: _Open) -> dict:
    """A call the stream had begun and the reply did not keep (cut by max_output_tokens mid-call: the
    reply is saved without it, as an empty message when it was the reply's first item)."""
    if item.kind == "message":
        return {"type": "message", "id": item.id, "status": "incomplete", "role": "assistant",
                "content": [_text_part(item.text)]}
    return {"type": "function_call", "id": item.id, "call_id": item.call_id, "name": item.name,
            "arguments": item.text, "status": "incomplete"}


def response_object(record: Response, outputs: list[Message] | None, *, live: bool = False,
                    stopped_by: str | None = None, error: str | None = None, output_deleted: bool = False) -> dict:
    """A response as OpenAI's `response` object. `outputs`: its output rows (the reply's, then the
    calls it made after it); None or `live`: still being generated, unless `output_deleted` (its
    output item was deleted from its conversation: it ended, how is no longer known)."""
    request = record.request
    output = outputs[0] if outputs else None
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
    for row in outputs or []:
        item = item_json(row, live)
        if status in ("cancelled", "incomplete"):
            item["status"] = "incomplete"  # as OpenAI marks an output cut short (max_output_tokens included)
        items.append(item)
    return {
        "id": record.id, "object": "response", "created_at": int(record.created_at), "status": status,
        "completed_at": int(output.updated_at) if usage is not None else None,
        "error": failure, "incomplete_details": incomplete, "instructions": record.instructions,
        "max_output_tokens": request.get("max_output_tokens"), "model": record.model, "output": items,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": record.previous_response_id,
        "conversation": {"id": record.conversation_id} if record.conversation_id else None,
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "tool_choice": request.get("tool_choice", "auto"), "tools": [_tool_json(t) for t in request.get("tools", [])],
        "text": request.get("text", {"format": {"type": "text"}}), "truncation": request.get("truncation", "disabled"),
        "reasoning": {"effort": None, "summary": None}, "background": False, "service_tier": "default",
        "store": record.stored, "metadata": request.get("metadata", {}), "user": request.get("user"),
        "safety_identifier": request.get("safety_identifier"), "prompt_cache_key": request.get("prompt_cache_key"),
        "usage": usage, "chatd": {"items_omitted": request.get("items_omitted", 0), "output_deleted": output_deleted},
    }


def _tool_json(tool: dict) -> dict:
    """A function tool as a response repeats it (every field, as OpenAI fills them)."""
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def replayed(tool_parser: ToolParser, record: Response, outputs: list[Message]) -> tuple[ReplyStream, int]:
    """A finished response's events rebuilt from its rows (after a restart, or once its stream left
    memory), and how many of them come before the first delta (numbered as the original stream's).
    tool_parser: how the model that made it reads calls."""
    reply = ReplyStream(record.conversation_id, record.output_message_id, named=True)
    if not outputs:  # its conversation's items were deleted
        raise APIError(404, f"response {record.id} has no output to stream", "response_id", "not_found")
    first, calls = outputs[0], outputs[1:]
    parser = None if first.kind == "message" and not calls else tool_parser  # (its calls are rows: nothing to read)
    events = ResponseEvents(record, first, parser, [m.id for m in calls])
    payloads = events.opening()
    for row in outputs:
        if row.kind == "message":
            payloads += events.text(row.content) or (events._open_message() if events.stream is not None else [])
        else:
            payloads += events._parsed("", [ToolCallDelta(len(events._calls), row.call["call_id"], row.call["name"],
                                                          row.content)])
    reply.calls = calls
    payloads += events.closing(first, None, reply)
    for payload in payloads:
        reply.publish(payload)
    reply.finish(first)
    exact = next((i for i, p in enumerate(payloads) if p["type"].endswith(".delta")), len(payloads))
    return reply, exact

"""A conversation's next message as a turn (turns.py): its prompt (the conversation's history and
the new message), its rows, and its reply told as chat-completion chunks.

The routes are routes/conversations.py's.
"""

from __future__ import annotations

from chatd.engine import CompletionOutput, RequestOutput
from chatd.http.errors import APIError
from chatd.http.generation.history import render_turn
from chatd.http.openai.openai_format import ChunkFormat
from chatd.http.openai.protocol import GenerationRequest, TurnRequest
from chatd.http.models.served_model import ServedModel
from chatd.http.server.state import ServerState
from chatd.http.generation.turns import ReplyEvents, ReplyStream, conversation_not_found
from chatd.http.server.wire import DONE
from chatd.store.db import Conversation, Message, Tenant
from chatd.store.messages import Call


class MessageTurn:
    """A conversation's next user message (`POST /v1/conversations/{id}/messages`), told as chat-completion chunks."""

    stored, named_events, endpoint, route = True, False, "conversations", "conversation"

    def __init__(self, state: ServerState, served: ServedModel, tenant: Tenant, conversation: Conversation,
                 turn: TurnRequest, idempotency_key: str | None = None) -> None:
        self.state, self.served, self.tenant, self.conversation, self.turn = state, served, tenant, conversation, turn
        self.idempotency_key = idempotency_key  # claimed by the route; the turn's rows are bound to it
        self.gen = turn.gen
        self.busy_key = conversation.id
        self.omitted = 0

    async def input_texts(self) -> list[str]:
        return [self.turn.content]

    def use_input_texts(self, texts: list[str]) -> None:
        self.turn.content = texts[0]

    async def prompts(self) -> dict[str, list[int]]:
        history = await self.state.store.list_messages(self.conversation.id)
        # Rendering a long history and tokenizing it is CPU work: off the event loop.
        prompt, self.omitted = await self.state.off_loop(render_turn, self.served, self.conversation, history, self.turn)
        return {"content": prompt}

    async def begin(self) -> Message:
        _, assistant = await self.state.store.start_turn(self.tenant.id, self.conversation.id, self.turn.content,
                                                         self.idempotency_key)
        return assistant

    def events(self, assistant: Message, omitted: int) -> ReplyEvents:
        return ChatEvents(self.served, assistant, self.gen, omitted)

    def not_found(self) -> APIError:
        return conversation_not_found(self.conversation.id)


class ChatEvents:
    """A conversation reply as chat-completion chunks, ended by `[DONE]` or an error event."""

    def __init__(self, served: ServedModel, assistant: Message, gen: GenerationRequest, omitted: int) -> None:
        self.gen, self.omitted = gen, omitted
        self.format = ChunkFormat(served.name, served.token_text, assistant.id, int(assistant.created_at), True,
                                  gen.include_usage, {"conversation_id": assistant.conversation_id})

    def opening(self) -> list[dict]:
        first = self.format.role_chunks(1)[0]
        first["chatd"] = {"messages_omitted": self.omitted}
        return [first]

    def delta(self, out: RequestOutput) -> list[dict]:
        chunk = self.format.delta_chunk(out)
        return [] if chunk is None else [chunk]

    def saved(self, output: CompletionOutput | None, finish: str | None) -> tuple[str, list[Call]]:
        return (output.text if output is not None else ""), []

    def closing(self, message: Message, merged: RequestOutput | None, reply: ReplyStream) -> list[dict | bytes]:
        if message.status == "error":
            return [reply.failure().body()]
        if message.status == "partial":
            return [reply.interruption().body()]
        usage = [self.format.usage_chunk(merged)] if self.gen.include_usage else []
        return [*usage, DONE]

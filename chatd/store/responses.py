"""OpenAI's Responses API, in the store: a response's record, the messages it added (its input
items and its output, in its conversation or on their own), and the chain of responses before it
by previous_response_id.

A store=false response keeps only its record (no text). `Responses` is a mixin of `Store`
(db.py): its SQL runs through the store's `_fetch`, `_write` and `_transaction`; its messages are
written with messages.py's functions, and purged with deleted conversations (conversations.py).
It knows nothing of HTTP.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Sequence
from typing import Any

import orjson

from chatd.store.database import Database, whole
from chatd.store.idempotency import bind_key
from chatd.store.messages import MESSAGE_COLUMNS, Item, insert_messages, message_from_row, new_message, next_position
from chatd.store.records import Message, Response, new_id

# In the order of Response's fields, so a row becomes a record with `_response(row)`.
_RESPONSE_COLUMNS = ("id, tenant_id, conversation_id, previous_response_id, output_message_id, stored, model, "
                     "instructions, request, created_at")


class Responses(Database):
    """Store methods for responses and the messages they added."""

    @whole
    async def create_response(self, tenant_id: str, *, model: str, stored: bool, inputs: Sequence[Item] = (),
                              conversation_id: str | None = None, previous_response_id: str | None = None,
                              instructions: str | None = None, request: dict[str, Any] | None = None,
                              idempotency_key: str | None = None) -> tuple[Response, Message | None]:
        """Record a new response. Stored, it gets its input items (role, text[, call]) and an empty
        `partial` output message, in its conversation when it has one (LookupError and nothing if
        that is not the tenant's live conversation); a store=false one keeps only its record.
        With `idempotency_key` (claimed first: claim_key), a stored one is bound to it."""
        now = self._clock()
        response = Response(new_id("resp_", 12), tenant_id, conversation_id, previous_response_id, None, stored,
                            model, instructions, dict(request or {}), now)
        output = None
        async with self._transaction() as conn:
            if stored:
                position = 0 if conversation_id is None else await next_position(conn, tenant_id, conversation_id)
                output = new_message(conversation_id, "assistant", "", now=now, status="partial")
                response = dataclasses.replace(response, output_message_id=output.id)
            await conn.execute(f"INSERT INTO responses ({_RESPONSE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               (*dataclasses.astuple(response)[:-2], orjson.dumps(response.request).decode(), now))
            if stored:
                messages = [new_message(conversation_id, *item, now=now) for item in inputs] + [output]
                await insert_messages(conn, conversation_id, response.id, position, messages)
                if idempotency_key is not None:
                    await bind_key(conn, tenant_id, idempotency_key, output.id, response_id=response.id)
            if conversation_id is not None:
                await conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return response, output

    async def get_response(self, tenant_id: str, response_id: str) -> Response | None:
        """The tenant's response (a store=false one's record too); None if missing, deleted,
        someone else's, or in a deleted conversation."""
        rows = await self._fetch(
            f"SELECT {', '.join('r.' + c for c in _RESPONSE_COLUMNS.split(', '))} FROM responses r "
            "LEFT JOIN conversations c ON c.id = r.conversation_id "
            "WHERE r.id = ? AND r.tenant_id = ? AND r.deleted_at IS NULL AND c.deleted_at IS NULL",
            (response_id, tenant_id))
        return _response(rows[0]) if rows else None

    async def delete_response(self, tenant_id: str, response_id: str) -> bool:
        """Soft delete: hidden at once, purged later (its messages in a conversation stay there).
        False if missing, deleted or someone else's."""
        deleted = await self._write("UPDATE responses SET deleted_at = ? WHERE id = ? AND tenant_id = ? "
                                    "AND deleted_at IS NULL", (self._clock(), response_id, tenant_id))
        return deleted == 1

    async def response_messages(self, response_id: str) -> list[Message]:
        """The messages a response added, in order: its input items, then its output."""
        rows = await self._fetch(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE response_id = ? ORDER BY position",
                                 (response_id,))
        return [message_from_row(row) for row in rows]

    async def chain_messages(self, response_id: str, model: str | None = None) -> list[Message]:
        """The messages of a response and of every response before it by previous_response_id,
        oldest first: the history a response that continues it starts from. (Check the response
        is the caller's first; a purged response ends the chain.) With `model`, the messages of
        responses another model served come without their token ids (another tokenizer's)."""
        columns = ", ".join("m." + c for c in MESSAGE_COLUMNS.split(", "))
        rows = await self._fetch(
            "WITH RECURSIVE chain (id, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT r.previous_response_id, chain.depth + 1 FROM responses r JOIN chain ON r.id = chain.id "
            "WHERE r.previous_response_id IS NOT NULL) "
            f"SELECT {columns}, r.model FROM chain JOIN messages m ON m.response_id = chain.id "
            "JOIN responses r ON r.id = chain.id ORDER BY chain.depth DESC, m.position", (response_id,))
        messages = []
        for row in rows:
            message = message_from_row(tuple(row)[:-1])
            if model is not None and row[-1] != model and message.token_ids is not None:
                message = dataclasses.replace(message, token_ids=None)
            messages.append(message)
        return messages

    async def chain_length(self, response_id: str) -> int:
        """How many messages `chain_messages` would give, counted in the database (escalation rules
        read it before the history itself is read)."""
        rows = await self._fetch(
            "WITH RECURSIVE chain (id) AS (SELECT ? UNION ALL "
            "SELECT r.previous_response_id FROM responses r JOIN chain ON r.id = chain.id "
            "WHERE r.previous_response_id IS NOT NULL) "
            "SELECT COUNT(*) FROM chain JOIN messages m ON m.response_id = chain.id", (response_id,))
        return rows[0][0]

    async def chain_root(self, response_id: str) -> str:
        """The first response of the chain `response_id` ends (itself if it continues none): what
        names the chain to a gateway, so every response of it lands on the replica that has its KV."""
        rows = await self._fetch(
            "WITH RECURSIVE chain (id, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT r.previous_response_id, chain.depth + 1 FROM responses r JOIN chain ON r.id = chain.id "
            "WHERE r.previous_response_id IS NOT NULL) SELECT id FROM chain ORDER BY depth DESC LIMIT 1", (response_id,))
        return rows[0][0]


def _response(row: sqlite3.Row) -> Response:
    *head, stored, model, instructions, request, created_at = row
    return Response(*head, bool(stored), model, instructions, orjson.loads(request), created_at)

"""The messages table, in the store: a conversation's turns (the user's message and the reply
streamed into a `partial` row, then finished with its usage), and the same rows as OpenAI's
Conversations API names them, items.

`Messages` is a mixin of `Store` (db.py): its SQL runs through the store's `_fetch`, `_write` and
`_transaction`. The functions below it are how conversations.py and responses.py add messages in
their own transactions. It knows nothing of tokenizers or the engine: a reply's token ids are kept
as given (int32s, native byte order), for the next turn's prompt.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import aiosqlite
import orjson

from chatd.store.database import Database, whole
from chatd.store.idempotency import bind_key, finish_key
from chatd.store.records import Message, new_id
from chatd.store.usage import INSERT_USAGE

STATUSES = ("complete", "partial", "error")  # an assistant message stays "partial" if the server dies mid-reply
# In the order of Message's fields, so a row becomes a record with `message_from_row(row)`.
MESSAGE_COLUMNS = ("id, conversation_id, role, content, status, finish_reason, prompt_tokens, cached_tokens, "
                   "completion_tokens, cost, created_at, updated_at, token_ids, call")
_INSERT_MESSAGE = (f"INSERT INTO messages (position, response_id, {MESSAGE_COLUMNS}) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


class Call(NamedTuple):
    """A tool call a reply made, as the reply's stream named it."""

    item_id: str  # its item's id ("fc_..."; the reply's own id when the reply is only calls)
    call_id: str  # the id its output answers ("call_...")
    name: str
    arguments: str  # JSON text


# An item a client adds: (role, text), or (role, text, call) for a tool item (Message.call's shape).
Item = tuple[str, str] | tuple[str, str, dict | None]


class Messages(Database):
    """Store methods for a conversation's messages: turns, and items."""

    async def list_messages(self, conversation_id: str) -> list[Message]:
        """A conversation's messages in order (check the conversation is the caller's first)."""
        rows = await self._fetch(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? "
                                 "ORDER BY position", (conversation_id,))
        return [message_from_row(row) for row in rows]

    async def count_messages(self, conversation_id: str) -> int:
        """How many messages a conversation holds (check the conversation is the caller's first)."""
        rows = await self._fetch("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (conversation_id,))
        return rows[0][0]

    async def get_message(self, conversation_id: str, message_id: str) -> Message | None:
        """One message of a conversation, or None."""
        rows = await self._fetch(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND id = ?",
                                 (conversation_id, message_id))
        return message_from_row(rows[0]) if rows else None

    # --- turns ---

    @whole
    async def start_turn(self, tenant_id: str, conversation_id: str, content: str,
                         idempotency_key: str | None = None) -> tuple[Message, Message]:
        """Add the user's message and an empty `partial` assistant reply, or LookupError and nothing;
        with `idempotency_key` (claimed first: claim_key), the two are bound to it."""
        now = self._clock()
        user = new_message(conversation_id, "user", content, now=now)
        reply = new_message(conversation_id, "assistant", "", now=now, status="partial")
        async with self._transaction() as conn:
            position = await next_position(conn, tenant_id, conversation_id)
            await insert_messages(conn, conversation_id, None, position, [user, reply])
            await conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            if idempotency_key is not None:
                await bind_key(conn, tenant_id, idempotency_key, reply.id, user_message_id=user.id)
        return user, reply

    async def save_partial(self, message_id: str, content: str, completion_tokens: int) -> None:
        """Keep the reply so far; a reply already finished is left alone."""
        await self._write("UPDATE messages SET content = ?, completion_tokens = ?, updated_at = ? "
                          "WHERE id = ? AND status = 'partial'", (content, completion_tokens, self._clock(), message_id))

    @whole
    async def finish_turn(self, tenant_id: str, message_id: str, *, content: str, status: str,
                          finish_reason: str | None, prompt_tokens: int, cached_tokens: int,
                          completion_tokens: int, cost: float, model: str, endpoint: str = "conversations",
                          finished_at: float | None = None, token_ids: Sequence[int] | None = None,
                          calls: Sequence[Call] = ()) -> Message:
        """Write the finished reply and its usage event together, both stamped `finished_at`
        (default: now). token_ids: the reply's tokens as generated, kept for the next turn's prompt.
        calls: the tool calls it made, each written as its own item right after the reply's (any
        later items move down); a call named by the reply's own id is the reply's row itself (a
        reply that is only calls), which then carries the usage.

        When the message is gone (its conversation purged mid-reply) the usage is still recorded,
        then LookupError is raised.
        """
        check_status(status)
        now = self._clock() if finished_at is None else finished_at
        own = calls[0] if calls and calls[0].item_id == message_id else None
        if own is not None:
            content, calls = own.arguments, calls[1:]
        async with self._transaction() as conn:
            await conn.execute(
                "UPDATE messages SET content = ?, status = ?, finish_reason = ?, prompt_tokens = ?, cached_tokens = ?, "
                "completion_tokens = ?, cost = ?, updated_at = ?, token_ids = ?, call = ? WHERE id = ?",
                (content, status, finish_reason, prompt_tokens, cached_tokens, completion_tokens, cost, now,
                 _pack_ids(token_ids), _pack_call(own and {"call_id": own.call_id, "name": own.name}), message_id))
            rows = await conn.execute_fetchall(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,))
            conversation_id = rows[0][1] if rows else None
            if rows and calls:
                await _insert_calls(conn, message_id, calls, status, now)
            await conn.execute(INSERT_USAGE, (tenant_id, endpoint, model, conversation_id, message_id,
                                              prompt_tokens, cached_tokens, completion_tokens, cost, now))
            await finish_key(conn, message_id, now)
        if not rows:
            raise LookupError(f"no message {message_id!r} (its usage was recorded)")
        return message_from_row(rows[0])

    # --- items: a conversation's messages as OpenAI's Conversations API names them ---

    @whole
    async def add_items(self, tenant_id: str, conversation_id: str, items: Sequence[Item]) -> list[Message]:
        """Append complete items (role, text[, call]) to the tenant's live conversation, or LookupError and nothing."""
        now = self._clock()
        messages = [new_message(conversation_id, *item, now=now) for item in items]
        async with self._transaction() as conn:
            position = await next_position(conn, tenant_id, conversation_id)
            await insert_messages(conn, conversation_id, None, position, messages)
            await conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return messages

    async def list_items(self, conversation_id: str, *, limit: int, after: str | None = None,
                         order: str = "desc") -> tuple[list[Message], bool]:
        """A page of a conversation's messages in `order` ("asc": oldest first) after the message
        `after`, and whether more follow; LookupError if `after` is not one of its messages."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be asc or desc, got {order!r}")
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        bound, params = "", [conversation_id]
        if after is not None:
            cursor = await self._fetch("SELECT position FROM messages WHERE conversation_id = ? AND id = ?",
                                       (conversation_id, after))
            if not cursor:
                raise LookupError(f"no item {after!r} to list after")
            bound = f"AND position {compare} ? "
            params.append(cursor[0][0])
        rows = await self._fetch(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? {bound}"
                                 f"ORDER BY position {direction} LIMIT ?", (*params, limit + 1))
        return [message_from_row(row) for row in rows[:limit]], len(rows) > limit

    async def delete_item(self, conversation_id: str, message_id: str) -> bool:
        """Remove a message from a conversation for good; False if it has no such message."""
        deleted = await self._write("DELETE FROM messages WHERE conversation_id = ? AND id = ?",
                                    (conversation_id, message_id))
        return deleted == 1


def check_status(status: str) -> None:
    """ValueError naming the statuses unless `status` is one of them."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")


def new_message(conversation_id: str | None, role: str, content: str, call: dict | None = None, *, now: float,
                status: str = "complete") -> Message:
    """An item not yet written, with a fresh id (named as OpenAI names its kind) and no usage."""
    prefix = "msg_" if call is None else "fco_" if role == "tool" else "fc_"
    return Message(new_id(prefix, 12), conversation_id, role, content, status, None, 0, 0, 0, 0.0, now, now, None, call)


def message_from_row(row: sqlite3.Row) -> Message:
    """A row read with MESSAGE_COLUMNS as a Message (its token ids and call unpacked)."""
    *head, token_ids, call = row
    return Message(*head, tuple(array("i", token_ids)) if token_ids is not None else None,
                   orjson.loads(call) if call is not None else None)


async def next_position(conn: aiosqlite.Connection, tenant_id: str, conversation_id: str) -> int:
    """The position after a live conversation's last message; LookupError if it is not the tenant's."""
    live = await conn.execute_fetchall("SELECT 1 FROM conversations WHERE id = ? AND tenant_id = ? "
                                       "AND deleted_at IS NULL", (conversation_id, tenant_id))
    if not live:
        raise LookupError(f"no conversation {conversation_id!r}")
    [(position,)] = await conn.execute_fetchall(
        "SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id = ?", (conversation_id,))
    return position


async def insert_messages(conn: aiosqlite.Connection, conversation_id: str | None, response_id: str | None,
                          position: int, messages: list[Message]) -> None:
    """Write `messages` at `position`, `position + 1`, ... (of the response `response_id`, if any). Runs
    inside a transaction."""
    if not messages:
        return
    await conn.executemany(_INSERT_MESSAGE, [(position + i, response_id, *dataclasses.astuple(m)[:-2], _pack_ids(m.token_ids),
                                              _pack_call(m.call)) for i, m in enumerate(messages)])


async def _insert_calls(conn: aiosqlite.Connection, message_id: str, calls: Sequence[Call], status: str,
                        now: float) -> None:
    """Write a reply's calls right after it, moving any later items of its conversation down (items
    a client added while the reply was being generated). Runs inside finish_turn's transaction."""
    [(conversation_id, response_id, position)] = await conn.execute_fetchall(
        "SELECT conversation_id, response_id, position FROM messages WHERE id = ?", (message_id,))
    if conversation_id is not None:
        # Two steps, so that no two rows ever share a position while they move.
        await conn.execute("UPDATE messages SET position = -position - 1 - ? WHERE conversation_id = ? AND position > ?",
                           (len(calls), conversation_id, position))
        await conn.execute("UPDATE messages SET position = -position - 1 WHERE conversation_id = ? AND position < 0",
                           (conversation_id,))
    rows = [_call_row(c, conversation_id, status, now) for c in calls]
    await insert_messages(conn, conversation_id, response_id, position + 1, rows)


def call_rows(reply: Message, calls: Sequence[Call]) -> tuple[Message, list[Message]]:
    """A finished reply's rows as finish_turn writes them: its own (the first call's, when the reply
    is only calls) and one for each call after it."""
    if calls and calls[0].item_id == reply.id:
        first, calls = calls[0], calls[1:]
        reply = dataclasses.replace(reply, content=first.arguments, call={"call_id": first.call_id, "name": first.name})
    return reply, [_call_row(c, reply.conversation_id, reply.status, reply.updated_at) for c in calls]


def _call_row(call: Call, conversation_id: str | None, status: str, now: float) -> Message:
    return Message(call.item_id, conversation_id, "assistant", call.arguments, status, None, 0, 0, 0, 0.0, now, now,
                   None, {"call_id": call.call_id, "name": call.name})


def _pack_ids(token_ids: Sequence[int] | None) -> bytes | None:
    return array("i", token_ids).tobytes() if token_ids else None


def _pack_call(call: dict | None) -> str | None:
    return orjson.dumps(call).decode() if call is not None else None

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

import aiosqlite

from chatd.store.database import Database, whole
from chatd.store.records import Message, new_id
from chatd.store.usage import INSERT_USAGE

STATUSES = ("complete", "partial", "error")  # an assistant message stays "partial" if the server dies mid-reply
# In the order of Message's fields, so a row becomes a record with `message_from_row(row)`.
MESSAGE_COLUMNS = ("id, conversation_id, role, content, status, finish_reason, prompt_tokens, cached_tokens, "
                   "completion_tokens, cost, created_at, updated_at, token_ids")
_INSERT_MESSAGE = (f"INSERT INTO messages (position, response_id, {MESSAGE_COLUMNS}) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


class Messages(Database):
    """Store methods for a conversation's messages: turns, and items."""

    async def list_messages(self, conversation_id: str) -> list[Message]:
        """A conversation's messages in order (check the conversation is the caller's first)."""
        rows = await self._fetch(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? "
                                 "ORDER BY position", (conversation_id,))
        return [message_from_row(row) for row in rows]

    async def get_message(self, conversation_id: str, message_id: str) -> Message | None:
        """One message of a conversation, or None."""
        rows = await self._fetch(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND id = ?",
                                 (conversation_id, message_id))
        return message_from_row(rows[0]) if rows else None

    # --- turns ---

    @whole
    async def start_turn(self, tenant_id: str, conversation_id: str, content: str) -> tuple[Message, Message]:
        """Add the user's message and an empty `partial` assistant reply, or LookupError and nothing."""
        now = self._clock()
        user = new_message(conversation_id, "user", content, now)
        reply = new_message(conversation_id, "assistant", "", now, status="partial")
        async with self._transaction() as conn:
            position = await next_position(conn, tenant_id, conversation_id)
            await insert_messages(conn, conversation_id, None, position, [user, reply])
            await conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return user, reply

    async def save_partial(self, message_id: str, content: str, completion_tokens: int) -> None:
        """Keep the reply so far; a reply already finished is left alone."""
        await self._write("UPDATE messages SET content = ?, completion_tokens = ?, updated_at = ? "
                          "WHERE id = ? AND status = 'partial'", (content, completion_tokens, self._clock(), message_id))

    @whole
    async def finish_turn(self, tenant_id: str, message_id: str, *, content: str, status: str,
                          finish_reason: str | None, prompt_tokens: int, cached_tokens: int,
                          completion_tokens: int, cost: float, model: str, endpoint: str = "conversations",
                          finished_at: float | None = None, token_ids: Sequence[int] | None = None) -> Message:
        """Write the finished reply and its usage event together, both stamped `finished_at`
        (default: now). token_ids: the reply's tokens as generated, kept for the next turn's prompt.

        When the message is gone (its conversation purged mid-reply) the usage is still recorded,
        then LookupError is raised.
        """
        check_status(status)
        now = self._clock() if finished_at is None else finished_at
        async with self._transaction() as conn:
            await conn.execute(
                "UPDATE messages SET content = ?, status = ?, finish_reason = ?, prompt_tokens = ?, cached_tokens = ?, "
                "completion_tokens = ?, cost = ?, updated_at = ?, token_ids = ? WHERE id = ?",
                (content, status, finish_reason, prompt_tokens, cached_tokens, completion_tokens, cost, now,
                 _pack_ids(token_ids), message_id))
            rows = await conn.execute_fetchall(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,))
            conversation_id = rows[0][1] if rows else None
            await conn.execute(INSERT_USAGE, (tenant_id, endpoint, model, conversation_id, message_id,
                                              prompt_tokens, cached_tokens, completion_tokens, cost, now))
        if not rows:
            raise LookupError(f"no message {message_id!r} (its usage was recorded)")
        return message_from_row(rows[0])

    # --- items: a conversation's messages as OpenAI's Conversations API names them ---

    @whole
    async def add_items(self, tenant_id: str, conversation_id: str, items: list[tuple[str, str]]) -> list[Message]:
        """Append complete messages (role, text) to the tenant's live conversation, or LookupError and nothing."""
        now = self._clock()
        messages = [new_message(conversation_id, role, text, now) for role, text in items]
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


def new_message(conversation_id: str | None, role: str, content: str, now: float,
                status: str = "complete") -> Message:
    """A message not yet written, with a fresh id and no usage."""
    return Message(new_id("msg_", 12), conversation_id, role, content, status, None, 0, 0, 0, 0.0, now, now)


def message_from_row(row: sqlite3.Row) -> Message:
    """A row read with MESSAGE_COLUMNS as a Message (its token ids unpacked)."""
    *head, token_ids = row
    return Message(*head, tuple(array("i", token_ids)) if token_ids is not None else None)


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
    await conn.executemany(_INSERT_MESSAGE, [(position + i, response_id, *dataclasses.astuple(m)[:-1], _pack_ids(m.token_ids))
                                             for i, m in enumerate(messages)])


def _pack_ids(token_ids: Sequence[int] | None) -> bytes | None:
    return array("i", token_ids).tobytes() if token_ids else None

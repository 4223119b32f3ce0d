"""Server-side conversations, in the store: made (with their first items), read, paged newest
first, renamed, soft-deleted, and purged later with their messages.

A conversation is only ever its tenant's: another tenant's, a deleted one and a missing one all
read as None, so the API never confirms that an id exists. `Conversations` is a mixin of `Store`
(db.py): its SQL runs through the store's `_fetch`, `_write` and `_transaction`; its messages are
written with messages.py's functions. It knows nothing of HTTP.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import orjson

from chatd.store.database import Database, whole
from chatd.store.messages import insert_messages, new_message
from chatd.store.records import Conversation, new_id

# In the order of Conversation's fields, so a row becomes a record with `_conversation(row)`.
_CONVERSATION_COLUMNS = "id, tenant_id, model, title, system_prompt, metadata, created_at, updated_at"


class Conversations(Database):
    """Store methods for a tenant's conversations."""

    @whole
    async def create_conversation(self, tenant_id: str, *, model: str, title: str | None = None,
                                  system_prompt: str | None = None, metadata: dict[str, Any] | None = None,
                                  items: list[tuple[str, str]] = ()) -> Conversation:
        """A new conversation, with its first `items` (role, text) if given; `metadata` is kept as
        JSON (orjson: str keys, ints within 64 bits)."""
        now = self._clock()
        conversation = Conversation(new_id("conv_", 12), tenant_id, model, title, system_prompt,
                                    dict(metadata or {}), now, now)
        async with self._transaction() as conn:
            await conn.execute(f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                               (conversation.id, tenant_id, model, title, system_prompt,
                                orjson.dumps(conversation.metadata).decode(), now, now))
            await insert_messages(conn, conversation.id, None, 0, [new_message(conversation.id, *item, now=now)
                                                                   for item in items])
        return conversation

    async def get_conversation(self, tenant_id: str, conversation_id: str) -> Conversation | None:
        """The tenant's live conversation; None if missing, deleted or someone else's."""
        rows = await self._fetch(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations "
                                 "WHERE id = ? AND tenant_id = ? AND deleted_at IS NULL", (conversation_id, tenant_id))
        return _conversation(rows[0]) if rows else None

    async def list_conversations(self, tenant_id: str, *, limit: int,
                                 after: str | None = None) -> tuple[list[Conversation], bool]:
        """A page of the tenant's conversations, newest first, and whether more follow.

        `after` is the id of the previous page's last conversation; LookupError if it is not
        one of this tenant's live conversations.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        live = "tenant_id = ? AND deleted_at IS NULL"
        if after is None:
            rows = await self._fetch(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE {live} "
                                     "ORDER BY created_at DESC, id DESC LIMIT ?", (tenant_id, limit + 1))
        else:
            cursor = await self._fetch(f"SELECT created_at, id FROM conversations WHERE {live} AND id = ?",
                                       (tenant_id, after))
            if not cursor:
                raise LookupError(f"no conversation {after!r} to list after")
            rows = await self._fetch(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE {live} "
                                     "AND (created_at, id) < (?, ?) ORDER BY created_at DESC, id DESC LIMIT ?",
                                     (tenant_id, *cursor[0], limit + 1))
        return [_conversation(row) for row in rows[:limit]], len(rows) > limit

    async def update_conversation(self, tenant_id: str, conversation_id: str, **fields: Any) -> Conversation | None:
        """Change a live conversation's `title`, `system_prompt` and/or `metadata` (replaced whole, as
        OpenAI's update does); None if it is missing, deleted or someone else's."""
        unknown = set(fields) - {"title", "system_prompt", "metadata"}
        if unknown:
            raise ValueError(f"cannot update {sorted(unknown)} of a conversation")
        if "metadata" in fields:
            fields["metadata"] = orjson.dumps(dict(fields["metadata"])).decode()
        assignments = "".join(f"{name} = ?, " for name in fields)
        changed = await self._write(f"UPDATE conversations SET {assignments}updated_at = ? "
                                    "WHERE id = ? AND tenant_id = ? AND deleted_at IS NULL",
                                    (*fields.values(), self._clock(), conversation_id, tenant_id))
        return await self.get_conversation(tenant_id, conversation_id) if changed == 1 else None

    @whole
    async def move_conversation(self, tenant_id: str, conversation_id: str, model: str) -> bool:
        """The conversation goes on with another model: it names that model now, and its replies'
        token ids (the old model's tokens) are forgotten, so its history is rendered again from text
        for the new one. False if it is missing, deleted or someone else's."""
        async with self._transaction() as conn:
            moved = await conn.execute("UPDATE conversations SET model = ? WHERE id = ? AND tenant_id = ? "
                                       "AND deleted_at IS NULL", (model, conversation_id, tenant_id))
            if moved.rowcount != 1:
                return False
            await conn.execute("UPDATE messages SET token_ids = NULL WHERE conversation_id = ? AND token_ids IS NOT NULL",
                               (conversation_id,))
        return True

    async def delete_conversation(self, tenant_id: str, conversation_id: str) -> bool:
        """Soft delete: hidden at once, purged later. False if missing, deleted or someone else's."""
        deleted = await self._write("UPDATE conversations SET deleted_at = ? "
                                    "WHERE id = ? AND tenant_id = ? AND deleted_at IS NULL",
                                    (self._clock(), conversation_id, tenant_id))
        return deleted == 1

    @whole
    async def purge_deleted(self, deleted_before: float) -> int:
        """Remove conversations and responses deleted before that time, with their messages (a
        deleted response's messages in a live conversation stay there); usage stays. Returns how
        many conversations and responses were removed."""
        # Responses are purged here too: a standalone response's messages are a conversation of
        # their own (conversation_id NULL), and a conversation's responses go with it (cascade).
        async with self._transaction() as conn:
            gone = "SELECT id FROM responses WHERE deleted_at IS NOT NULL AND deleted_at < ?"
            await conn.execute(f"DELETE FROM messages WHERE conversation_id IS NULL AND response_id IN ({gone})",
                               (deleted_before,))
            responses = await conn.execute("DELETE FROM responses WHERE deleted_at IS NOT NULL AND deleted_at < ?",
                                           (deleted_before,))
            conversations = await conn.execute("DELETE FROM conversations WHERE deleted_at IS NOT NULL AND deleted_at < ?",
                                               (deleted_before,))
            return responses.rowcount + conversations.rowcount


def _conversation(row: sqlite3.Row) -> Conversation:
    *head, metadata, created_at, updated_at = row
    return Conversation(*head, orjson.loads(metadata), created_at, updated_at)

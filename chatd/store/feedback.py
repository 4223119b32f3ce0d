"""Users' ratings of replies (thumbs up or down, with a comment): the quality signal an operator
reads per model, and the source of `chatd eval add`'s new golden items.

A rating is on a reply its tenant was given: an assistant message of a conversation or a
Responses chain, a stored response, or a chat or text completion (whose usage row keeps its id,
so chatd can say which model served it without keeping its text). A tenant rates a reply once;
rating it again replaces the rating. `Feedback` is a mixin of `Store` (its SQL runs through the
store's `_fetch` and `_write`, on SQLite or PostgreSQL alike).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from chatd.store.records import new_id

RATINGS = ("up", "down")
TARGETS = ("message", "response", "completion")
MAX_COMMENT_CHARS = 2000

# Schema version 8 (database.py runs it as MIGRATIONS[6]). A migration step is fixed once released.
# No foreign key on the reply: a rating outlives a purged conversation (its model and text-free
# verdict are what the operator keeps).
FEEDBACK_MIGRATION = [
    """CREATE TABLE feedback (
        id         TEXT PRIMARY KEY,  -- "fb_" + 24 hex
        tenant_id  TEXT NOT NULL REFERENCES tenants (id),
        target_id  TEXT NOT NULL,     -- the reply rated
        target     TEXT NOT NULL CHECK (target IN ('message', 'response', 'completion')),
        model      TEXT NOT NULL,     -- the model that served the reply
        rating     TEXT NOT NULL CHECK (rating IN ('up', 'down')),
        comment    TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        UNIQUE (tenant_id, target_id)
    )""",
    "CREATE INDEX feedback_newest ON feedback (updated_at DESC, id DESC)",
    # A completion's rating finds its usage row by the completion's id.
    "CREATE INDEX usage_by_message ON usage_events (message_id) WHERE message_id IS NOT NULL",
]
_COLUMNS = "id, tenant_id, target_id, target, model, rating, comment, created_at, updated_at"


@dataclass(frozen=True)
class Rating:
    """One tenant's rating of one reply."""

    id: str
    tenant_id: str
    target_id: str
    target: str  # message | response | completion
    model: str
    rating: str  # up | down
    comment: str | None
    created_at: float
    updated_at: float
    tenant_name: str | None = None  # (the operator's lists)


class Feedback:
    """Store methods that keep and list ratings of replies."""

    # Provided by Store.
    _clock: Callable[[], float]
    _fetch: Callable[..., Awaitable[list[sqlite3.Row]]]
    _write: Callable[[str, tuple], Awaitable[int]]

    async def rated_reply(self, tenant_id: str, reply_id: str) -> tuple[str, str] | None:
        """(target, model) of a reply this tenant was given, found by its id; None for an id that is
        no reply of this tenant's (another tenant's reads as unknown)."""
        if reply_id.startswith("resp_"):
            rows = await self._fetch("SELECT model FROM responses WHERE id = ? AND tenant_id = ? AND deleted_at IS NULL "
                                     "AND stored = 1", (reply_id, tenant_id))
            return ("response", rows[0][0]) if rows else None
        if reply_id.startswith("msg_"):
            rows = await self._fetch(
                "SELECT COALESCE(c.model, r.model) FROM messages m "
                "LEFT JOIN conversations c ON c.id = m.conversation_id AND c.tenant_id = ? AND c.deleted_at IS NULL "
                "LEFT JOIN responses r ON r.id = m.response_id AND r.tenant_id = ? AND r.deleted_at IS NULL "
                "WHERE m.id = ? AND m.role = 'assistant' AND (c.id IS NOT NULL OR r.id IS NOT NULL)",
                (tenant_id, tenant_id, reply_id))
            return ("message", rows[0][0]) if rows else None
        if reply_id.startswith(("chatcmpl-", "cmpl-")):
            rows = await self._fetch("SELECT model FROM usage_events WHERE message_id = ? AND tenant_id = ? "
                                     "AND endpoint IN ('chat.completions', 'completions')", (reply_id, tenant_id))
            return ("completion", rows[0][0]) if rows else None
        return None

    async def rating_of(self, tenant_id: str, target_id: str) -> str | None:
        """The tenant's rating of a reply now (up or down), or None if it has none."""
        rows = await self._fetch("SELECT rating FROM feedback WHERE tenant_id = ? AND target_id = ?", (tenant_id, target_id))
        return rows[0][0] if rows else None

    async def rate(self, tenant_id: str, target_id: str, target: str, model: str, rating: str,
                   comment: str | None = None) -> Rating:
        """Keep a tenant's rating of a reply (found by `rated_reply`), replacing its earlier one."""
        if rating not in RATINGS:
            raise ValueError(f"rating must be one of {RATINGS}, got {rating!r}")
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        now = self._clock()
        await self._write(
            f"INSERT INTO feedback ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (tenant_id, target_id) DO UPDATE SET rating = excluded.rating, comment = excluded.comment, "
            "updated_at = excluded.updated_at",
            (new_id("fb_", 12), tenant_id, target_id, target, model, rating, comment, now, now))
        rows = await self._fetch(f"SELECT {_COLUMNS} FROM feedback WHERE tenant_id = ? AND target_id = ?",
                                 (tenant_id, target_id))
        return Rating(*rows[0])

    async def list_feedback(self, *, rating: str | None = None, model: str | None = None, limit: int = 100,
                            since: float = 0.0) -> list[Rating]:
        """The ratings given or changed since `since`, newest first, of one rating and model when given
        (the operator's list: every tenant's)."""
        where, params = " AND f.updated_at >= ?", [since]
        if rating is not None:
            where, params = where + " AND f.rating = ?", [*params, rating]
        if model is not None:
            where, params = where + " AND f.model = ?", [*params, model]
        columns = ", ".join(f"f.{column}" for column in _COLUMNS.split(", "))
        rows = await self._fetch(f"SELECT {columns}, t.name FROM feedback f JOIN tenants t ON t.id = f.tenant_id "
                                 f"WHERE TRUE{where} ORDER BY f.updated_at DESC, f.id DESC LIMIT ?", (*params, limit))
        return [Rating(*row) for row in rows]

    async def rated_exchange(self, rated: Rating) -> tuple[str | None, str | None]:
        """(the user's last message before the reply, the reply's text) of a rated conversation or
        chain reply or stored response, as the store keeps them; (None, None) for a completion
        (chatd keeps no completion's text) or a reply since purged."""
        reply_id = rated.target_id
        if rated.target == "response":
            rows = await self._fetch("SELECT output_message_id FROM responses WHERE id = ?", (reply_id,))
            if not rows or rows[0][0] is None:
                return None, None
            reply_id = rows[0][0]
        elif rated.target != "message":
            return None, None
        return await self.exchange(reply_id)

    async def exchange(self, reply_id: str) -> tuple[str | None, str | None]:
        """(the user's last message before this assistant message, its text); (None, None) if it is gone."""
        rows = await self._fetch("SELECT conversation_id, response_id, position, content FROM messages WHERE id = ?",
                                 (reply_id,))
        if not rows:
            return None, None
        conversation_id, response_id, position, reply = rows[0]
        owner, value = ("conversation_id", conversation_id) if conversation_id is not None else ("response_id", response_id)
        asked = await self._fetch(f"SELECT content FROM messages WHERE {owner} = ? AND role = 'user' AND position < ? "
                                  "ORDER BY position DESC LIMIT 1", (value, position))
        return (asked[0][0] if asked else None), reply

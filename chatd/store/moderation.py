"""The safety pipeline's audit trail in the store: each time a content policy blocks, flags or
redacts a request's input or a reply's output, one moderation event, whose id is the appeal id
the user is given; the user may appeal it once, and the operator resolves it.

`ModerationLog` is a mixin of `Store`: it runs its SQL through the store's `_fetch` and `_write`
(one statement each, so each change is atomic without a transaction) and stamps times with the
store's clock. It knows nothing of policies, HTTP or the CLI: it keeps and hands out
`ModerationEvent`s, and refuses values it does not know by name.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from chatd.store.records import ModerationEvent, new_id

STAGES = ("input", "output", "moderations")  # a request's messages, a streamed reply, the /v1/moderations endpoint
ACTIONS = ("blocked", "flagged", "redacted", "guard_failed")
EVENT_STATUSES = ("open", "appealed", "upheld", "overturned")
DECISIONS = ("upheld", "overturned")  # what the operator's review may end in
EXCERPT_CHARS = 200
MAX_APPEAL_CHARS = 2000

# Schema version 5 (database.py runs it as MIGRATIONS[3]). A migration step is fixed once released:
# change this table with a new step, never here. No foreign key on the conversation, message or
# request: the audit trail outlives a purged conversation and must not block its purge.
MODERATION_MIGRATION = [
    """CREATE TABLE moderation_events (
        id              TEXT PRIMARY KEY,  -- "modr_" + 24 hex: the appeal id the user is given
        tenant_id       TEXT NOT NULL REFERENCES tenants (id),
        stage           TEXT NOT NULL CHECK (stage IN ('input', 'output', 'moderations')),
        action          TEXT NOT NULL CHECK (action IN ('blocked', 'flagged', 'redacted', 'guard_failed')),
        categories      TEXT NOT NULL,     -- a JSON array of strings
        endpoint        TEXT NOT NULL,     -- chat.completions | responses | conversations | moderations | ...
        excerpt         TEXT,              -- up to 200 characters, when the operator keeps excerpts
        text_sha256     TEXT,              -- the whole text's digest, when the operator keeps hashes
        request_id      TEXT,
        conversation_id TEXT,
        message_id      TEXT,
        created_at      REAL NOT NULL,
        status          TEXT NOT NULL CHECK (status IN ('open', 'appealed', 'upheld', 'overturned')),
        appeal_reason   TEXT,
        appealed_at     REAL,
        resolved_at     REAL,
        resolution_note TEXT
    )""",
    # The operator's list, newest first; a tenant's events; the queue of one status (appealed).
    "CREATE INDEX moderation_events_newest ON moderation_events (created_at DESC, id DESC)",
    "CREATE INDEX moderation_events_by_tenant ON moderation_events (tenant_id, created_at DESC, id DESC)",
    "CREATE INDEX moderation_events_by_status ON moderation_events (status, created_at DESC, id DESC)",
]

# In the order of ModerationEvent's fields, so a row becomes a record with `_event(row)`.
_EVENT_COLUMNS = ("id, tenant_id, stage, action, categories, endpoint, excerpt, text_sha256, request_id, "
                  "conversation_id, message_id, created_at, status, appeal_reason, appealed_at, resolved_at, "
                  "resolution_note")
_INSERT_EVENT = (f"INSERT INTO moderation_events ({_EVENT_COLUMNS}) "
                 f"VALUES ({', '.join(['?'] * len(_EVENT_COLUMNS.split(', ')))})")
_NEWEST_FIRST = "ORDER BY created_at DESC, id DESC"


class ModerationLog:
    """Store methods that record the safety pipeline's decisions, their appeals and their review."""

    # Provided by Store.
    _clock: Callable[[], float]
    _fetch: Callable[..., Awaitable[list[sqlite3.Row]]]
    _write: Callable[[str, tuple], Awaitable[int]]

    async def add_moderation_event(self, tenant_id: str, *, stage: str, action: str, categories: Sequence[str],
                                   endpoint: str, excerpt: str | None = None, text_sha256: str | None = None,
                                   request_id: str | None = None, conversation_id: str | None = None,
                                   message_id: str | None = None) -> ModerationEvent:
        """Record one decision, "open" until appealed or reviewed; the excerpt is cut to 200 characters."""
        _check_choice("stage", stage, STAGES)
        _check_choice("action", action, ACTIONS)
        # A lone string is a Sequence[str] too, but its letters are no categories.
        if isinstance(categories, str) or not all(isinstance(c, str) and c for c in categories):
            raise ValueError(f"categories must be a list of non-empty strings; got {categories!r}")
        event = ModerationEvent(
            id=new_id("modr_", 12), tenant_id=tenant_id, stage=stage, action=action,
            categories=tuple(categories), endpoint=endpoint,
            excerpt=None if excerpt is None else excerpt[:EXCERPT_CHARS], text_sha256=text_sha256,
            request_id=request_id, conversation_id=conversation_id, message_id=message_id,
            created_at=self._clock(), status="open", appeal_reason=None, appealed_at=None, resolved_at=None,
            resolution_note=None)
        await self._write(_INSERT_EVENT, _event_values(event))
        return event

    async def get_moderation_event(self, event_id: str, tenant_id: str | None = None) -> ModerationEvent | None:
        """The event; with `tenant_id`, only if it is that tenant's (someone else's reads as unknown)."""
        where, params = _filters(tenant_id=tenant_id)
        rows = await self._fetch(f"SELECT {_EVENT_COLUMNS} FROM moderation_events WHERE id = ?{where}",
                                 (event_id, *params))
        return _event(rows[0]) if rows else None

    async def list_moderation_events(self, *, status: str | None = None, tenant_id: str | None = None,
                                     limit: int = 50, after: str | None = None) -> list[ModerationEvent]:
        """A page of events, newest first, with that status and of that tenant when given.

        `after` is the id of the previous page's last event; LookupError if it is not one of the
        events listed (with `tenant_id`: not one of that tenant's).
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        where, params = _filters(status=status, tenant_id=tenant_id)
        if after is not None:
            cursor = await self._fetch(f"SELECT created_at, id FROM moderation_events WHERE id = ?{where}",
                                       (after, *params))
            if not cursor:
                raise LookupError(f"no moderation event {after!r} to list after")
            where += " AND (created_at, id) < (?, ?)"
            params += tuple(cursor[0])
        rows = await self._fetch(f"SELECT {_EVENT_COLUMNS} FROM moderation_events WHERE TRUE{where} "
                                 f"{_NEWEST_FIRST} LIMIT ?", (*params, limit))
        return [_event(row) for row in rows]

    async def count_moderation_events(self, *, status: str | None = None, tenant_id: str | None = None) -> int:
        """How many events have that status (and tenant), all of them without filters."""
        where, params = _filters(status=status, tenant_id=tenant_id)
        [(count,)] = await self._fetch(f"SELECT COUNT(*) FROM moderation_events WHERE TRUE{where}", params)
        return count

    async def appeal_moderation_event(self, event_id: str, tenant_id: str, reason: str) -> ModerationEvent:
        """The tenant contests an open event, once: it becomes "appealed" with the reason.

        LookupError if the tenant has no such event; ValueError if it is no longer open, or the
        reason is blank or longer than 2000 characters.
        """
        if not reason.strip():
            raise ValueError("reason must not be empty")
        if len(reason) > MAX_APPEAL_CHARS:
            raise ValueError(f"reason may be at most {MAX_APPEAL_CHARS} characters; got {len(reason)}")
        # Conditional on "open" in the one statement: two appeals racing cannot both succeed.
        changed = await self._write(
            "UPDATE moderation_events SET status = 'appealed', appeal_reason = ?, appealed_at = ? "
            "WHERE id = ? AND tenant_id = ? AND status = 'open'", (reason, self._clock(), event_id, tenant_id))
        event = await self.get_moderation_event(event_id, tenant_id)
        if event is None:
            raise LookupError(f"no moderation event {event_id!r}")
        if changed != 1:
            raise ValueError(f"moderation event {event_id!r} is {event.status}; only an open event can be appealed")
        return event

    async def resolve_moderation_event(self, event_id: str, decision: str, note: str | None = None) -> ModerationEvent:
        """The operator's review: "upheld" or "overturned", appealed or not, once.

        LookupError for an unknown id; ValueError for another decision or an event already resolved.
        """
        _check_choice("decision", decision, DECISIONS)
        changed = await self._write(
            "UPDATE moderation_events SET status = ?, resolution_note = ?, resolved_at = ? "
            "WHERE id = ? AND status IN ('open', 'appealed')", (decision, note, self._clock(), event_id))
        event = await self.get_moderation_event(event_id)
        if event is None:
            raise LookupError(f"no moderation event {event_id!r}")
        if changed != 1:
            raise ValueError(f"moderation event {event_id!r} is already {event.status}; it cannot be resolved again")
        return event


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    """ValueError naming the field and what it may be, unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}; got {value!r}")


def _filters(*, status: str | None = None, tenant_id: str | None = None) -> tuple[str, tuple[Any, ...]]:
    """The `AND ...` conditions (and their parameters) for the filters given; the status is checked."""
    where, params = "", ()
    if status is not None:
        _check_choice("status", status, EVENT_STATUSES)
        where, params = where + " AND status = ?", (*params, status)
    if tenant_id is not None:
        where, params = where + " AND tenant_id = ?", (*params, tenant_id)
    return where, params


def _event_values(event: ModerationEvent) -> tuple[Any, ...]:
    """The event as the row's values, in _EVENT_COLUMNS' order (its categories as JSON)."""
    return (event.id, event.tenant_id, event.stage, event.action, orjson.dumps(list(event.categories)).decode(),
            event.endpoint, event.excerpt, event.text_sha256, event.request_id, event.conversation_id,
            event.message_id, event.created_at, event.status, event.appeal_reason, event.appealed_at,
            event.resolved_at, event.resolution_note)


def _event(row: sqlite3.Row) -> ModerationEvent:
    id_, tenant_id, stage, action, categories, *rest = row
    return ModerationEvent(id_, tenant_id, stage, action, tuple(orjson.loads(categories)), *rest)

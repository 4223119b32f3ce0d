"""The store: one SQLite file, read and written through aiosqlite, holding who may call the API
(tenants, API keys), their conversations and messages, what each request used, and the safety
pipeline's moderation events (moderation.py).

It knows nothing of HTTP or the engine; it hands out the frozen records of records.py. The
schema is `schema.sql` (version 1) followed by the steps in MIGRATIONS, tracked in
`PRAGMA user_version`. All SQL takes its values as parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import re
import secrets
import sqlite3
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiosqlite
import orjson

from chatd.config import TIER_NAME  # which tiers exist is the config's to say; a name's spelling is checked here
from chatd.store.moderation import MODERATION_MIGRATION, ModerationLog
from chatd.store.records import ApiKey, Conversation, Message, Response, Tenant, Usage

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
# Column lists in the order of the dataclass fields, so a row becomes `Message(*row)`.
_API_KEY_COLUMNS = "k.id, k.tenant_id, t.name, t.tier, k.created_at, k.revoked_at, k.last_used_at"
_CONVERSATION_COLUMNS = "id, tenant_id, model, title, system_prompt, metadata, created_at, updated_at"
_MESSAGE_COLUMNS = ("id, conversation_id, role, content, status, finish_reason, prompt_tokens, cached_tokens, "
                    "completion_tokens, cost, created_at, updated_at, token_ids")
_INSERT_MESSAGE = (f"INSERT INTO messages (position, response_id, {_MESSAGE_COLUMNS}) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_RESPONSE_COLUMNS = ("id, tenant_id, conversation_id, previous_response_id, output_message_id, stored, model, "
                     "instructions, request, created_at")
_INSERT_USAGE = ("INSERT INTO usage_events (tenant_id, endpoint, model, conversation_id, message_id, prompt_tokens, "
                 "cached_tokens, completion_tokens, cost, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")

# The columns messages had at version 1 (fixed: migration 3 copies them).
_V1_MESSAGE_COLUMNS = ("id, conversation_id, role, content, status, finish_reason, prompt_tokens, cached_tokens, "
                       "completion_tokens, cost, created_at, updated_at")

# Later schema changes, in order: MIGRATIONS[0] takes a file from version 1 to 2, and so on. Each
# step is a list of SQL statements, run in one transaction together with its version bump.
MIGRATIONS: list[list[str]] = [
    # 2: the table probe_write fills in a transaction it always rolls back; it never holds a row.
    ["CREATE TABLE write_probe (body BLOB NOT NULL)"],
    # 3: OpenAI's Responses API. A response owns the messages it added (its input items and its
    # output); they belong to a conversation (`conversation=`) or to no conversation (a
    # standalone response, chained by previous_response_id), so messages are rebuilt with a
    # nullable conversation_id and a response_id. Existing rows are kept as they are.
    [
        """CREATE TABLE responses (
            id                   TEXT PRIMARY KEY,  -- "resp_" + 24 hex
            tenant_id            TEXT NOT NULL REFERENCES tenants (id),
            conversation_id      TEXT REFERENCES conversations (id) ON DELETE CASCADE,
            previous_response_id TEXT,              -- no foreign key: a chain outlives a purged link
            output_message_id    TEXT,
            stored               INTEGER NOT NULL,  -- 0: a store=false response; only this row is kept
            model                TEXT NOT NULL,
            instructions         TEXT,
            request              TEXT NOT NULL,     -- a JSON object: the request fields a response echoes
            created_at           REAL NOT NULL,
            deleted_at           REAL               -- soft delete; the purge removes the row later
        )""",
        """CREATE TABLE messages_v3 (
            id                TEXT PRIMARY KEY,
            conversation_id   TEXT REFERENCES conversations (id) ON DELETE CASCADE,  -- NULL: a standalone response's
            response_id       TEXT REFERENCES responses (id) ON DELETE SET NULL,     -- the response that added it
            position          INTEGER NOT NULL,  -- 0, 1, 2, ... within the conversation (or the response)
            role              TEXT NOT NULL,     -- user | assistant | system | developer
            content           TEXT NOT NULL,
            status            TEXT NOT NULL CHECK (status IN ('complete', 'partial', 'error')),
            finish_reason     TEXT,
            prompt_tokens     INTEGER NOT NULL DEFAULT 0,
            cached_tokens     INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0,
            cost              REAL NOT NULL DEFAULT 0,
            created_at        REAL NOT NULL,
            updated_at        REAL NOT NULL,
            UNIQUE (conversation_id, position)
        )""",
        f"INSERT INTO messages_v3 (position, {_V1_MESSAGE_COLUMNS}) SELECT position, {_V1_MESSAGE_COLUMNS} FROM messages",
        "DROP TABLE messages",
        "ALTER TABLE messages_v3 RENAME TO messages",
        "CREATE INDEX messages_by_response ON messages (response_id, position) WHERE response_id IS NOT NULL",
        "CREATE INDEX responses_by_tenant ON responses (tenant_id, created_at)",
    ],
    # 4: a reply's token ids as the model generated them (int32s, native byte order), so the next
    # turn's prompt holds exactly the tokens the prefix cache has. NULL: only its text is known.
    ["ALTER TABLE messages ADD COLUMN token_ids BLOB"],
    # 5: the safety pipeline's decisions and their appeals (its SQL lives in moderation.py).
    MODERATION_MIGRATION,
]
SCHEMA_VERSION = 1 + len(MIGRATIONS)

STATUSES = ("complete", "partial", "error")  # an assistant message stays "partial" if the server dies mid-reply
LOCAL_TENANT = "local"  # id and name of the one user while auth is off
PROBE_PAGES = 8  # probe_write needs room for this many new pages
LAST_USED_RESOLUTION_S = 60.0  # a key's last_used_at is written at most this often
KEY_PATTERN = re.compile(r"chatd_([0-9a-f]{12})_([A-Za-z0-9_-]+)")  # chatd_<key id>_<secret>


class StoreFileError(ValueError):
    """The database file cannot be used by this chatd (written by a newer one, or not chatd's)."""


def _whole(method):
    """Run a method that writes in a transaction to its end even if its caller is cancelled (a
    client that went away): the reply is still saved and billed, and no transaction is left open."""
    @functools.wraps(method)
    async def run(self, *args, **kwargs):
        return await asyncio.shield(method(self, *args, **kwargs))

    return run


class Store(ModerationLog):
    """chatd's SQLite file. One connection; an asyncio lock keeps each transaction whole.
    (The moderation events' methods come from ModerationLog, in moderation.py.)"""

    def __init__(self, conn: aiosqlite.Connection, path: Path, clock: Callable[[], float]):
        self._conn = conn
        self._lock = asyncio.Lock()
        self._clock = clock
        self.path = path

    @classmethod
    async def open(cls, path: str | Path, *, clock: Callable[[], float] = time.time, max_bytes: int = 0) -> Store:
        """Open (creating it and its folder if missing) and migrate the file to SCHEMA_VERSION.

        With `max_bytes` > 0 the database may not grow past that size: a write that needs more
        fails as on a full disk (sqlite3.OperationalError "database or disk is full"), until
        rows are deleted (freed pages are reused). The WAL file next to it is not counted.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; the store opens its own (see _transaction).
        conn = await aiosqlite.connect(path, isolation_level=None)
        try:
            await conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
            # With WAL, NORMAL syncs at checkpoints, not at every commit: a killed process loses
            # nothing (committed pages are in the WAL, in the OS's hands); only a power cut or OS
            # crash can lose the last commits, and never corrupts the file.
            await conn.execute("PRAGMA synchronous = NORMAL")
            await conn.execute("PRAGMA foreign_keys = ON")  # per connection; the cascades need it
            await conn.execute("PRAGMA busy_timeout = 5000")  # wait for `chatd keys` in another process
            await _migrate(conn, path)
            if max_bytes > 0:
                # Per connection, not kept in the file. SQLite fails a write that would need a page
                # past it with SQLITE_FULL; a file already larger keeps its size as the limit.
                [(page_size,)] = await conn.execute_fetchall("PRAGMA page_size")
                await conn.execute(f"PRAGMA max_page_count = {max(1, max_bytes // page_size)}")
        except BaseException:
            await conn.close()
            raise
        return cls(conn, path, clock)

    async def close(self) -> None:
        """Close the connection (the last one to close folds the WAL back into the file)."""
        await self._conn.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # --- tenants and keys ---

    @_whole
    async def local_tenant(self, tier: str) -> Tenant:
        """The one user while auth is off, created on first use; its tier is set to `tier`."""
        _check_tier(tier)
        async with self._transaction() as conn:
            tenant_id = await _upsert_tenant(conn, LOCAL_TENANT, tier, self._clock())
        return Tenant(tenant_id, LOCAL_TENANT, tier)

    @_whole
    async def create_key(self, name: str, tier: str) -> tuple[str, ApiKey]:
        """Make a key for tenant `name` (created if new; its tier set). Returns the key, shown once."""
        _check_tier(tier)
        if not name.strip():
            raise ValueError("a key needs a tenant name")
        key_id, secret, now = secrets.token_hex(6), secrets.token_urlsafe(32), self._clock()
        async with self._transaction() as conn:
            tenant_id = await _upsert_tenant(conn, name, tier, now)
            await conn.execute(
                "INSERT INTO api_keys (id, tenant_id, secret_sha256, created_at) VALUES (?, ?, ?, ?)",
                (key_id, tenant_id, _sha256(secret), now))
        return f"chatd_{key_id}_{secret}", ApiKey(key_id, tenant_id, name, tier, now, None, None)

    async def list_keys(self) -> list[ApiKey]:
        """Every key, revoked ones included, newest first."""
        rows = await self._fetch(f"SELECT {_API_KEY_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
                                 "ORDER BY k.created_at DESC, k.id DESC")
        return [ApiKey(*row) for row in rows]

    async def revoke_key(self, key_id: str) -> bool:
        """Revoke a key for good; False when there is no such live key."""
        revoked = await self._write("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                    (self._clock(), key_id))
        return revoked == 1

    async def authenticate(self, key: str) -> Tenant | None:
        """The tenant of a live key; None for a malformed, unknown, wrong or revoked one."""
        match = KEY_PATTERN.fullmatch(key)
        if match is None:
            return None
        key_id, secret = match.groups()
        rows = await self._fetch(
            "SELECT k.secret_sha256, k.revoked_at, k.last_used_at, t.id, t.name, t.tier "
            "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.id = ?", (key_id,))
        if not rows:
            return None
        digest, revoked_at, last_used_at, tenant_id, name, tier = rows[0]
        if not hmac.compare_digest(digest, _sha256(secret)) or revoked_at is not None:
            return None
        now = self._clock()
        if last_used_at is None or now - last_used_at >= LAST_USED_RESOLUTION_S:
            # Bookkeeping only: a store that cannot write now (full disk) must not lock every key out.
            with contextlib.suppress(sqlite3.OperationalError):
                await self._write("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (now, key_id))
        return Tenant(tenant_id, name, tier, key_id)

    async def keys_with_unknown_tiers(self, tiers: set[str]) -> list[ApiKey]:
        """The live keys whose tenant's tier is not among `tiers` (the ones a config defines)."""
        return [key for key in await self.list_keys() if key.revoked_at is None and key.tier not in tiers]

    # --- conversations ---

    @_whole
    async def create_conversation(self, tenant_id: str, *, model: str, title: str | None = None,
                                  system_prompt: str | None = None, metadata: dict[str, Any] | None = None,
                                  items: list[tuple[str, str]] = ()) -> Conversation:
        """A new conversation, with its first `items` (role, text) if given; `metadata` is kept as
        JSON (orjson: str keys, ints within 64 bits)."""
        now = self._clock()
        conversation = Conversation(_new_id("conv_", 12), tenant_id, model, title, system_prompt,
                                    dict(metadata or {}), now, now)
        async with self._transaction() as conn:
            await conn.execute(f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                               (conversation.id, tenant_id, model, title, system_prompt,
                                orjson.dumps(conversation.metadata).decode(), now, now))
            await _insert_messages(conn, conversation.id, None, 0, [_message(conversation.id, role, text, now)
                                                                   for role, text in items])
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
        """Change a live conversation's `title` and/or `metadata` (replaced whole, as OpenAI's update does);
        None if it is missing, deleted or someone else's."""
        unknown = set(fields) - {"title", "metadata"}
        if unknown:
            raise ValueError(f"cannot update {sorted(unknown)} of a conversation")
        if "metadata" in fields:
            fields["metadata"] = orjson.dumps(dict(fields["metadata"])).decode()
        assignments = "".join(f"{name} = ?, " for name in fields)
        changed = await self._write(f"UPDATE conversations SET {assignments}updated_at = ? "
                                    "WHERE id = ? AND tenant_id = ? AND deleted_at IS NULL",
                                    (*fields.values(), self._clock(), conversation_id, tenant_id))
        return await self.get_conversation(tenant_id, conversation_id) if changed == 1 else None

    async def delete_conversation(self, tenant_id: str, conversation_id: str) -> bool:
        """Soft delete: hidden at once, purged later. False if missing, deleted or someone else's."""
        deleted = await self._write("UPDATE conversations SET deleted_at = ? "
                                    "WHERE id = ? AND tenant_id = ? AND deleted_at IS NULL",
                                    (self._clock(), conversation_id, tenant_id))
        return deleted == 1

    @_whole
    async def purge_deleted(self, deleted_before: float) -> int:
        """Remove conversations and responses deleted before that time, with their messages (a
        deleted response's messages in a live conversation stay there); usage stays. Returns how
        many conversations and responses were removed."""
        async with self._transaction() as conn:
            gone = "SELECT id FROM responses WHERE deleted_at IS NOT NULL AND deleted_at < ?"
            await conn.execute(f"DELETE FROM messages WHERE conversation_id IS NULL AND response_id IN ({gone})",
                               (deleted_before,))
            responses = await conn.execute("DELETE FROM responses WHERE deleted_at IS NOT NULL AND deleted_at < ?",
                                           (deleted_before,))
            conversations = await conn.execute("DELETE FROM conversations WHERE deleted_at IS NOT NULL AND deleted_at < ?",
                                               (deleted_before,))
            return responses.rowcount + conversations.rowcount

    # --- messages and turns ---

    async def list_messages(self, conversation_id: str) -> list[Message]:
        """A conversation's messages in order (check the conversation is the caller's first)."""
        rows = await self._fetch(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? "
                                 "ORDER BY position", (conversation_id,))
        return [_message_row(row) for row in rows]

    async def get_message(self, conversation_id: str, message_id: str) -> Message | None:
        """One message of a conversation, or None."""
        rows = await self._fetch(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND id = ?",
                                 (conversation_id, message_id))
        return _message_row(rows[0]) if rows else None

    @_whole
    async def start_turn(self, tenant_id: str, conversation_id: str, content: str) -> tuple[Message, Message]:
        """Add the user's message and an empty `partial` assistant reply, or LookupError and nothing."""
        now = self._clock()
        user = _message(conversation_id, "user", content, now)
        reply = _message(conversation_id, "assistant", "", now, status="partial")
        async with self._transaction() as conn:
            position = await _next_position(conn, tenant_id, conversation_id)
            await _insert_messages(conn, conversation_id, None, position, [user, reply])
            await conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return user, reply

    # --- items: a conversation's messages as OpenAI's Conversations API names them ---

    @_whole
    async def add_items(self, tenant_id: str, conversation_id: str, items: list[tuple[str, str]]) -> list[Message]:
        """Append complete messages (role, text) to the tenant's live conversation, or LookupError and nothing."""
        now = self._clock()
        messages = [_message(conversation_id, role, text, now) for role, text in items]
        async with self._transaction() as conn:
            position = await _next_position(conn, tenant_id, conversation_id)
            await _insert_messages(conn, conversation_id, None, position, messages)
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
        rows = await self._fetch(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? {bound}"
                                 f"ORDER BY position {direction} LIMIT ?", (*params, limit + 1))
        return [_message_row(row) for row in rows[:limit]], len(rows) > limit

    async def delete_item(self, conversation_id: str, message_id: str) -> bool:
        """Remove a message from a conversation for good; False if it has no such message."""
        deleted = await self._write("DELETE FROM messages WHERE conversation_id = ? AND id = ?",
                                    (conversation_id, message_id))
        return deleted == 1

    # --- responses ---

    @_whole
    async def create_response(self, tenant_id: str, *, model: str, stored: bool, inputs: list[tuple[str, str]] = (),
                              conversation_id: str | None = None, previous_response_id: str | None = None,
                              instructions: str | None = None,
                              request: dict[str, Any] | None = None) -> tuple[Response, Message | None]:
        """Record a new response. Stored, it gets its input items (role, text) and an empty
        `partial` output message, in its conversation when it has one (LookupError and nothing if
        that is not the tenant's live conversation); a store=false one keeps only its record."""
        now = self._clock()
        response = Response(_new_id("resp_", 12), tenant_id, conversation_id, previous_response_id, None, stored,
                            model, instructions, dict(request or {}), now)
        output = None
        async with self._transaction() as conn:
            if stored:
                position = 0 if conversation_id is None else await _next_position(conn, tenant_id, conversation_id)
                output = _message(conversation_id, "assistant", "", now, status="partial")
                response = dataclasses.replace(response, output_message_id=output.id)
            await conn.execute(f"INSERT INTO responses ({_RESPONSE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               (*dataclasses.astuple(response)[:-2], orjson.dumps(response.request).decode(), now))
            if stored:
                messages = [_message(conversation_id, role, text, now) for role, text in inputs] + [output]
                await _insert_messages(conn, conversation_id, response.id, position, messages)
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
        rows = await self._fetch(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE response_id = ? ORDER BY position",
                                 (response_id,))
        return [_message_row(row) for row in rows]

    async def chain_messages(self, response_id: str) -> list[Message]:
        """The messages of a response and of every response before it by previous_response_id,
        oldest first: the history a response that continues it starts from. (Check the response
        is the caller's first; a purged response ends the chain.)"""
        columns = ", ".join("m." + c for c in _MESSAGE_COLUMNS.split(", "))
        rows = await self._fetch(
            "WITH RECURSIVE chain (id, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT r.previous_response_id, chain.depth + 1 FROM responses r JOIN chain ON r.id = chain.id "
            "WHERE r.previous_response_id IS NOT NULL) "
            f"SELECT {columns} FROM chain JOIN messages m ON m.response_id = chain.id "
            "ORDER BY chain.depth DESC, m.position", (response_id,))
        return [_message_row(row) for row in rows]

    async def save_partial(self, message_id: str, content: str, completion_tokens: int) -> None:
        """Keep the reply so far; a reply already finished is left alone."""
        await self._write("UPDATE messages SET content = ?, completion_tokens = ?, updated_at = ? "
                          "WHERE id = ? AND status = 'partial'", (content, completion_tokens, self._clock(), message_id))

    @_whole
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
            rows = await conn.execute_fetchall(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,))
            conversation_id = rows[0][1] if rows else None
            await conn.execute(_INSERT_USAGE, (tenant_id, endpoint, model, conversation_id, message_id,
                                               prompt_tokens, cached_tokens, completion_tokens, cost, now))
        if not rows:
            raise LookupError(f"no message {message_id!r} (its usage was recorded)")
        return _message_row(rows[0])

    # --- usage ---

    async def record_usage(self, tenant_id: str, *, endpoint: str, model: str, prompt_tokens: int,
                           cached_tokens: int, completion_tokens: int, cost: float,
                           conversation_id: str | None = None, message_id: str | None = None,
                           created_at: float | None = None) -> None:
        """Record what one request used, at `created_at` (default: now)."""
        await self._write(_INSERT_USAGE, (tenant_id, endpoint, model, conversation_id, message_id, prompt_tokens,
                                          cached_tokens, completion_tokens, cost,
                                          self._clock() if created_at is None else created_at))

    async def usage(self, tenant_id: str, start: float, end: float) -> Usage:
        """The tenant's totals over events with start <= created_at < end."""
        [row] = await self._fetch(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
            "COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost), 0.0) FROM usage_events "
            "WHERE tenant_id = ? AND created_at >= ? AND created_at < ?", (tenant_id, start, end))
        return Usage(*row)

    # --- can it write? ---

    @_whole
    async def probe_write(self) -> None:
        """Raise what a write needing PROBE_PAGES new pages would raise now; return if it would
        succeed. Leaves nothing: the row is rolled back (its pages may pass through the WAL)."""
        async with self._lock:
            [(cache_size,)] = await self._conn.execute_fetchall("PRAGMA cache_size")
            [(page_size,)] = await self._conn.execute_fetchall("PRAGMA page_size")
            # A rolled-back row whose pages stay in the page cache never touches the disk, so it
            # passes on a full disk. A one-page cache makes SQLite spill them into the WAL, as a
            # commit would. (Under max_page_count the insert fails on its own.)
            await self._conn.execute("PRAGMA cache_size = 1")
            try:
                await self._conn.execute("BEGIN IMMEDIATE")
                try:
                    await self._conn.execute("INSERT INTO write_probe (body) VALUES (zeroblob(?))",
                                             (PROBE_PAGES * page_size,))
                finally:
                    await self._rollback()
            finally:
                await self._conn.execute(f"PRAGMA cache_size = {int(cache_size)}")

    # --- plumbing ---

    async def _fetch(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        async with self._lock:
            return list(await self._conn.execute_fetchall(sql, params))

    async def _write(self, sql: str, params: tuple) -> int:
        """Run one statement (atomic on its own) and return the number of rows it changed."""
        async with self._lock, self._conn.execute(sql, params) as cursor:
            return cursor.rowcount

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """Statements that commit together or not at all. The lock keeps other coroutines'
        statements on this connection out of it; IMMEDIATE takes the file's write lock up front,
        so another process cannot make it fail halfway. Callers are @_whole: a cancellation
        landing on BEGIN would leave the transaction open, since the statement still runs."""
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                await self._conn.execute("COMMIT")
            except BaseException:
                await self._rollback()
                raise

    async def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already: after some errors (a full
        disk or file, SQLITE_FULL; an I/O error) it rolls back by itself, and a second ROLLBACK
        would fail with "no transaction is active" and hide the error that matters."""
        if self._conn.in_transaction:
            await self._conn.execute("ROLLBACK")


async def _migrate(conn: aiosqlite.Connection, path: Path) -> None:
    """Bring the file to SCHEMA_VERSION in one transaction: a fresh file gets schema.sql, then
    every step of MIGRATIONS it lacks. A file newer than this code is refused."""
    latest = 1 + len(MIGRATIONS)
    await conn.execute("BEGIN IMMEDIATE")  # a second process opening a fresh file waits, then finds it migrated
    try:
        [(version,)] = await conn.execute_fetchall("PRAGMA user_version")
        if version > latest:
            raise StoreFileError(f"{path} has schema version {version}, but this chatd knows versions up to "
                                 f"{latest}: upgrade chatd, or point [store] db_path at another file")
        if version == 0:
            if await conn.execute_fetchall("SELECT 1 FROM sqlite_master LIMIT 1"):
                raise StoreFileError(f"{path} is not a chatd database (it has tables but no schema version)")
            steps = [_statements(SCHEMA_FILE.read_text()), *MIGRATIONS]
        else:
            steps = MIGRATIONS[version - 1:]
        for statements in steps:
            for sql in statements:
                await conn.execute(sql)
            version += 1
            await conn.execute(f"PRAGMA user_version = {int(version)}")  # PRAGMA takes no parameters
        await conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # see Store._rollback
            await conn.execute("ROLLBACK")
        raise


def _statements(script: str) -> list[str]:
    """Split a SQL script into statements (executescript would commit our open transaction)."""
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    return statements


async def _upsert_tenant(conn: aiosqlite.Connection, name: str, tier: str, now: float) -> str:
    """Create tenant `name` or set its tier; returns its id. Runs inside a transaction."""
    new_id = LOCAL_TENANT if name == LOCAL_TENANT else _new_id("ten_", 8)
    await conn.execute("INSERT INTO tenants (id, name, tier, created_at) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (name) DO UPDATE SET tier = excluded.tier", (new_id, name, tier, now))
    [(tenant_id,)] = await conn.execute_fetchall("SELECT id FROM tenants WHERE name = ?", (name,))
    return tenant_id


def check_status(status: str) -> None:
    """ValueError naming the statuses unless `status` is one of them."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")


def _check_tier(tier: str) -> None:
    if not TIER_NAME.fullmatch(tier):
        raise ValueError(f"a tier name is 1-32 lower-case letters, digits, '-' or '_'; got {tier!r}")


def _conversation(row: sqlite3.Row) -> Conversation:
    *head, metadata, created_at, updated_at = row
    return Conversation(*head, orjson.loads(metadata), created_at, updated_at)


def _response(row: sqlite3.Row) -> Response:
    *head, stored, model, instructions, request, created_at = row
    return Response(*head, bool(stored), model, instructions, orjson.loads(request), created_at)


def _message_row(row: sqlite3.Row) -> Message:
    *head, token_ids = row
    return Message(*head, tuple(array("i", token_ids)) if token_ids is not None else None)


def _pack_ids(token_ids: Sequence[int] | None) -> bytes | None:
    return array("i", token_ids).tobytes() if token_ids else None


def _message(conversation_id: str | None, role: str, content: str, now: float, status: str = "complete") -> Message:
    return Message(_new_id("msg_", 12), conversation_id, role, content, status, None, 0, 0, 0, 0.0, now, now)


async def _next_position(conn: aiosqlite.Connection, tenant_id: str, conversation_id: str) -> int:
    """The position after a live conversation's last message; LookupError if it is not the tenant's."""
    live = await conn.execute_fetchall("SELECT 1 FROM conversations WHERE id = ? AND tenant_id = ? "
                                       "AND deleted_at IS NULL", (conversation_id, tenant_id))
    if not live:
        raise LookupError(f"no conversation {conversation_id!r}")
    [(position,)] = await conn.execute_fetchall(
        "SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id = ?", (conversation_id,))
    return position


async def _insert_messages(conn: aiosqlite.Connection, conversation_id: str | None, response_id: str | None,
                           position: int, messages: list[Message]) -> None:
    await conn.executemany(_INSERT_MESSAGE, [(position + i, response_id, *dataclasses.astuple(m)[:-1], _pack_ids(m.token_ids))
                                             for i, m in enumerate(messages)])


def _new_id(prefix: str, num_bytes: int) -> str:
    return prefix + secrets.token_hex(num_bytes)


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()

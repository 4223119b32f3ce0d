"""The store: one SQLite file, read and written through aiosqlite (or a PostgreSQL database, see
postgres.py), holding who may call the API (tenants, API keys), their conversations and messages,
OpenAI-style responses, what each request used, and the safety pipeline's moderation events.

`Store` is what callers open (`await open_store(url_or_path)`, url.py) and call. It is assembled
here from one owner of the connection, its transactions and the schema's migrations (database.py;
postgres.py on PostgreSQL) and a mixin per table family, each with its own SQL:

    keys.py           tenants and API keys; authentication
    conversations.py  conversations, their soft delete and the purge
    messages.py       a conversation's messages: turns, and items
    responses.py      the Responses API's records and their chains
    usage.py          usage events and a tenant's totals
    moderation.py     the safety pipeline's events and appeals
    idempotency.py    idempotency keys (a retried turn stored and billed once) and replicas' heartbeats

It knows nothing of HTTP or the engine; it hands out the frozen records of records.py. The names
below stay importable from here, as callers have always imported them.
"""

from __future__ import annotations

from chatd.store.conversations import Conversations
from chatd.store.database import (MIGRATIONS, PROBE_PAGES, SCHEMA_FILE, SCHEMA_VERSION, Database, StoreFileError,
                                  StoreUnavailableError)
from chatd.store.canaries import CanaryLog
from chatd.store.feedback import Feedback
from chatd.store.idempotency import Claim, Idempotency
from chatd.store.keys import KEY_PATTERN, LAST_USED_RESOLUTION_S, LOCAL_TENANT, KeyRing
from chatd.store.messages import STATUSES, Messages, check_status
from chatd.store.moderation import ModerationLog
from chatd.store.records import ApiKey, Conversation, Message, Response, Tenant, Usage
from chatd.store.responses import Responses
from chatd.store.usage import UsageLog

__all__ = [
    "KEY_PATTERN", "LAST_USED_RESOLUTION_S", "LOCAL_TENANT", "MIGRATIONS", "PROBE_PAGES", "SCHEMA_FILE",
    "SCHEMA_VERSION", "STATUSES", "ApiKey", "Claim", "Conversation", "Message", "Response", "Store", "StoreFileError",
    "StoreUnavailableError", "Tenant", "Usage", "check_status",
]


class Store(KeyRing, Conversations, Messages, Responses, UsageLog, ModerationLog, Feedback, CanaryLog, Idempotency,
            Database):
    """chatd's SQLite file: Database's one connection, with every table family's methods.
    (Migrations are read from chatd.store.database.MIGRATIONS: a test adding a step patches it there.)"""

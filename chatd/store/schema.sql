-- chatd's store at schema version 1. This file only ever creates a fresh database; a later
-- change is a new migration step in database.py (MIGRATIONS), never an edit here.
-- Timestamps are unix seconds (REAL). Tokens are counts; cost is USD.

CREATE TABLE tenants (
    id         TEXT PRIMARY KEY,         -- "local", or "ten_" + 16 hex
    name       TEXT NOT NULL UNIQUE,
    tier       TEXT NOT NULL,            -- free | paid | premium
    created_at REAL NOT NULL
);

CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY,      -- the public key id: 12 hex, as in chatd_<id>_<secret>
    tenant_id     TEXT NOT NULL REFERENCES tenants (id),
    secret_sha256 TEXT NOT NULL,         -- hex digest of the secret; the secret itself is never stored
    created_at    REAL NOT NULL,
    revoked_at    REAL,
    last_used_at  REAL
);

CREATE TABLE conversations (
    id            TEXT PRIMARY KEY,      -- "conv_" + 24 hex
    tenant_id     TEXT NOT NULL REFERENCES tenants (id),
    model         TEXT NOT NULL,
    title         TEXT,
    system_prompt TEXT,
    metadata      TEXT NOT NULL,         -- a JSON object
    created_at    REAL NOT NULL,
    updated_at    REAL NOT NULL,
    deleted_at    REAL                   -- soft delete; the purge removes the row later
);

-- Listing a tenant's conversations, newest first, page by page.
CREATE INDEX conversations_by_tenant
    ON conversations (tenant_id, created_at DESC, id DESC) WHERE deleted_at IS NULL;

CREATE TABLE messages (
    id                TEXT PRIMARY KEY,  -- "msg_" + 24 hex
    conversation_id   TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    position          INTEGER NOT NULL,  -- 0, 1, 2, ... within the conversation
    role              TEXT NOT NULL,     -- user | assistant
    content           TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('complete', 'partial', 'error')),
    finish_reason     TEXT,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    cached_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cost              REAL NOT NULL DEFAULT 0,
    created_at        REAL NOT NULL,
    updated_at        REAL NOT NULL,
    UNIQUE (conversation_id, position)   -- also the index that reads a conversation in order
);

CREATE TABLE usage_events (
    id                INTEGER PRIMARY KEY,
    tenant_id         TEXT NOT NULL REFERENCES tenants (id),
    endpoint          TEXT NOT NULL,     -- chat.completions | completions | conversations
    model             TEXT NOT NULL,
    -- A purged conversation's usage stays billed; only the link is cleared.
    conversation_id   TEXT REFERENCES conversations (id) ON DELETE SET NULL,
    message_id        TEXT,              -- no foreign key: it outlives its message
    prompt_tokens     INTEGER NOT NULL,
    cached_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost              REAL NOT NULL,
    created_at        REAL NOT NULL
);

CREATE INDEX usage_by_tenant ON usage_events (tenant_id, created_at);
-- Lets a purge find the events whose link it clears without scanning every event.
CREATE INDEX usage_by_conversation ON usage_events (conversation_id);

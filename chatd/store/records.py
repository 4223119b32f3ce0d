"""What the store hands out: frozen records of tenants, keys, conversations, messages, responses,
usage, and the safety pipeline's moderation events; and `new_id`, how each family names its rows.

Timestamps are unix seconds; costs are USD. Import them from here or from chatd.store.db (a
ModerationEvent: from here or from chatd.store.moderation).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tenant:
    """Whoever owns keys, conversations and usage."""

    id: str
    name: str
    tier: str
    key_id: str | None = None  # the API key a request authenticated with (None: the local user)


@dataclass(frozen=True)
class ApiKey:
    """An API key's record; the secret is never kept, only its SHA-256."""

    id: str
    tenant_id: str
    tenant_name: str
    tier: str
    created_at: float
    revoked_at: float | None
    last_used_at: float | None


@dataclass(frozen=True)
class Conversation:
    """A server-side conversation (a soft-deleted one is never returned)."""

    id: str
    tenant_id: str
    model: str
    title: str | None
    system_prompt: str | None
    metadata: dict[str, Any]
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Message:
    """One message of a conversation, with what its reply cost when it is the assistant's."""

    id: str
    conversation_id: str
    role: str
    content: str
    status: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float
    created_at: float
    updated_at: float
    token_ids: tuple[int, ...] | None = None  # a reply's tokens as generated (None: only its text is known)
    # A tool item's call: {"call_id", "name"} for a function call (its content is the arguments as
    # JSON text, its role assistant), {"call_id"} for a call's output (its role tool). None: a message.
    call: dict[str, str] | None = None

    @property
    def kind(self) -> str:
        """Its item type, as OpenAI names it: message, function_call or function_call_output."""
        if self.call is None:
            return "message"
        return "function_call_output" if self.role == "tool" else "function_call"


@dataclass(frozen=True)
class Response:
    """A response of OpenAI's Responses API. Its input items and its output are messages (in its
    conversation, or its own when it has none); a store=false response keeps only this record."""

    id: str
    tenant_id: str
    conversation_id: str | None
    previous_response_id: str | None
    output_message_id: str | None
    stored: bool
    model: str
    instructions: str | None
    request: dict[str, Any]  # the request fields the response object echoes (temperature, metadata, ...)
    created_at: float


@dataclass(frozen=True)
class Usage:
    """A tenant's totals over a time window."""

    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: float


@dataclass(frozen=True)
class ModerationEvent:
    """One decision of the safety pipeline: what was blocked, flagged or redacted, for whom, and its appeal."""

    id: str  # the appeal id a user is given: "modr_" + 24 hex
    tenant_id: str
    stage: str  # input (a request's messages or prompt) | output (a streamed reply) | moderations (/v1/moderations)
    action: str  # blocked | flagged | redacted | guard_failed
    categories: tuple[str, ...]  # e.g. ("harassment", "pii/card")
    endpoint: str  # chat.completions | responses | conversations | moderations | ...
    excerpt: str | None  # up to 200 characters of the text, when the operator keeps excerpts
    text_sha256: str | None  # hex digest of the whole text, when the operator keeps hashes
    request_id: str | None  # the server's request id, to find the request in the logs
    conversation_id: str | None
    message_id: str | None
    created_at: float
    status: str  # open | appealed | upheld | overturned
    appeal_reason: str | None
    appealed_at: float | None
    resolved_at: float | None
    resolution_note: str | None


def new_id(prefix: str, num_bytes: int) -> str:
    """A fresh row id: `prefix` and `num_bytes` random bytes in hex ("conv_" + 24 hex)."""
    return prefix + secrets.token_hex(num_bytes)

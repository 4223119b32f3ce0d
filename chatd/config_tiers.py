"""The tables config.toml keys by name that say what a tenant gets: [tiers.NAME] (with the tiers
every server knows), [prices."MODEL"] and [policies."CATEGORY"] (the safety pipeline's, per tier).
Part of the one configuration tree (config.py re-exports them); it imports nothing of chatd.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Price:
    """USD per million tokens; cached prompt tokens may have their own price."""

    input: float = 0.0
    cached_input: float = -1.0  # negative = the input price
    output: float = 0.0

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        cached_price = self.input if self.cached_input < 0 else self.cached_input
        fresh = prompt_tokens - cached_tokens
        return (fresh * self.input + cached_tokens * cached_price + completion_tokens * self.output) / 1e6


LIMIT_PER = ("tenant", "key")


@dataclass(frozen=True)
class TierConfig:
    """What a tier's tenants may use, and where their requests go in the queue. 0 means no limit.
    Limits apply while the key database is on ([auth] enabled), never to the one local user."""

    requests_per_minute: int = 0  # generation requests (a request bucket refilled continuously)
    tokens_per_minute: int = 0  # prompt + max_tokens reserved at admission; the unused part is refunded
    max_concurrent_requests: int = 0  # generating at once, replies that outlive their client included
    max_queued_requests: int = 0  # this tier's requests waiting for their first token, server-wide
    max_tokens: int = 0  # ceiling on a request's max_tokens (and its default); 0: the context window
    max_embedding_tokens: int = 0  # input tokens of one embeddings request, all its inputs together; 0: no limit
    models: tuple[str, ...] = ()  # served model names (and aliases) it may use; empty: all
    default_model: str = ""  # what a request naming no model (or "default") gets; "": the server's first model
    priority: int = 0  # lower is scheduled first; a client's `priority` can only add to it
    weight: float = 1.0  # a tenant's share of the batch among tenants of equal priority
    ttft_p95_seconds: float = 0.0  # latency objective: a request expected to wait longer is shed (503)
    limit_per: str = "tenant"  # whose buckets count: "tenant" (all its keys together) or "key"

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_queued_requests",
                     "max_tokens", "max_embedding_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (no limit) or more, got {getattr(self, name)}")
        if self.priority < 0:
            raise ValueError(f"priority must be 0 or more (lower is scheduled first), got {self.priority}")
        if not self.weight > 0:
            raise ValueError(f"weight must be more than 0, got {self.weight}")
        if self.ttft_p95_seconds < 0:
            raise ValueError(f"ttft_p95_seconds must be 0 (no objective) or more, got {self.ttft_p95_seconds}")
        if self.limit_per not in LIMIT_PER:
            raise ValueError(f"limit_per must be one of {', '.join(LIMIT_PER)}, got {self.limit_per!r}")


# A tier's name as keys and [tiers.NAME] spell it.
TIER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")

# The tiers every server knows; [tiers.NAME] in config.toml changes their fields or adds tiers.
# Sized for a small public service on one GPU: free keeps a bounded share and is shed first,
# paid is never held back by free traffic, premium is scheduled before both.
DEFAULT_TIERS: dict[str, TierConfig] = {
    "free": TierConfig(requests_per_minute=20, tokens_per_minute=40_000, max_concurrent_requests=4, max_queued_requests=256,
                       max_tokens=2048, max_embedding_tokens=16_384, priority=20, weight=1.0, ttft_p95_seconds=10.0),
    "paid": TierConfig(requests_per_minute=500, tokens_per_minute=1_000_000, max_concurrent_requests=64, max_queued_requests=1024,
                       max_embedding_tokens=300_000, priority=10, weight=1.0, ttft_p95_seconds=2.0),  # OpenAI's 300k
    "premium": TierConfig(requests_per_minute=5_000, tokens_per_minute=10_000_000, max_concurrent_requests=256,
                          priority=0, weight=1.0, ttft_p95_seconds=1.0),
}


POLICY_ACTIONS = ("block", "flag", "redact")
FAILURE_MODES = ("open", "closed")


@dataclass(frozen=True)
class CategoryPolicy:
    """What the safety pipeline does with one category (OpenAI's moderation categories, and pii/*)."""

    action: str = "block"  # block: refuse the request (cut the reply); flag: serve and record; redact: mask the match
    failure: str = "open"  # when a check cannot run (the guard failed): "open" serves and records, "closed" refuses
    tiers: tuple[str, ...] = ()  # the tiers it applies to; empty: every tier

    def __post_init__(self) -> None:
        if self.action not in POLICY_ACTIONS:
            raise ValueError(f"action must be one of {', '.join(POLICY_ACTIONS)}, got {self.action!r}")
        if self.failure not in FAILURE_MODES:
            raise ValueError(f"failure must be one of {', '.join(FAILURE_MODES)}, got {self.failure!r}")


# A public service's policies (used once [safety] turns a check on): threats, hate, violent
# crimes, graphic violence and sexual content are refused; what a person in distress or a
# curious one writes (self-harm, illicit, violence, harassment) is served and recorded for
# review; personal data is masked. The worst categories fail closed: when the guard cannot
# judge, such requests are refused rather than let through.
DEFAULT_POLICIES: dict[str, CategoryPolicy] = {
    "harassment": CategoryPolicy("flag"),
    "harassment/threatening": CategoryPolicy("block"),
    "hate": CategoryPolicy("block"),
    "hate/threatening": CategoryPolicy("block"),
    "illicit": CategoryPolicy("flag"),
    "illicit/violent": CategoryPolicy("block", "closed"),
    "self-harm": CategoryPolicy("flag"),
    "self-harm/intent": CategoryPolicy("flag"),
    "self-harm/instructions": CategoryPolicy("block", "closed"),
    "sexual": CategoryPolicy("block"),
    "sexual/minors": CategoryPolicy("block", "closed"),
    "violence": CategoryPolicy("flag"),
    "violence/graphic": CategoryPolicy("block"),
    "pii/email": CategoryPolicy("redact"),
    "pii/phone": CategoryPolicy("redact"),
    "pii/card": CategoryPolicy("redact"),
}

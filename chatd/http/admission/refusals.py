"""What a request that a tier's limits refuse is told: OpenAI's errors and headers where OpenAI has some.

limits.py decides; this module only words the refusals (status, code, message naming the limit,
Retry-After). It knows nothing of buckets' storage or of the queue.
"""

from __future__ import annotations

import math

from chatd.config import TierConfig
from chatd.http.errors import APIError
from chatd.store.db import Tenant


class Refused(APIError):
    """A request a tier's limits refuse; `reason` labels the metrics and the log line."""

    def __init__(self, status: int, reason: str, message: str, code: str, retry_after: float | None,
                 param: str | None = None) -> None:
        super().__init__(status, message, param, code, {} if retry_after is None else retry_headers(retry_after))
        self.reason = reason


class Refusal:
    """The errors a tenant's request is refused with, in OpenAI's words where OpenAI has some."""

    def __init__(self, tenant: Tenant, tier: TierConfig) -> None:
        self.tenant, self.tier = tenant, tier

    def _error(self, status: int, reason: str, message: str, code: str, retry_after: float | None,
               param: str | None = None) -> Refused:
        return Refused(status, reason, message, code, retry_after, param)

    def never(self, reserved: int, param: str | None) -> Refused:
        limit = self.tier.tokens_per_minute
        what = f"lower {param} or shorten the prompt" if param else "shorten the prompt"
        return self._error(400, "too_large", f"this request needs {reserved} tokens (prompt + max tokens per choice), more "
                           f"than tier {self.tenant.tier}'s limit of {limit} tokens per minute: {what}",
                           "request_too_large", None, param)

    def concurrency(self, in_flight: int) -> Refused:
        return self._error(429, "concurrency", f"{in_flight} of your requests are being generated, tier "
                           f"{self.tenant.tier}'s limit (max_concurrent_requests); try again when one has finished",
                           "concurrency_limit_exceeded", 1.0)

    def rate(self, kind: str, limit: int, remaining: float, cost: int, wait: float) -> Refused:
        return self._error(429, kind, f"rate limit reached for {kind} per minute (tier {self.tenant.tier}): limit "
                           f"{limit}, remaining {int(remaining)}, requested {cost}; try again in {duration(wait)}",
                           "rate_limit_exceeded", wait)

    def store_unavailable(self, retry_after: float) -> Refused:
        # Not where the store is (host, port, database): that is the operator's, in the log (buckets.py).
        return self._error(503, "limit_store", "the shared limit store that counts tier "
                           f"{self.tenant.tier}'s requests and tokens across this server's replicas cannot be reached, "
                           "and this server refuses limited requests until it can ([tiers] on_storage_error = "
                           "\"closed\"); try again later", "limit_store_unavailable", retry_after)

    def queue_full(self, waiting: int, expected: float) -> Refused:
        return self._error(503, "queue_full", f"the server is busy: {waiting} tier {self.tenant.tier} requests are "
                           f"waiting for their first token (the tier's max_queued_requests); try again later",
                           "server_overloaded", max(1.0, expected if math.isfinite(expected) else 1.0))

    def overloaded(self, expected: float) -> Refused:
        objective = self.tier.ttft_p95_seconds
        shown = "the engine admits nothing now" if not math.isfinite(expected) else f"about {expected:.1f} s"
        return self._error(503, "overloaded", f"the server is busy: a tier {self.tenant.tier} request would wait "
                           f"{shown} for its first token, over the tier's objective of {objective:g} s; try again "
                           "later", "server_overloaded", expected if math.isfinite(expected) else objective)


def retry_headers(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (HTTP's form, at least 1) and in milliseconds (read first by the OpenAI SDKs)."""
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def duration(seconds: float) -> str:
    """A time as OpenAI's x-ratelimit-reset-* headers give one: 20ms, 1s, 6m0s, 1h2m3s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"

"""The checks a tier runs on a request, in order, each refusing with its reason: a request that
can never fit, the concurrency slots, the request and token buckets, the queue bound, and the
latency objective (the estimated wait for a first token). limits.py calls `check` once per
admission (and once per precheck), and `check_buckets` alone where the shared store answered.

It decides nothing about what is taken: it reads the holder's Budget (buckets.py) and the queued
work (queued_work.py), words a refusal with refusals.py, and raises it (Refused). None of those
call back, and neither does this module: the trip goes down and comes back once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from chatd.config import TierConfig
from chatd.http.admission.buckets import Budget
from chatd.http.admission.queued_work import QueuedWork
from chatd.http.admission.refusals import Refusal
from chatd.store.db import Tenant


def check(tenant: Tenant, tier: TierConfig, budget: Budget, queued: QueuedWork, reserved_tokens: int | None,
          prompt_tokens: int, priority: int, drain_rate: Callable[[], float | None], param: str,
          clock: Callable[[], float], buckets: bool = True) -> None:
    """Refuse (Refused) unless every limit lets the request in; `reserved_tokens` None: not known
    yet; `buckets` False: all but the buckets (the shared store checks them)."""
    if reserved_tokens is not None and tier.tokens_per_minute and reserved_tokens > tier.tokens_per_minute:
        reducible = reserved_tokens - prompt_tokens
        raise Refusal(tenant, tier).never(reserved_tokens,
                                          param if prompt_tokens < tier.tokens_per_minute and reducible else None)
    if tier.max_concurrent_requests and budget.in_flight >= tier.max_concurrent_requests:
        raise Refusal(tenant, tier).concurrency(budget.in_flight)
    if buckets:
        check_buckets(tenant, tier, budget, reserved_tokens, clock())
    waiting = queued.requests.get(tenant.tier, 0)
    queue_full = tier.max_queued_requests and waiting >= tier.max_queued_requests
    if not (queue_full or tier.ttft_p95_seconds):
        return
    expected = expected_wait(queued, tenant, tier, priority, prompt_tokens, drain_rate)
    if queue_full:
        raise Refusal(tenant, tier).queue_full(waiting, expected)
    if expected > tier.ttft_p95_seconds:
        raise Refusal(tenant, tier).overloaded(expected)


def check_buckets(tenant: Tenant, tier: TierConfig, budget: Budget, reserved_tokens: int | None, now: float) -> None:
    """Refuse (429, with the wait) when the holder's request or token bucket is short."""
    short = budget.shortfall(reserved_tokens, now)
    if short is not None:
        kind, bucket, cost, wait = short
        raise Refusal(tenant, tier).rate(kind, bucket.capacity, bucket.level(now), cost, wait)


def expected_wait(queued: QueuedWork, tenant: Tenant, tier: TierConfig, priority: int, prompt_tokens: int,
                  drain_rate: Callable[[], float | None]) -> float:
    """Seconds the request would wait for the engine to reach it (0 while no queue has been measured)."""
    ahead = queued.ahead(priority, tenant.id, tier.weight, prompt_tokens)
    if not ahead:
        return 0.0
    rate = drain_rate()
    if rate is None:
        return 0.0
    return ahead / rate if rate > 0 else math.inf

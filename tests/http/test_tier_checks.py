"""A tier's checks (chatd/http/admission/tier_checks.py) on a holder's Budget and the queued work, with
no Limits around them: the order they refuse in, and what they read. No server, no clock but a number."""

from __future__ import annotations

import pytest

from chatd.config import TierConfig
from chatd.http.admission import tier_checks
from chatd.http.admission.buckets import Budget, TokenBucket
from chatd.http.admission.queued_work import QueuedWork
from chatd.http.admission.refusals import Refused
from chatd.store.db import Tenant

ALICE = Tenant("t-alice", "alice", "free")


def make_budget(tier: TierConfig, in_flight: int = 0) -> Budget:
    return Budget(TokenBucket(tier.requests_per_minute, 0.0) if tier.requests_per_minute else None,
                  TokenBucket(tier.tokens_per_minute, 0.0) if tier.tokens_per_minute else None, in_flight)


def check(tier: TierConfig, budget: Budget, queued: QueuedWork | None = None, reserved: int = 10,
          drain_rate=lambda: None) -> None:
    tier_checks.check(ALICE, tier, budget, queued or QueuedWork(), reserved, 10, tier.priority, drain_rate,
                      "max_tokens", lambda: 0.0)


def test_a_request_that_fails_several_limits_is_refused_for_the_first_in_order():
    # Over its concurrency and short of requests in its bucket: the client is told of its slots first.
    tier = TierConfig(priority=20, requests_per_minute=1, max_concurrent_requests=1)
    budget = make_budget(tier, in_flight=1)
    budget.take(0, 0.0)
    with pytest.raises(Refused) as refused:
        check(tier, budget)
    assert refused.value.reason == "concurrency"


def test_a_short_bucket_refuses_with_its_kind_and_wait_and_takes_nothing():
    tier = TierConfig(priority=20, tokens_per_minute=60)
    budget = make_budget(tier)
    budget.take(55, 0.0)
    with pytest.raises(Refused) as refused:
        check(tier, budget, reserved=10)
    assert (refused.value.status, refused.value.reason) == (429, "tokens")
    assert budget.tokens.level(0.0) == 5  # the check took nothing


def test_the_engines_pace_is_read_only_when_a_queue_bound_or_objective_needs_it():
    reads = []

    def drain_rate() -> float:
        reads.append(1)
        return 1.0

    queued = QueuedWork()
    check(TierConfig(priority=20), make_budget(TierConfig()), queued, drain_rate=drain_rate)
    assert reads == []
    tier = TierConfig(priority=20, ttft_p95_seconds=1.0)
    queued.tokens[10] = {"t-bob": 100}  # a better class's prompt work ahead: 100 s at 1 token a second
    with pytest.raises(Refused) as refused:
        check(tier, make_budget(tier), queued, drain_rate=drain_rate)
    assert refused.value.reason == "overloaded" and reads == [1]

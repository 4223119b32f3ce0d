"""Tier limits at admission (chatd/http/admission/limits.py) on an injected clock: buckets refill and refund,
bounds hold, shedding refuses the lowest tier first and never a fair newcomer. No server, no sleeps."""

from __future__ import annotations

import pytest

from chatd.config import DEFAULT_TIERS, TierConfig
from chatd.engine import Placement
from chatd.http.errors import APIError
from chatd.http.admission.limits import Limits, Refused, TokenBucket, duration
from chatd.store.db import Tenant


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def no_queue() -> float | None:
    return None


ALICE = Tenant("t-alice", "alice", "free")
BOB = Tenant("t-bob", "bob", "free")
PAYING = Tenant("t-paying", "paying", "paid")


def limits(clock: Clock, enabled: bool = True, **tiers: TierConfig) -> Limits:
    return Limits({"free": TierConfig(priority=20), "paid": TierConfig(priority=10), **tiers}, enabled, clock=clock)


def admit(lim: Limits, tenant: Tenant, prompt: int = 10, reserved: int | None = None, drain=no_queue, priority=None):
    place = lim.placement(tenant, 0).priority if priority is None else priority
    return lim.admit(tenant, prompt, prompt if reserved is None else reserved, place, drain, "max_tokens")


def test_a_bucket_refills_continuously_up_to_its_capacity():
    bucket = TokenBucket(60, now=0.0)  # 60 a minute: one a second
    bucket.take(60, 0.0)
    assert bucket.wait(1, 0.0) == pytest.approx(1.0)
    assert bucket.level(0.5) == pytest.approx(0.5)
    assert bucket.wait(1, 0.5) == pytest.approx(0.5)
    assert bucket.level(1000.0) == 60  # never above capacity
    assert bucket.seconds_to_full(1000.0) == 0


def test_tokens_are_reserved_at_admission_and_the_unused_part_refunded():
    clock = Clock()
    lim = limits(clock, free=TierConfig(tokens_per_minute=1000, priority=20))
    first = admit(lim, ALICE, prompt=100, reserved=600)  # prompt + max_tokens
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE, prompt=100, reserved=600)
    error = refused.value
    assert (error.status, error.code, error.reason) == (429, "rate_limit_exceeded", "tokens")
    # 400 left, 600 wanted: 200 more at 1000/minute take 12 s.
    assert error.headers["Retry-After"] == "12" and error.headers["retry-after-ms"] == "12000"
    assert "limit 1000, remaining 400, requested 600" in error.message
    first.release(used_tokens=150)  # 100 prompt + 50 generated: 450 come back
    assert lim.headers(ALICE)["x-ratelimit-remaining-tokens"] == "850"
    admit(lim, ALICE, prompt=100, reserved=600)
    first.release(used_tokens=150)  # a second release gives nothing back again
    assert lim.headers(ALICE)["x-ratelimit-remaining-tokens"] == "250"


def test_the_request_bucket_refuses_the_request_over_the_rate_and_refills():
    clock = Clock()
    lim = limits(clock, free=TierConfig(requests_per_minute=2, priority=20))
    for _ in range(2):
        admit(lim, ALICE).release(10)
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE)
    assert refused.value.reason == "requests" and refused.value.headers["Retry-After"] == "30"
    clock.now += 30
    admit(lim, ALICE)


def test_a_refused_request_takes_nothing_from_any_bucket():
    clock = Clock()
    lim = limits(clock, free=TierConfig(requests_per_minute=10, tokens_per_minute=100, priority=20))
    admit(lim, ALICE, reserved=80)
    before = lim.headers(ALICE)
    for _ in range(5):
        with pytest.raises(Refused):
            admit(lim, ALICE, reserved=50)
    assert lim.headers(ALICE) == before
    assert before["x-ratelimit-remaining-requests"] == "9" and before["x-ratelimit-remaining-tokens"] == "20"


def test_tenants_of_one_tier_have_their_own_buckets():
    clock = Clock()
    lim = limits(clock, free=TierConfig(requests_per_minute=1, priority=20))
    admit(lim, ALICE)
    with pytest.raises(Refused):
        admit(lim, ALICE)
    admit(lim, BOB)  # alice's empty bucket is hers alone
    assert lim.headers(BOB)["x-ratelimit-remaining-requests"] == "0"
    assert lim.headers(Tenant("t-carol", "carol", "free"))["x-ratelimit-remaining-requests"] == "1"


def test_limit_per_key_gives_each_key_its_own_buckets_and_per_tenant_shares_them():
    clock = Clock()
    for per, second_key_admitted in (("key", True), ("tenant", False)):
        lim = limits(clock, free=TierConfig(requests_per_minute=1, priority=20, limit_per=per))
        admit(lim, Tenant("t-alice", "alice", "free", "key1"))
        try:
            admit(lim, Tenant("t-alice", "alice", "free", "key2"))
            admitted = True
        except Refused:
            admitted = False
        assert admitted == second_key_admitted, per


def test_concurrency_is_bounded_until_a_request_ends():
    clock = Clock()
    lim = limits(clock, free=TierConfig(max_concurrent_requests=2, priority=20))
    leases = [admit(lim, ALICE), admit(lim, ALICE)]
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE)
    assert (refused.value.status, refused.value.code) == (429, "concurrency_limit_exceeded")
    assert refused.value.headers["Retry-After"] == "1"
    admit(lim, BOB)  # another tenant's slots are its own
    leases[0].release(10)
    admit(lim, ALICE)


def test_a_request_larger_than_a_minute_of_tokens_is_a_400_naming_what_to_lower():
    lim = limits(Clock(), free=TierConfig(tokens_per_minute=1000, priority=20))
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE, prompt=100, reserved=2000)
    assert (refused.value.status, refused.value.param, refused.value.reason) == (400, "max_tokens", "too_large")
    assert "2000 tokens" in refused.value.message and "1000 tokens per minute" in refused.value.message
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE, prompt=1500, reserved=1600)  # the prompt alone is too long: lowering max_tokens cannot help
    assert refused.value.param is None and "shorten the prompt" in refused.value.message


def test_headers_say_limit_remaining_and_when_the_bucket_is_full_again():
    clock = Clock()
    lim = limits(clock, free=TierConfig(requests_per_minute=60, tokens_per_minute=6000, priority=20))
    assert lim.headers(ALICE) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "60", "x-ratelimit-reset-requests": "0ms",
        "x-ratelimit-limit-tokens": "6000", "x-ratelimit-remaining-tokens": "6000", "x-ratelimit-reset-tokens": "0ms",
    }
    admit(lim, ALICE, reserved=3000)
    headers = lim.headers(ALICE)
    assert headers["x-ratelimit-remaining-requests"] == "59" and headers["x-ratelimit-reset-requests"] == "1s"
    assert headers["x-ratelimit-remaining-tokens"] == "3000" and headers["x-ratelimit-reset-tokens"] == "30s"
    assert limits(clock, paid=TierConfig(priority=10)).headers(PAYING) == {}  # an unlimited tier sends none
    assert [duration(s) for s in (0.02, 1, 59.5, 360, 3723)] == ["20ms", "1s", "1m0s", "6m0s", "1h2m3s"]


def test_the_shipped_tiers_put_paid_before_free_and_premium_first():
    assert DEFAULT_TIERS["premium"].priority < DEFAULT_TIERS["paid"].priority < DEFAULT_TIERS["free"].priority
    lim = Limits(DEFAULT_TIERS, True, clock=Clock())
    assert lim.placement(PAYING, 0).priority < lim.placement(ALICE, 0).priority


def test_a_client_priority_can_only_lower_its_place():
    lim = limits(Clock())
    assert lim.placement(PAYING, -100) == Placement(priority=10, tenant="t-paying", weight=1.0)
    assert lim.placement(PAYING, 3).priority == 13
    one_user = limits(Clock(), enabled=False)
    assert one_user.placement(PAYING, -100).priority == -100  # alone, it orders its own requests as it likes


def test_the_max_tokens_ceiling_caps_the_default_and_refuses_more():
    lim = limits(Clock(), free=TierConfig(max_tokens=256, priority=20))
    assert lim.max_tokens(ALICE, None, "max_tokens") == 256
    assert lim.max_tokens(ALICE, 100, "max_tokens") == 100
    with pytest.raises(APIError) as refused:
        lim.max_tokens(ALICE, 1000, "max_completion_tokens")
    assert refused.value.param == "max_completion_tokens" and "over the limit of 256 for tier free" in refused.value.message
    assert limits(Clock(), enabled=False, free=TierConfig(max_tokens=256)).max_tokens(ALICE, 1000, "max_tokens") == 1000


def test_a_tier_limited_to_some_models_gets_403_naming_the_model_and_the_tier():
    lim = limits(Clock(), free=TierConfig(models=("small",), priority=20))
    lim.check_model(ALICE, "small")
    with pytest.raises(APIError) as refused:
        lim.check_model(ALICE, "large")
    assert (refused.value.status, refused.value.code, refused.value.param) == (403, "model_not_allowed", "model")
    assert "'large'" in refused.value.message and "tier (free)" in refused.value.message
    assert lim.may_use(PAYING, "large") and not lim.may_use(ALICE, "large")


def draining() -> float:
    return 100.0  # prompt tokens a second


def test_shedding_refuses_the_lowest_tier_first_and_keeps_admitting_paid():
    lim = limits(Clock(), free=TierConfig(ttft_p95_seconds=1.0, priority=20), paid=TierConfig(ttft_p95_seconds=1.0, priority=10))
    admit(lim, ALICE, prompt=100, drain=draining)
    admit(lim, ALICE, prompt=100, drain=draining)  # 100 tokens ahead of it: 1 s, within the objective
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE, prompt=100, drain=draining)  # 200 ahead: 2 s
    error = refused.value
    assert (error.status, error.code, error.reason) == (503, "server_overloaded", "overloaded")
    assert error.headers["Retry-After"] == "2" and "about 2.0 s" in error.message and "objective of 1 s" in error.message
    for _ in range(5):  # nothing of a better class is queued ahead of paid
        admit(lim, PAYING, prompt=100, drain=draining).first_token(0.01)


def test_shedding_counts_only_a_fair_share_of_another_tenant_s_queue():
    lim = limits(Clock(), free=TierConfig(ttft_p95_seconds=1.0, priority=20))
    flood = TierConfig(ttft_p95_seconds=60.0, priority=20)
    lim.tiers["flood"] = flood
    flooder = Tenant("t-flood", "flood", "flood")
    for _ in range(5):
        admit(lim, flooder, prompt=100, drain=draining)  # 500 tokens queued: 5 s of work
    # Bob's 50 tokens wait only for 50 of the flood's (the scheduler alternates between them): 0.5 s.
    assert lim.queued.ahead(20, BOB.id, 1.0, 50) == 50
    admit(lim, BOB, prompt=50, drain=draining)
    with pytest.raises(Refused):
        admit(lim, Tenant("t-flood", "flood", "free"), prompt=50, drain=draining)  # the flood's own work is ahead


def test_a_stalled_queue_sheds_and_an_unmeasured_one_does_not():
    clock = Clock()
    lim = limits(clock, free=TierConfig(ttft_p95_seconds=1.0, priority=20))
    admit(lim, ALICE, prompt=100, drain=lambda: 0.0)  # nothing ahead: admitted whatever the pace
    with pytest.raises(Refused) as refused:
        admit(lim, BOB, prompt=100, drain=lambda: 0.0)  # the engine admits nothing now
    assert "admits nothing now" in refused.value.message
    admit(lim, BOB, prompt=100, drain=no_queue)  # no queue has formed yet: no estimate, no shedding


def test_the_queue_bound_refuses_until_a_first_token_arrives():
    lim = limits(Clock(), free=TierConfig(max_queued_requests=2, priority=20))
    first, _ = admit(lim, ALICE), admit(lim, BOB)
    with pytest.raises(Refused) as refused:
        admit(lim, Tenant("t-carol", "carol", "free"))
    assert (refused.value.status, refused.value.reason) == (503, "queue_full")
    admit(lim, PAYING)  # another tier's bound
    first.first_token(0.1)
    admit(lim, Tenant("t-carol", "carol", "free"))


def test_every_lease_leaves_nothing_behind():
    clock = Clock()
    lim = limits(clock, free=TierConfig(max_concurrent_requests=5, max_queued_requests=5, priority=20))
    leases = [admit(lim, tenant) for tenant in (ALICE, BOB, ALICE, PAYING)]
    leases[0].first_token(0.1)
    for lease in leases:
        lease.release(10)
    assert lim.queued.tokens == {} and lim.queued.weights == {} and all(n == 0 for n in lim.queued.requests.values())
    assert lim.remaining(ALICE)["in_flight_requests"] == 0


def test_with_the_key_database_off_nothing_is_limited():
    lim = limits(Clock(), enabled=False, free=TierConfig(requests_per_minute=1, max_concurrent_requests=1,
                                                          ttft_p95_seconds=0.001, priority=20))
    for _ in range(10):
        admit(lim, ALICE, prompt=100, drain=lambda: 0.0)
    assert lim.headers(ALICE) == {} and lim.remaining(ALICE) == {"limited": False}


def test_a_tier_the_config_does_not_define_is_a_403_not_a_crash():
    lim = limits(Clock())
    with pytest.raises(APIError) as refused:
        admit(lim, Tenant("t-gold", "gold", "gold"))
    assert (refused.value.status, refused.value.code) == (403, "unknown_tier")
    assert refused.value.body()["error"]["type"] == "permission_error"


def test_the_precheck_refuses_before_tokenizing_what_no_prompt_length_could_save():
    lim = limits(Clock(), free=TierConfig(max_concurrent_requests=1, tokens_per_minute=100, priority=20))
    lim.precheck(ALICE, 20, no_queue)  # takes nothing
    lease = admit(lim, ALICE, reserved=90)
    with pytest.raises(Refused) as refused:
        lim.precheck(ALICE, 20, no_queue)
    assert refused.value.reason == "concurrency"
    lease.release(90)  # it used all it reserved: 10 tokens are left
    lim.precheck(ALICE, 20, no_queue)  # the token bucket needs the prompt's length: checked at admission
    with pytest.raises(Refused) as refused:
        admit(lim, ALICE, reserved=90)
    assert refused.value.reason == "tokens"

"""Tier buckets shared in Redis (chatd/http/admission/buckets.py, limits.py) against a real redis-server:
two replicas' limiters admit exactly a tier's rate between them, tenants keep their own buckets,
an outage is answered as configured, a key that holds no bucket is that holder's bucket reset (not
an outage), and Redis is used again once it is back. The slow test at
the end runs two chatd servers on one Redis."""

from __future__ import annotations

import asyncio
import logging
import sys

import httpx
import pytest

from chatd.config import TierConfig
from chatd.http.admission.buckets import SharedBuckets, check_storage, shared_buckets, shown_url
from chatd.http.admission.limits import Lease, Limits, Refused
from chatd.store.db import Tenant
from tests.redis_server import RedisServer, skip_without_redis

ALICE = Tenant("t-alice", "alice", "free")
BOB = Tenant("t-bob", "bob", "free")


class Clock:
    """The shared store's clock, for its pause between tries while Redis is down."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_server():
    skip_without_redis()
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture
async def replicas(redis_server):
    """Make limiters as separate chatd replicas would have them: each its own Redis connections."""
    made: list[Limits] = []

    def make(fail_open: bool = True, clock: Clock | None = None, **free) -> Limits:
        shared = SharedBuckets(redis_server.url, clock=clock or Clock())
        made.append(Limits({"free": TierConfig(priority=20, **free)}, True, shared=shared, fail_open=fail_open))
        return made[-1]

    yield make
    for limits in made:
        await limits.close()


async def admit(limits: Limits, tenant: Tenant, reserved: int = 10) -> Lease | Refused:
    """One admission (10 prompt tokens reserving `reserved`): its lease, or the refusal."""
    try:
        async with asyncio.timeout(2):  # never hangs, Redis up or down
            return await limits.admit_async(tenant, 10, reserved, 20, lambda: None, "max_tokens")
    except Refused as refusal:
        return refusal


def split(results: list) -> tuple[list[Lease], list[Refused]]:
    return [r for r in results if isinstance(r, Lease)], [r for r in results if isinstance(r, Refused)]


async def test_two_replicas_admit_exactly_the_tiers_requests_per_minute_between_them(replicas):
    n = 10
    pair = [replicas(requests_per_minute=n), replicas(requests_per_minute=n)]
    admitted, refused = split(await asyncio.gather(*(admit(pair[i % 2], ALICE) for i in range(3 * n))))
    assert len(admitted) == n and len(refused) == 2 * n
    assert {lease.limits for lease in admitted} == set(pair)  # both replicas admitted some
    for refusal in refused:
        assert (refusal.status, refusal.code, refusal.reason) == (429, "rate_limit_exceeded", "requests")
        assert 0 < int(refusal.headers["retry-after-ms"]) <= 6000  # one request of 10 a minute: 6 s at most
        assert int(refusal.headers["Retry-After"]) >= 1


async def test_tokens_are_reserved_exactly_across_replicas_and_what_is_unused_comes_back(replicas):
    pair = [replicas(tokens_per_minute=1000), replicas(tokens_per_minute=1000)]
    admitted, refused = split(await asyncio.gather(*(admit(pair[i % 2], ALICE, reserved=100) for i in range(30))))
    assert len(admitted) == 10 and len(refused) == 20
    assert {r.reason for r in refused} == {"tokens"} and all(int(r.headers["retry-after-ms"]) > 0 for r in refused)
    assert "limit 1000, remaining 0, requested 100" in refused[0].message
    for lease in admitted[:4]:
        lease.release(used_tokens=50)  # 50 of each 100 come back: 200
    for limits in pair:
        await limits.given_back()
    again, still_refused = split([await admit(pair[i % 2], ALICE, reserved=100) for i in range(3)])
    assert len(again) == 2 and still_refused[0].reason == "tokens"


async def test_headers_show_the_shared_levels_as_each_replica_last_saw_them(replicas):
    first, second = replicas(requests_per_minute=60, tokens_per_minute=6000), replicas(requests_per_minute=60,
                                                                                      tokens_per_minute=6000)
    await admit(first, ALICE, reserved=1000)
    await admit(first, ALICE, reserved=1000)
    await admit(second, ALICE, reserved=1000)
    headers = second.headers(ALICE)
    assert headers["x-ratelimit-remaining-requests"] == "57" and headers["x-ratelimit-remaining-tokens"] == "3000"
    assert headers["x-ratelimit-limit-tokens"] == "6000" and headers["x-ratelimit-reset-tokens"] in ("29s", "30s")
    assert second.remaining(ALICE)["remaining_requests"] == 57


async def test_one_tenant_exhausting_its_shared_bucket_leaves_another_s_alone(replicas, redis_server):
    pair = [replicas(requests_per_minute=3), replicas(requests_per_minute=3)]
    admitted, refused = split([await admit(pair[i % 2], ALICE) for i in range(5)])
    assert (len(admitted), len(refused)) == (3, 2)
    admitted, refused = split([await admit(pair[i % 2], BOB) for i in range(3)])
    assert (len(admitted), len(refused)) == (3, 0)  # bob's bucket was full
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_server.url)
    keys = sorted(k.decode() for k in await client.keys("chatd:*"))
    await client.aclose()
    # Keyed by the authenticated tenant's id and tier; an unlimited tokens bucket is not stored.
    assert keys == ["chatd:bucket:{free:t-alice}:requests", "chatd:bucket:{free:t-bob}:requests"]


CORRUPTIONS = {  # what a key can hold that is no bucket, written by hand or by another program
    "a string": lambda r, k: r.set(k, "not a bucket"),
    "a list": lambda r, k: r.rpush(k, "1", "2"),
    "a level that is no number": lambda r, k: r.hset(k, mapping={"level": "abc", "at": "1"}),
    "a level that is nan": lambda r, k: r.hset(k, mapping={"level": "nan", "at": "1"}),
    "a time far ahead": lambda r, k: r.hset(k, mapping={"level": "0", "at": "1e15"}),
}


@pytest.mark.parametrize("fail_open", [False, True], ids=["closed", "open"])
@pytest.mark.parametrize("corruption", CORRUPTIONS)
async def test_a_key_that_holds_no_bucket_is_that_holder_s_bucket_reset_never_an_outage(
        replicas, redis_server, corruption, fail_open, caplog):
    """One holder's key holding something else (WRONGTYPE, garbage fields) is reset for that holder
    and logged: the others are served from Redis as before, closed or open, and so is that holder."""
    import redis

    limits = replicas(fail_open=fail_open, requests_per_minute=2, tokens_per_minute=1000)
    sync = redis.Redis.from_url(redis_server.url)

    def corrupt(key: str) -> None:
        sync.delete(key)
        CORRUPTIONS[corruption](sync, key)

    for bucket in ("requests", "tokens"):
        corrupt(f"chatd:bucket:{{free:t-alice}}:{bucket}")
    with caplog.at_level(logging.WARNING, logger="chatd.http"):
        bob, alice = await admit(limits, BOB), await admit(limits, ALICE)
        assert isinstance(bob, Lease) and bob.shared_holder == "t-bob"  # Redis counted bob, as always
        assert isinstance(alice, Lease) and alice.shared_holder == "t-alice"  # and alice, on a full bucket
        assert limits.shared.down_since is None
        # Corrupt again before the give-back: it too resets, and the request is unharmed.
        corrupt("chatd:bucket:{free:t-alice}:tokens")
        alice.release(used_tokens=1)
        await limits.given_back()
    assert sync.hget("chatd:bucket:{free:t-alice}:requests", "level") == b"1"  # a bucket again, one taken
    warned = [r.getMessage() for r in caplog.records if "held something other than a bucket" in r.getMessage()]
    assert len(warned) == 2 and all("t-alice" in message and "t-bob" not in message for message in warned)
    # Alice's rate still holds: 2 a minute.
    admitted, refused = split([await admit(limits, ALICE) for _ in range(2)])
    assert (len(admitted), len(refused)) == (1, 1) and refused[0].reason == "requests"
    sync.close()


async def test_redis_down_fails_closed_with_a_503_and_counts_again_once_it_is_back(replicas, redis_server):
    clock = Clock()
    limits = replicas(fail_open=False, clock=clock, requests_per_minute=2)
    assert isinstance(await admit(limits, ALICE), Lease)
    redis_server.stop()
    for _ in range(3):
        refusal = await admit(limits, ALICE)
        assert (refusal.status, refusal.code, refusal.reason) == (503, "limit_store_unavailable", "limit_store")
        assert refusal.body()["error"]["type"] == "server_error" and refusal.headers["Retry-After"] == "1"
        assert str(redis_server.port) not in refusal.message  # where Redis is: the operator's log only
    assert limits.remaining(ALICE)["in_flight_requests"] == 1  # the refusals held nothing
    redis_server.start()  # empty: it kept nothing on disk, so alice's bucket is full again
    clock.now += 1.0  # the store is tried again a second after the last failed try
    admitted, refused = split([await admit(limits, ALICE) for _ in range(3)])
    assert len(admitted) == 2 and refused[0].reason == "requests"


async def test_redis_down_fails_open_to_each_replica_s_own_buckets_and_recovers(replicas, redis_server, caplog):
    clock = Clock()
    first, second = (replicas(clock=clock, requests_per_minute=3, tokens_per_minute=1000) for _ in range(2))
    before = await admit(first, ALICE)
    assert before.shared_holder == "t-alice"
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="chatd.http"):
        # Each replica goes on from the levels it last saw: at most the tier's rate on each.
        assert len(split([await admit(first, ALICE) for _ in range(4)])[0]) == 2
        assert len(split([await admit(second, ALICE) for _ in range(4)])[0]) == 3
        before.release(used_tokens=10)  # its give-back cannot reach Redis: logged, the request unharmed
        await first.given_back()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "is unreachable" in r.getMessage()]
    assert len(warned) == 2  # once per replica and outage
    redis_server.start()
    clock.now += 1.0
    admitted, refused = split([await admit(first if i % 2 else second, ALICE) for i in range(4)])
    assert len(admitted) == 3 and all(lease.shared_holder == "t-alice" for lease in admitted)
    assert refused[0].reason == "requests"


async def test_without_the_redis_package_in_process_buckets_work_and_a_redis_storage_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` fails as if it were not installed
    check_storage("")
    assert shared_buckets("memory://") is None
    with pytest.raises(ValueError, match=r"needs the redis package: pip install 'redis>=5.0.1'"):
        check_storage("redis://:secret@cache:6379/0")
    limits = Limits({"free": TierConfig(requests_per_minute=1, priority=20)}, True)
    assert isinstance(await admit(limits, ALICE), Lease) and isinstance(await admit(limits, ALICE), Refused)


def test_a_storage_url_is_shown_without_its_password():
    assert shown_url("redis://:secret@cache:6379/0") == "redis://cache:6379/0"
    assert shown_url("redis://user:secret@cache:6379/0") == "redis://cache:6379/0"
    assert shown_url("redis://cache:6379/0") == "redis://cache:6379/0"


@pytest.mark.slow
def test_two_chatd_replicas_on_one_redis_answer_exactly_the_tiers_rate(tmp_path, redis_server):
    from tests.http.serving import start_server, stop_server, tenants_server

    n = 4
    tiers = (f'[tiers]\nstorage = "{redis_server.url}"\n'
             f"[tiers.paid]\nrequests_per_minute = {n}\ntokens_per_minute = 0\nttft_p95_seconds = 0\n")
    with tenants_server(tmp_path / "first", tiers, names=("alice",)) as first:
        (tmp_path / "second").mkdir()
        second, second_url, _ = start_server(tmp_path / "second", first["model_dir"], first["config"].read_text())
        try:
            statuses, retry_after = [], []
            for i in range(2 * n):
                url = (first["url"], second_url)[i % 2]
                response = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                                      headers={"Authorization": f"Bearer {first['keys']['alice']}"},
                                      json={"model": "demo", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]})
                statuses.append(response.status_code)
                if response.status_code == 429:
                    retry_after.append(int(response.headers["Retry-After"]))
        finally:
            stop_server(second)
    assert statuses.count(200) == n and statuses.count(429) == n, statuses
    assert all(seconds >= 1 for seconds in retry_after)

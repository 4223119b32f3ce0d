"""The tiers' request and token buckets: in this process (TokenBucket), or in Redis (SharedBuckets)
so that every replica of a server counts against the same ones ([tiers] storage = "redis://...").

A bucket holds `capacity` units refilled continuously at `capacity` per minute, and starts full.
In Redis each is a hash {level, at} under `chatd:bucket:{TIER:HOLDER}:requests` (and `:tokens`),
where HOLDER is the authenticated tenant's id (or tenant/key with `limit_per = "key"`), never
anything a client sends. The braces are a Redis Cluster hash tag: a holder's two buckets live on
one node. A bucket's key expires once it would be full again, so idle holders cost nothing.

Each admission is one Lua script: it reads both buckets refilled to Redis's own clock (TIME, so
replicas whose clocks disagree still agree on every level), and takes from both or from neither.
It answers whether it took and both levels, from which limits.py tells the client its
x-ratelimit-* headers and its Retry-After. Giving back what a request did not use is a second
script. Redis runs a script alone, so two replicas admitting at once cannot both take the last unit.
A key that holds no bucket (LEVEL below) is that holder's bucket reset and logged, not an outage.

This module knows nothing of tiers' other limits (concurrency, queues: each replica's own) nor
of what to do when Redis cannot be reached: every failure, and any call slower than `timeout`,
is StoreUnavailable, and limits.py decides. redis-py is imported only when a redis:// storage
is configured: chatd runs with in-process buckets without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger("chatd.http")


class TokenBucket:
    """`capacity` units refilled continuously at `capacity` per minute; starts full."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0  # units per second
        self._level = float(capacity)
        self._at = now

    def level(self, now: float) -> float:
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait(self, cost: int, now: float) -> float:
        """Seconds until `cost` units are there (0: now)."""
        return max(0.0, (cost - self.level(now)) / self.rate)

    def take(self, cost: int, now: float) -> None:
        self._level = self.level(now) - cost

    def give_back(self, units: int, now: float) -> None:
        self._level = min(self.capacity, self.level(now) + units)

    def set_level(self, level: float, now: float) -> None:
        """The level the shared store answered: this replica's view of a bucket kept in Redis."""
        self._level, self._at = level, now

    def seconds_to_full(self, now: float) -> float:
        return (self.capacity - self.level(now)) / self.rate



@dataclass
class Budget:
    """One holder's buckets (None: that bucket is unlimited) and the requests it has generating."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0

    def idle(self, now: float) -> bool:
        """Nothing running and both buckets full: forgetting it changes nothing."""
        return self.in_flight == 0 and all(b is None or b.level(now) >= b.capacity for b in (self.requests, self.tokens))

    def shortfall(self, reserved_tokens: int | None, now: float) -> tuple[str, TokenBucket, int, float] | None:
        """The first bucket short of one request and `reserved_tokens` (None: not known yet, not
        checked): (kind, bucket, cost, seconds until it has them); None when both have enough."""
        for kind, bucket, cost in (("requests", self.requests, 1), ("tokens", self.tokens, reserved_tokens)):
            if bucket is not None and cost is not None and (wait := bucket.wait(cost, now)):
                return kind, bucket, cost, wait
        return None

    def take(self, reserved_tokens: int, now: float) -> None:
        """One request and `reserved_tokens` from the buckets (checked before, by shortfall)."""
        for bucket, cost in ((self.requests, 1), (self.tokens, reserved_tokens)):
            if bucket is not None:
                bucket.take(cost, now)

    def set_levels(self, requests: float | None, tokens: float | None, now: float) -> None:
        """The levels the shared store answered (None: not known), as this replica's view."""
        for bucket, level in ((self.requests, requests), (self.tokens, tokens)):
            if bucket is not None and level is not None:
                bucket.set_level(level, now)


# Both scripts read a bucket through LEVEL: a key that holds anything but a bucket (another type,
# as `SET` or `LPUSH` by hand or another program would leave; fields that are not finite numbers;
# a time far ahead of Redis's clock) is deleted, and the holder's bucket starts full again. That
# is one holder's problem, answered for that holder; were the script to fail (WRONGTYPE), the
# replica would read it as "Redis is down" and fail every tenant open or closed.
LEVEL = """
local function level_of(key, capacity, now)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then return capacity, 0 end
  if kind == 'hash' then
    local held = redis.call('HMGET', key, 'level', 'at')
    local level, at = tonumber(held[1]), tonumber(held[2])
    local finite = function(x) return x ~= nil and x == x and x > -math.huge and x < math.huge end
    if finite(level) and finite(at) and at <= now + 60 then
      return math.min(capacity, level + math.max(0, now - at) * capacity / 60), 0
    end
  end
  redis.call('DEL', key)
  return capacity, 1
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# KEYS: the requests bucket, the tokens bucket. ARGV: each one's capacity and cost (a capacity of
# 0: no such bucket). Answers {taken (1 or 0), requests level, tokens level, keys reset} after
# taking or not, levels as strings (Redis would cut a Lua number to an integer), "-1" for no bucket.
TAKE = LEVEL + """
local levels, taken, reset = {}, 1, 0
for i = 1, 2 do
  local capacity, cost = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  if capacity > 0 then
    local was_reset
    levels[i], was_reset = level_of(KEYS[i], capacity, now)
    reset = reset + was_reset
    if levels[i] < cost then taken = 0 end
  end
end
local answer = {taken}
for i = 1, 2 do
  local capacity, cost = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  if capacity > 0 and taken == 1 then
    levels[i] = levels[i] - cost
    redis.call('HSET', KEYS[i], 'level', string.format('%.17g', levels[i]), 'at', string.format('%.6f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil((capacity - levels[i]) * 60000 / capacity) + 1000)
  end
  answer[i + 1] = capacity > 0 and string.format('%.17g', levels[i]) or '-1'
end
answer[4] = reset
return answer
"""

# KEYS: a bucket. ARGV: its capacity, the units given back. Answers {its level after, keys reset}.
# A bucket whose key has expired (or was reset) is full: nothing to give back to.
GIVE_BACK = LEVEL + """
local capacity, units = tonumber(ARGV[1]), tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then return {tostring(capacity), 0} end
local level, reset = level_of(KEYS[1], capacity, now)
if reset == 1 then return {tostring(capacity), 1} end
level = math.min(capacity, level + units)
redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level), 'at', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - level) * 60000 / capacity) + 1000)
return {string.format('%.17g', level), 0}
"""

PROBE_EVERY = 1.0  # seconds between tries while the store is down; calls meanwhile fail at once


class StoreUnavailable(Exception):
    """The shared buckets could not be read or written (Redis down, unreachable or too slow)."""


@dataclass(frozen=True)
class Taken:
    """One admission's answer: whether it took, and the levels after (None: that bucket is unlimited)."""

    taken: bool
    requests: float | None
    tokens: float | None


class SharedBuckets:
    """Every holder's request and token buckets in one Redis database, shared by the replicas using it."""

    def __init__(self, url: str, timeout: float = 0.25, clock=time.monotonic) -> None:
        redis = _import_redis(url)
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # One immediate retry: a pooled connection that Redis closed (a restart) reconnects on it.
        self.client = redis.asyncio.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                                   retry=Retry(NoBackoff(), 1))
        self._take = self.client.register_script(TAKE)
        self._give_back = self.client.register_script(GIVE_BACK)
        self._errors = (redis.RedisError, OSError, TimeoutError)
        self.where = shown_url(url)
        self.timeout = timeout
        self.clock = clock
        self.down_since: float | None = None  # clock() when the current outage began; None: reachable
        self._last_try = 0.0
        self._failed_calls = 0  # during the current outage

    async def take(self, tier: str, holder: str, requests: tuple[int, int], tokens: tuple[int, int]) -> Taken:
        """Take `requests` = (capacity, cost) and `tokens` = (capacity, cost) from a holder's buckets,
        both or neither (a capacity of 0: no such bucket)."""
        keys = [key(tier, holder, "requests"), key(tier, holder, "tokens")]
        answer = await self._run(self._take, keys, [*requests, *tokens])
        taken, levels = int(answer[0]), [float(level) for level in answer[1:3]]
        self._say_reset(int(answer[3]), keys)
        return Taken(bool(taken), *(None if level < 0 else level for level in levels))

    async def give_back(self, tier: str, holder: str, capacity: int, units: int) -> float:
        """Return unused tokens to a holder's token bucket; its level after."""
        keys = [key(tier, holder, "tokens")]
        level, reset = await self._run(self._give_back, keys, [capacity, units])
        self._say_reset(int(reset), keys)
        return float(level)

    def _say_reset(self, reset: int, keys: list[str]) -> None:
        if reset:
            log.warning("the shared limit store %s held something other than a bucket under %s: reset to a full "
                        "bucket (only this holder's limits were affected)", self.where, " or ".join(keys))

    async def close(self) -> None:
        await self.client.aclose()

    async def _run(self, script, keys: list[str], args: list[int]):
        now = self.clock()
        if self.down_since is not None and now - self._last_try < PROBE_EVERY:
            self._failed_calls += 1
            raise StoreUnavailable(f"the shared limit store {self.where} is unreachable")
        self._last_try = now
        try:
            # The socket timeout bounds each read; this bounds the call, its reconnect and retry included.
            async with asyncio.timeout(4 * self.timeout):
                answer = await script(keys=keys, args=args)
        except self._errors as exc:
            self._failed_calls += 1
            if self.down_since is None:
                self.down_since = now
                log.warning("the shared limit store %s is unreachable (%s: %s)", self.where, type(exc).__name__, exc)
            raise StoreUnavailable(f"the shared limit store {self.where} is unreachable") from exc
        if self.down_since is not None:
            log.warning("the shared limit store %s is reachable again after %.1f s; %d calls failed meanwhile",
                        self.where, now - self.down_since, self._failed_calls)
            self.down_since, self._failed_calls = None, 0
        return answer


def shared_buckets(storage: str) -> SharedBuckets | None:
    """The store [tiers] storage names; None for each replica's own memory ("" or "memory://")."""
    if not storage or storage == "memory://":
        return None
    shared = SharedBuckets(storage)
    log.info("tiers' request and token buckets: in %s, shared by every replica that uses it", shared.where)
    return shared


def check_storage(storage: str) -> None:
    """ValueError naming the pip command when [tiers] storage needs redis-py and it is not installed."""
    if storage and storage != "memory://":
        _import_redis(storage)


def key(tier: str, holder: str, bucket: str) -> str:
    """A holder's bucket's key; the braces keep a holder's buckets on one Redis Cluster node."""
    return f"chatd:bucket:{{{tier}:{holder}}}:{bucket}"


def shown_url(url: str) -> str:
    """A storage URL as logs and errors show it: without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _import_redis(url: str):
    try:
        import redis
        import redis.asyncio
    except ImportError:
        raise ValueError(f"[tiers] storage = {shown_url(url)!r} keeps the tiers' buckets in Redis, which needs the "
                         "redis package: pip install 'redis>=5.0.1'") from None
    return redis

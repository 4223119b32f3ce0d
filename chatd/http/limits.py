"""Tiers at the door: whether a tenant's request may start now, what it reserves, where it queues.

A tenant's tier ([tiers.NAME] in config.toml) sets its limits. They apply while the key database
is on ([auth] enabled); the one local user (auth off, or one shared key) is never limited. Per
holder (the tenant, or each of its keys with `limit_per = "key"`):

- a request bucket and a token bucket (requests_per_minute, tokens_per_minute), refilled
  continuously. A request reserves its prompt plus max_tokens per choice at admission, as
  OpenAI counts tokens per minute, and gives back what it did not use when it ends;
- at most max_concurrent_requests generating at once. A stored reply that goes on after its
  client left holds its slot until it ends, so nobody can leave a hundred running.

Per tier, server-wide: at most max_queued_requests waiting for their first token, and its
latency objective. A request whose estimated wait exceeds ttft_p95_seconds is refused at once
(503 with Retry-After), never left to time out. The estimate is the prompt work queued ahead of
it divided by the pace the engine drains its queue (EngineStats.queued_prefill_rate). Ahead of
it: all of each better class's work, and each tenant of its own class up to a fair share (the
scheduler serves them in turn, core/fairness.py). A lower tier sees more work ahead, so it is
shed first, and paid traffic keeps being admitted while free traffic is refused.

Refusals are OpenAI's: 429 `rate_limit_exceeded` with Retry-After (and retry-after-ms, which the
OpenAI SDKs read first), and the x-ratelimit-* headers that every response to a limited tenant
carries. A refused request takes nothing from any bucket.

Why not a library: `limits` counts hits in fixed or moving windows and cannot give back a
reservation, and reads the wall clock; `aiolimiter` waits for capacity instead of refusing with
a time to retry, and cannot give back either. A continuous bucket is a few lines of arithmetic.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from chatd.config import TierConfig
from chatd.engine import Placement
from chatd.http.errors import APIError
from chatd.http.metrics import ServerMetrics
from chatd.store.db import Tenant

log = logging.getLogger("chatd.http")

SWEEP_EVERY = 1024  # admissions between sweeps of idle holders' budgets


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

    def seconds_to_full(self, now: float) -> float:
        return (self.capacity - self.level(now)) / self.rate


@dataclass
class Budget:
    """One holder's buckets and the requests it has generating."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0

    def idle(self, now: float) -> bool:
        """Nothing running and both buckets full: forgetting it changes nothing."""
        return self.in_flight == 0 and all(b is None or b.level(now) >= b.capacity for b in (self.requests, self.tokens))


@dataclass(eq=False)
class Lease:
    """An admitted request's hold: a concurrency slot, reserved tokens, a place in its tier's queue.

    `first_token()` leaves the queue when the first token arrives; `release(used)` ends the hold
    when generation ends (however it ends), refunding what was reserved and not used. Both may be
    called again (and release implies first_token): only the first call counts.
    """

    limits: Limits
    tier_name: str
    tenant_id: str
    priority: int
    queued_tokens: int  # its prompt: work the engine does before its first token
    budget: Budget | None = None  # None: nothing held (the local user)
    reserved_tokens: int = 0
    arrived_at: float = field(default_factory=time.perf_counter)  # perf_counter when its request arrived
    queued: bool = True
    released: bool = False

    def first_token(self, queue_time: float | None = None) -> None:
        """Its first token arrived (`queue_time`: how long the engine kept it waiting)."""
        if self.queued:
            self.queued = False
            self.limits._leave_queue(self, queue_time, time.perf_counter() - self.arrived_at)

    def release(self, used_tokens: int) -> None:
        """Generation ended having used `used_tokens` (prompts + generated, every choice)."""
        if self.released:
            return
        if self.queued:  # ended before any token: it leaves the queue, and no first token is measured
            self.queued = False
            self.limits._leave_queue(self, None, None)
        self.released = True
        self.limits._release(self, used_tokens)


@dataclass
class QueuedWork:
    """Prompt tokens admitted and not yet answered with a first token, per class and tenant."""

    tokens: dict[int, dict[str, int]] = field(default_factory=dict)  # priority -> tenant id -> tokens
    weights: dict[str, float] = field(default_factory=dict)  # tenant id -> its tier's weight
    requests: dict[str, int] = field(default_factory=dict)  # tier name -> requests waiting

    def add(self, lease: Lease, weight: float) -> None:
        tenants = self.tokens.setdefault(lease.priority, {})
        tenants[lease.tenant_id] = tenants.get(lease.tenant_id, 0) + lease.queued_tokens
        self.weights[lease.tenant_id] = weight
        self.requests[lease.tier_name] = self.requests.get(lease.tier_name, 0) + 1

    def remove(self, lease: Lease) -> None:
        tenants = self.tokens[lease.priority]
        tenants[lease.tenant_id] -= lease.queued_tokens
        if tenants[lease.tenant_id] <= 0:  # its last queued request (an empty prompt counts 0 either way)
            del tenants[lease.tenant_id]
            if not tenants:
                del self.tokens[lease.priority]
            if not any(lease.tenant_id in t for t in self.tokens.values()):
                self.weights.pop(lease.tenant_id, None)
        self.requests[lease.tier_name] -= 1

    def ahead(self, priority: int, tenant_id: str, weight: float, num_tokens: int) -> int:
        """Prompt tokens the engine computes before a new request's: every better class's, then
        its own tenant's, and each other tenant of its class up to the same weighted share."""
        work = sum(sum(t.values()) for p, t in self.tokens.items() if p < priority)
        own_class = self.tokens.get(priority, {})
        mine = own_class.get(tenant_id, 0)
        for other, tokens in own_class.items():
            if other != tenant_id:
                work += min(tokens, (mine + num_tokens) * self.weights.get(other, 1.0) / weight)
        return int(work + mine)


class Limits:
    """Every holder's budget and the queued work, checked at admission; stored on ServerState."""

    def __init__(self, tiers: dict[str, TierConfig], enabled: bool, metrics: ServerMetrics | None = None,
                 clock=time.monotonic) -> None:
        self.tiers = tiers
        self.enabled = enabled  # the key database is on: tenants are limited by their tiers
        self.metrics = metrics
        self.clock = clock
        self.queued = QueuedWork()
        self._budgets: dict[str, Budget] = {}
        self._admissions = 0

    def tier(self, tenant: Tenant) -> TierConfig:
        tier = self.tiers.get(tenant.tier)
        if tier is None:  # a key made after start, under a config that defines more tiers
            log.error("tenant %s has tier %r, which this server's config does not define", tenant.name, tenant.tier)
            raise APIError(403, f"your API key's tier {tenant.tier!r} is not defined on this server; ask its operator",
                           None, "unknown_tier")
        return tier

    # -- before tokenizing: where the request may go and how long it may be -----------------------

    def placement(self, tenant: Tenant, client_priority: int) -> Placement:
        """Where the engine places a request: its class (the tier's priority, to which a client's
        own `priority` can only add) and its tenant's fair share."""
        if not self.enabled:  # one user: its own priorities order its own requests, as vLLM's do
            return Placement(client_priority, tenant.id)
        tier = self.tier(tenant)
        return Placement(tier.priority + max(0, client_priority), tenant.id, tier.weight)

    def check_model(self, tenant: Tenant, model: str | None) -> None:
        """404 for a served model name the tenant's tier may not use (as OpenAI says of a model one has no access to)."""
        if not self.enabled or model is None:
            return
        allowed = self.tier(tenant).models
        if allowed and model not in allowed:
            raise APIError(404, f"the model {model!r} does not exist or your tier ({tenant.tier}) does not have access "
                                f"to it; it may use {', '.join(repr(m) for m in allowed)}", "model", "model_not_found")

    def may_use(self, tenant: Tenant, model: str) -> bool:
        allowed = self.tier(tenant).models if self.enabled else ()
        return not allowed or model in allowed

    def max_tokens(self, tenant: Tenant, requested: int | None, param: str) -> int | None:
        """The reply length a request gets: its own, within the tier's ceiling (the ceiling when it
        names none). 400 naming `param` above the ceiling."""
        ceiling = self.tier(tenant).max_tokens if self.enabled else 0
        if not ceiling:
            return requested
        if requested is not None and requested > ceiling:
            raise APIError(400, f"{param} is {requested}, over the limit of {ceiling} for tier {tenant.tier}", param,
                           "max_tokens_exceeds_tier")
        return requested if requested is not None else ceiling

    # -- admission --------------------------------------------------------------------------------

    def admit(self, tenant: Tenant, prompt_tokens: int, reserved_tokens: int, priority: int,
              drain_rate: Callable[[], float | None], param: str, arrived_at: float | None = None) -> Lease:
        """Admit a request of `prompt_tokens` reserving `reserved_tokens` (prompt + max_tokens per
        choice), or refuse it (Refused: 429 or 503, or 400 if it can never fit), taking nothing.
        `priority` is its class as placed; `drain_rate` says how fast the engine drains its queue
        (read only when an objective needs it); `param` names max_tokens as the client did."""
        with self._telling(tenant):
            lease = self._admit(tenant, prompt_tokens, reserved_tokens, priority, drain_rate, param)
        if arrived_at is not None:
            lease.arrived_at = arrived_at
        self.queued.add(lease, self.tier(tenant).weight)
        if self.metrics is not None:
            self.metrics.tier_admitted(tenant.tier)
        return lease

    def precheck(self, tenant: Tenant, priority: int, drain_rate: Callable[[], float | None]) -> None:
        """What can be refused before the prompt is rendered and tokenized (all but the token
        bucket, and the wait estimate without the request's own prompt): a flood that would be
        refused costs the server no tokenizing. Takes nothing; `admit` checks everything again."""
        if self.enabled:
            with self._telling(tenant):
                self._check(tenant, self.tier(tenant), None, 0, priority, drain_rate, "")

    @contextlib.contextmanager
    def _telling(self, tenant: Tenant):
        """Log and count each refusal once, with tenant, tier and reason."""
        try:
            yield
        except Refused as refusal:
            log.info("request refused", extra={"tenant": tenant.name, "tier": tenant.tier, "reason": refusal.reason,
                                               "status": refusal.status})
            if self.metrics is not None:
                self.metrics.tier_refused(tenant.tier, refusal.reason)
            raise

    def _admit(self, tenant: Tenant, prompt_tokens: int, reserved_tokens: int, priority: int,
               drain_rate: Callable[[], float | None], param: str) -> Lease:
        tier = self.tier(tenant)
        if not self.enabled:
            return Lease(self, tenant.tier, tenant.id, priority, prompt_tokens)
        budget = self._check(tenant, tier, reserved_tokens, prompt_tokens, priority, drain_rate, param)
        now = self.clock()
        for bucket, cost in ((budget.requests, 1), (budget.tokens, reserved_tokens)):
            if bucket is not None:
                bucket.take(cost, now)
        budget.in_flight += 1
        return Lease(self, tenant.tier, tenant.id, priority, prompt_tokens, budget, reserved_tokens)

    def _check(self, tenant: Tenant, tier: TierConfig, reserved_tokens: int | None, prompt_tokens: int,
               priority: int, drain_rate: Callable[[], float | None], param: str) -> Budget:
        """Refuse (Refused) unless every limit lets the request in; `reserved_tokens` None: not known yet."""
        now = self.clock()
        budget = self._budget(tenant, tier, now)
        refuse = _Refusal(tenant, tier)
        if reserved_tokens is not None and tier.tokens_per_minute and reserved_tokens > tier.tokens_per_minute:
            reducible = reserved_tokens - prompt_tokens
            raise refuse.never(reserved_tokens, param if prompt_tokens < tier.tokens_per_minute and reducible else None)
        if tier.max_concurrent_requests and budget.in_flight >= tier.max_concurrent_requests:
            raise refuse.concurrency(budget.in_flight)
        if budget.requests is not None and (wait := budget.requests.wait(1, now)):
            raise refuse.rate("requests", budget.requests, 1, wait, now)
        if reserved_tokens is not None and budget.tokens is not None and (wait := budget.tokens.wait(reserved_tokens, now)):
            raise refuse.rate("tokens", budget.tokens, reserved_tokens, wait, now)
        waiting = self.queued.requests.get(tenant.tier, 0)
        if tier.max_queued_requests and waiting >= tier.max_queued_requests:
            raise refuse.queue_full(waiting, self._expected_wait(tenant, tier, priority, prompt_tokens, drain_rate))
        if tier.ttft_p95_seconds:
            expected = self._expected_wait(tenant, tier, priority, prompt_tokens, drain_rate)
            if expected > tier.ttft_p95_seconds:
                raise refuse.overloaded(expected)
        return budget

    def _expected_wait(self, tenant: Tenant, tier: TierConfig, priority: int, prompt_tokens: int,
                       drain_rate: Callable[[], float | None]) -> float:
        """Seconds the request would wait for the engine to reach it (0 while no queue has been measured)."""
        ahead = self.queued.ahead(priority, tenant.id, tier.weight, prompt_tokens)
        if not ahead:
            return 0.0
        rate = drain_rate()
        if rate is None:
            return 0.0
        return ahead / rate if rate > 0 else math.inf

    def _leave_queue(self, lease: Lease, queue_time: float | None, ttft: float | None) -> None:
        self.queued.remove(lease)
        if self.metrics is not None and ttft is not None:
            self.metrics.tier_first_token(lease.tier_name, ttft, queue_time)

    def _release(self, lease: Lease, used_tokens: int) -> None:
        budget = lease.budget
        if budget is None:
            return
        budget.in_flight -= 1
        if budget.tokens is not None and lease.reserved_tokens > used_tokens:
            budget.tokens.give_back(lease.reserved_tokens - used_tokens, self.clock())

    @staticmethod
    def _holder(tenant: Tenant, tier: TierConfig) -> str:
        """Whose budget a request counts against: its tenant's, or its key's with limit_per = "key"."""
        return f"{tenant.id}/{tenant.key_id}" if tier.limit_per == "key" and tenant.key_id else tenant.id

    def _budget(self, tenant: Tenant, tier: TierConfig, now: float) -> Budget:
        holder = self._holder(tenant, tier)
        budget = self._budgets.get(holder)
        if budget is None:
            budget = self._budgets[holder] = Budget(
                TokenBucket(tier.requests_per_minute, now) if tier.requests_per_minute else None,
                TokenBucket(tier.tokens_per_minute, now) if tier.tokens_per_minute else None)
        self._admissions += 1
        if self._admissions % SWEEP_EVERY == 0:
            self._budgets = {h: b for h, b in self._budgets.items() if b is budget or not b.idle(now)}
        return budget

    # -- what clients are told --------------------------------------------------------------------

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tenant's buckets now (none for unlimited ones)."""
        if not self.enabled:
            return {}
        tier = self.tier(tenant)
        now = self.clock()
        budget = self._budget_if_any(tenant, tier)
        headers = {}
        for kind, limit, bucket in (("requests", tier.requests_per_minute, budget and budget.requests),
                                    ("tokens", tier.tokens_per_minute, budget and budget.tokens)):
            if limit:
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = str(int(bucket.level(now)) if bucket else limit)
                headers[f"x-ratelimit-reset-{kind}"] = duration(bucket.seconds_to_full(now) if bucket else 0.0)
        return headers

    def remaining(self, tenant: Tenant) -> dict:
        """The tenant's limits and what is left of them now, for /v1/usage."""
        tier = self.tier(tenant)
        if not self.enabled:
            return {"limited": False}
        now = self.clock()
        budget = self._budget_if_any(tenant, tier)

        def left(limit: int, bucket: TokenBucket | None) -> int | None:
            return None if not limit else int(bucket.level(now)) if bucket else limit

        return {
            "limited": True,
            "requests_per_minute": tier.requests_per_minute or None,
            "remaining_requests": left(tier.requests_per_minute, budget and budget.requests),
            "tokens_per_minute": tier.tokens_per_minute or None,
            "remaining_tokens": left(tier.tokens_per_minute, budget and budget.tokens),
            "max_concurrent_requests": tier.max_concurrent_requests or None,
            "in_flight_requests": budget.in_flight if budget else 0,
            "max_tokens": tier.max_tokens or None,
        }

    def _budget_if_any(self, tenant: Tenant, tier: TierConfig) -> Budget | None:
        return self._budgets.get(self._holder(tenant, tier))


class Refused(APIError):
    """A request a tier's limits refuse; `reason` labels the metrics and the log line."""

    def __init__(self, status: int, reason: str, message: str, code: str, retry_after: float | None,
                 param: str | None = None) -> None:
        super().__init__(status, message, param, code, {} if retry_after is None else retry_headers(retry_after))
        self.reason = reason


class _Refusal:
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

    def rate(self, kind: str, bucket: TokenBucket, cost: int, wait: float, now: float) -> Refused:
        return self._error(429, kind, f"rate limit reached for {kind} per minute (tier {self.tenant.tier}): limit "
                           f"{bucket.capacity}, remaining {int(bucket.level(now))}, requested {cost}; try again in "
                           f"{duration(wait)}", "rate_limit_exceeded", wait)

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

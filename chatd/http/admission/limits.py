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

Where the buckets live ([tiers] storage): in each replica's memory by default; in Redis
(buckets.py) when several replicas serve one set of tenants, so that a tenant's requests
and tokens per minute hold across all of them. The server then admits with `admit_async`, one
Redis call per admission, and each replica keeps a view of the holder's levels from Redis's
answers for the x-ratelimit-* headers, /v1/usage and the precheck. Concurrency slots, the queue
bound and the latency objective stay each replica's own: each protects its own GPU, and a tenant
may have max_concurrent_requests generating on each replica.

When Redis cannot be reached ([tiers] on_storage_error), "open" (the default) goes on with each
replica's own buckets from the levels it last saw: a tenant gets at most its limit per replica
instead of its limit overall, and nobody is refused because a cache is restarting. "closed"
refuses limited tenants' requests (503, Retry-After) until Redis answers again. Open by default
because the store shares limits, it does not gate the service: bills come from the usage ledger
(what each request used), not from the buckets, and each replica's concurrency and queue bounds
still protect its GPU. Choose "closed" where going over a quota costs more than refusing. Either
way a call waits at most a fraction of a second, and Redis is used again as soon as it answers.

This module is admission's entry: Limits and the Lease it hands out. An admission goes down
once into each helper and comes back: tier_checks.py (every check, in order, Refused if one
fails), then the holder's Budget takes (buckets.py), then the queue counts it (queued_work.py),
then the metrics. No helper calls back into this module.

Why not a library: `limits` counts hits in fixed or moving windows and cannot give back a
reservation, and reads the wall clock; `aiolimiter` waits for capacity instead of refusing with
a time to retry, and cannot give back either. A continuous bucket is a few lines of arithmetic,
and in Redis a short Lua script.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from chatd.config import TierConfig
from chatd.engine import Placement
from chatd.http.admission import tier_checks
from chatd.http.admission.buckets import Budget, SharedBuckets, StoreUnavailable, TokenBucket
from chatd.http.errors import APIError
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.admission.queued_work import QueuedWork
from chatd.http.admission.refusals import Refusal, Refused, duration
from chatd.store.db import Tenant

log = logging.getLogger("chatd.http")

SWEEP_EVERY = 1024  # admissions between sweeps of idle holders' budgets


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
    shared_holder: str | None = None  # whose buckets in the shared store its reservation is in; None: in-process
    arrived_at: float = field(default_factory=time.perf_counter)  # perf_counter when its request arrived
    queued: bool = True
    released: bool = False
    model_name: str | None = None  # the model serving it, for the tier series (None: the first)

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


class Limits:
    """Every holder's budget and the queued work, checked at admission; stored on ServerState."""

    def __init__(self, tiers: dict[str, TierConfig], enabled: bool, metrics: ServerMetrics | None = None,
                 shared: SharedBuckets | None = None, fail_open: bool = True, clock=time.monotonic) -> None:
        self.tiers = tiers
        self.enabled = enabled  # the key database is on: tenants are limited by their tiers
        self.metrics = metrics
        self.shared = shared  # the buckets in Redis, shared by the replicas; None: this process's own
        self.fail_open = fail_open  # Redis unreachable: go on with this replica's buckets (else refuse: 503)
        self.clock = clock
        self.queued = QueuedWork()
        self._budgets: dict[str, Budget] = {}
        self._admissions = 0
        self._giving_back: set[asyncio.Task] = set()

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
        """403 for a served model name the tenant's tier may not use, naming the model and the tier."""
        if not self.enabled or model is None:
            return
        allowed = self.tier(tenant).models
        if allowed and model not in allowed:
            raise APIError(403, f"your tier ({tenant.tier}) may not use the model {model!r}; it may use "
                                f"{', '.join(repr(m) for m in allowed)}", "model", "model_not_allowed")

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
              drain_rate: Callable[[], float | None], param: str, arrived_at: float | None = None,
              model_name: str | None = None) -> Lease:
        """Admit a request of `prompt_tokens` reserving `reserved_tokens` (prompt + max_tokens per
        choice), or refuse it (Refused: 429 or 503, or 400 if it can never fit), taking nothing.
        `priority` is its class as placed; `drain_rate` says how fast the engine drains its queue
        (read only when an objective needs it); `param` names max_tokens as the client did.
        In-process buckets only: the server admits with `admit_async`."""
        with self._telling(tenant, model_name):
            lease = self._admit(tenant, prompt_tokens, reserved_tokens, priority, drain_rate, param)
        lease.model_name = model_name
        self.queued.add(lease, self.tier(tenant).weight)
        return self._admitted(lease, arrived_at)

    async def admit_async(self, tenant: Tenant, prompt_tokens: int, reserved_tokens: int, priority: int,
                          drain_rate: Callable[[], float | None], param: str, arrived_at: float | None = None,
                          model_name: str | None = None) -> Lease:
        """`admit`, taking from the shared store's buckets when there is one (one call to Redis)."""
        tier = self.tier(tenant)
        if self.shared is None or not self.enabled or not (tier.requests_per_minute or tier.tokens_per_minute):
            return self.admit(tenant, prompt_tokens, reserved_tokens, priority, drain_rate, param, arrived_at,
                              model_name)
        with self._telling(tenant, model_name):
            budget = self._check(tenant, tier, reserved_tokens, prompt_tokens, priority, drain_rate, param, buckets=False)
            # Its slot and queue place are held while Redis answers, so that requests admitted
            # meanwhile see them: the bounds hold however many wait for Redis at once.
            lease = Lease(self, tenant.tier, tenant.id, priority, prompt_tokens, budget, reserved_tokens,
                          model_name=model_name)
            budget.in_flight += 1
            self.queued.add(lease, tier.weight)
            try:
                lease.shared_holder = await self._take_shared(tenant, tier, budget, reserved_tokens)
            except BaseException:
                budget.in_flight -= 1
                self.queued.remove(lease)
                raise
        return self._admitted(lease, arrived_at)

    def _admitted(self, lease: Lease, arrived_at: float | None) -> Lease:
        """An admitted lease, in the queue already: when its request arrived, and counted."""
        if arrived_at is not None:
            lease.arrived_at = arrived_at
        if self.metrics is not None:
            self.metrics.tier_admitted(lease.tier_name, lease.model_name)
        return lease

    def precheck(self, tenant: Tenant, priority: int, drain_rate: Callable[[], float | None],
                 model_name: str | None = None) -> None:
        """What can be refused before the prompt is rendered and tokenized (all but the token
        bucket, and the wait estimate without the request's own prompt): a flood that would be
        refused costs the server no tokenizing. Takes nothing; `admit` checks everything again."""
        if self.enabled:
            with self._telling(tenant, model_name):
                self._check(tenant, self.tier(tenant), None, 0, priority, drain_rate, "")

    @contextlib.contextmanager
    def _telling(self, tenant: Tenant, model_name: str | None):
        """Log and count each refusal once, with tenant, tier and reason."""
        try:
            yield
        except Refused as refusal:
            log.info("request refused", extra={"tenant": tenant.name, "tier": tenant.tier, "reason": refusal.reason,
                                               "status": refusal.status})
            if self.metrics is not None:
                self.metrics.tier_refused(tenant.tier, refusal.reason, model_name)
            raise

    def _admit(self, tenant: Tenant, prompt_tokens: int, reserved_tokens: int, priority: int,
               drain_rate: Callable[[], float | None], param: str) -> Lease:
        tier = self.tier(tenant)
        if not self.enabled:
            return Lease(self, tenant.tier, tenant.id, priority, prompt_tokens)
        budget = self._check(tenant, tier, reserved_tokens, prompt_tokens, priority, drain_rate, param)
        budget.take(reserved_tokens, self.clock())
        budget.in_flight += 1
        return Lease(self, tenant.tier, tenant.id, priority, prompt_tokens, budget, reserved_tokens)

    async def _take_shared(self, tenant: Tenant, tier: TierConfig, budget: Budget, reserved_tokens: int) -> str | None:
        """Take from the holder's buckets in Redis, or refuse (Refused) taking nothing; the holder,
        or None when Redis is unreachable and this replica's own buckets took (fail open)."""
        holder = self._holder(tenant, tier)
        try:
            taken = await self.shared.take(tenant.tier, holder, (tier.requests_per_minute, 1),
                                           (tier.tokens_per_minute, reserved_tokens))
        except StoreUnavailable:
            if not self.fail_open:
                raise Refusal(tenant, tier).store_unavailable(1.0) from None
            tier_checks.check_buckets(tenant, tier, budget, reserved_tokens, self.clock())
            budget.take(reserved_tokens, self.clock())
            return None
        budget.set_levels(taken.requests, taken.tokens, self.clock())
        if not taken.taken:  # the view now holds Redis's levels: the bucket it found short refuses
            tier_checks.check_buckets(tenant, tier, budget, reserved_tokens, self.clock())
        return holder

    def _check(self, tenant: Tenant, tier: TierConfig, reserved_tokens: int | None, prompt_tokens: int,
               priority: int, drain_rate: Callable[[], float | None], param: str, buckets: bool = True) -> Budget:
        """The holder's budget, once every check lets the request in (tier_checks.py; Refused if not)."""
        budget = self._budget(tenant, tier, self.clock())
        tier_checks.check(tenant, tier, budget, self.queued, reserved_tokens, prompt_tokens, priority, drain_rate, param,
                          self.clock, buckets)
        return budget

    def _leave_queue(self, lease: Lease, queue_time: float | None, ttft: float | None) -> None:
        self.queued.remove(lease)
        if self.metrics is not None and ttft is not None:
            self.metrics.tier_first_token(lease.tier_name, ttft, queue_time, lease.model_name)

    def _release(self, lease: Lease, used_tokens: int) -> None:
        budget = lease.budget
        if budget is None:
            return
        budget.in_flight -= 1
        unused = lease.reserved_tokens - used_tokens
        if budget.tokens is None or unused <= 0:
            return
        if lease.shared_holder is None:
            budget.tokens.give_back(unused, self.clock())
        else:  # Redis answers later; the request has ended either way
            task = asyncio.get_running_loop().create_task(self._give_back_shared(lease, budget.tokens, unused))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    async def _give_back_shared(self, lease: Lease, view: TokenBucket, unused: int) -> None:
        try:
            level = await self.shared.give_back(lease.tier_name, lease.shared_holder, view.capacity, unused)
        except StoreUnavailable:  # the store logs its outage once; these tokens stay taken
            log.info("%d unused tokens of tenant %s not given back: the shared limit store is unreachable", unused,
                     lease.tenant_id)
            return
        view.set_level(level, self.clock())

    async def given_back(self, timeout: float = 1.0) -> None:
        """Wait (at most `timeout` seconds) for the give-backs to the shared store under way."""
        if self._giving_back:
            await asyncio.wait(set(self._giving_back), timeout=timeout)

    async def close(self) -> None:
        """Let give-backs under way finish (a second at most) and close the shared store's connections."""
        await self.given_back()
        if self.shared is not None:
            await self.shared.close()

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

"""The server's Prometheus metrics: engine gauges and counters, per-request histograms.

Names follow vLLM's (`vllm:num_requests_running` becomes `chatd:num_requests_running`) so
dashboards written for vLLM need only the prefix changed. The engine series a router reads for
load and cache affinity are also exposed under vLLM's own names and labels (metric_collectors.VLLM_NAMED), so
gateways built for vLLM replicas read chatd unchanged. Every `ServerMetrics` owns its
own `CollectorRegistry`: two apps in one process, or two tests, never see each other's
numbers. The per-request series carry a `route` label (ROUTES: which API generated), so one
dashboard shows the chat page's turns beside the API's completions. This module knows nothing
of HTTP; the route serves what `render` returns. The collectors that read many values at once
(the engine's stats, inter-token latencies) are metric_collectors.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from chatd.engine import FinishReason
from chatd.http.telemetry.metric_collectors import ROUTES, BulkHistogram, EngineCollector, WithoutCreated

if TYPE_CHECKING:
    from chatd.engine import EngineStats

# From a cached one-token reply (~1 ms) to a long generation on a busy server (minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
# Why a tier's requests are refused: by their tenant's own limits, or because the server is busy
# (or, with [tiers] on_storage_error = "closed", cannot reach the shared limit store).
LIMITED_REASONS = ("requests", "tokens", "concurrency", "too_large")
SHED_REASONS = ("overloaded", "queue_full", "limit_store")
# Powers of two, 1 .. 32768: context windows are powers of two, so the top bucket is one.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(16))
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
UNLOAD_REASONS = ("idle", "room", "stopped", "admin")
# What becomes of a finished trace's spans (tracing.py, trace_export.py).
TRACE_OUTCOMES = ("exported", "sampled_out", "dropped_queue_full", "dropped_export_failed", "dropped_too_many_pending")
class ServerMetrics:
    """The server's Prometheus metrics."""

    def __init__(self, model_name: str, kv_bytes_per_token: int = 0, block_size: int = 0) -> None:
        """kv_bytes_per_token, block_size: the KV pool's layout, so blocks moved read as bytes."""
        self.model_name = model_name  # the first model's: series whose model is not named carry it
        self._model_names: list[str] = []
        self._tiers: list[str] = []
        # Told of each finished request (model, finish reason, time to first token) and each rating
        # (model, up or down): the canary ramps measure versions with them (models/canary.py).
        self.request_watchers: list[Callable[[str, str, float | None], None]] = []
        self.rating_watchers: list[Callable[[str, str], None]] = []
        self.registry = CollectorRegistry()
        self._engine = EngineCollector()
        self.registry.register(self._engine)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, ["model_name", "route"], buckets=buckets, registry=self.registry)

        self._request_success = Counter(
            "chatd:request_success_total",
            "Finished requests, by route (chat, completions, responses, conversation) and why they finished.",
            ["model_name", "route", "finished_reason"],
            registry=self.registry,
        )
        self._ttft = histogram("chatd:time_to_first_token_seconds", "Seconds from arrival to the first token.", LATENCY_BUCKETS)
        self._inter_token = BulkHistogram("chatd:inter_token_latency_seconds",
                                           "Seconds between consecutive tokens of one choice.", LATENCY_BUCKETS)
        self.registry.register(self._inter_token)
        self._e2e = histogram("chatd:e2e_request_latency_seconds", "Seconds from arrival to the last token.", LATENCY_BUCKETS)
        self._queue_time = histogram("chatd:request_queue_time_seconds", "Seconds a request waited before its first schedule.", LATENCY_BUCKETS)
        self._prompt_tokens = histogram("chatd:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self._generation_tokens = histogram("chatd:request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS)
        self._route_series: dict[tuple[str, str], tuple] = {}  # (model, route) -> its children of the histograms above

        # Per tier ([tiers.NAME]): who got in, who was refused and why, and how long they waited.
        self._tier_admitted = Counter("chatd:tier_requests_admitted_total", "Generation requests admitted, by tier.",
                                      ["model_name", "tier"], registry=self.registry)
        self._tier_limited = Counter(
            "chatd:tier_requests_rate_limited_total",
            "Requests refused by their tenant's limits (429; too_large: 400, more than a minute's tokens), by tier and "
            "reason: requests, tokens, concurrency, too_large.", ["model_name", "tier", "reason"], registry=self.registry)
        self._tier_shed = Counter(
            "chatd:tier_requests_shed_total",
            "Requests refused because the server is busy (503), by tier and reason: overloaded (the expected wait is "
            "over the tier's objective), queue_full (max_queued_requests).", ["model_name", "tier", "reason"],
            registry=self.registry)
        self._tier_ttft = Histogram("chatd:tier_time_to_first_token_seconds", "Seconds from arrival to the first token, "
                                    "by tier.", ["model_name", "tier"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._tier_queue_time = Histogram("chatd:tier_request_queue_time_seconds", "Seconds a request waited in the "
                                          "engine's queue before its first schedule, by tier.", ["model_name", "tier"],
                                          buckets=LATENCY_BUCKETS, registry=self.registry)
        self._alias_requests = Counter(
            "chatd:alias_requests_total", "Requests an alias ([aliases]) sent to a model, by why: weight (a canary's "
            "draw), thread (its conversation or chain was there), none (an escalating alias's small model), or the "
            "escalation rule that held (tiers, tools, response_format, prompt_chars, messages).",
            ["alias", "model_name", "why"], registry=self.registry)
        # A fleet's models coming and going (models/fleet.py): loads by outcome, unloads by reason, load time.
        self._model_loads = Counter("chatd:model_loads_total", "Loads of a chat model, by outcome (loaded, failed).",
                                    ["model_name", "outcome"], registry=self.registry)
        self._model_unloads = Counter(
            "chatd:model_unloads_total", "Unloads of a chat model, by reason: idle (its keep_alive passed), room (a "
            "least recently used model made room for another), stopped (its engine died), admin.",
            ["model_name", "reason"], registry=self.registry)
        self._model_load_seconds = Histogram("chatd:model_load_seconds", "Seconds a chat model took to load.",
                                             ["model_name"], buckets=LOAD_BUCKETS, registry=self.registry)
        # Read at scrape time (update_health): what the alerts of deploy/prometheus/ page on.
        self._store_writable = Gauge("chatd:store_writable", "1 while the store records usage and replies; 0 while "
                                     "its writes wait (new work is refused meanwhile).", registry=self.registry)
        self._pending_writes = Gauge("chatd:store_pending_writes", "Usage and reply writes queued for the store.",
                                     registry=self.registry)
        self._limit_store_up = Gauge("chatd:limit_store_up", "1 while the shared limit store ([tiers] storage, "
                                     "Redis) answers, or there is none; 0 while it is unreachable.",
                                     registry=self.registry)
        self._engine_failed = Gauge("chatd:engine_failed", "1 while a model's engine has stopped serving (a crash, "
                                    "out of memory); 0 while it serves or is unloaded.", ["model_name"],
                                    registry=self.registry)
        self._tier_objective = Gauge("chatd:tier_ttft_p95_objective_seconds", "A tier's p95 time-to-first-token "
                                     "objective ([tiers.NAME] ttft_p95_seconds), where it has one.", ["tier"],
                                     registry=self.registry)
        self._usage_tokens = Counter("chatd:usage_tokens_total", "Tokens billed, by tier, model and kind (prompt, "
                                     "cached: of the prompt, read from the prefix cache; completion).",
                                     ["tier", "model_name", "kind"], registry=self.registry)
        self._usage_cost = Counter("chatd:usage_cost_usd_total", "USD billed at the configured prices, by tier and "
                                   "model.", ["tier", "model_name"], registry=self.registry)
        self._canary_weight = Gauge("chatd:canary_weight", "A ramped canary's percentage of its alias's new threads.",
                                    ["alias", "model_name"], registry=self.registry)
        self._canary_changes = Counter("chatd:canary_changes_total", "Steps of canary ramps, by action: start, "
                                       "advance, done, rollback, restart.", ["alias", "model_name", "action"],
                                       registry=self.registry)
        self._feedback = Counter("chatd:feedback_total", "Users' ratings of replies (POST /v1/feedback), by the "
                                 "model that served the reply and rating (up, down).", ["model_name", "rating"],
                                 registry=self.registry)
        self._trace_spans = Counter("chatd:trace_spans_total", "Spans of finished traces ([tracing] on), by outcome: "
                                    "exported, sampled_out, dropped_queue_full, dropped_export_failed, "
                                    "dropped_too_many_pending.", ["outcome"], registry=self.registry)
        for outcome in TRACE_OUTCOMES:  # at 0 from the start (and while tracing is off), for rates and alerts
            self._trace_spans.labels(outcome=outcome)
        self.declare_model(model_name, kv_bytes_per_token, block_size)

    def trace_spans(self, outcome: str, count: int) -> None:
        """Spans a finished trace had, by what became of them (from the export thread too)."""
        self._trace_spans.labels(outcome=outcome).inc(count)

    def canary_changed(self, alias: str, model_name: str, weight: float, action: str | None = None) -> None:
        """A canary's weight in its alias now, and the ramp's step (start, advance, done, rollback, restart)."""
        self._canary_weight.labels(alias=alias, model_name=model_name).set(weight)
        if action is not None:
            self._canary_changes.labels(alias=alias, model_name=model_name, action=action).inc()

    def usage(self, tier: str, model_name: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              cost: float) -> None:
        """One request's usage as it is billed (the ledger writes the same to the store)."""
        for kind, tokens in (("prompt", prompt_tokens), ("cached", cached_tokens), ("completion", completion_tokens)):
            self._usage_tokens.labels(tier=tier, model_name=model_name, kind=kind).inc(tokens)
        self._usage_cost.labels(tier=tier, model_name=model_name).inc(cost)

    def feedback_given(self, model_name: str, rating: str) -> None:
        self._feedback.labels(model_name=model_name, rating=rating).inc()
        for watch in self.rating_watchers:
            watch(model_name, rating)

    def alias_picked(self, alias: str, model_name: str, why: str) -> None:
        self._alias_requests.labels(alias=alias, model_name=model_name, why=why).inc()

    def model_loaded(self, model_name: str, seconds: float | None) -> None:
        """A model loaded in `seconds`, or (None) failed to."""
        self._model_loads.labels(model_name=model_name, outcome="failed" if seconds is None else "loaded").inc()
        if seconds is not None:
            self._model_load_seconds.labels(model_name=model_name).observe(seconds)

    def model_unloaded(self, model_name: str, reason: str) -> None:
        self._model_unloads.labels(model_name=model_name, reason=reason).inc()

    def declare_model(self, model_name: str, kv_bytes_per_token: int = 0, block_size: int = 0) -> None:
        """A chat model's series, at 0 from the start so rate() works before its first request (each
        model of the fleet is one `model_name`; kv_bytes_per_token, block_size: its KV pool's layout,
        so blocks moved read as bytes, once known)."""
        self._engine.declare(model_name, kv_bytes_per_token, block_size)
        self._inter_token.declare(model_name)
        if model_name not in self._model_names:
            self._model_names.append(model_name)
        for outcome in ("loaded", "failed"):
            self._model_loads.labels(model_name=model_name, outcome=outcome)
        for reason in UNLOAD_REASONS:
            self._model_unloads.labels(model_name=model_name, reason=reason)
        self._model_load_seconds.labels(model_name=model_name)
        for rating in ("up", "down"):
            self._feedback.labels(model_name=model_name, rating=rating)
        self._declare_tier_series(model_name, self._tiers)
        for route in ROUTES:
            for metric in (self._ttft, self._e2e, self._queue_time, self._prompt_tokens, self._generation_tokens):
                metric.labels(model_name=model_name, route=route)
            for reason in FinishReason:
                self._request_success.labels(model_name=model_name, route=route, finished_reason=reason.value)

    def declare_safety(self, categories: Iterable[str]) -> None:
        """The safety pipeline's series ([safety]): what it blocked, flagged and masked, per
        category and stage, how long its checks took, and how often the guard model failed."""
        self._safety_actions = Counter(
            "chatd:safety_actions_total", "Safety decisions, by category, stage (input, output, moderations) and "
            "action (block, flag, redact).", ["model_name", "category", "stage", "action"], registry=self.registry)
        self._safety_seconds = Histogram(
            "chatd:safety_check_seconds", "Seconds a safety check took, by check (rules, guard).",
            ["model_name", "check"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self._guard_failures = Counter("chatd:safety_guard_failures_total", "Guard model checks that failed or "
                                       "timed out (each policy's `failure` decided).", ["model_name"], registry=self.registry)
        self._appeals = Counter("chatd:safety_appeals_total", "Appeals users filed against the safety pipeline's "
                                "decisions about them (POST /v1/appeals), by the decision's stage.", ["stage"],
                                registry=self.registry)
        for stage in ("input", "output", "moderations"):
            self._appeals.labels(stage=stage)
        for model_name in self._model_names:
            self._guard_failures.labels(model_name=model_name)
            for category in categories:
                for stage in ("input", "output"):
                    for action in ("block", "flag", "redact"):
                        self._safety_actions.labels(model_name=model_name, category=category, stage=stage, action=action)

    # The tier and safety series carry the model that serves the request (`model_name`; None: the first).

    def safety_action(self, category: str, stage: str, action: str, model_name: str | None = None) -> None:
        self._safety_actions.labels(model_name=model_name or self.model_name, category=category, stage=stage,
                                    action=action).inc()

    def safety_check(self, check: str, seconds: float, model_name: str | None = None) -> None:
        self._safety_seconds.labels(model_name=model_name or self.model_name, check=check).observe(seconds)

    def appeal_filed(self, stage: str) -> None:
        self._appeals.labels(stage=stage).inc()

    def guard_failed(self, model_name: str | None = None) -> None:
        self._guard_failures.labels(model_name=model_name or self.model_name).inc()

    def declare_tiers(self, tiers: Iterable[str], objectives: dict[str, float] | None = None) -> None:
        """Expose each tier's counters at 0 from the start, for every model, so rate() works before
        the first event; and each tier's p95 time-to-first-token objective, where it has one (an
        alert compares the measured p95 with it: deploy/prometheus/chatd.rules.yml)."""
        self._tiers = list(tiers)
        for model_name in self._model_names:
            self._declare_tier_series(model_name, self._tiers)
        for tier, seconds in (objectives or {}).items():
            if seconds > 0:
                self._tier_objective.labels(tier=tier).set(seconds)

    def update_health(self, store_writable: bool, pending_writes: int, limit_store_up: bool,
                      failed_models: dict[str, bool]) -> None:
        """What an alert pages on, read at each scrape: whether the store records usage now (and
        the writes queued meanwhile), whether the shared limit store answers (1 without one), and
        each model's engine that stopped serving (1) or serves or is unloaded (0)."""
        self._store_writable.set(1 if store_writable else 0)
        self._pending_writes.set(pending_writes)
        self._limit_store_up.set(1 if limit_store_up else 0)
        for model_name, failed in failed_models.items():
            self._engine_failed.labels(model_name=model_name).set(1 if failed else 0)

    def _declare_tier_series(self, model_name: str, tiers: Iterable[str]) -> None:
        for tier in tiers:
            self._tier_admitted.labels(model_name=model_name, tier=tier)
            for reason in LIMITED_REASONS:
                self._tier_limited.labels(model_name=model_name, tier=tier, reason=reason)
            for reason in SHED_REASONS:
                self._tier_shed.labels(model_name=model_name, tier=tier, reason=reason)

    def tier_admitted(self, tier: str, model_name: str | None = None) -> None:
        self._tier_admitted.labels(model_name=model_name or self.model_name, tier=tier).inc()

    def tier_refused(self, tier: str, reason: str, model_name: str | None = None) -> None:
        counter = self._tier_shed if reason in SHED_REASONS else self._tier_limited
        counter.labels(model_name=model_name or self.model_name, tier=tier, reason=reason).inc()

    def tier_first_token(self, tier: str, ttft: float, queue_time: float | None, model_name: str | None = None) -> None:
        model_name = model_name or self.model_name
        self._tier_ttft.labels(model_name=model_name, tier=tier).observe(ttft)
        if queue_time is not None:
            self._tier_queue_time.labels(model_name=model_name, tier=tier).observe(queue_time)

    def update_engine(self, stats: EngineStats | None, stage_times: dict[str, float] | None = None,
                      model_name: str | None = None, kv_bytes_per_token: int = 0, block_size: int = 0) -> None:
        """Remember a model's engine's latest counters (and where its host time went,
        core/stage_times.py; None: it is unloaded, and its gauges read 0); they are read at the next
        scrape. `model_name`: which model (default: the first)."""
        self._engine.update(model_name or self.model_name, stats, stage_times, kv_bytes_per_token, block_size)

    def observe_request(
        self,
        *,
        route: str,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        cached_tokens: int,
        ttft: float | None,
        e2e: float,
        queue_time: float | None,
        inter_token_latencies: list[float],
        model_name: str | None = None,
    ) -> None:
        """Record one finished request of `route` (one of ROUTES) served by `model_name` (default:
        the first model). `ttft` and `queue_time` are None when it never got that far."""
        if route not in ROUTES:  # a label value nobody declared would be a series no dashboard expects
            raise ValueError(f"unknown route {route!r}; one of {', '.join(ROUTES)}")
        # FinishReason(...) refuses unknown reasons and turns the enum into its plain value;
        # str() of a str-enum on Python 3.11 would give "FinishReason.STOP".
        reason = FinishReason(finish_reason).value
        model_name = model_name or self.model_name
        series = self._route_series.get((model_name, route))
        if series is None:  # labels() costs ~2 us a call: each route's children are looked up once
            labels = {"model_name": model_name, "route": route}
            series = self._route_series[model_name, route] = tuple(
                metric.labels(**labels) for metric in (self._prompt_tokens, self._generation_tokens, self._ttft,
                                                       self._queue_time, self._e2e))
        prompt_series, generation_series, ttft_series, queue_series, e2e_series = series
        self._request_success.labels(model_name=model_name, route=route, finished_reason=reason).inc()
        prompt_series.observe(prompt_tokens)
        generation_series.observe(generation_tokens)
        # cached_tokens needs no series of its own: the engine already counts prefix-cache
        # hits per token (chatd:prefix_cache_hits_total).
        if ttft is not None:
            ttft_series.observe(ttft)
        if queue_time is not None:
            queue_series.observe(queue_time)
        e2e_series.observe(e2e)
        self._inter_token.observe_many(model_name, route, inter_token_latencies)
        for watch in self.request_watchers:
            watch(model_name, reason, ttft)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for GET /metrics."""
        # Every name here is legal in the classic text format, which all Prometheus versions read.
        return generate_latest(WithoutCreated(self.registry)), CONTENT_TYPE_PLAIN_0_0_4

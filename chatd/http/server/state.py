"""What every handler shares: the chat models (models/fleet.py), the store, metrics, readiness, background work."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import sqlite3
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from chatd.config import Config, keep_alive_seconds
from chatd.engine import Embedder, EngineClient, ModelInfo, Tokenizer
from chatd.http.admission.buckets import shared_buckets
from chatd.http.errors import APIError
from chatd.http.models.canary import Canaries
from chatd.http.models.escalation import RequestTraits
from chatd.http.models.fleet import Choice, Fleet
from chatd.http.models.served_model import ServedModel, fleet_config
from chatd.http.admission.limits import Limits
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.server.safety import Safety
from chatd.http.telemetry.tracing import Tracing
from chatd.safety.guard import GuardModel
from chatd.safety.pipeline import SafetyPipeline
from chatd.store.db import Store, StoreUnavailableError, Tenant
from chatd.store.ledger import Ledger, cannot_write_now
from chatd.store.records import new_id

log = logging.getLogger("chatd.http")

T = TypeVar("T")


@dataclass
class ServerState:
    """The server's shared state, stored on the app under STATE."""

    # The first chat model, loaded at start (serve.py); the fleet holds it and the others.
    engine: EngineClient
    tokenizer: Tokenizer
    model: ModelInfo  # what the engine loaded
    model_name: str  # the name it is served under ([server] model_name's first, or the model folder's name)
    store: Store
    local_tenant: Tenant  # who every request is while the key database is off (shared key or none)
    ledger: Ledger  # usage and finished replies, written in order even when the store must wait
    config: Config = field(default_factory=Config)
    model_aliases: tuple[str, ...] = ()  # other names a request may use ([server] model_name's others)
    # This process, to the other replicas sharing its store: who runs a turn with an idempotency key.
    replica: str = field(default_factory=lambda: new_id("rep_", 8))
    ready: bool = False
    stopping: bool = False  # set at shutdown: replies cut short now are partial, not failed
    draining_until: float | None = None  # on SIGTERM: the loop time the grace period ends; new requests get 503
    num_in_flight: int = 0  # requests whose handlers have not returned (app.py's draining_middleware counts them)
    guard: GuardModel | None = None  # [safety] guard_model, on its own engine (serve.py starts it)
    embedder: Embedder | None = None  # [embeddings] model, on its own thread (serve.py loads it); None: off
    # Makes the engine of a [[models]] model loaded later (serve.py's; None: only the first model serves).
    make_engine: Callable[[Config], EngineClient] | None = None
    fleet: Fleet = field(init=False)  # the chat models, the first one above among them (models/fleet.py)
    canaries: Canaries = field(init=False)  # the aliases whose canary moves by measurement (models/canary.py)
    metrics: ServerMetrics = field(init=False)
    limits: Limits = field(init=False)  # the tiers' buckets, bounds and load shedding
    safety: Safety = field(init=False)  # input checks, output windows, moderation, the audit trail
    tracing: Tracing = field(init=False)  # spans of requests and their stages; off unless [tracing] names a collector
    # Rendering and tokenizing run here, off the event loop. Two threads: a huge prompt does not
    # hold up everyone else's, and the loop competes for the GIL with few threads.
    tokenizing: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="chatd-tokenize"))
    heartbeats: object = None  # routes/completions.py's one timer for every stream's keep-alive comments
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        entries = self.config.fleet()
        first = ServedModel(dataclasses.replace(entries[0], names=self.model_names_given), fleet_config(self.config, entries[0]),
                            self.make_engine, self.tokenizing)
        first.loaded(self.engine, self.tokenizer, self.model)
        others = [ServedModel(entry, fleet_config(self.config, entry), self.make_engine, self.tokenizing)
                  for entry in entries[1:]]
        self.metrics = ServerMetrics(self.model_name, self.model.kv_bytes_per_token, self.model.block_size)
        for served in others:
            self.metrics.declare_model(served.name)
        for served in (first, *others):
            served.metrics = self.metrics  # its loads and unloads are counted
        self.fleet = Fleet(self.config, [first, *others], on_alias=self.metrics.alias_picked)
        self.canaries = Canaries(self.fleet, self.store, self.metrics)
        self.metrics.declare_tiers(self.config.tiers, {name: tier.ttft_p95_seconds
                                                      for name, tier in self.config.tiers.items()})
        self.limits = Limits(self.config.tiers, self.config.auth.enabled, self.metrics,
                             shared_buckets(self.config.tiers_storage), self.config.tiers_on_storage_error == "open")
        pipeline = SafetyPipeline.build(self.config.safety, self.config.policies, self.guard)
        self.tracing = Tracing.start(self.config.tracing, self.metrics.trace_spans, self.replica)
        self.safety = Safety(pipeline, self.store, self.metrics, self.fleet.primary.token_text, self.tracing)

    def pick_model(self, requested: str | None, tenant: Tenant | None = None, thread_model: str | None = None,
                   traits: RequestTraits = RequestTraits()) -> ServedModel:
        """`choose_model`'s model (generating routes ask pipeline.pick, which may also ask the small
        model of an escalating alias how sure it is)."""
        choice = self.choose_model(requested, tenant, thread_model, traits)
        self.fleet.told(choice)
        return choice.model

    def choose_model(self, requested: str | None, tenant: Tenant | None = None, thread_model: str | None = None,
                     traits: RequestTraits = RequestTraits()) -> Choice:
        """The chat model that serves a request naming `requested` (models/fleet.py's `choose`): the
        tenant's tier decides the default and, while limits apply, what it may use (404 for an
        unknown name, 403 for one the tier may not use). `thread_model`: its conversation's or
        chain's model; `traits`: what an escalating alias's rules read of it."""
        tier_name = tenant.tier if tenant is not None else self.config.auth.local_tier
        tier = self.config.tiers.get(tier_name)
        allowed = tier.models if tier is not None and self.limits.enabled and tenant is not None else ()
        default = tier.default_model if tier is not None else ""
        return self.fleet.choose(requested, tier_name, allowed, default, thread_model, traits)

    def take_keep_alive(self, served: ServedModel, body) -> None:
        """A request's `keep_alive` (Ollama's) becomes its model's, from now on: how long it stays
        loaded once idle. Only for the one local user: with API keys, one tenant's `0` would make
        the next tenant wait for a load, so it is the operator's and a request's is a 400."""
        value = body.get("keep_alive") if isinstance(body, dict) else None
        if value is None:
            return
        if self.config.auth.enabled:
            raise APIError(400, "keep_alive is set by the operator ([server] keep_alive, [[models]] keep_alive) while "
                                "API keys are on", "keep_alive")
        try:
            served.keep_alive = keep_alive_seconds(value, "keep_alive")
        except ValueError as exc:
            raise APIError(400, str(exc), "keep_alive") from None

    @property
    def model_names(self) -> list[str]:
        """Every name a request may give as `model`: each model's, then the aliases."""
        return self.fleet.names

    async def off_loop(self, function: Callable[..., T], *args) -> T:
        """Run CPU work on text (templates, tokenizing) in the tokenizing threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, function, *args)

    @property
    def model_names_given(self) -> tuple[str, ...]:
        """The first model's names as serve.py gave them: the served name first."""
        return (self.model_name, *self.model_aliases)

    @property
    def heartbeat_seconds(self) -> float:
        return self.config.server.heartbeat_seconds

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        """Run work that must outlive the request that started it; `wait_background` awaits it at shutdown."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def wait_background(self, timeout: float) -> None:
        """Wait for background work (replies being saved, usage being recorded); cancel what is left."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    def check_store_writable(self) -> None:
        """New work waits while the store cannot write: no token is served that could not be billed."""
        if not self.ledger.healthy:
            raise self.store_unavailable()

    def store_failed(self, exc: BaseException) -> bool:
        """Whether an error is the store's file or disk refusing writes now (not a client's connection,
        not a bug); if so the ledger hears of it, and new work waits until writes succeed again."""
        if not (isinstance(exc, sqlite3.Error | StoreUnavailableError) and cannot_write_now(exc)):
            return False
        self.ledger.report_failure(exc)
        return True

    def store_unavailable(self) -> APIError:
        """The 503 a client gets while the store cannot write, with when to try again. It says no
        more: the store's error names its address (a PostgreSQL URL's user, host, port, database),
        which is the operator's to read, in the log (ledger.py logs it once an outage)."""
        return APIError(503, "the server cannot record usage right now; try again later", None,
                        "store_unavailable", headers={"Retry-After": str(self.ledger.retry_after)})

STATE = web.AppKey("state", ServerState)

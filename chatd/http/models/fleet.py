"""Several chat models in one process: which one serves a request, and which stay loaded.

Each model is a `ServedModel` (served_model.py): one of config.toml's [[models]] (or the one
model of [model]), with its own engine, loaded on demand.

`Fleet.choose` decides which model serves a request, in this order:
  1. no `model`, or "default": the tier's `default_model`, else the first model;
  2. an alias split by weight ([aliases.NAME] targets = { stable = 95, canary = 5 }): the model its
     thread already runs on (a conversation's, a Responses chain's) when that is one of its
     targets, else one drawn by weight;
  3. an escalating alias (small = "s", large = "l", escalate_when = { ... }): the large model when
     its thread is already there or one of the rules holds of the request (escalation.py: its
     text's length, its thread's messages, tools, a response format, its tenant's tier; the small
     model's confidence is asked by pipeline.pick after this), else the small one;
  4. a model's name: that model.
An unknown name is a 404 (`model_not_found`) naming it; a model or alias the tenant's tier may
not use, a 403 naming both.

Loading: the first model loads at start; the others when a request first needs them (or at start
with `preload = true`). A model idle longer than its keep_alive is unloaded (-1: never; 0: after
each reply); one with requests in flight, queued or being admitted never is.

It knows nothing of routes: handlers call pipeline.pick (the generating routes) or
ServerState.pick_model (the others), then hold the model with `in_use` while they render and start
its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from chatd.config import DEFAULT_ALIAS, AliasConfig, Config
from chatd.http.errors import APIError, shown
from chatd.http.models.escalation import RequestTraits, escalation
from chatd.http.models.served_model import LOADED, ServedModel

log = logging.getLogger("chatd.http")

IDLE_CHECK_SECONDS = 1.0  # how often idle models are looked for (keep_alive is this precise)


@dataclass(frozen=True)
class Choice:
    """The model that serves a request, and the alias that picked it and why (weight, thread, none
    for an escalating alias's small model, or the rule that sent it up)."""

    model: ServedModel
    alias: str | None = None
    why: str = ""


class Fleet:
    """The server's chat models by name, its aliases, and which one serves each request."""

    def __init__(self, config: Config, models: list[ServedModel], rng: random.Random | None = None,
                 on_alias: Callable[[str, str, str], None] | None = None) -> None:
        """on_alias(alias, model, why): told of each request an alias served (why: "weight",
        "thread", an escalation rule, or "none" for the small model)."""
        self.config = config
        self.models = models  # the first is the default
        self.aliases = dict(config.aliases)
        self._rng = rng or random.Random()
        self.on_alias = on_alias or (lambda alias, model, why: None)
        self._by_name: dict[str, ServedModel] = {}
        self._reaper: asyncio.Task | None = None
        for model in models:
            model.make_room = self._make_room
            model.reloads = bool(config.models)

    @property
    def primary(self) -> ServedModel:
        """The first model: loaded at start, the default of a tier that names none."""
        return self.models[0]

    def by_name(self, name: str) -> ServedModel | None:
        """The model one of whose names this is."""
        if not self._by_name or name not in self._by_name:  # names of [model] alone are known once it loads
            self._by_name = {n: model for model in self.models for n in model.names}
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        """Every name a request may send as `model`: each model's, then the aliases."""
        return [name for model in self.models for name in model.names] + list(self.aliases)

    def pick(self, requested: str | None, tier_name: str, allowed: tuple[str, ...], default: str,
             thread_model: str | None = None, traits: RequestTraits = RequestTraits()) -> ServedModel:
        """`choose`'s model, its alias's choice counted (`told`)."""
        choice = self.choose(requested, tier_name, allowed, default, thread_model, traits)
        self.told(choice)
        return choice.model

    def told(self, choice: Choice) -> None:
        """Count an alias's choice, once it is final."""
        if choice.alias is not None:
            self.on_alias(choice.alias, choice.model.name, choice.why)

    def choose(self, requested: str | None, tier_name: str, allowed: tuple[str, ...], default: str,
               thread_model: str | None = None, traits: RequestTraits = RequestTraits()) -> Choice:
        """The model that serves a request naming `requested` (None: naming none), for a tenant
        whose tier may use `allowed` (empty: every name) and defaults to `default`; `thread_model`:
        the model its conversation or Responses chain runs on; `traits`: what escalation rules
        read of it. 404 for an unknown name, 403 for one the tier may not use."""
        name = requested if requested not in (None, DEFAULT_ALIAS) else None
        if name is None:
            thread = self.by_name(thread_model) if thread_model else None
            if thread is not None and _may_use(allowed, thread.name):
                return Choice(thread)
            name = default or self.primary.name
        if name in self.aliases:
            self._check_tier(name, allowed, tier_name)
            chosen, why = self._through_alias(self.aliases[name], tier_name, thread_model, traits)
            return Choice(self.by_name(chosen), name, why)
        model = self.by_name(name)
        if model is None:
            served = ", ".join(repr(n) for n in self.names)
            raise APIError(404, f"the model {shown(name)} does not exist; this server serves {served}", "model",
                           "model_not_found")
        if not _may_use(allowed, name):
            raise APIError(403, f"your tier ({tier_name}) may not use the model {name!r}; it may use "
                                f"{', '.join(repr(m) for m in allowed)}", "model", "model_not_allowed")
        return Choice(model)

    def _through_alias(self, alias: AliasConfig, tier_name: str, thread_model: str | None,
                       traits: RequestTraits) -> tuple[str, str]:
        """The model an alias picks, and why."""
        if alias.small:  # escalating: up when a rule holds, and a thread that went up stays there
            if thread_model == alias.large:
                return alias.large, "thread"
            rule = escalation(alias, tier_name, traits)
            return (alias.large, rule) if rule is not None else (alias.small, "none")
        targets = alias.targets
        if thread_model in targets and targets[thread_model] > 0:
            return thread_model, "thread"
        [chosen] = self._rng.choices(list(targets), weights=list(targets.values()))
        return chosen, "weight"

    @staticmethod
    def _check_tier(name: str, allowed: tuple[str, ...], tier_name: str) -> None:
        if allowed and name not in allowed:
            raise APIError(403, f"your tier ({tier_name}) may not use the model {name!r}; it may use "
                                f"{', '.join(repr(m) for m in allowed)}", "model", "model_not_allowed")

    def loaded(self) -> list[ServedModel]:
        return [model for model in self.models if model.status == LOADED]

    def reload(self, config: Config) -> None:
        """Take a reloaded config's [aliases] and keep_alive (SIGHUP); the models themselves stay as
        they are. ValueError, changing nothing, when it serves other models than this process."""
        names = [entry.names for entry in config.fleet()]
        if names != [model.entry.names for model in self.models] and config.models:
            raise ValueError(f"its [[models]] are {names}, not the ones serving; restart to change the models")
        for alias, settings in config.aliases.items():
            unknown = [target for target in settings.models if self.by_name(target) is None]
            if unknown:
                raise ValueError(f"aliases.{alias} names {unknown}, which this server does not serve")
        self.aliases = dict(config.aliases)
        if config.models:
            for model, entry in zip(self.models, config.fleet()):
                model.keep_alive = entry.keep_alive
        log.info("reloaded: aliases %s", {name: dict(a.targets) for name, a in self.aliases.items()} or "none")

    # -- keep_alive ----------------------------------------------------------------------------

    def start(self) -> None:
        """Preload what asks to be, and start unloading idle models."""
        loop = asyncio.get_running_loop()
        for model in self.models[1:]:
            if model.entry.preload:
                loop.create_task(_logged(model.load()), name=f"preload {model.name}")
        # Always: a request may set a model's keep_alive (Ollama's field), and a dead engine is loaded again.
        self._reaper = loop.create_task(self._unload_idle_forever(), name="unload idle models")

    async def stop(self) -> None:
        """Stop unloading, and every model's engine: its open streams end with an error, replies in
        flight are saved as partial (the first model's may be another engine than the one serve.py
        started: it may have been unloaded and loaded again)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for model in self.models:
            if model._loading is not None:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await model._loading
            if model.engine is not None:
                await model.engine.stop()

    async def _unload_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(IDLE_CHECK_SECONDS)
            try:
                await self.unload_idle(time.monotonic())
            except Exception:
                log.exception("unloading idle models failed; trying again")

    async def unload_idle(self, now: float) -> None:
        """Unload each model idle past its keep_alive (a busy one counts as used now), and load
        again one whose engine died, unless it would have unloaded anyway."""
        for model in self.models:
            if model.status != LOADED:
                continue
            problem = model.engine.health() if model.reloads else None
            if problem is not None:
                await model.unload("stopped", f"its engine stopped ({problem})")
                if model.keep_alive != 0:
                    asyncio.get_running_loop().create_task(_logged(model.load()), name=f"reload {model.name}")
            elif model.busy():
                model.last_used = now
            elif model.keep_alive >= 0 and now - model.last_used >= model.keep_alive:
                await model.unload("idle", f"idle for {now - model.last_used:.0f} s, keep_alive {model.keep_alive:g} s")

    async def _make_room(self, incoming: ServedModel) -> None:
        """Before `incoming` loads: unload the least recently used idle models (never the first)
        until it fits [server] max_loaded_models and models_memory_gb; 503 naming what holds the
        room when the others are all in use."""
        settings = self.config.server
        budget = settings.models_memory_gb * 2**30
        while True:
            loaded = [m for m in self.models if m.status == LOADED and m is not incoming]
            over_count = settings.max_loaded_models and len(loaded) + 1 > settings.max_loaded_models
            over_budget = budget and sum(m.footprint_bytes() for m in loaded) + incoming.footprint_bytes() > budget
            if not (over_count or over_budget):
                return
            idle = [m for m in loaded if m is not self.primary and not m.busy()]
            if not idle:
                held = ", ".join(repr(m.name) for m in loaded)
                limit = (f"max_loaded_models = {settings.max_loaded_models}" if over_count
                         else f"models_memory_gb = {settings.models_memory_gb:g}")
                raise APIError(503, f"the model {incoming.name!r} cannot be loaded now: {held} are loaded and in use "
                                    f"({limit}); try again shortly", "model", "model_unavailable",
                               headers={"Retry-After": "5"})
            victim = min(idle, key=lambda m: m.last_used)
            await victim.unload("room", f"making room for {incoming.name}: least recently used")


def _may_use(allowed: tuple[str, ...], name: str) -> bool:
    """Whether a tier that may use `allowed` (empty: everything) may use this name (a model's names count apart)."""
    return not allowed or name in allowed


async def _logged(load) -> None:
    with contextlib.suppress(Exception):  # (its failure is logged, and shown on /v1/models)
        await load

"""Canary ramps: an alias's canary share moved by measurement, not by hand.

An alias split over two versions with a ramp ([aliases.chat] targets = { stable = 100, v2 = 0 },
ramp = { canary = "v2", steps = [1, 5, 25, 100], bake_seconds = 600, ... }) starts the canary at
its first step's percentage of new threads. Every CHECK_SECONDS the canary's requests in the
current step are compared with the stable version's (`verdict`: the share ending in an error, the
p95 time to first token, thumbs down per request); once it has served `min_requests`:
- worse than a bound allows: back to 0% at once (`rolled_back`), whatever the step;
- within every bound for the step's `bake_seconds`: the next step; past the last, `done`.
Each step and rollback is kept in the store (a restart goes on from the same step and weight, a
rolled-back canary stays at 0 until an operator restarts it: POST /admin/canaries/NAME/restart),
logged, and counted in /metrics (`chatd:canary_weight`, `chatd:canary_changes_total`).

Measurements are this process's own: with several replicas each ramps on what it serves, and
the store keeps the last decision any of them made (each adopts it at its next check).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from chatd.config import AliasConfig, RampConfig
from chatd.http.errors import APIError
from chatd.http.models.fleet import Fleet
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.store.canaries import RampState
from chatd.store.db import Store

log = logging.getLogger("chatd.http")

CHECK_SECONDS = 1.0
MAX_TTFTS = 10_000  # a window keeps at most this many times to first token (the latest)


@dataclass
class Window:
    """One version's requests since the current step began."""

    requests: int = 0
    errors: int = 0
    downs: int = 0
    ttfts: list[float] = field(default_factory=list)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def down_rate(self) -> float:
        return self.downs / self.requests if self.requests else 0.0

    def ttft_p95(self) -> float | None:
        if not self.ttfts:
            return None
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def verdict(rules: RampConfig, canary: Window, stable: Window) -> str | None:
    """Why the canary measures worse than the stable version by more than a bound; None if it does not."""
    if rules.max_error_rate_increase and canary.error_rate - stable.error_rate > rules.max_error_rate_increase:
        return (f"error rate {canary.error_rate:.1%} against the stable version's {stable.error_rate:.1%} "
                f"(at most +{rules.max_error_rate_increase:.1%})")
    mine, theirs = canary.ttft_p95(), stable.ttft_p95()
    if rules.max_ttft_p95_ratio and mine is not None and theirs and mine > theirs * rules.max_ttft_p95_ratio:
        return (f"p95 time to first token {mine * 1e3:.0f} ms against the stable version's {theirs * 1e3:.0f} ms "
                f"(at most x{rules.max_ttft_p95_ratio:g})")
    if rules.max_thumbs_down_increase and canary.down_rate - stable.down_rate > rules.max_thumbs_down_increase:
        return (f"thumbs down on {canary.down_rate:.1%} of replies against the stable version's "
                f"{stable.down_rate:.1%} (at most +{rules.max_thumbs_down_increase:.1%})")
    return None


class Canaries:
    """Every ramped alias of the fleet, measured and moved."""

    def __init__(self, fleet: Fleet, store: Store, metrics: ServerMetrics, clock: Callable[[], float] = time.time):
        self.fleet, self.store, self.metrics, self.clock = fleet, store, metrics, clock
        self.ramps: dict[str, RampState] = {}
        self.windows: dict[str, Window] = {}  # by model name: its requests in its alias's current step
        self.stable_before: dict[str, Window] = {}  # by alias: the stable version's last step with enough requests
        self._task: asyncio.Task | None = None
        metrics.request_watchers.append(self._observed)
        metrics.rating_watchers.append(self._rated)

    def _observed(self, model_name: str, finish_reason: str, ttft: float | None) -> None:
        window = self.windows.get(model_name)
        if window is not None:
            window.requests += 1
            window.errors += finish_reason == "error"
            if ttft is not None:
                window.ttfts.append(ttft)
                del window.ttfts[:-MAX_TTFTS]

    def _rated(self, model_name: str, rating: str) -> None:
        window = self.windows.get(model_name)
        if window is not None and rating == "down":
            window.downs += 1

    def _configured(self) -> dict[str, AliasConfig]:
        return {name: alias for name, alias in self.fleet.aliases.items() if alias.ramp is not None}

    async def start(self) -> None:
        """Take each ramp from the store (or start it), set its weight, and check every CHECK_SECONDS."""
        await self.adopt()
        self._task = asyncio.get_running_loop().create_task(self._check_forever(), name="canary ramps")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def adopt(self) -> None:
        """Each configured ramp as the store has it (a new canary starts at its first step); the
        weights applied to the aliases (also after a SIGHUP reloaded them from the config)."""
        for name, alias in self._configured().items():
            stored = await self.store.get_ramp(name)
            if stored is None or stored.canary != alias.ramp.canary:
                now = self.clock()
                stored = RampState(name, alias.ramp.canary, 0, alias.ramp.steps[0], "ramping", now, now)
                await self._save(stored, "start", f"a new canary {alias.ramp.canary!r} starts at {stored.weight:g}%")
            elif self.ramps.get(name) != stored:
                self._begin_step(name, alias)
            self.ramps[name] = stored
            self._apply(name, alias, stored.weight)
            if stored.state == "ramping":
                self._load(name, stored.canary)
        for name in set(self.ramps) - set(self._configured()):
            del self.ramps[name]  # its ramp left the config: the config's weights stand

    def _load(self, alias: str, name: str) -> None:
        """Load a ramping canary ahead of its traffic: a request that waited for its load would count
        the load in its time to first token, and a step judged on a few requests would roll back a
        healthy version for it. One that cannot be loaded at all is rolled back."""
        served = self.fleet.by_name(name)
        if served is not None and served.status == "unloaded":
            asyncio.get_running_loop().create_task(self._load_or_roll_back(alias, served), name=f"load canary {name}")

    async def _load_or_roll_back(self, alias: str, served) -> None:
        try:
            await served.load()
        except APIError:
            return  # no room under the memory budget now: tried again at the next check
        except Exception as exc:  # (the load logged it)
            if self.ramps.get(alias) is not None and self.ramps[alias].state == "ramping":
                await self.roll_back(alias, f"{served.name} could not be loaded: {type(exc).__name__}: {exc}")

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            try:
                await self.adopt()
                await self.check()
            except Exception:
                log.exception("checking the canary ramps failed; trying again")

    async def check(self) -> None:
        """Judge each ramping canary on its step so far: roll it back, let it bake, or advance it."""
        now = self.clock()
        for name, ramp in list(self.ramps.items()):
            alias = self._configured().get(name)
            if alias is None or ramp.state != "ramping":
                continue
            rules = alias.ramp
            canary = self.windows.setdefault(ramp.canary, Window())
            stable = self.windows.setdefault(self._stable(alias), Window())
            if canary.requests < rules.min_requests:
                continue
            if stable.requests < rules.min_requests:
                stable = self.stable_before.get(name, stable)  # (at 100% the stable version serves nothing)
            else:
                self.stable_before[name] = dataclasses.replace(stable, ttfts=list(stable.ttfts))
            why = verdict(rules, canary, stable)
            if why is not None:
                await self.roll_back(name, f"{ramp.canary} measured worse: {why}")
            elif now - ramp.step_started_at >= rules.bake_seconds:
                await self._advance(name, alias, ramp, now)

    async def _advance(self, name: str, alias: AliasConfig, ramp: RampState, now: float) -> None:
        steps = alias.ramp.steps
        if ramp.step + 1 >= len(steps):
            done = dataclasses.replace(ramp, state="done", updated_at=now)
            await self._save(done, "done", f"{ramp.canary} held up at {ramp.weight:g}%: the ramp is done")
            return
        weight = steps[ramp.step + 1]
        moved = dataclasses.replace(ramp, step=ramp.step + 1, weight=weight, step_started_at=now, updated_at=now)
        await self._save(moved, "advance", f"{ramp.canary} held up at {ramp.weight:g}% for "
                                           f"{now - ramp.step_started_at:.0f} s: {weight:g}% now")
        self._begin_step(name, alias)
        self._apply(name, alias, weight)

    async def roll_back(self, name: str, why: str) -> None:
        """The canary to 0% now, and kept there until restarted."""
        ramp, alias = self.ramps[name], self._configured()[name]
        now = self.clock()
        await self._save(dataclasses.replace(ramp, weight=0.0, state="rolled_back", updated_at=now), "rollback", why)
        self._apply(name, alias, 0.0)

    async def restart(self, name: str) -> None:
        """Start a ramp again from its first step (an operator's decision after a rollback)."""
        alias, now = self._configured()[name], self.clock()
        ramp = RampState(name, alias.ramp.canary, 0, alias.ramp.steps[0], "ramping", now, now)
        await self._save(ramp, "restart", f"restarted by an operator at {ramp.weight:g}%")
        self._begin_step(name, alias)
        self._apply(name, alias, ramp.weight)

    async def _save(self, ramp: RampState, action: str, why: str) -> None:
        await self.store.save_ramp(ramp, action, why)
        self.ramps[ramp.alias] = ramp
        self.metrics.canary_changed(ramp.alias, ramp.canary, ramp.weight, action)
        say = log.warning if action == "rollback" else log.info
        say("canary %s of alias %s: %s (%s)", ramp.canary, ramp.alias, action, why)

    def _begin_step(self, name: str, alias: AliasConfig) -> None:
        """A new step measures from nothing, the stable version too."""
        for model in alias.targets:
            self.windows[model] = Window()

    def _apply(self, name: str, alias: AliasConfig, weight: float) -> None:
        """The alias's targets with the canary at `weight` percent and the stable version at the rest."""
        targets = {alias.ramp.canary: weight, self._stable(alias): 100.0 - weight}
        self.fleet.aliases[name] = dataclasses.replace(alias, targets=targets)
        self.metrics.canary_changed(name, alias.ramp.canary, weight)
        self.windows.setdefault(alias.ramp.canary, Window())
        self.windows.setdefault(self._stable(alias), Window())

    @staticmethod
    def _stable(alias: AliasConfig) -> str:
        return next(model for model in alias.targets if model != alias.ramp.canary)

    async def describe(self, name: str) -> dict:
        """A ramp as the admin route shows it: where it stands, what it measured, its history."""
        ramp, alias = self.ramps[name], self._configured()[name]
        windows = {role: self.windows.get(model, Window()) for role, model in
                   (("canary", ramp.canary), ("stable", self._stable(alias)))}
        return {"alias": name, "canary": ramp.canary, "stable": self._stable(alias), "state": ramp.state,
                "weight": ramp.weight, "step": ramp.step, "steps": list(alias.ramp.steps),
                "step_started_at": ramp.step_started_at,
                "measured": {role: {"requests": w.requests, "error_rate": w.error_rate, "ttft_p95": w.ttft_p95(),
                                    "thumbs_down_rate": w.down_rate} for role, w in windows.items()},
                "events": [dataclasses.asdict(e) for e in await self.store.ramp_events(name)]}

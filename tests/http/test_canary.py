"""Canary ramps (chatd/http/models/canary.py) on a real SQLite store, fed through the server's own metrics
as finished requests and ratings are: a healthy canary advances step by step after each bake to
100% and is done; one that errors, is slow, or draws thumbs down is rolled back to 0% at the first
check after it has served enough; every step is kept, and a restart goes on from where it was."""

from __future__ import annotations

import asyncio

import pytest

from chatd.http.models.canary import Canaries, Window, verdict
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.store.db import Store
from tests.http.test_fleet import FLEET, make_fleet

RAMPED = {**FLEET, "aliases": {"chat": {"targets": {"small": 100, "canary": 0}, "ramp": {
    "canary": "canary", "steps": [5, 50, 100], "bake_seconds": 60, "min_requests": 10}}}}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def ramp(tmp_path):
    clock = Clock()
    store = await Store.open(tmp_path / "chatd.db", clock=clock)
    fleet, _, _ = make_fleet(RAMPED)
    metrics = ServerMetrics("small")
    canaries = Canaries(fleet, store, metrics, clock)
    await canaries.adopt()
    yield canaries, fleet, metrics, clock, store
    await store.close()


def serve(metrics: ServerMetrics, model: str, count: int, ttft: float = 0.05, finish_reason: str = "stop") -> None:
    """`count` finished chat requests of `model`, as request_log.py reports them."""
    for _ in range(count):
        metrics.observe_request(route="chat", finish_reason=finish_reason, prompt_tokens=5, generation_tokens=3,
                                cached_tokens=0, ttft=ttft, e2e=0.2, queue_time=0.0, inter_token_latencies=[],
                                model_name=model)


async def test_a_healthy_canary_advances_after_each_bake_to_100_percent_and_a_restart_resumes(ramp, tmp_path):
    canaries, fleet, metrics, clock, store = ramp
    assert fleet.aliases["chat"].targets == {"canary": 5.0, "small": 95.0}  # the first step, from the start
    serve(metrics, "canary", 10)
    serve(metrics, "small", 50)
    await canaries.check()
    assert canaries.ramps["chat"].weight == 5.0  # within bounds, but not baked yet
    clock.now += 61
    await canaries.check()
    assert fleet.aliases["chat"].targets == {"canary": 50.0, "small": 50.0}
    serve(metrics, "canary", 9)  # a new step measures from nothing: 9 are not enough
    clock.now += 61
    await canaries.check()
    assert canaries.ramps["chat"].weight == 50.0
    # A restart: another process on the same store picks the ramp up where it stands.
    again = Canaries(fleet, store, metrics, clock)
    fleet.aliases["chat"] = fleet.config.aliases["chat"]  # (as a fresh process reads it from the config)
    await again.adopt()
    assert again.ramps["chat"].weight == 50.0 and fleet.aliases["chat"].targets["canary"] == 50.0
    serve(metrics, "canary", 10)
    serve(metrics, "small", 10)
    await again.check()  # the step began before the restart: its bake is over
    assert fleet.aliases["chat"].targets == {"canary": 100.0, "small": 0.0}
    serve(metrics, "canary", 10)  # the stable version serves nothing now: judged against its last step
    clock.now += 61
    await again.check()
    assert again.ramps["chat"].state == "done"
    actions = [e.action for e in await store.ramp_events("chat")]
    assert actions == ["start", "advance", "advance", "done"]
    body, _ = metrics.render()
    assert 'chatd:canary_weight{alias="chat",model_name="canary"} 100.0' in body.decode()


@pytest.mark.parametrize("how, why", [
    ({"finish_reason": "error"}, "error rate 100.0%"),
    ({"ttft": 0.5}, "p95 time to first token 500 ms"),
    ("thumbs", "thumbs down on 30.0% of replies"),
])
async def test_a_canary_that_measures_worse_is_rolled_back_at_once_and_stays_back(ramp, how, why):
    canaries, fleet, metrics, clock, store = ramp
    serve(metrics, "small", 40)
    if how == "thumbs":
        serve(metrics, "canary", 10)
        for _ in range(3):
            metrics.feedback_given("canary", "down")
    else:
        serve(metrics, "canary", 10, **how)
    await canaries.check()  # no bake needed to go back
    ramp_state = canaries.ramps["chat"]
    assert (ramp_state.state, ramp_state.weight) == ("rolled_back", 0.0)
    assert fleet.aliases["chat"].targets == {"canary": 0.0, "small": 100.0}
    [*_, rollback] = await store.ramp_events("chat")
    assert rollback.action == "rollback" and why in rollback.reason
    clock.now += 3600
    serve(metrics, "canary", 100)
    await canaries.check()
    await canaries.adopt()
    assert canaries.ramps["chat"].state == "rolled_back"  # until an operator restarts it
    await canaries.restart("chat")
    assert fleet.aliases["chat"].targets == {"canary": 5.0, "small": 95.0}


def test_the_verdict_names_the_measure_and_leaves_out_a_bound_of_zero():
    from chatd.config import RampConfig

    canary, stable = Window(20, 2, 0, [0.1] * 20), Window(100, 1, 0, [0.1] * 100)
    assert "error rate 10.0%" in verdict(RampConfig(canary="c"), canary, stable)
    assert verdict(RampConfig(canary="c", max_error_rate_increase=0), canary, stable) is None
    assert verdict(RampConfig(canary="c", max_error_rate_increase=0.1), canary, stable) is None


async def test_a_canary_that_cannot_be_loaded_is_rolled_back(tmp_path):
    clock = Clock()
    store = await Store.open(tmp_path / "chatd.db", clock=clock)
    fleet, _, _ = make_fleet(RAMPED)
    canary = fleet.by_name("canary")

    def broken(_):
        raise RuntimeError("no such weights")

    canary._make_engine = broken
    canaries = Canaries(fleet, store, ServerMetrics("small"), clock)
    try:
        await canaries.adopt()  # the ramp starts, and its canary is loaded ahead of its traffic
        for _ in range(50):
            if canaries.ramps["chat"].state != "ramping":
                break
            await asyncio.sleep(0.02)
        assert (canaries.ramps["chat"].state, fleet.aliases["chat"].targets["canary"]) == ("rolled_back", 0.0)
        [*_, rollback] = await store.ramp_events("chat")
        assert "canary could not be loaded: RuntimeError: no such weights" in rollback.reason
    finally:
        await store.close()

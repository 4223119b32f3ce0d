"""Which model serves a request (fleet.py's Fleet.pick), an alias's split by weight, and models
loaded on first use and unloaded after keep_alive, with engines that only count (the real
server with three real models is test_fleet_serve.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import random
import time

import pytest

from chatd.config_loader import build_config
from chatd.engine import LLM, AsyncEngine, CacheScope, EngineStats, Placement, SamplingParams
from chatd.engine.models.demo import build_demo_model
from chatd.http.models import escalation
from chatd.http.errors import APIError
from chatd.http.models.escalation import RequestTraits, request_traits
from chatd.http.models.fleet import Fleet
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.models.served_model import LOADED, UNLOADED, ServedModel, fleet_config
from tests.factories import make_model_info
from tests.http.test_metrics import scrape

FLEET = {
    "models": [{"name": "small", "path": "demo"}, {"name": ["large", "big"], "path": "", "keep_alive": "2s"},
               {"name": "canary", "path": "demo", "keep_alive": 0}],
    "aliases": {"chat": {"targets": {"small": 95, "canary": 5}},
                "auto": {"small": "small", "large": "large", "escalate_when": {
                    "prompt_chars": 100, "tools": True, "response_format": True, "messages": 4, "tiers": ["premium"]}}},
    "tiers": {"free": {"models": ["small", "chat"], "default_model": "small"}, "paid": {"default_model": "large"}},
}


class CountingEngine:
    """An engine that starts, stops and reports how many requests it holds (`streams`)."""

    def __init__(self, name: str, starts: list[str], delay: float = 0.0, path: str = "") -> None:
        self.name, self.starts, self.delay, self.path = name, starts, delay, path or f"/models/{name}"
        self.streams = 0
        self.stopped = False
        self.problem: str | None = None  # what health() says: None while it serves
        self.tokenizer = object()

    async def start(self):
        await asyncio.sleep(self.delay)
        self.starts.append(self.name)
        return make_model_info(256, path=self.path, num_kv_blocks=0)

    async def stop(self) -> None:
        self.stopped = True

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 16, 16, 0, 0, 0, 0, 0, num_request_streams=self.streams)

    def compile_state(self) -> str:
        return "off"

    def health(self) -> str | None:
        return self.problem


def make_fleet(values=FLEET, seed: int = 0, delay: float = 0.0) -> tuple[Fleet, list[str], dict[str, CountingEngine]]:
    """The fleet of `values` with counting engines; the first model loaded, the others not."""
    config = build_config(values)
    starts: list[str] = []
    engines: dict[str, CountingEngine] = {}

    def make_engine(model_config):
        name = next(m.name for m in models if m.config is model_config)
        engines[name] = CountingEngine(name, starts, delay, model_config.model.path)
        return engines[name]

    tokenizing = concurrent.futures.ThreadPoolExecutor(1)
    models = [ServedModel(entry, fleet_config(config, entry), make_engine, tokenizing) for entry in config.fleet()]
    first = CountingEngine("small", starts)
    engines["small"] = first
    models[0].loaded(first, first.tokenizer, make_model_info(256))
    return Fleet(config, models, random.Random(seed)), starts, engines


def pick(fleet: Fleet, requested, tier: str = "paid", thread_model=None, traits=RequestTraits()) -> str:
    tier_config = fleet.config.tiers[tier]
    return fleet.pick(requested, tier, tier_config.models, tier_config.default_model, thread_model, traits).name


def test_a_request_gets_the_model_it_names_or_its_tiers_default_and_others_are_refused_by_name():
    fleet, _, _ = make_fleet()
    assert pick(fleet, "large") == pick(fleet, "big") == "large"  # a model's second name is the model
    assert pick(fleet, None, "paid") == pick(fleet, "default", "paid") == "large"  # the tier's default_model
    assert pick(fleet, None, "free") == "small"
    assert pick(fleet, None, "premium") == "small"  # a tier without a default gets the first model
    with pytest.raises(APIError) as unknown:
        pick(fleet, "gpt-5")
    assert (unknown.value.status, unknown.value.code, unknown.value.param) == (404, "model_not_found", "model")
    assert "'gpt-5'" in unknown.value.message and "'small'" in unknown.value.message
    with pytest.raises(APIError) as forbidden:
        pick(fleet, "large", "free")
    assert (forbidden.value.status, forbidden.value.code) == (403, "model_not_allowed")
    assert "'large'" in forbidden.value.message and "tier (free)" in forbidden.value.message
    assert pick(fleet, "chat", "free") in ("small", "canary")  # through an alias the tier may use


def test_an_alias_splits_new_threads_by_weight_and_a_thread_keeps_its_model():
    fleet, _, _ = make_fleet(seed=7)
    picks = [pick(fleet, "chat") for _ in range(4000)]
    counts = {name: picks.count(name) for name in ("small", "canary")}
    expected = {"small": 4000 * 0.95, "canary": 4000 * 0.05}
    chi_square = sum((counts[n] - expected[n]) ** 2 / expected[n] for n in counts)
    assert chi_square < 10.83, (counts, chi_square)  # one degree of freedom, p = 0.001
    # A thread on one of the alias's models stays there, whatever the draw would say.
    assert {pick(fleet, "chat", thread_model="canary") for _ in range(200)} == {"canary"}
    assert {pick(fleet, "chat", thread_model="small") for _ in range(200)} == {"small"}
    # A thread on a model outside the alias is drawn again; a thread naming no model keeps its own.
    assert pick(fleet, "large", thread_model="small") == "large"
    assert pick(fleet, None, "paid", thread_model="canary") == "canary"
    # Unless its tier may not use that model: then its tier's default.
    assert pick(fleet, None, "free", thread_model="large") == "small"


def test_an_escalating_alias_sends_a_request_up_when_a_rule_holds_and_its_thread_stays_up():
    fleet, _, _ = make_fleet()
    said = []
    fleet.on_alias = lambda alias, model, why: said.append((alias, model, why))
    question = {"messages": [{"role": "user", "content": "hi"}]}
    assert pick(fleet, "auto", traits=request_traits(question)) == "small"
    long = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 101}]}]}
    assert pick(fleet, "auto", traits=request_traits(long)) == "large"
    assert pick(fleet, "auto", traits=request_traits({**question, "tools": [{"type": "function"}]})) == "large"
    schema = {**question, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}
    assert pick(fleet, "auto", traits=request_traits(schema)) == "large"
    assert pick(fleet, "auto", traits=request_traits({**question, "response_format": {"type": "text"}})) == "small"
    assert pick(fleet, "auto", traits=request_traits({"content": "next"}).with_history(4)) == "large"
    assert pick(fleet, "auto", traits=request_traits({"content": "next"}).with_history(2)) == "small"
    assert pick(fleet, "auto", "premium", traits=request_traits(question)) == "large"
    assert pick(fleet, "auto", thread_model="large", traits=request_traits(question)) == "large"  # stays up
    assert pick(fleet, "auto", thread_model="small", traits=request_traits(long)) == "large"  # may go up
    assert [why for _, _, why in said] == ["none", "prompt_chars", "tools", "response_format", "none", "messages", "none",
                                           "tiers", "thread", "prompt_chars"]
    # A Responses body: its input items and text.format.
    traits = request_traits({"input": [{"role": "user", "content": "a" * 50}, {"type": "function_call_output",
                                                                             "output": "b" * 60}],
                             "text": {"format": {"type": "json_object"}}})
    assert traits == RequestTraits(prompt_chars=110, messages=2, tools=False, response_format=True)


async def test_a_model_loads_once_for_concurrent_first_requests_and_unloads_after_keep_alive():
    fleet, starts, engines = make_fleet(delay=0.2)
    large = fleet.by_name("large")
    assert large.status == UNLOADED and starts == []

    async def request() -> str:
        async with large.in_use() as served:
            assert served.status == LOADED
            await asyncio.sleep(0.05)
            return served.name

    assert await asyncio.gather(*(request() for _ in range(8))) == ["large"] * 8
    assert starts == ["large"] and large.num_loads == 1  # one load for all eight
    # Busy (a request in its engine) is never idle, however long ago it was picked.
    engines["large"].streams = 1
    now = time.monotonic() + 60
    await fleet.unload_idle(now)
    assert large.status == LOADED
    engines["large"].streams = 0
    engines["large"].compile_state = lambda: "compiling"  # its steps compiling on a thread: not idle either
    now += 60
    await fleet.unload_idle(now)
    assert large.status == LOADED
    engines["large"].compile_state = lambda: "compiled"
    await fleet.unload_idle(now + 1)  # idle 1 s of its 2 since it was last seen busy
    assert large.status == LOADED
    await fleet.unload_idle(now + 2.5)
    assert large.status == UNLOADED and engines["large"].stopped and large.engine is None
    assert fleet.primary.status == LOADED  # keep_alive -1 (the default): never unloaded
    # The next request loads it again.
    assert await request() == "large" and large.num_loads == 2 and starts == ["large", "large"]
    # keep_alive 0: unloaded as soon as nothing holds it.
    canary = fleet.by_name("canary")
    async with canary.in_use():
        await fleet.unload_idle(time.monotonic())
        assert canary.status == LOADED
    await fleet.unload_idle(time.monotonic())
    assert canary.status == UNLOADED


async def test_a_load_shows_its_progress_and_loads_and_unloads_are_counted_by_reason():
    fleet, _, _ = make_fleet({**FLEET, "server": {"max_loaded_models": 2}}, delay=0.3)
    metrics = ServerMetrics("small")
    for served in fleet.models:
        metrics.declare_model(served.name)
        served.metrics = metrics
    large, canary = fleet.by_name("large"), fleet.by_name("canary")
    assert large.load_progress(time.monotonic()) is None
    loading = asyncio.get_running_loop().create_task(large.load())
    await asyncio.sleep(0.15)
    first = large.card()["load"]  # its first load: how long so far, nothing to compare with
    assert large.status == "loading" and first["seconds"] > 0 and first["expected_seconds"] is None
    await loading
    assert "load" not in large.card() and large.last_load_seconds >= 0.3
    await large.unload("admin", "a test asked")
    loading = asyncio.get_running_loop().create_task(large.load())
    await asyncio.sleep(0.15)
    again = large.card()["load"]  # its second: the share of the last one's time passed
    assert again["expected_seconds"] >= 0.3 and 0 < again["progress"] < 1
    await loading
    async with canary.in_use():  # large (idle) makes room
        pass
    await fleet.unload_idle(time.monotonic())  # canary's keep_alive is 0
    samples = scrape(metrics)
    assert samples["chatd:model_loads_total{model_name=large,outcome=loaded}"] == 2
    assert samples["chatd:model_loads_total{model_name=canary,outcome=loaded}"] == 1
    assert samples["chatd:model_unloads_total{model_name=large,reason=admin}"] == 1
    assert samples["chatd:model_unloads_total{model_name=large,reason=room}"] == 1
    assert samples["chatd:model_unloads_total{model_name=canary,reason=idle}"] == 1
    assert samples["chatd:model_load_seconds_count{model_name=large}"] == 2


async def test_a_model_that_cannot_load_is_a_503_naming_it_and_is_tried_again():
    fleet, _, engines = make_fleet()
    large = fleet.by_name("large")
    failures = [RuntimeError("out of memory")]

    def make_engine(_):
        engine = CountingEngine("large", [])
        if failures:
            async def fail():
                raise failures.pop()
            engine.start = fail
        return engine

    large._make_engine = make_engine
    with pytest.raises(APIError) as failed:
        async with large.in_use():
            pass
    assert (failed.value.status, failed.value.code) == (503, "model_unavailable") and "'large'" in failed.value.message
    assert failed.value.headers["Retry-After"] and large.status == UNLOADED
    assert large.card()["load_error"] == "RuntimeError: out of memory"
    async with large.in_use() as served:  # the next request tries again
        assert served.status == LOADED and "load_error" not in served.card()


async def test_past_max_loaded_models_the_least_recently_used_idle_model_makes_room_and_a_busy_one_never():
    fleet, starts, engines = make_fleet({**FLEET, "server": {"max_loaded_models": 2}})
    large, canary = fleet.by_name("large"), fleet.by_name("canary")
    canary.keep_alive = -1
    async with large.in_use():
        pass
    assert [m.status for m in fleet.models] == [LOADED, LOADED, UNLOADED]
    async with canary.in_use():  # two loaded already: large (idle) goes; the first model never does
        assert [m.status for m in fleet.models] == [LOADED, UNLOADED, LOADED]
        # Now the only other model is in use: no room for large, and the 503 says why.
        with pytest.raises(APIError) as full:
            async with large.in_use():
                pass
        assert (full.value.status, full.value.code) == (503, "model_unavailable")
        assert "'canary'" in full.value.message and "max_loaded_models = 2" in full.value.message
        assert full.value.headers["Retry-After"] and large.load_error is None
    async with large.in_use():  # canary is idle now: it makes room
        assert [m.status for m in fleet.models] == [LOADED, LOADED, UNLOADED]
    assert starts == ["large", "canary", "large"]


async def test_a_memory_budget_unloads_by_size_as_well(tmp_path):
    fleet, _, _ = make_fleet({**FLEET, "server": {"models_memory_gb": 1.0}})
    large, canary = fleet.by_name("large"), fleet.by_name("canary")
    canary.keep_alive = -1
    (tmp_path / "large.gguf").write_bytes(b"\0" * (600 << 20))  # weight files together over 1 GB
    (tmp_path / "canary").mkdir()
    (tmp_path / "canary" / "model.safetensors").write_bytes(b"\0" * (500 << 20))
    for served, path in ((large, tmp_path / "large.gguf"), (canary, tmp_path / "canary")):
        served.entry = dataclasses.replace(served.entry, model=dataclasses.replace(served.entry.model, path=str(path)))
        served.config = fleet_config(fleet.config, served.entry)
    assert canary.footprint_bytes() == 500 << 20
    async with large.in_use():
        pass
    async with canary.in_use():
        assert large.status == UNLOADED and canary.status == LOADED


async def test_a_model_whose_engine_died_is_loaded_again_and_the_next_request_is_served():
    fleet, starts, engines = make_fleet()
    large = fleet.by_name("large")
    async with large.in_use():
        pass
    engines["large"].problem = "engine stopped: RuntimeError('out of memory')"
    async with large.in_use() as served:  # a request finds it dead: it loads again, and is served
        assert served.status == LOADED and served.engine is not None and served.engine.problem is None
    assert starts == ["large", "large"]
    engines["large"].problem = "engine stopped: segfault in a worker"  # the unloader finds it too
    await fleet.unload_idle(time.monotonic())
    await asyncio.sleep(0.05)
    assert starts == ["large", "large", "large"] and large.status == LOADED
    assert fleet.primary.status == LOADED  # the others never noticed


@pytest.mark.parametrize("auth", [False, True], ids=["local", "keys"])
async def test_a_requests_keep_alive_is_the_local_users_and_a_bad_one_is_named(tmp_path, auth):
    from aiohttp.test_utils import TestClient, TestServer

    from chatd.http.app import create_app
    from tests.factories import ScriptedChatEngine, close_server_state, make_server_state

    state = await make_server_state(ScriptedChatEngine(pause=0.0), tmp_path, build_config({"auth": {"enabled": auth}}))
    key = None
    if auth:
        key, _ = await state.store.create_key("alice", "paid")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        async with TestClient(TestServer(create_app(state))) as client:
            answer = await client.post("/v1/chat/completions", json={**body, "keep_alive": "5m"}, headers=headers)
            if auth:  # with keys, it is the operator's: one tenant's `0` would make the next one wait for a load
                error = (await answer.json())["error"]
                assert answer.status == 400 and error["param"] == "keep_alive" and "operator" in error["message"]
                assert state.fleet.primary.keep_alive == -1
                return
            assert answer.status == 200 and state.fleet.primary.keep_alive == 300.0
            answer = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "keep_alive": 0})
            assert answer.status == 200 and state.fleet.primary.keep_alive == 0
            answer = await client.post("/v1/chat/completions", json={**body, "keep_alive": "soon"})
            error = (await answer.json())["error"]
            assert answer.status == 400 and error["param"] == "keep_alive" and "duration" in error["message"]
            assert state.fleet.primary.keep_alive == 0
    finally:
        await close_server_state(state)


@pytest.mark.parametrize("values, message", [
    ({"models": [{"name": "a", "path": "demo"}], "aliases": {"chat": {"targets": {"b": 1}}}},
     "aliases.chat names 'b', which is no model's name"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "'a' names two models"),
    ({"models": [{"name": "a"}], "aliases": {"a": {"targets": {"a": 1}}}}, "an alias needs a name of its own"),
    ({"models": [{"name": "a"}], "aliases": {"chat": {"targets": {"a": 0}}}}, "at least one weight"),
    ({"models": [{"name": "a"}, {"name": "b"}], "tiers": {"free": {"models": ["a"], "default_model": "b"}}},
     "tiers.free.default_model 'b' is not one of the tier's models"),
    ({"models": [{"name": "a"}], "tiers": {"free": {"default_model": "x"}}}, "tiers.free names model 'x'"),
    ({"models": [{"name": "a", "keep_alive": "soon"}]}, "models.a.keep_alive must be a duration"),
    ({"models": [{"name": "a", "dtype": "float8"}]}, "models.a: setting model.dtype must be one of"),
    ({"models": [{"name": "a", "cache": {"num_blockz": 8}}]}, "unknown setting models.a.cache.num_blockz"),
    ({"models": [{"name": "default"}]}, "cannot be a model's name"),
    ({"server": {"model_name": "x"}, "models": [{"name": "a"}]}, "with [[models]], each entry has its names"),
])
def test_a_fleet_config_mistake_is_refused_naming_the_setting(values, message):
    with pytest.raises(ValueError) as refused:
        build_config(values)
    assert message in str(refused.value)


def test_each_model_has_its_own_sections_over_the_servers_and_todays_config_is_one_model():
    config = build_config({"model": {"device": "cpu", "max_model_len": 512}, "cache": {"num_blocks": 32},
                           "models": [{"name": "a", "path": "demo"},
                                      {"name": "b", "path": "x", "max_model_len": 128, "cache": {"num_blocks": 8},
                                       "speculative": {"method": "ngram"}, "keep_alive": "5m", "preload": True}]})
    a, b = config.fleet()
    assert (a.model.path, a.model.device, a.model.max_model_len, a.cache.num_blocks) == ("demo", "cpu", 512, 32)
    assert (b.model.path, b.model.device, b.model.max_model_len, b.cache.num_blocks) == ("x", "cpu", 128, 8)
    assert (b.speculative.method, b.keep_alive, b.preload, a.keep_alive) == ("ngram", 300.0, True, -1.0)
    assert fleet_config(config, b).model is b.model and fleet_config(config, b).server is config.server
    one = build_config({"model": {"path": "demo"}, "server": {"model_name": ["m", "m2"]}})
    [only] = one.fleet()
    assert only.names == ("m", "m2") and only.model is one.model and only.keep_alive == -1


async def test_the_confidence_probe_is_the_small_models_own_greedy_logprobs(tmp_path):
    """escalation.confidence: the geometric mean probability of the small model's first greedy
    tokens for the request's messages, as its offline engine computes it; None with nothing to read."""
    path = build_demo_model(tmp_path / "demo")
    engine = AsyncEngine(lambda: LLM(str(path), device="cpu", compile=False).engine)
    info = await engine.start()
    try:
        config = build_config({"models": [{"name": "small", "path": str(path)}]})
        served = ServedModel(config.fleet()[0], fleet_config(config, config.fleet()[0]), None,
                             concurrent.futures.ThreadPoolExecutor(1))
        served.loaded(engine, engine.tokenizer, info)
        said = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        body = {"messages": [*said, {"role": "tool", "content": "left out"}]}
        sure = await escalation.confidence(served, request_traits(body), 6, Placement(), lambda prompt: CacheScope())
        with LLM(str(path), device="cpu", compile=False) as alone:
            ids = alone.tokenizer.encode_chat(said, True, None)
            [out] = alone.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))
            logprobs = [lp.logprob for lp in out.outputs[0].logprobs]
            texts = alone.generate("Once upon", SamplingParams(max_tokens=3, temperature=0.0, logprobs=0))
        assert sure == pytest.approx(math.exp(sum(logprobs) / len(logprobs)), rel=1e-4)
        prompt_sure = await escalation.confidence(served, request_traits({"prompt": "Once upon"}), 3, Placement(),
                                                  lambda prompt: CacheScope())
        text_logprobs = [lp.logprob for lp in texts[0].outputs[0].logprobs]
        assert prompt_sure == pytest.approx(math.exp(sum(text_logprobs) / 3), rel=1e-4)
        for nothing in ({"messages": [{"role": "tool", "content": "x"}]}, {"messages": "not a list"}, {}):
            assert await escalation.confidence(served, request_traits(nothing), 6, Placement(),
                                               lambda prompt: CacheScope()) is None
        assert engine.stats().num_request_streams == 0  # each probe's request has left the engine
    finally:
        await engine.stop()

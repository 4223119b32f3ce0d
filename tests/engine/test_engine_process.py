"""The engine in a process of its own (`--engine-process`): the same tokens, refusals, aborts and
failures as the engine thread gives, through the same AsyncEngine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal

import pytest
import torch

from chatd.config_loader import build_config, config_from_options
from chatd.engine import AsyncEngine, EngineProcess, LLMEngine, ParamError, SamplingParams, engine_process_wanted
from chatd.engine.engine_process import ENGINE_PROCESS_CORES
from tests.engine.conftest import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _failing_build() -> LLMEngine:
    raise ValueError("no model here")


@contextlib.asynccontextmanager
async def engine_process(path):
    config = config_from_options(path=str(path), device="cpu", dtype="float32", block_size=8, num_blocks=256,
                                 max_num_batched_tokens=512, compile=False)
    engine = AsyncEngine(functools.partial(EngineProcess, functools.partial(LLMEngine.from_config, config),
                                           config.scheduler, config.cache))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def collect(stream) -> tuple[list[int], str | None]:
    tokens, error = [], None
    async for out in stream:
        tokens += out.outputs[0].token_ids
        error = error or out.error
    return tokens, error


async def test_the_same_tokens_as_the_offline_engine_and_nothing_left_running(model_dirs):
    path = model_dirs["llama"]
    prompts = [[5, 6, 7, i] for i in range(3, 11)]
    want = [out.outputs[0].token_ids for out in make_llm(path).generate(prompts, GREEDY)]
    async with engine_process(path) as engine:
        got = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in prompts))
        assert [tokens for tokens, _ in got] == want
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
        assert engine.stage_times()["steps"] > 0


@pytest.mark.slow
async def test_a_bad_request_is_refused_at_once_naming_the_field(model_dirs):
    async with engine_process(model_dirs["llama"]) as engine:
        with pytest.raises(ParamError) as refused:
            engine.generate([1, 2, 3], SamplingParams(max_tokens=10**6))
        assert refused.value.param == "max_tokens"
        assert (await collect(engine.generate([1, 2, 3], GREEDY)))[1] is None  # and it serves on


@pytest.mark.slow
async def test_an_abort_frees_the_childs_blocks(model_dirs):
    async with engine_process(model_dirs["llama"]) as engine:
        stream = engine.generate(list(range(3, 40)), SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        stream.abort()
        for _ in range(200):
            await asyncio.sleep(0.02)
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
                break
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


@pytest.mark.slow
async def test_a_dead_engine_process_ends_every_stream_with_the_reason(model_dirs):
    async with engine_process(model_dirs["llama"]) as engine:
        stream = engine.generate(list(range(3, 40)), SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.engine._process.pid, signal.SIGKILL)
        tokens, error = await asyncio.wait_for(collect(stream), 30)
        assert error is not None and "engine process exited" in error
        assert "engine process exited" in engine.health()


async def test_a_child_that_cannot_build_says_why():
    config = config_from_options(device="cpu")
    engine = AsyncEngine(functools.partial(EngineProcess, _failing_build, config.scheduler, config.cache))
    with pytest.raises(RuntimeError, match="no model here"):
        await engine.start()


@pytest.mark.slow
async def test_a_burst_larger_than_the_pipes_is_served(model_dirs):
    """Hundreds of requests at once (their adds fill the pipe) while the child sends steps back:
    neither end waits for the other forever."""
    async with engine_process(model_dirs["llama"]) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)  # big step messages
        streams = [engine.generate([3 + (i + j) % 90 for j in range(100)], params) for i in range(400)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
        assert all(error is None and len(tokens) == 4 for tokens, error in results)


def test_auto_keeps_the_engine_on_a_thread_without_a_gpu_or_the_cores(monkeypatch):
    """`engine_process = "auto"`: its own process only on a GPU with ENGINE_PROCESS_CORES CPUs; a CPU
    model keeps its thread however many cores (its forward's own threads want them); on and off
    are as said; config.toml's booleans mean on and off, anything else is refused by name."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert engine_process_wanted("auto", "cpu") == (False, "auto: no GPU, 64 CPUs")
    assert engine_process_wanted("on", "cpu")[0] and not engine_process_wanted("off", "cpu")[0]
    assert engine_process_wanted("auto", "cuda:1") == (True, "auto: a GPU, 64 CPUs")
    assert engine_process_wanted("auto", "auto")[0] == torch.cuda.is_available()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(ENGINE_PROCESS_CORES - 1)))
    assert not engine_process_wanted("auto", "cuda")[0]
    assert build_config({"server": {"engine_process": True}}).server.engine_process == "on"
    assert build_config({"server": {"engine_process": False}}).server.engine_process == "off"
    assert build_config({}).server.engine_process == "auto"
    with pytest.raises(ValueError, match="server.engine_process must be one of auto, on, off"):
        build_config({"server": {"engine_process": "sometimes"}})

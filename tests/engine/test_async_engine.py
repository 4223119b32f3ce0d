"""AsyncEngine: streams equal offline output, cancellation frees blocks, slow readers never stall."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from chatd.engine import AsyncEngine, FinishReason, ParamError, SamplingParams
from tests.engine.conftest import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture
async def engine(model_dirs):
    async_engine = AsyncEngine(lambda: make_llm(model_dirs["llama"]).engine)
    await async_engine.start()
    yield async_engine
    await async_engine.stop()


async def collect(engine: AsyncEngine, prompt, params=GREEDY, **kwargs):
    merged = None
    async for out in engine.generate(prompt, params, **kwargs):
        if merged is None:
            merged = out
        else:
            merged.merge(out)
    return merged


async def test_streamed_deltas_add_up_to_the_offline_result(engine, model_dirs):
    prompts = [[5, 6, 7], list(range(10, 40)), [99] * 17]
    streamed = await asyncio.gather(*(collect(engine, p) for p in prompts))
    offline = make_llm(model_dirs["llama"]).generate(prompts, GREEDY)
    for got, want in zip(streamed, offline):
        assert got.finished
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text


async def test_cancelled_consumer_aborts_and_blocks_are_freed(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def consume():
        async for _ in engine.generate(list(range(3, 60)), params):
            pass

    task = asyncio.create_task(consume())
    while engine.stats().num_running == 0:  # wait until it holds blocks
        await asyncio.sleep(0.005)
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await engine.sync()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


async def test_leaving_the_loop_early_aborts_the_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = engine.generate([4, 5, 6, 7], params)
    async with contextlib.aclosing(stream):
        async for out in stream:
            assert out.outputs[0].token_ids
            break
    await engine.sync()
    assert engine.stats().num_running == 0
    assert not engine.engine.requests


async def test_a_slow_reader_gets_merged_deltas_and_does_not_hold_back_others(engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    slow = engine.generate([8, 9, 10], params)
    first = await slow.__anext__()  # then read nothing while the other stream runs to the end
    fast = await collect(engine, [11, 12, 13], params)
    assert fast.finished and len(fast.outputs[0].token_ids) == 30
    rest = await slow.__anext__()
    # Everything generated while nobody read arrives as one merged delta.
    assert len(first.outputs[0].token_ids) + len(rest.outputs[0].token_ids) >= 25
    async with contextlib.aclosing(slow):
        async for out in slow:
            rest.merge(out)
    assert len(first.outputs[0].token_ids) + len(rest.outputs[0].token_ids) == 30


async def test_a_sink_takes_outputs_as_they_come_and_leaves_the_rest_to_the_reader_in_order(engine):
    """A sink that takes every other output: the reader gets the ones it left, each merged with
    what came while it waited (a later output never passes one left for the reader), so the two
    together have every token once, in order; the sink taking the finished output ends the reader."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = (await collect(engine, [8, 9, 10], params)).outputs[0].token_ids
    stream = engine.generate([8, 9, 10], params)
    in_order, offered = [], [0]

    def sink(out):
        offered[0] += 1
        if offered[0] % 2 or out.finished:
            in_order.append(("sink", out.outputs[0].token_ids))
            return None
        return out

    stream.deliver_to(sink)
    async for out in stream:
        in_order.append(("reader", out.outputs[0].token_ids))
        await asyncio.sleep(0.01)  # steps go on meanwhile
    assert [t for _, tokens in in_order for t in tokens] == expected
    assert {who for who, _ in in_order} == {"sink", "reader"}
    # A sink that takes everything, the finished output too: the reader's loop ends with nothing read.
    taken = []
    stream = engine.generate([8, 9, 10], params)
    stream.deliver_to(lambda out: taken.append(out.outputs[0].token_ids))
    assert [out async for out in stream] == [] and [t for tokens in taken for t in tokens] == expected
    assert not engine._streams  # its last output left the table as a read one would have


async def test_bad_request_raises_before_anything_is_queued(engine):
    with pytest.raises(ParamError) as err:
        await collect(engine, [1, 2], SamplingParams(top_p=1.5))
    assert err.value.param == "top_p"
    await engine.sync()
    assert not engine.engine.requests


async def test_stop_ends_open_streams_with_an_error(model_dirs):
    async_engine = AsyncEngine(lambda: make_llm(model_dirs["llama"]).engine)
    await async_engine.start()
    stream = async_engine.generate([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    await stream.__anext__()
    await async_engine.stop()
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished and last.error
    assert async_engine.stats().num_free_blocks == async_engine.stats().num_blocks


async def test_the_engine_is_built_on_the_engine_thread_and_build_errors_reach_start(model_dirs):
    # All torch work of a server runs on one thread (a second OpenMP team halves CPU speed).
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return make_llm(model_dirs["llama"]).engine

    async_engine = AsyncEngine(build)
    model = await async_engine.start()
    try:
        assert built_on == ["chatd-engine"] and async_engine.engine.model_info() == model
        out = await collect(async_engine, [3, 4, 5])
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        await async_engine.stop()

    def broken():
        raise FileNotFoundError("no model at /nowhere")

    failing = AsyncEngine(broken)
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        await failing.start()
    assert not failing.is_running


async def test_every_exit_leaves_no_stream_and_no_blocks(engine):
    """Finished, aborted before its first read, closed mid-way, dropped unread: the stream table and
    the KV pool end empty (a request whose reader vanished must not be kept forever)."""
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    await collect(engine, [3, 4, 5], params)  # read to the end
    never_read = engine.generate(list(range(3, 40)), params)
    never_read.abort()
    read_once = engine.generate(list(range(5, 40)), params)
    await read_once.__anext__()
    await read_once.aclose()
    dropped = engine.generate(list(range(7, 40)), params)
    del dropped  # the reader went away without a word
    ids = [engine.generate([9, 10, 11], params) for _ in range(20)]
    for stream in ids:
        stream.abort()
    await engine.sync()
    stats = engine.stats()
    assert stats.num_request_streams == 0
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
    assert not engine.engine.requests


async def test_request_ids_are_made_by_the_engine_and_never_repeat(engine):
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    streams = [engine.generate([3, 4, 5], params) for _ in range(50)]
    assert len({s.request_id for s in streams}) == 50
    outs = [await collect_stream(s) for s in streams]
    assert all(out.request_id == s.request_id for out, s in zip(outs, streams))


async def collect_stream(stream):
    merged = None
    async for out in stream:
        merged = out if merged is None else merged.merge(out) or merged
    return merged


async def test_stop_answers_requests_queued_after_the_last_step(model_dirs):
    async_engine = AsyncEngine(lambda: make_llm(model_dirs["llama"]).engine)
    await async_engine.start()
    streams = [async_engine.generate([3, 4, 5], SamplingParams(max_tokens=100, ignore_eos=True)) for _ in range(8)]
    await async_engine.stop()
    for stream in streams:
        last = await asyncio.wait_for(collect_stream(stream), timeout=10)
        assert last.finished and last.error
    assert async_engine.stats().num_request_streams == 0
    with pytest.raises(RuntimeError, match="not running"):
        async_engine.generate([3, 4, 5])


async def test_an_abort_from_elsewhere_ends_the_readers_stream(engine):
    """Aborting a request by id (a conversation deleted mid-reply) wakes whoever reads it."""
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    stream = engine.generate(list(range(3, 30)), params)
    first = await stream.__anext__()
    engine.abort(stream.request_id)
    rest = await asyncio.wait_for(collect_stream(stream), timeout=10)
    first.merge(rest)
    assert first.finished and first.outputs[0].finish_reason == FinishReason.ABORT
    assert len(first.outputs[0].token_ids) < 500
    await engine.sync()
    assert engine.stats().num_request_streams == 0 and engine.stats().num_running == 0

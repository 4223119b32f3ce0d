"""`chatd serve`: load the model, start the engine thread and the HTTP server, stop gracefully.

Order at start: load (before the port opens) -> listen (/health answers, /ready says warming
up) -> warm-up request (one prefill, a few decode steps) -> ready, one log line with the URL.
On SIGINT/SIGTERM: stop accepting, give in-flight requests the grace period, abort the rest.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from pathlib import Path

from aiohttp import web

from chatd.config import Config
from chatd.engine.async_engine import AsyncEngine
from chatd.engine.engine import LLMEngine
from chatd.engine.params import SamplingParams
from chatd.http.app import create_app
from chatd.http.state import ServerState

log = logging.getLogger("chatd.http")


async def serve(config: Config, stop: asyncio.Event | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (or `stop` is set)."""
    # Loaded on the engine thread, where all of the server's torch work runs (see async_engine.py).
    async_engine = AsyncEngine(functools.partial(LLMEngine.from_config, config))
    engine = await async_engine.start()
    if engine.tokenizer is None:
        await async_engine.stop()
        raise ValueError("chatd serve needs a model with a tokenizer")
    model_path = Path(engine.model_path)
    state = ServerState(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        model_name=config.server.model_name or model_path.name,
        max_model_len=engine.max_model_len,
        details=engine.describe(),
        heartbeat_seconds=config.server.heartbeat_seconds,
    )
    app = create_app(state, config.server.max_body_bytes)
    # handler_cancellation: a client that goes away cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await _warm_up(async_engine)
        state.ready = True
        d = state.details
        log.info(
            "ready: model %s, dtype %s, device %s, attention %s, %d KV blocks, http://%s:%d",
            state.model_name, d["dtype"], d["device"], d["attention_backend"], d["num_kv_blocks"],
            config.server.host, _bound_port(site, config.server.port),
        )
        await stop.wait()
        log.info("stopping: no new connections; %.0f s for in-flight requests", config.server.shutdown_grace_seconds)
        state.ready = False
        await site.stop()
        await _drain(async_engine, config.server.shutdown_grace_seconds)
    finally:
        await runner.cleanup()  # cancels handlers still running: their requests are aborted
        await async_engine.stop()
        log.info("stopped")


async def _warm_up(engine: AsyncEngine) -> None:
    """One prefill and a few decode steps, so the first user does not pay for lazy initialisation."""
    async for _ in engine.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)):
        pass


async def _drain(engine: AsyncEngine, grace: float) -> None:
    deadline = asyncio.get_running_loop().time() + grace
    while asyncio.get_running_loop().time() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.05)


def _bound_port(site: web.TCPSite, configured: int) -> int:
    server = site._server  # the port actually bound, for --port 0
    if server is not None and server.sockets:
        return server.sockets[0].getsockname()[1]
    return configured

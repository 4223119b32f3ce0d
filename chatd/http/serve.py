"""`chatd serve`: load the model, start the engine thread and the HTTP server, stop gracefully.

Order at start: open the store (migrations) -> load (before the port opens) -> listen (/health
answers, /ready says warming up) -> warm-up request (one prefill, a few decode steps) -> ready,
one log line with the URL. A background task purges deleted conversations past retention.
On SIGINT/SIGTERM: stop accepting, give in-flight requests the grace period, abort the rest
(conversation replies cut short are saved as partial), wait for the store writes, close it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from chatd.config import Config, StoreConfig, store_path
from chatd.engine.async_engine import AsyncEngine
from chatd.engine.engine import LLMEngine
from chatd.engine.params import SamplingParams
from chatd.http.app import create_app
from chatd.http.state import ServerState
from chatd.store.db import SCHEMA_VERSION, Store

log = logging.getLogger("chatd.http")

SHUTDOWN_WRITE_SECONDS = 2.0


async def serve(config: Config, stop: asyncio.Event | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (or `stop` is set)."""
    path = store_path(config)
    store = await Store.open(path)
    log.info("store: %s (schema version %d)", path, SCHEMA_VERSION)
    try:
        await _serve(config, store, stop)
    finally:
        await store.close()


async def _serve(config: Config, store: Store, stop: asyncio.Event | None) -> None:
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
        store=store,
        local_tenant=await store.local_tenant(config.auth.local_tier),
        config=config,
    )
    app = create_app(state, config.server.max_body_bytes)
    # handler_cancellation: a client that goes away cancels its handler, which aborts its request.
    # shutdown_timeout: after the grace period and the engine's stop, handlers only write their
    # last events; aiohttp's default (60 s) would silently stretch the grace period.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_WRITE_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    purge = asyncio.create_task(_purge_forever(store, config.store), name="purge")
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
        purge.cancel()
        state.stopping = True
        await async_engine.stop()  # aborts what is left: streams end with an error event, replies save as partial
        await runner.cleanup()  # handlers finish their last writes, or are cancelled after SHUTDOWN_WRITE_SECONDS
        await state.wait_background(timeout=10.0)
        log.info("stopped")


async def _warm_up(engine: AsyncEngine) -> None:
    """One prefill and a few decode steps, so the first user does not pay for lazy initialisation."""
    async for _ in engine.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)):
        pass


async def _purge_forever(store: Store, config: StoreConfig) -> None:
    """Purge conversations deleted more than `retention_days` ago, now and every `purge_interval_seconds`."""
    while True:
        try:
            purged = await store.purge_deleted(time.time() - config.retention_days * 86400)
            if purged:
                log.info("purged %d deleted conversations older than %g days", purged, config.retention_days)
        except Exception:
            log.exception("purging deleted conversations failed; trying again later")
        await asyncio.sleep(config.purge_interval_seconds)


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

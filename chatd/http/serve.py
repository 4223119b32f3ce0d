"""`chatd serve`: open the port, load the model, start the engine thread and the HTTP server, stop gracefully.

Order at start: bind and listen at once, with a small app answering while the server starts
(server/starting.py: /health 200, /ready 503 with the phase, other routes 503 with Retry-After) ->
open the store (migrations) -> load -> warm-up request (one prefill, a few decode steps) ->
the full app takes the port: ready, one log line with the URL. On a CPU the steps compile on a
thread meanwhile (worker/fast_steps/compile_job.py); the log keeps the start timeline (server/starting.py). A
background task purges deleted conversations past retention.
On SIGINT/SIGTERM: keep listening, answer new requests 503 with Retry-After and /ready 503,
give in-flight requests the grace period, abort the rest (conversation replies cut short are
saved as partial), stop listening, wait for the store writes, close it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import logging
import signal
import socket
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from chatd.config import Config, StoreConfig
from chatd.engine import AsyncEngine, Embedder, EngineProcess, LLMEngine, SamplingParams, engine_process_wanted
from chatd.http.app import create_app
from chatd.http.admission.buckets import check_storage
from chatd.http.models.served_model import fleet_config
from chatd.http.server.starting import Startup, starting_app
from chatd.http.server.state import ServerState
from chatd.safety.guard import GuardModel
from chatd.safety.pipeline import SafetyPipeline
from chatd.store.db import SCHEMA_VERSION, Store
from chatd.store.idempotency import KEY_LIFETIME_S
from chatd.store.ledger import Ledger
from chatd.store.url import open_store, store_location, store_target

log = logging.getLogger("chatd.http")

SHUTDOWN_WRITE_SECONDS = 2.0
# The starting app's last connections get this long to send their requests and have their answers
# (a probe that connected just before the hand-over, from a busy machine, may take a while to send).
HAND_OVER_SECONDS = 5.0
# A connection the OS handed the starting app just before it stopped accepting becomes one of its
# connections only once asyncio has made its transport, a few loop turns later: counted after this.
HAND_OVER_SETTLE_SECONDS = 0.2
GUARD_SEQUENCES = 8  # inputs the guard model judges at once: its KV pool holds this many full contexts
LEDGER_FLUSH_SECONDS = 10.0  # at stop, billing writes the store refuses are retried this long


async def serve(config: Config, stop: asyncio.Event | None = None,
                build_engine: Callable[[Config], LLMEngine] = functools.partial(LLMEngine.from_config,
                                                                                background_compile=True),
                reload_config: Callable[[], Config] | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (or `stop` is set). `build_engine` makes the engine from
    the config, on the engine thread (benchmarks/host.py passes one around a fixed-time model).
    `reload_config` reads the config again: on SIGHUP, its [aliases] and keep_alive take effect."""
    SafetyPipeline.build(config.safety, config.policies)  # a bad rules file or policy: said now, not after loading
    check_storage(config.tiers_storage)  # [tiers] storage needs redis-py: said now too
    sock = reserve_port(config.server.host, config.server.port)
    warn_if_open(config)
    startup = Startup()
    # While it starts, a small app answers on a second descriptor of the same socket; the full
    # app takes the socket itself, so the port never closes in between.
    early = web.AppRunner(starting_app(startup), access_log=None, shutdown_timeout=1.0)
    await early.setup()
    early_site = web.SockSite(early, sock.dup())
    await early_site.start()
    listening = Listening(sock, early, early_site, startup)
    startup.mark("listening", f"http://{config.server.host}:{sock.getsockname()[1]}; /ready says when the model serves")
    try:
        where = store_target(config)
        store = await open_store(where, max_bytes=int(config.store.max_db_mb * 2**20))
        # A PostgreSQL url may hold a password: only its dialect is logged.
        shown = where if store_location(where)[0] == "sqlite" else "a PostgreSQL database ([store] url)"
        log.info("store: %s (schema version %d)", shown, SCHEMA_VERSION)
        try:
            await check_key_tiers(store, config)
        except ValueError:
            await store.close()
            raise
        ledger = Ledger(store, retry_seconds=config.store.retry_seconds)
        ledger.start()
        try:
            await _serve(config, store, ledger, listening, stop, build_engine, reload_config)
        finally:
            await ledger.stop(timeout=LEDGER_FLUSH_SECONDS)  # what still cannot be written is logged in full
            await store.close()
    finally:
        await listening.close()


@dataclasses.dataclass
class Listening:
    """The bound socket, the app answering on it while the server starts, and the start's phases."""

    sock: socket.socket
    early: web.AppRunner
    early_site: web.SockSite
    startup: Startup

    retiring: asyncio.Task | None = None

    async def hand_over(self, runner: web.AppRunner) -> web.SockSite:
        """The full app takes the port: it accepts first, then the starting app stops accepting and,
        once the connections it took have had their answers (it closes each after one), goes. That
        last part runs beside the server: the full app serves meanwhile."""
        site = web.SockSite(runner, self.sock)
        await site.start()
        await self.early_site.stop()
        self.retiring = asyncio.create_task(self._retire_early(), name="starting app")
        return site

    async def _retire_early(self) -> None:
        # A connection the starting app took whose request has not arrived yet (a probe on a busy
        # machine) is waited for, up to HAND_OVER_SECONDS, rather than reset: its client did nothing wrong.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HAND_OVER_SECONDS
        await asyncio.sleep(HAND_OVER_SETTLE_SECONDS)  # (else such a connection was reset, request unread)
        while self.early.server.connections and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await self.early.cleanup()

    async def close(self) -> None:
        """The starting app gone (whatever it still held closed) and the socket closed."""
        if self.retiring is not None:
            await self.retiring
        await self.early.cleanup()  # a no-op once it was retired
        self.sock.close()


def warn_if_open(config: Config) -> None:
    """A warning when the server listens beyond this machine and asks no one for a key."""
    if config.auth.enabled or config.auth.api_key:
        return
    host = config.server.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if not loopback:
        log.warning("listening on %s with no API key: anyone who can reach this address can use the model and read "
                    "every conversation; set CHATD_API_KEY (or --api-key), or turn on [auth] enabled with "
                    "`chatd keys create`", host)


async def check_key_tiers(store: Store, config: Config) -> None:
    """With the key database on, every live key's tier must be one config.toml defines: a key whose
    tier is not would have no limits to apply. ValueError naming each such key."""
    if not config.auth.enabled:
        return
    unknown = await store.keys_with_unknown_tiers(set(config.tiers))
    if unknown:
        keys = "; ".join(f"key {k.id} (tenant {k.tenant_name!r}) has tier {k.tier!r}" for k in unknown)
        raise ValueError(f"{keys}, which the config does not define (defined: {', '.join(config.tiers)}): add "
                         f"[tiers.{unknown[0].tier}] to the config, or give the tenant a defined tier with "
                         "`chatd keys create --name NAME --tier TIER`")


def reserve_port(host: str, port: int) -> socket.socket:
    """Bind the listening address now (listening starts after loading); ValueError naming it if taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror} (check [server] host or --host)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT after a restart is fine
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"cannot listen on {host}:{port}: the address is already in use (is another server "
                             "running there? pick another port with --port)") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


async def _serve(config: Config, store: Store, ledger: Ledger, listening: Listening, stop: asyncio.Event | None,
                 build_engine: Callable[[Config], LLMEngine], reload_config: Callable[[], Config] | None) -> None:
    # The guard model first: on a GPU the main engine then sizes its KV pool from what the guard left.
    guard_engine, guard = await _start_guard(config)
    embedder = None
    try:
        embedder = await _load_embedder(config)  # before the engine too: it sizes its KV pool from what is left
        await _serve_with(config, store, ledger, listening, stop, guard, embedder, build_engine, reload_config)
    finally:
        if embedder is not None:
            embedder.stop()
        if guard_engine is not None:
            await guard_engine.stop()


async def _load_embedder(config: Config) -> Embedder | None:
    """[embeddings] model, loaded on a thread (the port answers meanwhile), or none when it is empty."""
    settings = config.embeddings
    if not settings.model:
        return None
    return await asyncio.to_thread(Embedder.load, settings.model, settings.embedding_device, settings.embedding_dtype,
                                   settings.served_name, settings.max_batch_tokens)


async def _start_guard(config: Config) -> tuple[AsyncEngine | None, GuardModel | None]:
    """[safety] guard_model on an engine of its own in this process (its own thread), or none."""
    if not config.safety.guard_model:
        return None, None
    guard_config = guard_engine_config(config)
    engine = AsyncEngine(functools.partial(LLMEngine.from_config, guard_config))
    info = await engine.start()
    if engine.tokenizer is None or not engine.tokenizer.hf.chat_template:
        await engine.stop()
        raise ValueError(f"safety.guard_model {config.safety.guard_model!r} has no chat template: a guard model renders "
                         "its own instructions with it")
    guard = GuardModel(engine, engine.tokenizer, info.max_model_len, config.safety.guard_timeout_seconds)
    log.info("guard model %s: %s verdicts, context %d, timeout %g s", info.name, guard.family.name, info.max_model_len,
             config.safety.guard_timeout_seconds)
    return engine, guard


def guard_engine_config(config: Config) -> Config:
    """The guard's engine: the guard model on the server's device, one rank, a small KV pool of its own."""
    block_size = config.cache.block_size
    context = config.safety.guard_max_model_len
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=config.safety.guard_model, max_model_len=context,
                                  tensor_parallel_size=1, dtype="auto", tool_parser="auto"),
        cache=dataclasses.replace(config.cache, num_blocks=GUARD_SEQUENCES * -(-context // block_size),
                                  host_kv_cache_gb=0.0, kv_cache_dtype="auto"),
        scheduler=dataclasses.replace(config.scheduler, max_num_seqs=GUARD_SEQUENCES),
    )


async def _serve_with(config: Config, store: Store, ledger: Ledger, listening: Listening, stop: asyncio.Event | None,
                      guard: GuardModel | None, embedder: Embedder | None,
                      build_engine: Callable[[Config], LLMEngine],
                      reload_config: Callable[[], Config] | None = None) -> None:
    # Loaded on the engine thread, where all of the server's torch work runs (see async_engine.py),
    # or in a process of its own (engine_process.py) that the engine thread drives.
    startup = listening.startup
    entries = config.fleet()
    own_process, why = engine_process_wanted(config.server.engine_process, entries[0].model.device)
    log.info("engine: %s (%s)", "in a process of its own" if own_process else "on a thread of the server", why)

    def make_engine(model_config: Config) -> AsyncEngine:
        """An engine (not started) for one chat model of the fleet."""
        build = functools.partial(build_engine, model_config)
        if engine_process_wanted(config.server.engine_process, model_config.model.device)[0]:
            build = functools.partial(EngineProcess, build, model_config.scheduler, model_config.cache)
        return AsyncEngine(build)

    # The first model loads now (its engine sizes its KV pool before any other's); the others on demand.
    async_engine = make_engine(fleet_config(config, entries[0]))
    model = await async_engine.start()
    tokenizer = async_engine.tokenizer
    if tokenizer is None:
        await async_engine.stop()
        raise ValueError("chatd serve needs a model with a tokenizer")
    startup.mark("loaded", f"steps {async_engine.compile_state()}")
    startup.phase = "warming up"
    names = entries[0].names or (model.name,)
    if embedder is not None and embedder.name in [*names, *(n for entry in entries[1:] for n in entry.names)]:
        await async_engine.stop()
        raise ValueError(f"the embedding model and the chat model are both served as {embedder.name!r}; give one "
                         "another name ([embeddings] served_name or [server] model_name)")
    state = ServerState(
        engine=async_engine,
        tokenizer=tokenizer,
        model=model,
        model_name=names[0],
        model_aliases=names[1:],
        store=store,
        local_tenant=await store.local_tenant(config.auth.local_tier),
        ledger=ledger,
        config=config,
        guard=guard,
        embedder=embedder,
        make_engine=make_engine,
    )
    await state.fleet.primary.render_shared_prefixes()
    app = create_app(state, config.server.max_body_bytes)
    # handler_cancellation: a client that goes away cancels its handler, which aborts its request.
    # shutdown_timeout: after the grace period and the engine's stop, handlers only write their
    # last events; aiohttp's default (60 s) would silently stretch the grace period.
    # keepalive_timeout: aiohttp closes a connection that has not sent a whole request head this
    # long after opening (or after its last response): the header timeout.
    # lingering_time: after answering early (401, 404) aiohttp reads the rest of an unread body so
    # the client can read the answer; no longer than a body may take to arrive at all.
    # auto_decompress off: wire.read_json decodes bodies itself, with bounded output and a 400 for
    # data that does not decode.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_WRITE_SECONDS,
                           keepalive_timeout=config.server.header_timeout_seconds,
                           lingering_time=min(10.0, config.server.body_timeout_seconds), auto_decompress=False)
    logging.getLogger("aiohttp.server").addFilter(_malformed_requests_at_debug)
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if reload_config is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: state.spawn(_reload(state, reload_config), "reload"))
    purge = asyncio.create_task(_purge_forever(store, config.store), name="purge")
    beat = asyncio.create_task(_beat_forever(store, state.replica, config.store.replica_timeout_seconds / 5),
                               name="heartbeat")
    watch = None
    try:
        await _warm_up(async_engine, state)
        site = await listening.hand_over(runner)
        state.fleet.start()  # [[models]] preloaded, idle ones unloaded past their keep_alive
        await state.canaries.start()  # ramped canaries at their stored step
        state.ready = True
        startup.phase = "serving"
        startup.mark("ready")
        watch = asyncio.create_task(_watch_start(async_engine, startup), name="start timeline")
        log.info("auth: %s", _auth_mode(config))
        if state.model_aliases:
            log.info("model %s is also served as %s", state.model_name, ", ".join(state.model_aliases))
        for other in state.fleet.models[1:]:
            log.info("model %s (%s): loads on %s, keep_alive %g s", other.name, other.entry.model.path or "the default "
                     "model", "start" if other.entry.preload else "its first request", other.keep_alive)
        log.info(
            "ready: model %s, dtype %s, device %s, attention %s, %d KV blocks, steps %s, http://%s:%d",
            state.model_name, model.dtype, model.device, model.attention_backend, model.num_kv_blocks,
            async_engine.compile_state(), config.server.host, listening.sock.getsockname()[1],
        )
        await stop.wait()
        grace = config.server.shutdown_grace_seconds
        log.info("stopping: new requests get 503; %.0f s for in-flight requests", grace)
        state.ready = False
        startup.phase = "draining"
        state.draining_until = loop.time() + grace
        await _drain(state, grace)
        await site.stop()
    finally:
        purge.cancel()
        beat.cancel()
        if watch is not None:
            watch.cancel()
        state.stopping = True
        await state.canaries.stop()
        # Every model's engine (the first one's too, loaded again or not; stopping twice is a no-op):
        # what is left is aborted, streams end with an error event, replies save as partial.
        await state.fleet.stop()
        await async_engine.stop()
        await runner.cleanup()  # handlers finish their last writes, or are cancelled after SHUTDOWN_WRITE_SECONDS
        await state.wait_background(timeout=10.0)
        await state.limits.close()  # the last give-backs to the shared buckets, and their connections
        await asyncio.to_thread(state.tracing.close)  # the spans still queued, for a few seconds at most
        state.tokenizing.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")


async def _watch_start(engine: AsyncEngine, startup: Startup) -> None:
    """Mark the first token a client's request gets and the compiled steps coming into use; log the
    whole start timeline once nothing compiles any more (at once when nothing was compiling)."""
    warm_up_tokens = engine.stats().num_generation_tokens
    while not (startup.timeline_logged and "first token" in startup.marks):
        if "first token" not in startup.marks and engine.stats().num_generation_tokens > warm_up_tokens:
            startup.mark("first token")
        compiled = engine.compile_state()
        if compiled != "compiling" and not startup.timeline_logged:
            if compiled == "compiled":
                startup.mark("compiled")
            startup.log_timeline()
        await asyncio.sleep(0.05)


async def _reload(state: ServerState, reload_config: Callable[[], Config]) -> None:
    """SIGHUP: read the config again and apply its [aliases] weights and keep_alive (a canary moved
    from 5% to 25% without a restart); a config that does not load, or whose aliases name models
    this process does not serve, changes nothing and is logged."""
    try:
        config = await asyncio.to_thread(reload_config)
        state.fleet.reload(config)
        await state.canaries.adopt()  # a ramped canary keeps its measured weight, not the file's
    except ValueError as exc:
        log.error("SIGHUP: the config was not reloaded: %s", exc)


async def _warm_up(engine: AsyncEngine, state: ServerState) -> None:
    """One prefill and a few decode steps, and the chat template compiled, so the first user does not pay for lazy initialisation."""
    async for _ in engine.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)):
        pass
    with contextlib.suppress(ValueError):  # a model without a chat template serves completions only
        await state.off_loop(state.tokenizer.encode_chat, [{"role": "user", "content": "hi"}])
    if state.embedder is not None:
        await asyncio.wrap_future(state.embedder.submit(state.embedder.encode(["hi"])))


async def _purge_forever(store: Store, config: StoreConfig) -> None:
    """Purge conversations deleted more than `retention_days` ago, now and every `purge_interval_seconds`."""
    while True:
        try:
            purged = await store.purge_deleted(time.time() - config.retention_days * 86400)
            await store.purge_keys(time.time() - KEY_LIFETIME_S)
            if purged:
                log.info("purged %d deleted conversations older than %g days", purged, config.retention_days)
        except Exception:
            log.exception("purging deleted conversations failed; trying again later")
        await asyncio.sleep(config.purge_interval_seconds)


async def _beat_forever(store: Store, replica: str, interval: float) -> None:
    """Tell the replicas sharing the store that this one is alive, every `interval` seconds (server/idempotency.py)."""
    while True:
        try:
            await store.beat(replica)
        except Exception as exc:  # the store is down: the ledger and /health say so
            log.debug("heartbeat not written: %r", exc)
        await asyncio.sleep(interval)


async def _drain(state: ServerState, grace: float) -> None:
    """Wait up to `grace` seconds for the requests in flight (and their last writes) to finish."""
    deadline = asyncio.get_running_loop().time() + grace
    while asyncio.get_running_loop().time() < deadline:
        engines = [model.engine.stats() for model in state.fleet.loaded()]
        # Probes and /metrics are counted too; a drain waits for them for a moment, which is fine.
        if all(s.num_running == 0 and s.num_waiting == 0 for s in engines) and state.num_in_flight == 0:
            return
        await asyncio.sleep(0.05)


def _auth_mode(config: Config) -> str:
    """Who may call, for the log; the shared key itself is never logged."""
    if config.auth.enabled:
        return "API keys from the store (chatd keys create)"
    if config.auth.api_key:
        return "one shared API key is set; every caller is the local user"
    return "off; every caller is the local user"


def _malformed_requests_at_debug(record: logging.LogRecord) -> bool:
    """aiohttp logs each request its parser rejects at ERROR with a traceback, so any client could
    flood the log; they are the client's mistakes, answered with a 400: one line, at DEBUG."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, HttpProcessingError):
        return True
    record.levelno, record.levelname, record.exc_info = logging.DEBUG, "DEBUG", None
    record.msg, record.args = "malformed request refused: %s", (str(exc).replace("\n", " "),)
    return logging.getLogger("aiohttp.server").isEnabledFor(logging.DEBUG)

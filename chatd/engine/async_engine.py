"""AsyncEngine: the engine steps in its own thread; asyncio callers stream its outputs.

The only asyncio-aware engine module. Callers never touch LLMEngine state: adds and aborts
are queued as commands the engine thread applies between steps. Each request has a stream
that merges deltas as they arrive, so a consumer that reads slowly gets bigger deltas and
never holds the batch back. Closing a stream early (`aclosing`, `abort()`, or dropping it) or
being cancelled while reading it aborts the request; its blocks are free once the engine
thread has applied the abort, before its next step. Request ids are made here, never taken
from a client.

The HTTP layer sees an engine only as an `EngineClient` (generate, abort, stats, health, the
tokenizer) and the `ModelInfo` that `start` returns, never the LLMEngine the thread owns.

Every torch operation of a server happens on the engine thread, loading included: `AsyncEngine`
takes a function that builds the engine and calls it there. On CPU this matters for speed: each
thread that runs torch ops gets its own OpenMP team, and once a process has more OpenMP threads
than cores, libgomp stops spinning between parallel regions and sleeps instead, so every small op
pays a wake-up. With the model loaded on another thread, engine steps ran ~1.9x slower on the
2-core machine (docs/design.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from chatd.engine.core.engine_stats import EngineStats
from chatd.engine.engine import LLMEngine
from chatd.engine.gc_freeze import freeze_startup_objects
from chatd.engine.frame_room import with_frame_room
from chatd.engine.model_info import ModelInfo
from chatd.engine.params import (
    CacheScope,
    CompletionOutput,
    FinishReason,
    Placement,
    RequestOutput,
    SamplingParams,
)
from chatd.engine.structured.spec import StructuredOutput
from chatd.engine.tokenizer import Tokenizer

log = logging.getLogger("chatd.engine")


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests (stopped, or a tensor-parallel rank failed): the reason."""


class RequestHandle(Protocol):
    """A running request as a caller holds it: its outputs as an async iterator, and a way to stop it."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


class EngineClient(Protocol):
    """What a server needs of an engine (vLLM's `EngineClient`): AsyncEngine, or a scripted fake in tests."""

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 placement: Placement = Placement(), cache: CacheScope = CacheScope()) -> RequestHandle:
        """Queue a request (as AsyncEngine.generate); iterate the handle for its merged deltas."""

    def abort(self, request_id: str) -> None:
        """End another reader's request; its reader gets a finished output."""

    def check_structured(self, spec: StructuredOutput, tenant: str | None = None) -> None:
        """Compile a structured-output spec for a tenant's request ahead of `generate` (from a worker
        thread: it may be slow); ParamError naming spec.param if it cannot be compiled."""

    def stats(self) -> EngineStats:
        """The engine's counters now."""

    def health(self) -> str | None:
        """None while the engine serves; otherwise why it cannot."""

    def stage_times(self) -> dict[str, float]:
        """Seconds of host work per step stage since the start (core/stage_times.py), `steps`, and
        `engine_thread_cpu`; empty where there is no engine thread."""

    def compile_state(self) -> str:
        """The compiled steps: "off", "compiling" (eager steps serve meanwhile), "compiled" or "failed"."""


class RequestStream:
    """One request's outputs, as an async iterator; what the engine sent since the last read arrives merged.

    The engine thread's outputs are put here on the event loop. Iterating to the end (the
    finished output) leaves nothing behind; `aclose()` (or `contextlib.aclosing`), `abort()`, or
    a cancellation while waiting abort the request, so its blocks are freed at the next step.

    A reader that can handle an output at once (a stream writing to a client that keeps up) may
    set a `sink` (`deliver_to`): each output is offered to it as the step's outputs are handed
    out, with no task to wake, and reaches the iterator only when the sink leaves it (the client
    fell behind, an error), merged with whatever follows until the reader takes it.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_token_ids: list[int], num_choices: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids, self.num_choices = prompt_token_ids, num_choices
        self._engine = engine
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()
        self._finished = False  # the finished output was handed to the reader (or the sink), or the request aborted
        self._sink: Callable[[RequestOutput], RequestOutput | None] | None = None

    def deliver_to(self, sink: Callable[[RequestOutput], RequestOutput | None] | None) -> None:
        """Offer each output to `sink` first (on the event loop): it returns None when it took it,
        or the output the iterator is to get (this one, or merged with outputs the sink held back).
        Outputs waiting for the reader are never passed by a later one."""
        self._sink = sink

    def put(self, out: RequestOutput) -> None:
        if self._pending is None and self._sink is not None:
            finished = out.finished
            out = self._sink(out)
            if out is None:
                if finished:  # the reader's iteration ends: nothing is left for it
                    self._finished = True
                    self._ready.set()
                return
        if self._pending is None:
            self._pending = out
        else:
            self._pending.merge(out)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished and self._pending is None:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            self.abort()
            raise
        self._ready.clear()
        out, self._pending = self._pending, None
        if out is None:  # the sink took the finished output
            raise StopAsyncIteration
        if out.finished:
            self._finished = True
        return out

    def abort(self) -> None:
        """Stop the request unless it has finished (no-op then, and when called again)."""
        if not self._finished:
            self._finished = True
            self._engine._forget(self.request_id)

    async def aclose(self) -> None:
        """Leaving before the end aborts the request."""
        self.abort()

    def __del__(self) -> None:
        # A stream dropped unread (a reader that broke out of its loop) still frees its request.
        if not self._finished:
            self._engine._forget(self.request_id)


class AsyncEngine:
    """Runs an LLMEngine in a background thread and streams its outputs to coroutines."""

    def __init__(self, build: Callable[[], LLMEngine]) -> None:
        self._build = build
        self.engine: LLMEngine | None = None  # set by start()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # Weak: a stream its reader dropped is collected, and its __del__ aborts the request.
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = weakref.WeakValueDictionary()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._stats: EngineStats | None = None
        self.error: BaseException | None = None  # set if the engine thread died
        self._dispatch_seconds = 0.0  # on the event loop: handing each step's outputs to their streams
        self._thread_cpu_seconds = 0.0  # the engine thread's CPU time while it stepped

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> str | None:
        """None while the engine thread is stepping; otherwise why not."""
        if self.error is not None:
            return f"engine stopped: {self.error!r}"
        if not self.is_running:
            return "engine stopped"
        return self.engine.health() if self.engine is not None else None

    def compile_state(self) -> str:
        """Whether the engine's steps are compiled yet (LLMEngine.compile_state); "off" before start."""
        return self.engine.compile_state if self.engine is not None else "off"

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (safe to use from other threads); set by start()."""
        return self.engine.tokenizer if self.engine is not None else None

    async def start(self) -> ModelInfo:
        """Start the engine thread (bound to the running event loop), build the engine in it, and say what it serves.

        Raises whatever building raised; the thread has then ended.
        """
        self._loop = asyncio.get_running_loop()
        built = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="chatd-engine", daemon=True)
        self._thread.start()
        try:
            await built
        except Exception:
            await asyncio.to_thread(self._thread.join)  # it ends right after reporting the error
            raise
        assert self.engine is not None
        return self.engine.model_info()

    async def stop(self) -> None:
        """Abort everything in flight and stop the engine thread; every open stream ends with an error."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # The thread has answered every request it knew of; none can be left waiting forever.
        for request_id, stream in list(self._streams.items()):
            stream.put(_error_output(request_id, [], "engine stopped"))
        self._streams.clear()

    def stats(self) -> EngineStats:
        """The counters as of the engine thread's last step (or applied command), and the open streams now."""
        assert self._stats is not None, "start() first"
        return dataclasses.replace(self._stats, num_request_streams=len(self._streams))

    def stage_times(self) -> dict[str, float]:
        """Seconds of host work per step stage since the start (core/stage_times.py), `steps`, and
        `engine_thread_cpu` (CPU seconds of the engine thread)."""
        if self.engine is None:
            return {}
        times = self.engine.stage_times()  # floats in dicts: read safely while the engine thread adds to them
        times["dispatch"] += self._dispatch_seconds
        times["engine_thread_cpu"] = self._thread_cpu_seconds
        return times

    def check_structured(self, spec: StructuredOutput, tenant: str | None = None) -> None:
        """Compile a structured-output spec for a tenant's request ahead of `generate`; call it
        from a worker thread (a big schema may take a while). ParamError naming spec.param if it
        cannot be compiled."""
        if self.engine is None:
            raise RuntimeError("the engine is not running")
        self.engine.check_structured(spec, tenant)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 placement: Placement = Placement(), cache: CacheScope = CacheScope()) -> RequestStream:
        """Validate and queue a request now (ValueError names the field); iterate the result for its deltas.
        `placement`: its class and fair share; `cache`: which prefix-cache blocks it may share.

        The request id is made here, never taken from a client: a client that could name it
        could read or abort another's request. Its stream is removed when the request finishes
        or is aborted; a caller that stops early must `abort()` it (or use `aclosing`).
        """
        problem = self.health() or ("engine stopping" if self._stopping else None)
        if problem is not None:
            raise EngineUnavailable(f"the engine is not running: {problem}")
        request_id = uuid.uuid4().hex
        request = self.engine.prepare_request(request_id, prompt, params, placement, cache)
        stream = RequestStream(self, request_id, request.prompt_token_ids, request.params.n)
        self._streams[request_id] = stream
        self._send(("add", request))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort someone else's request (no-op if it ended): its reader gets a finished output now,
        every choice ending with `abort`, and its blocks are freed before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            outputs = [CompletionOutput(i, finish_reason=FinishReason.ABORT) for i in range(stream.num_choices)]
            stream.put(RequestOutput(request_id, stream.prompt_token_ids, outputs, finished=True))
        self._send(("abort", request_id))

    def _forget(self, request_id: str) -> None:
        """A reader aborts its own request: nobody is left to tell."""
        self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    async def sync(self) -> None:
        """Wait until the engine thread has applied every command sent before this call."""
        done = asyncio.get_running_loop().create_future()
        self._send(("sync", done))
        await done

    # -- the engine thread --------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self, built: asyncio.Future) -> None:
        try:
            self.engine = self._build()
            freeze_startup_objects()
            self._stats = self.engine.stats()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(_settle, built, exc)
            return
        self._loop.call_soon_threadsafe(_settle, built, None)
        try:
            with_frame_room(self._step_until_stopped)  # no step maps memory for its frames (frame_room.py)
        except BaseException as exc:  # a bug outside a step's own error handling: nothing can go on
            log.exception("engine thread died")
            self.error = exc
        finally:
            self._shutdown()
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - stopping anyway; say what went wrong
                log.exception("closing the engine failed")

    def _step_until_stopped(self) -> None:
        cpu_start = time.thread_time() - self._thread_cpu_seconds
        while not self._stopping:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            outputs = self.engine.step()
            self._stats = self.engine.stats()
            if outputs:  # one wake-up of the event loop a step, for all of its outputs
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
            self._thread_cpu_seconds = time.thread_time() - cpu_start

    def _apply_commands(self) -> None:
        synced, applied = [], False
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            applied = True
            if kind == "add":
                try:
                    self.engine.add_prepared(arg)
                except ValueError as exc:
                    self._loop.call_soon_threadsafe(self._dispatch, [_error_output(arg.request_id, arg.prompt_token_ids, str(exc))])
            elif kind == "abort":
                self.engine.abort(arg)
            elif kind == "sync":
                synced.append(arg)
        if not applied:
            return  # the counters are as the last step left them (taking them costs ~30 us a token, cold)
        self._stats = self.engine.stats()
        for future in synced:
            self._loop.call_soon_threadsafe(_settle, future, None)

    def _shutdown(self) -> None:
        """Abort what is left and tell every open stream why it ends."""
        message = f"engine stopped: {self.error!r}" if self.error else "engine stopped"
        self._apply_commands()  # requests queued since the last step are answered too
        outputs = []
        for request_id in list(self.engine.requests):
            request = self.engine.requests[request_id]
            self.engine.abort(request_id)
            outputs.append(_error_output(request_id, request.prompt_token_ids, message, len(request.seqs)))
        self._stats = self.engine.stats()
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        started = time.perf_counter()
        for out in outputs:
            # The last output leaves the table; its reader still holds the stream.
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        self._dispatch_seconds += time.perf_counter() - started


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _error_output(request_id: str, prompt_token_ids: list[int], message: str, n: int = 1) -> RequestOutput:
    outputs = [CompletionOutput(i, finish_reason=FinishReason.ERROR) for i in range(n)]
    return RequestOutput(request_id, prompt_token_ids, outputs, finished=True, error=message)

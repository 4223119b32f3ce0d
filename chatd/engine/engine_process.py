"""The engine in a process of its own (`chatd serve --engine-process`, as vLLM's engine core).

In one process the engine thread and the event loop share one GIL: at 256 streams the engine's
Python (~5 ms a step) and the loop's (~8 ms: every stream's event and socket send) cannot run at
once, so a 10 ms device step took ~14 (docs/design.md, issue 37). Here the engine runs in a child
process and `EngineProcess` stands in for it on AsyncEngine's thread, with the same methods the
thread calls (`add_prepared`, `abort`, `step`, `stats`, ...): AsyncEngine, the HTTP layer and
every request path are unchanged.

Requests are validated and tokenized in this process (a copy of the engine with no runner, built
from what the child reports once it has loaded), so a bad request is refused at once, naming the
field, as in one process; the child then adds it by its fields. Each child step sends back its
outputs, counters and stage times in one message. A child that dies ends the engine thread with
the reason, so every open stream gets an error and `/health` says why.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from chatd.config import CacheConfig, SchedulerConfig
from chatd.engine.engine import LLMEngine
from chatd.engine.gc_freeze import freeze_startup_objects
from chatd.engine.model_info import ModelInfo
from chatd.engine.params import CompletionOutput, FinishReason, ParamError, RequestOutput
from chatd.engine.structured.spec import StructuredOutput
from chatd.engine.request import Request

log = logging.getLogger("chatd.engine")

# "auto" runs the engine in its own process from this many usable CPUs: the loop, the engine and
# the tokenizing threads each need one. On 2 cores, with a client on the same machine, the three
# processes lose to one (docs/design.md, issue 53); from 4 cores each has its own.
ENGINE_PROCESS_CORES = 4


def engine_process_wanted(setting: str, device: str) -> tuple[bool, str]:
    """[server] engine_process ("on", "off", "auto") for a model on `device`: whether the engine
    runs in its own process, and why, for the log. "auto" does on a GPU where this process may use
    ENGINE_PROCESS_CORES CPUs or more; on a CPU the model's own threads want the cores."""
    if setting != "auto":
        return setting == "on", f"engine_process = {setting}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpu = device.startswith("cuda") or device == "auto" and _cuda_available()
    wanted = gpu and cores >= ENGINE_PROCESS_CORES
    return wanted, f"auto: {'a GPU' if gpu else 'no GPU'}, {cores} CPUs"


def _cuda_available() -> bool:
    # Only torch.cuda here: the model's modules are the engine thread's to import (torch work on the
    # loop's thread once left the engine thread's CPU steps slower: docs/design.md, issue 53).
    import torch

    return torch.cuda.is_available()


# How long a step waits for the child's next message before the engine thread looks at its own
# commands again (a new request waits at most this long to be sent on).
POLL_SECONDS = 0.002


class EngineProcess:
    """A child process running `build()`'s LLMEngine, driven as AsyncEngine drives an LLMEngine.

    `build` runs in the child: it must pickle (a module-level function, or a partial of one)."""

    def __init__(self, build: Callable[[], LLMEngine], scheduler: SchedulerConfig, cache: CacheConfig) -> None:
        context = multiprocessing.get_context("spawn")  # no CUDA state or threads inherited
        self._conn, child_conn = context.Pipe()
        self._compiled = context.Value("b", 0)  # the child's compile job, once it ends: 1 compiled, 2 failed
        self._process = context.Process(target=_run_engine, args=(build, child_conn, self._compiled),
                                        name="chatd-engine-core")
        self._process.start()
        child_conn.close()
        message = self._recv_or_exit()
        if message[0] == "failed":
            self._process.join()
            raise RuntimeError(f"the engine process could not start: {message[1]}")
        _, facts = message
        self.info: ModelInfo = facts["info"]
        self._stats, self._times = facts["stats"], facts["times"]
        # Validates and tokenizes requests here; it never steps.
        self.front = LLMEngine(None, scheduler, cache, num_blocks=self.info.num_kv_blocks,
                               max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size,
                               tokenizer=facts["tokenizer"], eos_token_ids=facts["eos_token_ids"],
                               model_path=self.info.path, is_demo=self.info.is_demo,
                               sampling_defaults=self.info.sampling_defaults)
        self.requests: dict[str, Request] = {}  # sent and not finished
        self._acks = 0  # aborts the child has not answered yet (with its counters after them)
        self.async_scheduling = facts["async_scheduling"]
        self._compile_state = facts["compile_state"]

    # -- what AsyncEngine's loop side calls ---------------------------------------------------

    @property
    def tokenizer(self):
        return self.front.tokenizer

    def prepare_request(self, *args, **kwargs) -> Request:
        return self.front.prepare_request(*args, **kwargs)

    def check_structured(self, spec: StructuredOutput, tenant: str | None = None) -> None:
        self.front.check_structured(spec, tenant)

    def model_info(self) -> ModelInfo:
        return self.info

    def health(self) -> str | None:
        if not self._process.is_alive():
            return f"the engine process exited (code {self._process.exitcode})"
        return None

    def stats(self):
        return self._stats

    @property
    def compile_state(self) -> str:
        """LLMEngine.compile_state of the child's engine, as of now (not of its last step)."""
        if self._compile_state == "compiling" and self._compiled.value:
            return "compiled" if self._compiled.value == 1 else "failed"
        return self._compile_state

    def stage_times(self) -> dict[str, float]:
        return dict(self._times)

    # -- what AsyncEngine's thread calls ------------------------------------------------------

    def add_prepared(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ParamError("request_id", f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self._send(("add", request.request_id, request.prompt_token_ids, request.params, request.placement,
                    request.cache))

    def abort(self, request_id: str) -> bool:
        if self.requests.pop(request_id, None) is None:
            return False
        if self._send(("abort", request_id)):
            self._acks += 1
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests are running, or the child has yet to answer an abort (its counters come with the answer)."""
        return bool(self.requests) or self._acks > 0

    def step(self) -> list[RequestOutput]:
        """What the child sent since the last call (waiting up to POLL_SECONDS for something)."""
        outputs: list[RequestOutput] = []
        if not self._conn.poll(POLL_SECONDS):
            self._check_alive()
            return outputs
        while self._conn.poll():
            message = self._recv_or_exit()
            if message[0] == "step":
                _, step_outputs, self._stats, self._times = message
                outputs += step_outputs
            elif message[0] == "aborted":
                _, self._stats, self._times = message
                self._acks -= 1
            elif message[0] == "refused":  # the child's own checks refused an add (this side's passed)
                _, request_id, error, param = message
                request = self.requests.get(request_id)
                n = len(request.seqs) if request is not None else 1
                outputs.append(RequestOutput(request_id, [], [CompletionOutput(i, finish_reason=FinishReason.ERROR)
                                                              for i in range(n)], finished=True, error=error,
                                             error_param=param))
        for out in outputs:
            request = self.requests.pop(out.request_id, None) if out.finished else self.requests.get(out.request_id)
            if request is not None:
                out.prompt_token_ids = request.prompt_token_ids
        return outputs

    def close(self) -> None:
        """Stop the child (its engine closes what it started) and wait for it."""
        if self._process.is_alive():
            self._send(("stop",))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self.front.close()

    def _send(self, message: tuple) -> bool:
        """Send a command; False if the child is gone (the next `step` says so, and AsyncEngine
        then ends every request it holds with the reason)."""
        try:
            self._conn.send(message)
        except OSError:
            return False
        return True

    def _recv_or_exit(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join(timeout=5)
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode})") from None

    def _check_alive(self) -> None:
        if not self._process.is_alive():
            raise RuntimeError(f"the engine process exited (code {self._process.exitcode})")


def _run_engine(build: Callable[[], LLMEngine], conn: Connection, compiled) -> None:
    """The child: build the engine, report, then apply commands and step until told to stop. It
    leaves without the interpreter's teardown (`os._exit`): that only collects what the process
    is about to drop anyway, and triton's bindings report each of their objects as leaked there."""
    try:
        _serve_parent(build, conn, compiled)
    finally:
        logging.shutdown()
        os._exit(0)


def _serve_parent(build: Callable[[], LLMEngine], conn: Connection, compiled) -> None:
    try:
        engine = build()
        freeze_startup_objects()
    except BaseException as exc:  # noqa: BLE001 - said to the parent, which raises it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {
        "info": engine.model_info(), "tokenizer": engine.tokenizer, "eos_token_ids": engine.scheduler.eos_token_ids,
        "stats": engine.stats(), "times": engine.stage_times(), "async_scheduling": engine.async_scheduling,
        "compile_state": engine.compile_state,
    }))
    if engine.compile_job is not None:  # the parent reads its end from shared memory, idle or not
        engine.compile_job.on_done(lambda: setattr(compiled, "value", 1 if engine.compile_state == "compiled" else 2))
    # Commands are read on a thread of their own, so the parent's sends never wait for this loop:
    # were both ends to send at once into full pipe buffers (a burst of 512 requests against a
    # step's outputs), each would wait for the other forever.
    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(conn, commands), name="chatd-engine-commands", daemon=True).start()
    try:
        while True:
            # Idle: wait for a command. Busy: take whatever has come, then step.
            while not engine.has_unfinished_requests() or not commands.empty():
                if _apply(engine, conn, commands.get()):
                    return
            outputs = engine.step()
            for out in outputs:  # the parent has each request's prompt: not sent again every step
                out.prompt_token_ids = []
            conn.send(("step", outputs, engine.stats(), engine.stage_times()))
    except OSError:  # the parent is gone
        return
    finally:
        engine.close()


def _read_commands(conn: Connection, commands: queue.SimpleQueue) -> None:
    try:
        while True:
            commands.put(conn.recv())
    except (EOFError, OSError):  # the parent is gone: stop
        commands.put(("stop",))


def _apply(engine: LLMEngine, conn: Connection, message: tuple) -> bool:
    """One command from the parent; True for stop."""
    kind = message[0]
    if kind == "add":
        request_id = message[1]
        try:
            engine.add_request(*message[1:])
        except ParamError as exc:
            conn.send(("refused", request_id, str(exc), exc.param))
        except ValueError as exc:
            conn.send(("refused", request_id, str(exc), None))
    elif kind == "abort":
        engine.abort(message[1])
        conn.send(("aborted", engine.stats(), engine.stage_times()))
    elif kind == "stop":
        return True
    return False


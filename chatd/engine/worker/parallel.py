"""Tensor-parallel ranks as processes: rank 0 (the server) starts ranks 1..N-1, feeds and supervises them.

Every rank holds its part of the model (models/tensor_parallel.py) and its own KV pool, and runs
the same forward on the same inputs; the collectives inside the forward (NCCL on CUDA, gloo on
CPU) are the only way the ranks' numbers meet. Only rank 0 schedules and samples. A worker's own
side is parallel_worker.py. Around that:

- *Start*: workers are spawned (never forked: a forked CUDA or OpenMP runtime is unusable) with
  the config and the model's path. Each says hello before it joins the process group, so rank 0
  only joins once every worker is alive, then loads its own shard while they load theirs.
- *Commands*: rank 0 sends each worker the same messages through a pipe, in order: a step's
  forward inputs (plain lists: token ids, positions' starts, block tables, which rows sample),
  the step's KV copies, and set-up calls (allocate the KV pool, profile memory, capture CUDA
  graphs) that answer back. An idle worker waits on its pipe, never inside a collective, so an
  idle server has no collective that could time out.
- *Supervision*: each worker sends a heartbeat twice a second from a thread of its own. A rank-0
  thread watches the workers' processes and heartbeats: a worker that exits, or stays silent for
  `model.worker_timeout` seconds, fails the whole group. Every worker is then killed, which
  breaks any collective rank 0 is waiting in (gloo) or is aborted (NCCL); the step fails its
  requests with the reason, later steps fail at once, and `health()` says why.
- *Stop*: `close()` asks the workers to leave, then kills what is left. A worker whose parent is
  gone (rank 0 killed) notices within a heartbeat and exits, so no rank outlives the server.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from chatd.config import Config
from chatd.engine.core.host_tier import KVCopy
from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.worker.parallel_worker import HEARTBEAT_SECONDS, WorkerSpec, leave_group, worker_main
from chatd.engine.worker.forward_inputs import ForwardInputs, StepHandle, forward_inputs
from chatd.engine.worker.runner import ModelRunner

log = logging.getLogger("chatd.engine")

# A new worker imports torch before its first heartbeat: until then only its exit counts, or this.
STARTUP_SECONDS = 120


class ParallelError(RuntimeError):
    """The tensor-parallel group failed (a worker died, hung or raised); it cannot serve again."""


def check_gpus(device: torch.device, size: int, visible: int) -> None:
    """ValueError naming the setting when `size` ranks need more GPUs than are visible."""
    first = device.index or 0
    if device.type == "cuda" and first + size > visible:
        raise ValueError(f"model.tensor_parallel_size {size} needs GPUs cuda:{first}..cuda:{first + size - 1}, "
                         f"but {visible} {'is' if visible == 1 else 'are'} visible")


class Workers:
    """Ranks 1..N-1 as processes: started, sent commands, watched, stopped."""

    def __init__(self, config: Config, model_path: str, device: torch.device, timeout: float | None = None) -> None:
        size = config.model.tensor_parallel_size
        self.size = size
        self.timeout = timeout if timeout is not None else config.model.worker_timeout
        self.failure: str | None = None
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._dir = tempfile.mkdtemp(prefix="chatd-tp-")
        self.rendezvous = os.path.join(self._dir, "rendezvous")
        context = multiprocessing.get_context("spawn")
        self.processes: list[multiprocessing.Process] = []
        self.commands: list[Connection] = []
        self._events: list[Connection] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            events_ours, events_theirs = context.Pipe(duplex=False)
            spec = WorkerSpec(rank, size, config, model_path, self.rendezvous, os.getpid(), logging.getLogger().level)
            process = context.Process(target=worker_main, args=(spec, theirs, events_theirs),
                                      name=f"chatd-tp-rank{rank}", daemon=True)
            process.start()
            theirs.close()
            events_theirs.close()
            self.processes.append(process)
            self.commands.append(ours)
            self._events.append(events_ours)
        self._started = time.monotonic()
        self._last_seen: list[float | None] = [None] * len(self.processes)  # None: no heartbeat yet
        self._errors: dict[int, str] = {}
        self._supervisor = threading.Thread(target=self._supervise, name="chatd-tp-supervisor", daemon=True)
        self._supervisor.start()

    # -- commands -----------------------------------------------------------------------------

    def send(self, *message) -> None:
        """The same message to every worker, in order after the ones before it."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.commands:
            try:
                conn.send_bytes(payload)
            except OSError:  # a worker that is gone: the supervisor says which and why
                self.raise_failure(wait=True)
                raise

    def collect(self, expect: str = "ok") -> list:
        """Each worker's answer to the last command that answers, waiting as long as they work; a
        worker that dies or hangs meanwhile raises ParallelError."""
        answers = []
        for rank, conn in enumerate(self.commands, start=1):
            while not conn.poll(HEARTBEAT_SECONDS):
                self.raise_failure()
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                self.raise_failure(wait=True)
                raise ParallelError(f"tensor-parallel worker rank {rank} closed its pipe") from None
            if kind != expect:
                raise ParallelError(f"tensor-parallel worker rank {rank} answered {kind!r}, expected {expect!r}")
            answers.append(value)
        return answers

    def call(self, function: Callable, *args):
        """Send every worker `function(runner, *args)` (a module-level function, sent by its name; rank 0
        makes its own call meanwhile); `collect()` their answers."""
        self.send("call", function, args)

    # -- failure ------------------------------------------------------------------------------

    def fail(self, reason: str) -> str:
        """Mark the group failed (the first reason stays) and kill every worker; returns the reason."""
        with self._lock:
            if self._closing:  # workers ending at close() are no failure
                return self.failure or reason
            if self.failure is None:
                self.failure = reason
                log.error("tensor parallelism failed: %s; stopping every worker", reason)
                self._kill_all()
                self._failed.set()
                if dist.is_initialized() and dist.get_backend() == "nccl":
                    try:  # NCCL waits forever on a dead peer unless its communicators are aborted
                        dist.distributed_c10d._abort_process_group()
                    except Exception as exc:  # noqa: BLE001 - best effort; the workers are dead anyway
                        log.warning("could not abort the NCCL process group: %s", exc)
        return self.failure

    def raise_failure(self, wait: bool = False) -> None:
        """Raise ParallelError if the group failed; `wait`: give the supervisor a moment to find out why
        (a collective that broke may be the first sign of a worker's death)."""
        if wait:
            self._failed.wait(4 * HEARTBEAT_SECONDS)
        if self.failure is not None:
            raise ParallelError(self.failure)

    def _supervise(self) -> None:
        watched = {conn: index for index, conn in enumerate(self._events)}
        while not self._closing and self.failure is None:
            sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
            for ready in wait([*watched, *sentinels], timeout=HEARTBEAT_SECONDS):
                if ready in watched and not self._drain(watched[ready]):
                    del watched[ready]  # the process is ending; its sentinel says how
            if self._closing:
                return
            now = time.monotonic()
            for index, process in enumerate(self.processes):
                rank = index + 1
                if not process.is_alive():
                    process.join(0)
                    self._drain(index)  # its last words may still be in the pipe
                    why = f"failed: {self._errors[index]}" if index in self._errors else f"exited with code {process.exitcode}"
                    self.fail(f"worker rank {rank} (pid {process.pid}) {why}")
                    return
                last_seen = self._last_seen[index]
                if last_seen is None and now - self._started > STARTUP_SECONDS:
                    self.fail(f"worker rank {rank} (pid {process.pid}) did not start within {STARTUP_SECONDS} s")
                    return
                if last_seen is not None and now - last_seen > self.timeout:
                    self.fail(f"worker rank {rank} (pid {process.pid}) stopped answering for {self.timeout:g} s")
                    return

    def _drain(self, index: int) -> bool:
        """Read what a worker sent (heartbeats, its error); False once its pipe is closed."""
        conn = self._events[index]
        try:
            while conn.poll():
                message = conn.recv()
                self._last_seen[index] = time.monotonic()
                if message is not None:
                    self._errors[index] = message[1]
        except (EOFError, OSError):
            return False
        return True

    def _kill_all(self) -> None:
        for process in self.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- stop ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Ask every worker to stop, kill those that do not within a few seconds, and clean up."""
        if self._closing:
            return
        self._closing = True
        if self.failure is None:
            payload = pickle.dumps(("stop",))
            for conn in self.commands:
                try:
                    conn.send_bytes(payload)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for process in self.processes:
            process.join(5)
        self._supervisor.join(4 * HEARTBEAT_SECONDS)
        for conn in (*self.commands, *self._events):
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class ParallelRunner:
    """Rank 0's runner under tensor parallelism: its own ModelRunner (`local`), with every call that
    touches the model or the KV pool sent to the workers first, so all ranks do the same in order."""

    def __init__(self, local: ModelRunner, workers: Workers) -> None:
        self.local = local
        self.workers = workers
        atexit.register(self.close)  # an offline LLM nobody closed: no worker outlives the process

    # What the engine and the loader read, as rank 0 has it.
    model = property(lambda self: self.local.model)
    backend = property(lambda self: self.local.backend)
    device = property(lambda self: self.local.device)
    dtype = property(lambda self: self.local.dtype)
    block_size = property(lambda self: self.local.block_size)
    kv_caches = property(lambda self: self.local.kv_caches)
    kv_bytes_per_token = property(lambda self: self.local.kv_bytes_per_token)
    fast = property(lambda self: self.local.fast)  # its CUDA graphs, captured on every rank alike
    tensor_parallel_size = property(lambda self: self.workers.size)

    def health(self) -> str | None:
        return None if self.workers.failure is None else f"tensor parallelism failed: {self.workers.failure}"

    # The other ranks take a step's inputs from the host: a token cannot stay on rank 0's device
    # for the next step, so each step is waited for before the next is planned.
    supports_async_scheduling = False

    def launch(self, scheduled: list[ScheduledSequence], previous: StepHandle | None = None) -> StepHandle:
        """The step on every rank; rank 0 samples."""
        assert previous is None, "tensor-parallel steps are not launched ahead"
        self.workers.raise_failure()
        inputs: ForwardInputs = forward_inputs(scheduled)
        self.workers.send("forward", inputs)
        try:
            logits = self.local.forward(inputs)
        except Exception as exc:
            self.workers.raise_failure(wait=True)  # a worker's death, said as such
            raise ParallelError(self.workers.fail(f"rank 0's forward failed: {exc}")) from exc
        handle = StepHandle(scheduled, self.local.sample(logits, scheduled))
        handle.prompt_logprobs, self.local.prompt_logprobs = self.local.prompt_logprobs, {}
        return handle

    def copy_kv(self, copies: list[KVCopy]) -> None:
        if self.workers.failure is None:  # else the step's execute fails, with the reason
            self.workers.send("copy_kv", copies)
            self.local.copy_kv(copies)

    def release(self, seq) -> None:
        self.local.release(seq)

    def keep_draws(self, kept) -> None:
        self.local.keep_draws(kept)

    def everywhere(self, function: Callable, *args) -> list:
        """`function(runner, *args)` on every rank's runner at once (it may hold collectives: a rank
        that fails fails the group); each rank's result, rank 0's first."""
        self.workers.call(function, *args)
        try:
            mine = function(self.local, *args)
        except Exception as exc:
            self.workers.raise_failure(wait=True)
            raise ParallelError(self.workers.fail(f"rank 0's {function.__name__} failed: {exc}")) from exc
        return [mine, *self.workers.collect()]

    def allocate_kv(self, num_blocks: int) -> None:
        self.everywhere(ModelRunner.allocate_kv, num_blocks)

    def close(self) -> None:
        """Stop the workers and leave the process group (again: nothing)."""
        atexit.unregister(self.close)
        self.workers.close()
        leave_group()

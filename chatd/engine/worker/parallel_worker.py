"""A tensor-parallel worker process (ranks 1..N-1), and the process-group calls every rank makes.

A worker says hello, joins the process group, loads its part of the model (the same
`build_runner` rank 0 uses), and then does what rank 0's pipe says, in order: a step's forward,
the step's KV copies, or a set-up function of its runner (sent by reference) that answers back.
A thread of its own sends a heartbeat every HEARTBEAT_SECONDS and exits the process when rank 0
is gone. Any failure is reported to rank 0 in one line before the process ends. Rank 0's side is parallel.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from chatd.config import Config, chatd_home
from chatd.engine.models.loader import open_checkpoint
from chatd.engine.models.tensor_parallel import TPGroup
from chatd.engine.worker.build import build_runner, resolve_device
from chatd.engine.worker.runner import ModelRunner

log = logging.getLogger("chatd.engine")

HEARTBEAT_SECONDS = 0.5
# How long a collective may wait. Hangs are found sooner by heartbeats; this only bounds what
# they cannot see (a rank stuck inside a collective while its heartbeat thread still runs).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def parallel_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the configured one (cuda:0 when none is named); CPU for all on CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def join_group(rank: int, size: int, device: torch.device, rendezvous: str) -> TPGroup:
    """Join the process group of `size` ranks (every rank calls this) and return this rank's place."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Ranks of one node talk over loopback only: nothing of theirs listens on another interface.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(parallel_backend(device), init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, size)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_threads_per_rank(size: int) -> int:
    """Each CPU rank gets an equal share of the cores, so N ranks do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // size)


# -- the worker process ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to become rank `rank`."""

    rank: int
    size: int
    config: Config
    model_path: str  # resolved by rank 0 (downloaded, or a GGUF's config folder prepared) before the start
    rendezvous: str
    parent_pid: int
    log_level: int


def worker_main(spec: WorkerSpec, commands: Connection, events: Connection) -> None:
    """A worker process: hello, join the group, load this rank's shard, then run commands until told to stop."""
    from chatd.logs import setup_logging

    setup_logging(spec.config.server.log_json, spec.log_level)
    send_lock = threading.Lock()

    def report(message) -> None:
        with send_lock:
            events.send(message)

    threading.Thread(target=_heartbeat, args=(report, spec.parent_pid), name="chatd-heartbeat", daemon=True).start()
    try:
        _serve_commands(spec, commands)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach rank 0 before this process goes
        log.error("tensor-parallel rank %d failed:\n%s", spec.rank, traceback.format_exc())
        try:
            report(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        os._exit(1)  # no collective teardown: the group is broken anyway
    leave_group()


def _heartbeat(report, parent_pid: int) -> None:
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        if os.getppid() != parent_pid:  # rank 0 is gone: no rank outlives it
            os._exit(1)
        try:
            report(None)
        except OSError:
            os._exit(1)


def _serve_commands(spec: WorkerSpec, commands: Connection) -> None:
    config = spec.config
    device = rank_device(resolve_device(config.model.device), spec.rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(spec.size))
    commands.send(("hello", os.getpid()))
    tp = join_group(spec.rank, spec.size, device, spec.rendezvous)
    runner = build_runner(config, open_checkpoint(Path(spec.model_path), chatd_home() / "gguf"), tp, device)
    commands.send(("ok", runner_facts(runner)))
    while True:
        try:
            message = pickle.loads(commands.recv_bytes())
        except EOFError:  # rank 0 closed its end: it is stopping
            return
        kind = message[0]
        if kind == "forward":
            runner.forward(message[1])
        elif kind == "copy_kv":
            runner.copy_kv(message[1])
        elif kind == "call":
            _, function, args = message
            commands.send(("ok", function(runner, *args)))
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown command {kind!r}")


def runner_facts(runner: ModelRunner) -> dict:
    """What rank 0 checks and reports of each rank after loading."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return {"backend": runner.backend.name, "weights_bytes": weights, "device": str(runner.device),
            "num_kv_heads": runner.model.num_kv_heads}

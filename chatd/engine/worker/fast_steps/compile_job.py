"""Compiling a CPU model's steps on a thread of its own while the engine serves with eager steps.

Compiling SmolLM2-135M's steps takes a minute or two the first time on two cores (compiled.py).
`chatd serve` does not make its first user wait for that: it answers as soon as the model is
loaded, with eager steps, while this job builds the compiled steps exactly as a start that waits
for them would, then hands them to the runner, whose next step uses them. Compiled and eager steps
give the same tokens (tests/engine/test_compiled.py), so a reply that spans the hand-over reads
as one.

Two things make that safe beside a serving engine. The dummy steps that check each compiled
step write one KV block, the pool's last (`CompiledDecode.scratch_block`), which the engine's
block manager is never given, so no sequence's cache is touched. And the hand-over is two
attribute stores (the runner's `fast.compiled`, `fast.compiled_prefill`), each read once per step.

While it runs, the job and the engine share the CPU and the GIL: eager steps run slower than
they would alone. The job's thread runs at a lower priority (nice 10) so the serving threads
get the cores first; the GIL it still takes in turn (benchmarks/README.md, "Ready in seconds").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from chatd.engine.models.quantized.quantize_model import int8_blocks_per_row
from chatd.engine.worker.fast_steps.compiled_prefill import CompiledPrefill
from chatd.engine.worker.fast_steps.fast_steps import enable_compiled_steps

log = logging.getLogger("chatd.engine")

COMPILING, COMPILED, FAILED = "compiling", "compiled", "failed"
# The job's thread (and the compilers it starts) yields the CPU to the serving threads: on Linux a
# thread has its own nice value, which the processes it starts inherit.
COMPILE_NICENESS = 10


class CompileJob:
    """Compiles a runner's steps on a thread: `state` is COMPILING until the steps are in use
    (COMPILED) or could not be made (FAILED: every step stays eager, and the log says why)."""

    def __init__(self, runner, folder: Path) -> None:
        self.runner = runner  # a ModelRunner on a CPU
        self.folder = folder
        self.state = COMPILING
        self.seconds: float | None = None  # how long it took, once done
        self.finished_at: float | None = None  # time.monotonic() when done
        self.prefill_tokens = CompiledPrefill.min_tokens  # steps this large run compiled, once COMPILED
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="chatd-compile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the job's thread) when the job ends; now, if it has."""
        with self._lock:
            if self.state == COMPILING:
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the job to end (tests, and offline use that wants compiled steps); its state."""
        self._thread.join(timeout)
        return self.state

    def _run(self) -> None:
        started = time.perf_counter()
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own priority (and its compilers')
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        try:
            enable_compiled_steps(self.runner, self.folder)
        except Exception as exc:  # no C++ compiler, an operation inductor refuses: serve eagerly, say why
            self.runner.fast.compiled = self.runner.fast.compiled_prefill = None
            int8_blocks_per_row(self.runner.model)  # as loading.py's eager steps: GGUF blocks get a scale per row
            state = FAILED
            log.warning("compiling decode and prefill steps failed (%s: %s); every step runs eagerly",
                        type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        else:
            state = COMPILED
            decode, prefill = self.runner.fast.compiled, self.runner.fast.compiled_prefill
            log.info("compiled steps in use: decode steps and prefill steps of %d tokens or more, in %.1f s on a "
                     "thread beside the eager steps (%d of %d read back from an earlier start)", prefill.min_tokens,
                     time.perf_counter() - started, decode.read_back + prefill.read_back,
                     len(decode.steps) + 2 * len(prefill.halves))
        with self._lock:
            self.seconds, self.finished_at = time.perf_counter() - started, time.monotonic()
            self.state = state
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

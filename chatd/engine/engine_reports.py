"""What LLMEngine tells those who run it: counters, where a step's host time goes, the compiled
steps' state, health, the model's facts. A mixin of LLMEngine, kept apart from engine.py, whose
reader wants the step: nothing here changes what the engine does.
"""

from __future__ import annotations

import dataclasses

from chatd.engine.core.engine_stats import EngineStats, scheduler_stats
from chatd.engine.core.sequence import Sequence, SequenceStatus
from chatd.engine.model_info import ModelInfo, read_model_info


class EngineReports:
    """LLMEngine's reports; they read its runner, scheduler, compile job, drain rate and times."""

    @property
    def compile_state(self) -> str:
        """The compiled steps: "off" (none: eager by config, on a GPU, or none could be made at
        start), "compiling" (on a thread; eager steps serve), "compiled" or "failed"."""
        if self.compile_job is not None:
            return self.compile_job.state
        fast = getattr(self.runner, "fast", None)  # (a test's fake runner has none)
        return "compiled" if fast is not None and fast.compiled is not None else "off"

    def stage_times(self) -> dict[str, float]:
        """Seconds each stage of the host's work took since the start, and the steps (core/stage_times.py)."""
        times = self.times.snapshot()
        runner_times = getattr(self.runner, "times", None)
        if runner_times is not None:
            for stage, seconds in runner_times.seconds.items():
                times[stage] += seconds
        return times

    def health(self) -> str | None:
        """None while the engine can serve; otherwise why not (a tensor-parallel rank failed)."""
        health = getattr(self.runner, "health", None)
        return health() if health is not None else None

    def stats(self) -> EngineStats:
        """A snapshot of the counters metrics are made of."""
        return dataclasses.replace(scheduler_stats(self.scheduler), queued_prefill_rate=self.drain_rate.per_second)

    def model_info(self) -> ModelInfo:
        """Facts about the loaded model and cache, for logs and /v1/models."""
        return read_model_info(self)

    def live_sequences(self) -> list[Sequence]:
        """Every sequence that may hold blocks (for invariant checks)."""
        return [s for r in self.requests.values() for s in r.seqs if s.status != SequenceStatus.FINISHED]

"""Where the host's time goes in a step: seconds per stage, summed since the engine started.

The engine, the runner and AsyncEngine each time their own stages with `time.perf_counter`
(about 60 ns a reading; a step takes ten or so). benchmarks/host.py and `/metrics`
(`chatd_engine_stage_seconds_total`) read the sums; a reader divides them by `steps`.

Stages, in a step's order:
  schedule     the scheduler plans the batch
  inputs       the runner builds the model's inputs (token ids, positions, slots, block tables)
  forward      the model's forward is launched (on a GPU: kernels queued; on a CPU: computed)
  sample       bans, penalties, grammar masks and the draw are launched
  wait         the host waits for the step's sampled ids (on a GPU: for the device)
  postprocess  the scheduler folds the tokens back (counters, cached blocks, stop tokens, lengths)
  detokenize   text, stop strings, and each request's delta
  dispatch     (AsyncEngine, on the event loop) the deltas are handed to each request's stream
"""

from __future__ import annotations

import time

STAGES = ("schedule", "inputs", "forward", "sample", "wait", "postprocess", "detokenize", "dispatch")


class StageTimes:
    """Seconds spent in each stage, and the steps run; add to it with `add` or `clock`."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.steps = 0

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds

    def since(self, stage: str, started: float) -> float:
        """Add the time from `started` (a perf_counter reading) to now; returns now."""
        now = time.perf_counter()
        self.seconds[stage] += now - started
        return now

    def snapshot(self) -> dict[str, float]:
        """The sums now, and `steps`."""
        return {**self.seconds, "steps": float(self.steps)}

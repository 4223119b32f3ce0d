"""How fast the engine drains its queue, so a server can tell a new request how long it would wait.

The engine notes each step that left requests waiting; `EngineStats.queued_prefill_rate` reports
the figure. Kept apart from engine.py because it is arithmetic over time with no engine state,
tested with plain numbers.
"""

from __future__ import annotations

import math


class DrainRate:
    """How fast a queue drains: prompt tokens computed per second in the steps that left requests
    waiting, an exponential average over about the last WINDOW seconds of them (steps, not a
    count of them: one long prefill step and ten short decode steps weigh what they last). When
    the batch is full (slots or KV blocks) and nothing is admitted, it falls towards 0. A server
    divides the work queued ahead of a new request by it to estimate that request's wait."""

    WINDOW = 5.0  # seconds

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0

    def note(self, num_tokens: int, seconds: float) -> None:
        decay = math.exp(-seconds / self.WINDOW)
        self.tokens = self.tokens * decay + num_tokens
        self.seconds = self.seconds * decay + seconds

    @property
    def per_second(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

"""Which inputs the embedding model runs next: requests' inputs cut into forward passes of bounded
size, shared between the requests' holders (tenants) in turn.

One request may hold thousands of inputs (OpenAI allows 2,048 a request); were a request's inputs
run as one batch, a one-text request arriving behind it would wait for all of them. Here each
pass takes one input from each holder in turn (and from each of a holder's requests in turn, a
request's shortest inputs first, so that padding stays small), until the pass's padded size
(inputs x the longest) would pass `max_pass_tokens`. A request that arrives while a pass runs
is in the next one: it waits one bounded pass at most, however much others sent before it.

Plain Python, no torch: embeddings.py's worker thread runs the passes.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs (token-id lists) and the future its vectors are handed to."""

    inputs: list[list[int]]
    future: concurrent.futures.Future
    holder: str = ""  # whose turn it takes: a tenant's id ("" offline)
    vectors: np.ndarray | None = None  # [len(inputs), dimensions] once a pass has run some of them
    num_done: int = 0
    _order: list[int] = field(default_factory=list)  # indices by length, shortest first: next at _taken
    _taken: int = 0

    def __post_init__(self) -> None:
        self._order = sorted(range(len(self.inputs)), key=lambda i: len(self.inputs[i]))

    @property
    def num_untaken(self) -> int:
        return len(self._order) - self._taken

    def next_length(self) -> int:
        return len(self.inputs[self._order[self._taken]])

    def take(self) -> int:
        """The index of the next input for a pass."""
        self._taken += 1
        return self._order[self._taken - 1]

    def put(self, index: int, vector: np.ndarray) -> bool:
        """A pass's vector for input `index`; whether the job now has them all."""
        if self.vectors is None:
            self.vectors = np.empty((len(self.inputs), len(vector)), dtype=np.float32)
        self.vectors[index] = vector
        self.num_done += 1
        return self.num_done == len(self.inputs)


class EmbeddingQueue:
    """Jobs waiting for passes, by holder, holders in turn (see the module docstring)."""

    def __init__(self, max_pass_tokens: int) -> None:
        self.max_pass_tokens = max_pass_tokens  # padded tokens one pass may hold (a longer input runs alone)
        self._holders: OrderedDict[str, deque[EmbeddingJob]] = OrderedDict()  # each holder's jobs with inputs untaken

    def __bool__(self) -> bool:
        return bool(self._holders)

    def add(self, job: EmbeddingJob) -> None:
        self._holders.setdefault(job.holder, deque()).append(job)

    def drop_finished(self) -> None:
        """Forget jobs whose future is done early: cancelled by their caller, or failed in a pass."""
        for holder in list(self._holders):
            jobs = deque(job for job in self._holders[holder] if not job.future.done())
            if jobs:
                self._holders[holder] = jobs
            else:
                del self._holders[holder]

    def next_pass(self) -> list[tuple[EmbeddingJob, int]]:
        """The next pass's inputs as (job, input index): at least one, in turn by holder and by job,
        while inputs x the longest stays within max_pass_tokens."""
        taken: list[tuple[EmbeddingJob, int]] = []
        longest = 0
        turns = deque(self._holders)
        if turns:  # the next pass starts with the next holder
            self._holders.move_to_end(turns[0])
        while turns:
            holder = turns.popleft()
            jobs = self._holders[holder]
            length = jobs[0].next_length()
            if taken and (len(taken) + 1) * max(longest, length) > self.max_pass_tokens:
                continue  # this holder's next input does not fit: it waits for the next pass
            job = jobs.popleft()
            taken.append((job, job.take()))
            longest = max(longest, length)
            if job.num_untaken:
                jobs.append(job)  # the holder's next turn is its next job's
            if jobs:
                turns.append(holder)
            else:
                del self._holders[holder]
        return taken

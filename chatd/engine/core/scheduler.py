"""Iteration-level (continuous) batching: which sequences get how many tokens this step.

Each step has a token budget. Running decodes are served first (one token each), then
running prefills continue, then waiting sequences are admitted, with long prompts cut into
chunks that fit what is left of the budget. When the KV pool runs dry, the running sequence
with the lowest priority (highest `priority` value, latest arrival) is preempted: its blocks
are freed and it is recomputed later, which the prefix cache makes cheap. Plain Python.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from chatd.config import SchedulerConfig
from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """A sequence and the number of its tokens computed this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so the step yields a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: decodes first, then prefill chunks; and who was preempted to make room."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _rank(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival)


class Scheduler:
    """Decides each step's batch under the token budget and the KV pool."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (new, preempted, or a freshly forked sibling holding shared blocks)."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_rank)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Every sequence in the returned plan holds the blocks its tokens need."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = sorted((s for s in self.running if not s.is_prefilling), key=_rank)
        prefills = sorted((s for s in self.running if s.is_prefilling), key=_rank)
        unscheduled = set(self.running)
        for seq in decodes + prefills:
            if seq not in unscheduled:  # preempted earlier in this loop to make room
                continue
            if budget == 0:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = max(unscheduled, key=_rank)
                self._preempt(victim)
                unscheduled.discard(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                unscheduled.discard(seq)
                out.scheduled.append(ScheduledSequence(seq, num_new))
                budget -= num_new

        # Admit waiting sequences, best first, unless this step already had to preempt.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.allocate(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new):
                self.block_manager.free(seq)  # give back prefix-cache hits; looked up again next time
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

        # The runner wants one-token rows (decodes) first: attention batches them in one call.
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

"""Iteration-level (continuous) batching: which sequences get how many tokens this step.

Each step has a token budget. Running decodes are served first (one token each), then
running prefills continue, then waiting sequences are admitted, with long prompts cut into
chunks that fit what is left of the budget; only the best class with a prompt to compute gets
prefill chunks in a step. Who goes first in each of these is fairness.py's
order: the best class (lowest `priority`), then the tenant furthest below its fair share, then
arrival. When the KV pool runs dry, the running sequence ranked last (the worst class, the
tenant furthest above its share, the latest arrival) is preempted: its blocks are freed and it
is recomputed later, which the prefix cache makes cheap. A waiting sequence of a better class
than some running ones does not wait for them: when the batch or the pool is full, they are
preempted to make room for it (a paid request never queues behind free ones). A sequence
with structured output samples only once its grammar's mask for the next token is ready (masks
are computed off the engine thread, structured/grammar_threads.py); until then it computes all but its last token,
so a costly grammar slows its own reply and nobody else's.

The scheduler is the only user of the block manager, and it does the bookkeeping after a
step too (`schedule` / `postprocess`, as nano-vllm pairs them): counters, naming blocks that
became full, appending sampled tokens, forking `n > 1` choices, finishing sequences that hit a
stop token or a length limit. Stop strings need text, so the engine checks those after it
detokenizes. Plain Python, no torch: tested without a model. Speculative decoding's proposed
tokens, verified in a sequence's decode, are drafts.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatd.config import SchedulerConfig
from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.drafts import DraftCounts, drafts_to_verify
from chatd.engine.core.fairness import FairShare, WaitQueue
from chatd.engine.core.host_tier import KVCopy
from chatd.engine.core.sequence import Sequence, SequenceStatus
from chatd.engine.params import FinishReason

@dataclass
class ScheduledSequence:
    """A sequence and the number of its tokens computed this step; the counters move by it when
    the plan is final (`Scheduler._plan`)."""

    seq: Sequence
    num_new_tokens: int
    start: int = 0  # its tokens already computed (or planned by a step in flight) before this chunk
    samples: bool = False  # the chunk reaches its last token, so the step yields a new token
    prefill: bool = False  # prompt tokens (or recomputed ones after a preemption)
    # Proposed tokens, the chunk's last len(draft_token_ids) tokens: each gets a sample too, which
    # verifies it (speculative decoding). Their slots are counted as computed once accepted.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_samples(self) -> int:
        """Tokens sampled for it this step: one, plus one per proposed token; none mid-prompt."""
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    """One step's plan: decodes first, then prefill chunks; and who was preempted to make room."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Blocks to copy between the device pool and the host tier before the step runs, in order
    # (made even when nothing is scheduled: a restore may have named a block already).
    kv_copies: list[KVCopy] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens (or recomputed ones) in the plan."""
        return sum(s.num_new_tokens for s in self.scheduled if s.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _scheduled(seq: Sequence, num_new: int, prefill: bool, drafts: tuple[int, ...] = ()) -> ScheduledSequence:
    """A chunk of `num_new` tokens of `seq`, from its first uncomputed one (the last of them `drafts`)."""
    start = seq.num_computed_tokens
    return ScheduledSequence(seq, num_new, start, start + num_new - len(drafts) == seq.num_tokens, prefill, drafts)


def _ready_tokens(seq: Sequence, max_model_len: int | None) -> int:
    """How many of a sequence's uncomputed tokens may run now: all but the last where sampling
    after it needs what the host does not know yet. That is where its grammar's mask for the next
    token is not ready (masks are computed off the engine thread, so a costly grammar slows its own
    sequence, never the step), and, with async scheduling, where its last token was sampled by the
    step still in flight: a grammar must accept that token and penalties must count it first, and
    a sequence that token ends by length runs no further."""
    last_held = seq.grammar is not None and (seq.num_pending_tokens or not seq.grammar.ready)
    if seq.num_pending_tokens and not last_held:
        params = seq.params
        last_held = (params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
                     or (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
                     or (max_model_len is not None and seq.num_tokens >= max_model_len))
    return seq.num_uncomputed_tokens - 1 if last_held else seq.num_uncomputed_tokens


class Scheduler:
    """Decides each step's batch under the token budget and the KV pool."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len  # None: only max_tokens ends a sequence by length
        self.eos_token_ids = eos_token_ids
        self.share = FairShare()
        self.waiting = WaitQueue(self.share)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # tokens computed in prefill (including recompute after preemption)
        self.num_generation_tokens = 0  # tokens sampled
        self.drafts = DraftCounts()  # speculative decoding's

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    def kv_blocks_needed(self, num_tokens: int) -> int:
        return self.block_manager.blocks_needed(num_tokens)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (or a freshly forked sibling holding shared blocks)."""
        self.share.join(seq)
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.share.leave(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Every sequence in the returned plan holds the blocks its tokens need, and
        its counters have moved (`_plan`): each plan must be folded back with `postprocess` (or its
        sequences finished) before the next step's tokens mean anything."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        rank = self.share.rank
        decodes, prefills = [], []
        for seq in self.running:
            (prefills if seq.is_prefilling else decodes).append(seq)
        # Who comes first matters only where some will not fit (the budget, or a new block each);
        # else ranking hundreds of decodes every step would cost more than all the rest of a plan.
        if len(decodes) > budget or len(decodes) > self.block_manager.num_free_blocks:
            decodes.sort(key=rank)
        prefills.sort(key=rank)
        # A prompt of a worse class never shares a step with a better class's: the better one's
        # first token would wait for both (its decodes, one token each, still run).
        head = self.waiting.peek()
        lead = min([s.priority for s in prefills] + ([head.priority] if head is not None else []), default=None)
        unscheduled = set(self.running)
        num_decodes = len(decodes)
        for i, seq in enumerate(decodes + [s for s in prefills if s.priority == lead]):
            if seq not in unscheduled:  # preempted earlier in this loop to make room
                continue
            if budget == 0:
                break
            num_new = min(_ready_tokens(seq, self.max_model_len), budget)
            if num_new == 0:  # waiting for its grammar's mask
                continue
            drafts = drafts_to_verify(seq, num_new, budget) if seq.draft_token_ids else ()
            if drafts and self.block_manager.can_allocate_slots(seq, num_new + len(drafts)):
                num_new += len(drafts)  # never preempting anyone for a guess
            else:
                drafts = ()
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = max(unscheduled, key=rank)
                self._preempt(victim)
                unscheduled.discard(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                unscheduled.discard(seq)
                out.scheduled.append(_scheduled(seq, num_new, i >= num_decodes, drafts))
                budget -= num_new

        # Admit waiting sequences, best first. After a preemption only a better class than the
        # preempted may come in (anything else would take back the room just made).
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            if seq.priority != lead or any(seq.priority >= victim.priority for victim in out.preempted):
                break
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._make_room(seq, out)
                if freed is None:
                    break
                budget += freed
            if not seq.block_table:
                self.block_manager.allocate(seq)
            num_new = min(_ready_tokens(seq, self.max_model_len), budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                freed = self._make_room(seq, out)
                if freed is None:
                    break
                budget += freed
                num_new = min(_ready_tokens(seq, self.max_model_len), budget)
            else:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if num_new:  # else it runs once its grammar's mask is ready, without holding up the queue
                    out.scheduled.append(_scheduled(seq, num_new, prefill=True))
                    budget -= num_new
                continue
            self.block_manager.free(seq)  # give back prefix-cache hits; looked up again next time
            break

        # The runner wants one-token rows (decodes, and verify steps, which it runs as decode rows)
        # first: attention batches them in one call.
        out.scheduled.sort(key=lambda s: s.num_new_tokens - s.num_draft_tokens != 1)
        out.kv_copies = self.block_manager.host.take_copies()
        self._plan(out)
        return out

    def _plan(self, out: SchedulerOutput) -> None:
        """Move the counters of the final plan's sequences now, so the next step can be planned before
        this one's results are back: their chunks count as computed, and a chunk that samples adds a
        pending token, whose value `postprocess` fills in."""
        charge = self.share.charge
        for scheduled in out.scheduled:
            seq, num_new = scheduled.seq, scheduled.num_new_tokens
            seq.draft_token_ids = []  # verified now or not at all (a sequence left out keeps its guesses)
            if scheduled.prefill:
                self.num_prompt_tokens += num_new
            charge(seq, num_new)
            seq.num_computed_tokens += num_new - scheduled.num_draft_tokens  # a guess counts once accepted
            if scheduled.samples:
                seq.num_pending_tokens += 1

    def waiting_for_masks(self) -> bool:
        """Some sequence could run but for its grammar's mask (being computed off the engine thread)."""
        return any(s.grammar is not None and not s.grammar.ready for s in self.running)

    def postprocess(self, plan: SchedulerOutput, token_ids: list[int]) -> list[tuple[Sequence, range]]:
        """Fold a step's results back: `token_ids` has the tokens sampled for each sequence whose
        chunk reached its end (`ScheduledSequence.num_samples` of them), in plan order. Returns
        those sequences that were still live (one aborted or ended while the step ran keeps nothing
        of it), each with the rows of `token_ids` that are its new tokens; the ones that ended now
        are finished.

        A sequence that verified proposed tokens gets them up to the first one that differs from
        the token sampled in its place, and then that sampled token (or, all accepted, the one
        sampled after the last): what it would have sampled one step at a time. The slots of the
        rest are given back."""
        sampled = []
        row = 0
        block_manager = self.block_manager
        for scheduled in plan.scheduled:
            seq, first = scheduled.seq, row
            row += scheduled.num_samples
            if seq.is_finished:
                continue
            if not scheduled.samples:
                block_manager.cache_blocks(seq)
                continue
            drafts = scheduled.draft_token_ids
            accepted = self.drafts.accepted(seq, drafts, token_ids[first : first + len(drafts)]) if drafts else 0
            for i in range(accepted + 1):
                seq.append_token(token_ids[first + i])
                if i < accepted:  # the guess in its place was right: its K/V, computed this step, stay
                    seq.num_computed_tokens += 1
                block_manager.cache_blocks(seq)  # after the token: a block it fills is named with it
                self._check_end(seq, token_ids[first + i])
                if seq.is_finished:
                    break
            if drafts and not seq.is_finished:
                block_manager.trim(seq)
            sampled.append((seq, range(first, first + i + 1)))
        return sampled

    def _check_end(self, seq: Sequence, token_id: int) -> None:
        """A sampled token was added: end the sequence on a stop token, EOS, max_tokens or the context window."""
        self.num_generation_tokens += 1
        if seq.forks:  # its first token: the prompt is computed, the siblings can share it
            self._fork(seq)
        params = seq.params
        # Counted up to this token: with async scheduling the next one may be pending already.
        num_output, num_tokens = len(seq.output_token_ids), len(seq.token_ids)
        enough = num_output >= params.min_tokens
        # Every token goes to the grammar first (EOS too): the mask allows only what it accepts, so a
        # refusal means its matcher failed (a parser limit reached) and the output is not complete.
        if seq.grammar is not None and not seq.grammar.accept(token_id):  # the engine says why
            seq.finish_reason = FinishReason.ERROR
        elif enough and token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token_id
        elif enough and not params.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif seq.grammar is not None and seq.grammar.is_terminated:  # the structured output is complete
            seq.finish_reason = FinishReason.STOP
        elif (params.max_tokens is not None and num_output >= params.max_tokens) or (
                self.max_model_len is not None and num_tokens >= self.max_model_len):
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            self.finish(seq)

    def _fork(self, parent: Sequence) -> None:
        """Start choices 1..n-1 sharing the full blocks of the first one's prompt; each computes only the tail."""
        block_size = self.block_manager.block_size
        # Under async scheduling the parent may have been preempted while its first token was in
        # flight: then the siblings share nothing and compute their prompts themselves.
        shared_blocks = min((parent.num_prompt_tokens - 1) // block_size, parent.num_computed_tokens // block_size)
        for child in parent.forks:
            self.block_manager.fork(parent, child, shared_blocks)
            self.add(child)
        parent.forks = []

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Preempt the last-ranked running sequence of a worse class than waiting `seq`, even one
        already planned for this step. Returns the budget it gives back; None if there is none."""
        worse = [s for s in self.running if s.priority > seq.priority]
        if not worse:
            return None
        victim = max(worse, key=self.share.rank)
        planned = next((s for s in out.scheduled if s.seq is victim), None)
        if planned is not None:
            out.scheduled.remove(planned)
        self._preempt(victim)
        out.preempted.append(victim)
        return planned.num_new_tokens if planned is not None else 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(seq)

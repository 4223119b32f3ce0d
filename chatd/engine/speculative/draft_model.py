"""Draft-model proposals: a small model sharing the served model's tokenizer guesses greedily.

The draft model has its own runner on the served model's device (rank 0's, under tensor
parallelism: it is small enough to run whole) and its own KV pool with its own block tables,
handed out by a block manager of its own without prefix caching (`speculative.draft_kv_cache_gb`).
For each guessing sequence it keeps a shadow sequence: the tokens whose K/V its pool holds. Each
step it first computes what it has not seen yet (the prompt the first time; after a verify step
the tokens from the first one that differs from what it guessed, plus the new one) and takes its
first guess from the last of them, then one decode step per further guess. Its cache keeps the
guesses' K/V too; what of them was rejected is found (the longest common prefix with the
sequence's tokens) and overwritten next time. A sequence for which its pool has no room guesses
nothing that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.sequence import Sequence
from chatd.engine.worker.forward_inputs import ForwardInputs
from chatd.engine.worker.runner import ModelRunner


@dataclass(eq=False)
class DraftCache:
    """A sequence's place in the draft model's pool, as its block manager sees a sequence."""

    token_ids: list[int] = field(default_factory=list)  # whose K/V the pool holds (its first `known` the sequence's own)
    known: int = 0  # tokens certainly the sequence's (the rest were guesses)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    def valid(self, tokens: list[int]) -> int:
        """How many of its tokens are still the sequence's: the longest common prefix."""
        i, n = min(self.known, len(tokens)), min(len(self.token_ids), len(tokens))
        while i < n and self.token_ids[i] == tokens[i]:
            i += 1
        return i


class DraftModelProposer:
    """Guesses from a draft model's greedy continuation of each sequence."""

    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self.blocks = BlockManager(num_blocks, runner.block_size, enable_prefix_caching=False)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in wanted]
        rows = []  # (index in wanted, its shadow, its tokens to compute)
        for i, (seq, length) in enumerate(wanted):
            tokens = seq.token_ids
            if len(tokens) + length > self.runner.max_model_len:  # past the draft model's context
                continue
            shadow = self._shadow(seq)
            # What its pool holds that is still the sequence's; at least the last token is run again.
            computed = min(shadow.valid(tokens), len(tokens) - 1)
            if computed < shadow.num_computed_tokens:
                shadow.num_computed_tokens = computed  # rejected guesses' slots are written over
            if not self.blocks.allocate_slots(shadow, len(tokens) - shadow.num_computed_tokens + length - 1):
                self.blocks.free(shadow)  # no room: start over next time (or never, if the pool stays full)
                shadow.token_ids, shadow.known = [], 0
                continue
            rows.append((i, shadow, tokens[shadow.num_computed_tokens :]))
        if not rows:
            return guesses
        # First guesses: each sequence's unseen tokens, the last one's logits (one-token rows first).
        rows.sort(key=lambda row: len(row[2]) != 1)
        last = self._run([(shadow, new) for _, shadow, new in rows])
        for (i, shadow, new), token_id in zip(rows, last, strict=True):
            shadow.token_ids = wanted[i][0].token_ids + [token_id]
            shadow.known = len(shadow.token_ids) - 1
            shadow.num_computed_tokens += len(new)
            guesses[i].append(token_id)
        # Further guesses: one decode step each, for the sequences that want more.
        while True:
            more = [(i, shadow) for i, shadow, _ in rows if len(guesses[i]) < wanted[i][1]]
            if not more:
                break
            last = self._run([(shadow, [guesses[i][-1]]) for i, shadow in more])
            for (i, shadow), token_id in zip(more, last, strict=True):
                shadow.token_ids.append(token_id)
                shadow.num_computed_tokens += 1
                guesses[i].append(token_id)
        for _, shadow, _ in rows:
            shadow.token_ids.pop()  # the last guess was never run through the draft model
        return guesses

    def release(self, seq: Sequence) -> None:
        shadow = seq.proposer_state.proposer
        if shadow is not None:
            self.blocks.free(shadow)

    def _shadow(self, seq: Sequence) -> DraftCache:
        state = seq.proposer_state
        if state.proposer is None:
            state.proposer = DraftCache()
        return state.proposer

    @torch.inference_mode()
    def _run(self, rows: list[tuple[DraftCache, list[int]]]) -> list[int]:
        """One draft forward over these rows (each its shadow and the tokens it computes from its
        computed count on); the most likely next token after each row's last."""
        token_ids, starts, query_lens = [], [], []
        for shadow, new in rows:
            token_ids += new
            starts.append(shadow.num_computed_tokens)
            query_lens.append(len(new))
        inputs = ForwardInputs(token_ids, starts, query_lens, [shadow.block_table for shadow, _ in rows],
                               list(range(len(rows))))
        return self.runner.forward(inputs).argmax(dim=-1).tolist()

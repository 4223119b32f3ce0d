"""Speculative decoding's verify steps in the worker: a sequence's guesses as rows of the forward,
a sampler row after each, and seeded generators rewound to the rows the scheduler kept.

A sequence verifying proposed tokens becomes one decode row per token, its last one and each guess,
at consecutive positions over the same blocks: every row's K/V is written before any row attends,
so each guess sees the ones before it, and the step stays a decode step (CUDA graphs, compiled CPU
steps) with logits for every row. Each row is sampled as if the tokens before it were accepted;
the scheduler keeps the rows up to the first whose token differs from the guess. A seeded
sequence's generator is then rewound to where the kept rows leave it (`keep_draws`), so its reply
is the one it gets without guesses.
"""

from __future__ import annotations

import dataclasses

import torch

from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.core.sequence import Sequence
from chatd.engine.worker.full_sampling import draw_uniform
from chatd.engine.worker.sampler import SamplingRow


def add_verify_rows(inputs, s: ScheduledSequence) -> None:
    """Add a verifying sequence's rows to the ForwardInputs being built (forward_inputs.py)."""
    seq = s.seq
    assert s.start < len(seq.token_ids), "a verify step follows a step whose tokens are back"
    rows = 1 + len(s.draft_token_ids)
    inputs.sampling.extend(range(len(inputs.starts), len(inputs.starts) + rows))
    inputs.token_ids.append(seq.token_ids[s.start])
    inputs.token_ids.extend(s.draft_token_ids)
    inputs.starts.extend(range(s.start, s.start + rows))
    inputs.query_lens.extend([1] * rows)
    inputs.block_tables.extend([seq.block_table] * rows)


class VerifyRows:
    """The sampler rows of verifying sequences, and their generators' states before a verify step."""

    def __init__(self, rows) -> None:
        self.rows = rows  # the SamplingRows (sampling_rows.py) these extend
        self._rewinds: dict[int, torch.Tensor] = {}  # seq_id -> its RNG's state before a verify step's draws

    def of(self, seq: Sequence, drafts: tuple[int, ...]) -> list[SamplingRow]:
        """A verify step's rows: the next token as usual, then one after each proposed token, as if
        the proposed tokens before it were its own (and its grammar's mask that of its matcher there)."""
        masks = seq.grammar.draft_masks(drafts) if seq.grammar is not None else [None] * len(drafts)
        if not seq.params.greedy:
            self._rewinds[seq.seq_id] = self.rows.generator(seq).get_state()
        first = self.rows.row(seq)
        return [first] + [dataclasses.replace(first, output_token_ids=seq.output_token_ids + list(drafts[: i + 1]),
                                              banned_token_ids=self.rows.banned(seq, seq.num_output_tokens + i + 1),
                                              grammar=masks[i])
                          for i in range(len(drafts))]

    def keep_draws(self, kept: list[tuple[Sequence, range]]) -> None:
        """After a verify step: each sampling sequence's generator as if it had drawn only for the
        tokens it kept (one uniform number each), not for the rows past them."""
        if not self._rewinds:
            return
        for seq, rows in kept:
            state = self._rewinds.pop(seq.seq_id, None)
            if state is not None:
                generator = self.rows.generators[seq.seq_id]
                generator.set_state(state)
                for _ in rows:
                    draw_uniform(generator, self.rows.device)
        self._rewinds.clear()  # sequences that ended meanwhile

    def release(self, seq: Sequence) -> None:
        self._rewinds.pop(seq.seq_id, None)

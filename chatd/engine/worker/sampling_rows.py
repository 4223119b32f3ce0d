"""Each sequence's row of the sampler: its parameters, its tokens so far, what it may not draw yet,
its grammar's mask, and its own random generator.

A greedy row draws no random number; a sampling one draws from a generator seeded from the
request's seed (or from the runner's seed source when it brings none), one per choice, so a seeded
request gets the same reply alone or in any batch. A verify step (speculative decoding) samples a
row after each proposed token; the generator of a seeded sequence is then rewound to where the rows
it kept leave it (`keep_draws`), so its reply is the one it gets without guesses.
"""

from __future__ import annotations

import torch

from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.core.sequence import Sequence
from chatd.engine.worker.sampler import SamplingRow, draw_uniform


class SamplingRows:
    """Builds the sampler's rows of a step's sequences and keeps each sampling sequence's RNG."""

    def __init__(self, eos_token_ids: frozenset[int], device: torch.device, seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own RNG
        self._rewinds: dict[int, torch.Tensor] = {}  # seq_id -> its RNG's state before a verify step's draws
        self._seed_source = torch.Generator().manual_seed(seed)  # seeds requests that bring none

    def of(self, scheduled: list[ScheduledSequence]) -> list[SamplingRow]:
        """The rows of a step: one per sample of each scheduled sequence that samples, in order."""
        rows = []
        for s in scheduled:
            if s.draft_token_ids:
                rows += self.verify_rows(s.seq, s.draft_token_ids)
            elif s.samples:
                rows.append(self.row(s.seq))
        return rows

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's RNG."""
        self.generators.pop(seq.seq_id, None)
        self._rewinds.pop(seq.seq_id, None)

    def row(self, seq: Sequence, drafts: tuple[int, ...] = (), grammar=None) -> SamplingRow:
        """What the sampler needs of a sequence's next token; after `drafts` (a verify row: as if
        the proposed tokens before it were its own, and `grammar` its matcher's state there)."""
        if not drafts and seq.sampling_row is not None:
            return seq.sampling_row
        params = seq.params
        banned: tuple[int, ...] = ()
        # A grammar decides where structured output ends: min_tokens does not ban its EOS. The token
        # drawn now is already counted (pending from when its step was planned).
        if seq.num_output_tokens + len(drafts) <= params.min_tokens and seq.grammar is None:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))
        row = SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids + list(drafts) if drafts else seq.output_token_ids,
            generator=None if params.greedy else self._generator(seq),
            banned_token_ids=banned,
            grammar=grammar if drafts else seq.grammar,
        )
        if not drafts and not banned:  # past min_tokens it stays so: the same row every step
            seq.sampling_row = row
        return row

    def verify_rows(self, seq: Sequence, drafts: tuple[int, ...]) -> list[SamplingRow]:
        """A verify step's rows: the next token as usual, then one after each proposed token. Each
        is sampled as if the tokens before it were accepted; the scheduler keeps the rows up to the
        first whose token differs from the guess. A seeded sequence's generator is rewound to where
        the kept rows leave it (`keep_draws`), so its reply is the one it gets without guesses."""
        masks = seq.grammar.draft_masks(drafts) if seq.grammar is not None else [None] * len(drafts)
        if not seq.params.greedy:
            self._rewinds[seq.seq_id] = self._generator(seq).get_state()
        return [self.row(seq)] + [self.row(seq, drafts[: i + 1], masks[i])
                                            for i in range(len(drafts))]

    def keep_draws(self, kept: list[tuple[Sequence, range]]) -> None:
        """After a verify step: each sampling sequence's generator as if it had drawn only for the
        tokens it kept (one uniform number each), not for the rows past them."""
        if not self._rewinds:
            return
        for seq, rows in kept:
            state = self._rewinds.pop(seq.seq_id, None)
            if state is not None:
                generator = self.generators[seq.seq_id]
                generator.set_state(state)
                for _ in rows:
                    draw_uniform(generator, self.device)
        self._rewinds.clear()  # sequences that ended meanwhile

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self.generators.get(seq.seq_id)
        if generator is None:
            seed = seq.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), generator=self._seed_source))
            # Each choice of a request gets its own stream, derived from the request's seed.
            seed = (seed + seq.index * 0x9E3779B97F4A7C15) % 2**63
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[seq.seq_id] = generator
        return generator

"""Each sequence's row of the sampler: its parameters, its tokens so far, what it may not draw yet,
its grammar's mask, and its own random generator.

A greedy row draws no random number; a sampling one draws from a generator seeded from the
request's seed (or from the runner's seed source when it brings none), one per choice, so a seeded
request gets the same reply alone or in any batch. A verify step's rows (speculative decoding) are
verify_rows.py's.
"""

from __future__ import annotations

import torch

from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.core.sequence import Sequence
from chatd.engine.worker.sampler import SamplingRow
from chatd.engine.worker.verify_rows import VerifyRows


class SamplingRows:
    """Builds the sampler's rows of a step's sequences and keeps each sampling sequence's RNG."""

    def __init__(self, eos_token_ids: frozenset[int], device: torch.device, seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own RNG
        self._seed_source = torch.Generator().manual_seed(seed)  # seeds requests that bring none
        self.verify = VerifyRows(self)

    def of(self, scheduled: list[ScheduledSequence]) -> list[SamplingRow]:
        """The rows of a step: one per sample of each scheduled sequence that samples, in order."""
        rows = []
        for s in scheduled:
            if s.draft_token_ids:
                rows += self.verify.of(s.seq, s.draft_token_ids)
            elif s.samples:
                rows.append(self.row(s.seq))
        return rows

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's RNG."""
        self.generators.pop(seq.seq_id, None)
        self.verify.release(seq)

    def row(self, seq: Sequence) -> SamplingRow:
        """What the sampler needs of a sequence's next token."""
        if seq.sampling_row is not None:
            return seq.sampling_row
        params = seq.params
        row = SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=None if params.greedy else self.generator(seq),
            banned_token_ids=self.banned(seq, seq.num_output_tokens),
            grammar=seq.grammar,
        )
        if not row.banned_token_ids:  # past min_tokens it stays so: the same row every step
            seq.sampling_row = row
        return row

    def banned(self, seq: Sequence, num_output_tokens: int) -> tuple[int, ...]:
        """The tokens a sequence may not draw once it has `num_output_tokens`: its stop tokens and EOS
        until min_tokens. The token drawn now is already counted (pending from when its step was planned)."""
        params = seq.params
        # A grammar decides where structured output ends: min_tokens does not ban its EOS.
        if num_output_tokens > params.min_tokens or seq.grammar is not None:
            return ()
        return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_token_ids))

    def generator(self, seq: Sequence) -> torch.Generator:
        """The sequence's own RNG, made on its first draw."""
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

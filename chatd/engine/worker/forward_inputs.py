"""A scheduled step as one forward's inputs (`forward_inputs`: plain lists, the same on every
tensor-parallel rank), and a launched step as its caller holds it (`StepHandle`).

The sequences of a step (one-token decodes first, then prefill chunks) are concatenated into one
batch of tokens. The rows that sample are named, and so are the prompt positions whose logprobs a
request asked for (prompt_logprobs.py); a verifying sequence's rows are verify_rows.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from chatd.engine.core.scheduler import ScheduledSequence
from chatd.engine.params import Logprob
from chatd.engine.worker.prompt_logprobs import PromptRows, prompt_rows
from chatd.engine.worker.sampler import SampledTokens, SamplerOutput
from chatd.engine.worker.verify_rows import add_verify_rows


@dataclass(frozen=True)
class ForwardInputs:
    """What a step's forward needs, as plain lists: the same on every tensor-parallel rank."""

    token_ids: list[int]  # the new tokens of every sequence, concatenated (one-token rows first)
    starts: list[int]  # per sequence: tokens already in its KV cache
    query_lens: list[int]  # per sequence: new tokens this step
    block_tables: list[list[int]]
    sampling: list[int]  # the rows whose chunk reaches their end: they get logits
    # Async scheduling: (index in token_ids, row of the previous step's draws) of each input that
    # step sampled and has not handed back yet; token_ids holds 0 there until it is filled in.
    pending: tuple[tuple[int, int], ...] = ()
    prompt_rows: tuple[PromptRows, ...] = ()  # the prompt positions whose logprobs are asked for


def forward_inputs(scheduled: list[ScheduledSequence], previous: StepHandle | None = None) -> ForwardInputs:
    """The forward's inputs for a scheduled batch (`previous`: the step in flight, whose draws
    some of its inputs are)."""
    inputs = ForwardInputs(token_ids=[], starts=[], query_lens=[], block_tables=[], sampling=[])
    token_ids = inputs.token_ids
    pending, wanted = [], []
    for s in scheduled:
        if s.draft_token_ids:
            add_verify_rows(inputs, s)
            continue
        seq = s.seq
        if s.samples:
            inputs.sampling.append(len(inputs.starts))
        if seq.prompt_logprobs is not None:  # (asked of every sequence, every step: no call for the rest)
            if (rows := prompt_rows(seq, s.start, s.num_new_tokens, len(token_ids))) is not None:
                wanted.append(rows)
        known = seq.token_ids[s.start : s.start + s.num_new_tokens]
        token_ids.extend(known)
        if len(known) < s.num_new_tokens:  # a decode whose input the step in flight sampled
            pending.append((len(token_ids), previous.rows[seq.seq_id]))
            token_ids.append(0)
        inputs.starts.append(s.start)
        inputs.query_lens.append(s.num_new_tokens)
        inputs.block_tables.append(seq.block_table)
    return dataclasses.replace(inputs, pending=tuple(pending), prompt_rows=tuple(wanted))


def fill_pending(inputs: ForwardInputs, draws: list[int]) -> ForwardInputs:
    """`inputs` with its pending tokens filled in from the previous step's draws, known on the host."""
    token_ids = list(inputs.token_ids)
    for index, row in inputs.pending:
        token_ids[index] = draws[row]
    return dataclasses.replace(inputs, token_ids=token_ids, pending=())


class StepHandle:
    """A launched step: which row of its draws each sampling sequence got, the draws as the device
    has them, and `result()`, which waits for them on the host."""

    def __init__(self, scheduled: list[ScheduledSequence], sampled: SampledTokens | None) -> None:
        self.rows = {}  # seq_id -> its (first) row of the draws
        row = 0
        for s in scheduled:
            if s.samples:
                self.rows[s.seq.seq_id] = row
                row += s.num_samples
        self.sampled = sampled
        # seq_id -> (the index of the first prompt token, the logprobs of the prompt tokens from there)
        self.prompt_logprobs: dict[int, tuple[int, list[Logprob]]] = {}

    @property
    def token_ids(self) -> torch.Tensor | None:
        """The draws, [rows], where the device has them (None: no row sampled)."""
        return self.sampled.token_ids if self.sampled is not None else None

    def result(self) -> SamplerOutput:
        if self.sampled is None:
            return SamplerOutput(token_ids=[], logprobs=[])
        return self.sampled.result()

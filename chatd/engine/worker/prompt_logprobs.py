"""The logprobs of a prompt's own tokens (SamplingParams.prompt_logprobs: what evaluation harnesses
score a model by), computed in the prefill's steps from the same forward that fills the KV cache.

A prefill chunk's position p predicts token p + 1, so the rows a step's forward computes anyway
give each prompt token's logprob once the logits of those rows are taken: `prompt_rows` says
which rows of a chunk are wanted (forward_inputs adds them to the step's inputs, the same on every
tensor-parallel rank), `prompt_logprobs` computes them after the forward. A sequence wanting them
reads nothing from the prefix cache (core/block_manager.py), so no position is skipped; a chunk
computed again after a preemption adds nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatd.engine.core.sequence import Sequence
from chatd.engine.params import Logprob

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are computed at once


@dataclass(frozen=True)
class PromptRows:
    """Consecutive prompt positions of one sequence in a step whose next tokens' logprobs it wants
    (SamplingParams.prompt_logprobs): rows `offset`.. of the step's tokens predict `targets`, the
    prompt tokens from index `first` on."""

    seq_id: int
    first: int
    offset: int
    targets: tuple[int, ...]
    top: int  # alternatives to report per token


def prompt_rows(seq: Sequence, start: int, num_new: int, offset: int) -> PromptRows | None:
    """The positions of a chunk (`num_new` tokens from `start`, at `offset` in the step's tokens)
    whose logits give prompt tokens' logprobs not yet computed: position p predicts token p + 1,
    up to the prompt's last token (a recomputed chunk after a preemption adds nothing twice); None
    where the sequence wants none."""
    if not seq.wants_prompt_logprobs:
        return None
    first = max(start + 1, len(seq.prompt_logprobs))  # the first prompt token still missing
    end = min(start + num_new + 1, seq.num_prompt_tokens)  # one past the last token this chunk predicts
    if first >= end:
        return None
    return PromptRows(seq.seq_id, first, offset + first - 1 - start, tuple(seq.prompt_token_ids[first:end]),
                      seq.params.prompt_logprobs)


def prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, wanted: tuple[PromptRows, ...]) -> dict[int, tuple[int, list[Logprob]]]:
    """The prompt tokens' logprobs (with their rank and top alternatives) from the hidden states
    of the positions before them, PROMPT_LOGPROB_ROWS rows of logits at a time (a long prompt's
    [tokens, vocab] at once would be gigabytes). Every tensor-parallel rank takes part in the
    logits' gather; rank 0 returns them, the others {}."""
    found: dict[int, tuple[int, list[Logprob]]] = {}
    for rows in wanted:
        logprobs: list[Logprob] = []
        for begin in range(0, len(rows.targets), PROMPT_LOGPROB_ROWS):
            targets = rows.targets[begin:begin + PROMPT_LOGPROB_ROWS]
            start = rows.offset + begin
            logits = model.compute_logits(hidden[start:start + len(targets)])
            if logits is None:
                continue
            all_logprobs = logits.log_softmax(dim=-1)
            target = torch.tensor(targets, device=all_logprobs.device)
            chosen = all_logprobs.gather(1, target[:, None])
            ranks = (all_logprobs > chosen).sum(dim=1) + 1
            chosen_list, rank_list = chosen[:, 0].tolist(), ranks.tolist()
            tops = [{} for _ in targets]
            if rows.top:
                values, ids = all_logprobs.topk(rows.top, dim=-1)
                tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            logprobs += [Logprob(t, lp, top, rank) for t, lp, top, rank in zip(targets, chosen_list, tops, rank_list)]
        if logprobs:
            found[rows.seq_id] = (rows.first, logprobs)
    return found

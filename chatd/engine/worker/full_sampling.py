"""The sampler's path for any step with a row that is not plain greedy: bans and penalties
(penalties.py), grammar masks (grammar_masks.py), then the argmax of greedy rows and a draw for
each sampled row, and the logprobs asked for (logprobs.py).

What a sampled row may draw (temperature, top-k, top-p, min-p) is sampling_choices.py's, batched,
for logits on a GPU; where the logits are on a CPU, sampled rows are worked out one by one in numpy
(host_sampling.py): the same choices, at a fraction of the cost of torch's small operations.
Rows are sampler.py's SamplingRows.
"""

from __future__ import annotations

import torch

from chatd.engine.worker.grammar_masks import apply_grammars
from chatd.engine.worker.host_sampling import host_choices, host_draw
from chatd.engine.worker.logprobs import logprob_tensors
from chatd.engine.worker.penalties import apply_penalties
from chatd.engine.worker.sampling_choices import MIN_TEMPERATURE, draw, sampling_choices, select_rows


def sample_rows(logits: torch.Tensor, rows: list) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """The token of each row of `logits` ([B, V]) as [B] on its device, the logprob tensors of the
    rows that want logprobs, and which rows those are."""
    raw_logits = logits.float()
    logits = apply_penalties(raw_logits, rows)
    logits = apply_grammars(logits, rows)

    sampled_rows = [i for i, row in enumerate(rows) if not row.greedy]
    if len(sampled_rows) < len(rows):
        token_ids = logits.argmax(dim=-1)  # [B]
    else:
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if sampled_rows and logits.device.type == "cpu":
        token_ids[sampled_rows] = torch.tensor(_draw_on_host(logits, rows, sampled_rows))
    elif sampled_rows:
        subset = [rows[i] for i in sampled_rows]
        # Each row's uniform drawn in row order, so a sequence whose rows are one per position
        # (a verify step) uses its stream's numbers in the order it would one step at a time.
        uniforms = torch.cat([draw_uniform(row.generator, logits.device) for row in subset])
        for part in sampling_choices(select_rows(logits, sampled_rows), subset):
            index = torch.tensor([sampled_rows[j] for j in part.rows], device=logits.device)
            token_ids[index] = draw(part, uniforms[torch.tensor(part.rows, device=logits.device)])

    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    logprobs = logprob_tensors(raw_logits, token_ids, wanted, rows) if wanted else []
    return token_ids, logprobs, wanted


def _draw_on_host(logits: torch.Tensor, rows: list, sampled: list[int]) -> list[int]:
    """The tokens of the `sampled` rows, each worked out alone in numpy (host_sampling.py)."""
    host_logits = logits.numpy()  # [B, V], CPU float32
    return [host_draw(host_choices(host_logits[i], rows[i].params, MIN_TEMPERATURE),
                      draw_uniform(rows[i].generator, logits.device).item())
            for i in sampled]


def draw_uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) from a row's generator, as a [1] tensor on `device`."""
    # Made on the generator's own device (a CPU generator cannot fill a CUDA tensor), then moved.
    # A row without a generator falls back to torch's global RNG: random, but not reproducible.
    where = generator.device if generator is not None else device
    return torch.rand(1, device=where, generator=generator).to(device)

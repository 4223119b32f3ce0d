"""The logprobs a request asked for (SamplingParams.logprobs): the sampled token's, and its most
likely alternatives', from the model's raw distribution (log_softmax of the logits before bans,
penalties, temperature and truncation, as vLLM reports them by default).

`logprob_tensors` computes them on the device when the step samples; `host_logprobs` turns them
into Logprob values once the step's draws are on the host. A row that asks for none costs nothing.
"""

from __future__ import annotations

import torch

from chatd.engine.params import Logprob


def logprob_tensors(raw_logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int], rows: list) -> list[torch.Tensor]:
    """For the rows that asked: the sampled token's logprob [W] and the top-k values and ids [W, max_k]."""
    index = torch.tensor(wanted, device=raw_logits.device)
    logprobs = raw_logits[index].log_softmax(dim=-1)  # [W, V]
    sampled = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)  # [W]
    max_k = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [W, max_k], sorted descending
    return [sampled, top_values, top_ids]


def host_logprobs(token_ids: list[int], wanted: list[int], tensors: list[torch.Tensor], rows: list) -> list[Logprob | None]:
    """On the host, from `logprob_tensors`' values: one Logprob per row that asked, None for the others."""
    result: list[Logprob | None] = [None] * len(rows)
    if not wanted:
        return result
    sampled, top_values, top_ids = (t.tolist() for t in tensors)
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        top = dict(zip(top_ids[j][:k], top_values[j][:k]))
        result[i] = Logprob(token_id=token_ids[i], logprob=sampled[j], top=top)
    return result

"""What each sampled row may draw, worked out in a batch on the device: temperature, top-k, top-p
and min-p in transformers' order, then one draw per row from its own uniform number.

This is the sampler's path for logits on a GPU (on a CPU, host_sampling.py makes the same choices in
numpy, row by row). A greedy row never comes here: its token is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this, dividing logits by the temperature can overflow float32; the limit T -> 0 is
# greedy anyway (vLLM draws the same line).
MIN_TEMPERATURE = 1e-5


# A row that truncates (top-k, top-p) is worked out over its most likely tokens only. Sorting
# SmolLM2's 49152 logits took 3.8 ms a row on the 2-core machine (40% of a decode step); their
# top 256 (`topk`) 0.12-0.27 ms, top 4096 0.8 ms. Over 320 of its chat steps at temperature 1,
# top_p 0.95 kept at most 256 tokens in 79% of them and at most 4096 in all. A row whose kept set
# could reach past its candidates looks wider, up to its whole vocabulary sorted, so the result is
# the same either way.
CANDIDATES = 256
WIDER_CANDIDATES = 4096


@dataclass
class Choices:
    """Some rows' allowed tokens and their probabilities, for `draw`.

    probs [R, C] sum to 1 per row, zero where a token is cut; token_ids [R, C] names the token of
    each column, or is None where column j is token j (the whole vocabulary in its own order)."""

    rows: list[int]  # which rows of the batch
    probs: torch.Tensor
    token_ids: torch.Tensor | None


def sampling_choices(logits: torch.Tensor, rows: list) -> list[Choices]:
    """Temperature, top-k, top-p and min-p (in transformers' order): what each row may draw.

    Rows without top-k and top-p keep the vocabulary in its order. Rows with either keep their
    tokens most likely first: their top CANDIDATES (or top_k, if larger), or where top-p could
    keep more than those, their top WIDER_CANDIDATES, or their whole vocabulary sorted. A row's
    choices do not depend on the other rows of its batch, so neither does what it draws."""
    # logits: [S, V] (already penalized)
    device = logits.device
    vocab_size = logits.shape[1]
    temperatures = [max(row.params.temperature, MIN_TEMPERATURE) for row in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
    truncates = [bool(row.params.top_k) or row.params.top_p < 1.0 for row in rows]
    whole = [i for i, t in enumerate(truncates) if not t]
    cut = [i for i, t in enumerate(truncates) if t]
    choices = []
    if whole:
        probs = select_rows(logits, whole).softmax(dim=-1)
        choices.append(Choices(whole, _min_p(probs, [rows[i] for i in whole]), None))
    if cut:
        pending, pending_logits = cut, select_rows(logits, cut)
        top_k = max(rows[i].params.top_k for i in cut)
        for width in (max(CANDIDATES, top_k), max(WIDER_CANDIDATES, top_k), vocab_size):
            width = min(width, vocab_size)
            if width < vocab_size:
                values, token_ids = pending_logits.topk(width, dim=-1)  # most likely first
            else:
                values, token_ids = pending_logits.sort(dim=-1, descending=True)
            probs, covered = _top_k_top_p(values, pending_logits, [rows[i] for i in pending], complete=width == vocab_size)
            if all(covered):
                choices.append(Choices(pending, probs, token_ids))
                break
            decided = [j for j, ok in enumerate(covered) if ok]
            if decided:
                choices.append(Choices([pending[j] for j in decided], probs[decided], token_ids[decided]))
            left = [j for j, ok in enumerate(covered) if not ok]  # top-p may keep more: look wider
            pending, pending_logits = [pending[j] for j in left], pending_logits[left]
    return choices


def sampling_probs(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """`sampling_choices` as one [S, V] table of probabilities over the vocabulary (zero where
    cut): the form transformers' warpers give, to compare against."""
    dense = torch.zeros_like(logits)
    for part in sampling_choices(logits, rows):
        index = torch.tensor(part.rows, device=logits.device)
        if part.token_ids is None:
            dense[index] = part.probs
        else:
            dense[index] = torch.zeros_like(dense[index]).scatter_(1, part.token_ids, part.probs)
    return dense


def draw(choices: Choices, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `choices`, each from its uniform number ([R], in [0, 1), drawn from the
    row's own generator) by inverse transform: the first column whose cumulative probability passes it."""
    # float64 sums, so a tail of tiny probabilities keeps its share; a point short of the
    # total always lands on a column with probability > 0.
    cumulative = choices.probs.double().cumsum(dim=-1)  # [R, C]
    column = torch.searchsorted(cumulative, (uniform.double() * cumulative[:, -1]).unsqueeze(1), right=True)
    if choices.token_ids is None:
        return column.squeeze(1)
    return choices.token_ids.gather(1, column).squeeze(1)


def select_rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    return logits if len(index) == len(logits) else logits[torch.tensor(index, device=logits.device)]


def _top_k_top_p(values: torch.Tensor, logits: torch.Tensor, rows: list,
                 complete: bool) -> tuple[torch.Tensor, list[bool]]:
    """Top-k, then top-p, then min-p over each row's most likely tokens `values` ([R, C], sorted
    descending) of its `logits` ([R, V]); `complete`: they are the whole vocabulary.

    Returns their probabilities [R, C] (zero where cut) and, per row, whether the C tokens decide
    it: top-p reaches past them only if they hold less than top_p of the mass, top-k only if
    the k-th value is tied with values past them."""
    device = values.device
    num_rows, width = values.shape
    top_ks = [min(row.params.top_k, width) for row in rows]
    covered = [True] * num_rows
    if any(top_ks):
        kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in top_ks], device=device).unsqueeze(1))
        kth = kth.masked_fill(torch.tensor([[k == 0] for k in top_ks], device=device), float("-inf"))
        # `<` keeps every token tied with the k-th, as transformers' TopKLogitsWarper does.
        values = values.masked_fill(values < kth, float("-inf"))
        if not complete:
            tied = (values[:, -1:] == kth).squeeze(1).tolist()
            covered = [not (k and t) for k, t in zip(top_ks, tied)]
    # Top-k renormalizes over its kept tokens, all of which are here; otherwise the whole vocabulary counts.
    if all(top_ks):
        normalizer = values.logsumexp(dim=-1)
    elif not any(top_ks):
        normalizer = logits.logsumexp(dim=-1)
    else:
        with_k = torch.tensor([bool(k) for k in top_ks], device=device)
        normalizer = torch.where(with_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - normalizer.unsqueeze(1)).exp()
    top_ps = [row.params.top_p for row in rows]
    if any(p < 1.0 for p in top_ps):
        # Keep a token while the tokens before it hold less than top_p: the smallest set with
        # mass >= top_p (transformers drops those whose ascending cumulative mass is <= 1 - top_p).
        limit = torch.tensor(top_ps, device=device).unsqueeze(1)
        before = probs.cumsum(dim=-1) - probs
        drop = (before >= limit) & (limit < 1.0)
        drop[:, 0] = False  # always keep the most likely token
        if not complete:
            mass = probs.sum(dim=-1).tolist()
            covered = [ok and (bool(k) or p >= 1.0 or m >= p) for ok, k, p, m in zip(covered, top_ks, top_ps, mass)]
        probs = probs.masked_fill(drop, 0.0)
    return _min_p(probs / probs.sum(dim=-1, keepdim=True), rows), covered


def _min_p(probs: torch.Tensor, rows: list) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (strict when the model is sure)."""
    min_ps = [row.params.min_p for row in rows]
    if not any(min_ps):
        return probs
    threshold = torch.tensor(min_ps, device=probs.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)

"""One row's sampling worked out in numpy: how the sampler draws a token when the logits are on a CPU.

`sampler.py` works out a batch's choices with torch operations, which is what pays on a GPU. On
a CPU a decode step has few rows, and each of the ~40 small torch operations a row goes through
costs its dispatch on caches the step has just flushed: temperature 0.7 and top_p 0.9 over
SmolLM2's 49152 logits took 1.24 ms a token there, 11% of a one-stream step (2-core EPYC). The
same choices in numpy, row by row, take a fraction of that (benchmarks/README.md).

They are the same choices: temperature, then top-k (keeping every token tied with the k-th),
top-p, min-p, in transformers' order, as `sampling_choices` makes them. Only how a row finds its
most likely tokens differs: rather than the top 256 by count (torch.topk, 140-210 us), the tokens
within `MARGINS[0]` of the most likely one on the temperature-scaled scale (a comparison, 16 us),
sorted. A row whose kept set could reach past them looks again with a wider margin, then over
its whole vocabulary sorted, so what a row may draw never depends on the margin. Each row is
worked out alone, so a seeded row draws the same tokens alone or in any batch.
"""

from __future__ import annotations

import numpy as np

from chatd.engine.params import SamplingParams

# On the temperature-scaled logits: a token this far below the most likely one is at most e^-12
# (6e-6) as likely; the second margin, e^-24. Past those, the whole vocabulary is sorted.
MARGINS = (12.0, 24.0)


def host_choices(logits: np.ndarray, params: SamplingParams, min_temperature: float) -> tuple[np.ndarray | None, np.ndarray]:
    """What one row may draw: (token ids, most likely first, or None where column j is token j;
    their probabilities, float64, summing to 1, zero where a token is cut)."""
    # logits: [V] float32, already penalized
    temperature = max(params.temperature, min_temperature)
    scaled = logits / np.float32(temperature) if temperature != 1.0 else logits
    peak = scaled.max()
    shifted = np.exp(scaled - peak)  # [V], float32: each token's likelihood relative to the most likely
    if not params.top_k and params.top_p >= 1.0:  # nothing truncates: the vocabulary in its order
        return None, _min_p(shifted.astype(np.float64) / shifted.sum(dtype=np.float64), params.min_p)
    log_total = peak + np.log(shifted.sum(dtype=np.float64))  # the whole vocabulary's normalizer
    for margin in (*MARGINS, None):
        if margin is None:
            token_ids = np.argsort(-scaled, kind="stable")
        else:
            token_ids = np.flatnonzero(scaled >= peak - margin)
            token_ids = token_ids[np.argsort(-scaled[token_ids], kind="stable")]
        probs = _top_k_top_p(scaled[token_ids].astype(np.float64), params, log_total, complete=margin is None)
        if probs is not None:
            return token_ids, _min_p(probs, params.min_p)
    raise AssertionError("the whole vocabulary decides every row")


def host_draw(choices: tuple[np.ndarray | None, np.ndarray], uniform: float) -> int:
    """The token whose cumulative probability first passes `uniform` (in [0, 1)) of the total."""
    token_ids, probs = choices
    cumulative = np.cumsum(probs)
    column = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
    column = min(column, len(probs) - 1)  # a total rounded just above the last sum
    return column if token_ids is None else int(token_ids[column])


def _top_k_top_p(values: np.ndarray, params: SamplingParams, log_total: float, complete: bool) -> np.ndarray | None:
    """Top-k then top-p over a row's most likely tokens `values` (sorted descending, float64):
    their probabilities, or None where the tokens past them could still be kept."""
    top_k = params.top_k
    if top_k:
        if len(values) < top_k and not complete:
            return None  # the k-th (and its ties) may lie past them; once there, every tie is here too
        kth = values[min(top_k, len(values)) - 1]
        values = np.where(values < kth, -np.inf, values)  # ties with the k-th stay, as transformers keeps them
        kept = values[np.isfinite(values)]
        log_total = kept.max() + np.log(np.exp(kept - kept.max()).sum())  # top-k renormalizes over what it keeps
    probs = np.exp(values - log_total)
    if params.top_p < 1.0:
        if not top_k and not complete and probs.sum() < params.top_p:
            return None  # top-p keeps tokens past these
        before = np.cumsum(probs) - probs
        drop = before >= params.top_p
        drop[0] = False  # the most likely token always stays
        probs[drop] = 0.0
    return probs / probs.sum()


def _min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens less likely than min_p times the most likely one."""
    if not min_p:
        return probs
    probs = np.where(probs < min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()

"""host_sampling: one row's choices in numpy are the batched torch choices, and transformers' warpers.

The sampler uses this path wherever the logits are on a CPU; `sampling_probs` (the batched torch
path, itself checked against transformers in test_sampler.py) and transformers' warpers are the
references.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from chatd.engine import SamplingParams
from chatd.engine.worker.host_sampling import MARGINS, host_choices, host_draw
from chatd.engine.worker.sampling_choices import MIN_TEMPERATURE, sampling_probs
from tests.engine.test_sampler import hf_probs, make_row, mixed_logits, random_params

VOCAB = 2048


def dense(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """host_choices for one row [1, V] as a [1, V] table of probabilities (zero where cut)."""
    token_ids, probs = host_choices(logits[0].numpy(), params, MIN_TEMPERATURE)
    table = np.zeros(logits.shape[1])
    if token_ids is None:
        table[:] = probs
    else:
        table[token_ids] = probs
    return torch.from_numpy(table).float()[None]


def test_every_setting_gives_the_batched_choices():
    """Random temperature, top-k, top-p and min-p over peaked rows and flat ones."""
    rng = random.Random(3)
    logits = mixed_logits(40, VOCAB, seed=21)
    for i in range(len(logits)):
        row = make_row(**random_params(rng))
        ours = dense(logits[i : i + 1], row.params)
        batched = sampling_probs(logits[i : i + 1], [row])
        assert torch.equal(ours > 0, batched > 0), f"row {i} {row.params}: the same tokens survive"
        torch.testing.assert_close(ours, batched, atol=1e-6, rtol=1e-4)


def test_a_row_looks_wider_only_where_its_kept_set_could_reach_past_the_margin():
    """Top-p on a peaked row: decided within the first margin. Top-k past what that margin holds:
    the second. Top-k past both: the whole vocabulary. All as transformers has them. (Top-p alone
    needs the second margin only where some 30 thousand tokens lie just past the first.)"""
    logits = torch.full((3, VOCAB), -40.0)
    logits[:, :30] = torch.linspace(10.0, 8.0, 30)  # the rest e^-48 as likely, or e^-25
    logits[1:, 30:230] = 10.0 - (MARGINS[0] + 3.0)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=100), SamplingParams(top_k=1000)]
    widths = [len(host_choices(logits[i].numpy(), params[i], MIN_TEMPERATURE)[0]) for i in range(3)]
    assert widths == [30, 230, VOCAB]
    for i in range(3):
        theirs = hf_probs(logits[i : i + 1], params[i])
        ours = dense(logits[i : i + 1], params[i])
        assert torch.equal(ours > 0, theirs > 0)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-4)


def test_top_k_keeps_every_token_tied_with_the_kth_even_past_the_margin():
    logits = torch.full((1, VOCAB), -60.0)
    logits[0, :10] = torch.linspace(3.0, 2.0, 10)
    logits[0, 100:612] = 3.0 - (MARGINS[0] + 1.0)  # 512 tokens tied with the 20th best, past the first margin
    params = SamplingParams(top_k=20)
    theirs = hf_probs(logits, params)
    assert (theirs > 0).sum().item() == 10 + 512
    ours = dense(logits, params)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-4)


def test_banned_tokens_stay_out_whatever_the_setting():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, ::2] = float("-inf")  # half the vocabulary banned (as a grammar mask would)
    for params in (SamplingParams(), SamplingParams(top_k=5000), SamplingParams(top_p=0.999, temperature=2.0)):
        ours = dense(logits, params)
        assert ours[0, ::2].sum().item() == 0.0
        torch.testing.assert_close(ours.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("token_ids", [None, np.array([7, 3, 9, 1])])
def test_the_draw_is_the_first_column_past_the_uniform(token_ids):
    probs = np.array([0.5, 0.0, 0.25, 0.25])
    names = token_ids if token_ids is not None else np.arange(4)
    assert host_draw((token_ids, probs), 0.0) == names[0]
    assert host_draw((token_ids, probs), 0.4999) == names[0]
    assert host_draw((token_ids, probs), 0.5) == names[2]  # never the zero column
    assert host_draw((token_ids, probs), 0.9999999) == names[3]

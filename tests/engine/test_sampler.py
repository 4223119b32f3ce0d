"""Sampler tests: transformers' own logits processors are the reference wherever one exists."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chatd.engine import SamplingParams
from chatd.engine.worker.penalties import apply_penalties
from chatd.engine.worker.sampler import Sampler, SamplingRow
from chatd.engine.worker.sampling_choices import CANDIDATES, WIDER_CANDIDATES, sampling_choices, sampling_probs

VOCAB = 64


def make_row(seed: int | None = 0, prompt=(), output=(), banned=(), device="cpu", **params) -> SamplingRow:
    """A row with its own generator seeded from `seed` (None: no generator, as for greedy)."""
    sampling = SamplingParams(**params)
    sampling.validate()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    return SamplingRow(sampling, list(prompt), list(output), generator, tuple(banned))


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order, for one row of logits [1, V]."""
    no_ids = torch.zeros(1, 0, dtype=torch.long)
    scores = TemperatureLogitsWarper(params.temperature)(no_ids, logits)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(no_ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(no_ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(no_ids, scores)
    return scores.softmax(dim=-1)


def random_params(rng: random.Random) -> dict:
    return dict(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 20]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.1]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
    )


# --- penalties -------------------------------------------------------------------------------


def test_no_params_leave_logits_untouched():
    logits = random_logits(3)
    rows = [make_row(), make_row(temperature=0.0, seed=None), make_row(top_k=3)]
    assert torch.equal(apply_penalties(logits, rows), logits)


def test_repetition_penalty_hand_checked():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    row = make_row(prompt=[0, 1], output=[2, 2], repetition_penalty=2.0)
    # Seen positive logits are halved, seen negative ones doubled; token 3 was never seen.
    assert apply_penalties(logits, [row]).tolist() == [[0.5, -2.0, 1.0, 0.5]]


def test_repetition_penalty_matches_transformers():
    logits = random_logits(4, seed=1)
    rng = random.Random(1)
    rows = []
    for penalty in [1.3, 0.7, 1.0, 2.0]:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
        rows.append(make_row(prompt=prompt, output=output, repetition_penalty=penalty))
    ours = apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        input_ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
        theirs = RepetitionPenaltyLogitsProcessor(row.params.repetition_penalty)(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], theirs)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    row = make_row(prompt=[0, 0, 4], output=[1, 1, 3], presence_penalty=1.0, frequency_penalty=0.5)
    # token 1: 2 * 0.5 + 1 = 2; token 3: 0.5 + 1 = 1.5; prompt-only tokens 0 and 4 untouched.
    assert apply_penalties(logits, [row]).tolist() == [[0.0, -2.0, 0.0, -1.5, 0.0]]


def test_negative_presence_penalty_encourages_repeats():
    row = make_row(output=[2], presence_penalty=-2.0, temperature=0.0, seed=None)
    assert Sampler()(torch.tensor([[1.0, 0.0, 0.0]]), [row]).token_ids == [2]


def test_penalties_apply_per_row():
    logits = torch.zeros(2, 4)
    rows = [make_row(output=[1], frequency_penalty=1.0), make_row(output=[2])]
    assert apply_penalties(logits, rows).tolist() == [[0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


# --- greedy and bans -------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(8, seed=2)
    rows = [make_row(seed=None, temperature=0.0) for _ in range(8)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_ties_go_to_the_first_most_likely_token():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 5.0]])
    rows = [make_row(seed=None, temperature=0.0) for _ in range(3)]
    assert Sampler()(logits, rows).token_ids == [1, 0, 3] == logits.argmax(dim=-1).tolist()


def test_an_all_greedy_batch_still_applies_each_rows_bans_and_penalties():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [make_row(seed=None, temperature=0.0),
            make_row(seed=None, temperature=0.0, banned=(0,)),
            make_row(seed=None, temperature=0.0, output=[0], frequency_penalty=2.0)]
    assert Sampler()(logits, rows).token_ids == [0, 1, 1]


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    logits = random_logits(6, seed=3)
    rows = [make_row(seed=None, temperature=0.0) if i % 2 else make_row(seed=i, temperature=1.5) for i in range(6)]
    tokens = Sampler()(logits, rows).token_ids
    assert tokens[1::2] == logits.argmax(dim=-1)[1::2].tolist()


def test_top_k_1_equals_greedy():
    logits = random_logits(16, seed=4)
    rows = [make_row(seed=i, temperature=1.5, top_k=1) for i in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_still_keeps_the_most_likely_token():
    logits = random_logits(16, seed=12)
    rows = [make_row(seed=i, top_p=1e-9) for i in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]]).repeat(200, 1)
    banned = (0, 1)
    rows = [make_row(seed=i, banned=banned, temperature=2.0) for i in range(199)]
    rows.append(make_row(seed=None, banned=banned, temperature=0.0))
    tokens = Sampler()(logits, rows).token_ids
    assert not set(tokens) & set(banned)
    assert tokens[-1] == 2  # greedy picks the best token that is not banned


# --- truncation against transformers ---------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(top_k=5),
        dict(top_k=5, temperature=1.3),
        dict(top_p=0.9),
        dict(top_p=0.3, temperature=0.5),
        dict(top_k=10, top_p=0.8),
        dict(min_p=0.1),
        dict(top_k=20, top_p=0.95, min_p=0.05, temperature=1.2),
        dict(top_k=200),  # larger than the vocabulary
    ],
)
def test_sampling_probs_match_transformers(params):
    logits = random_logits(8, seed=5)
    rows = [make_row(**params) for _ in range(8)]
    ours = sampling_probs(logits, rows)
    for i in range(8):
        theirs = hf_probs(logits[i : i + 1], rows[i].params)
        assert torch.equal(ours[i : i + 1] > 0, theirs > 0), "the same tokens survive truncation"
        torch.testing.assert_close(ours[i : i + 1], theirs)


def test_sampling_probs_mixed_batch_match_transformers():
    """Each row gets its own params even when the batch mixes top-k-only, top-p and none."""
    rng = random.Random(6)
    logits = random_logits(32, seed=6)
    rows = [make_row(**random_params(rng)) for _ in range(32)]
    ours = sampling_probs(logits, rows)
    for i, row in enumerate(rows):
        theirs = hf_probs(logits[i : i + 1], row.params)
        assert torch.equal(ours[i : i + 1] > 0, theirs > 0)
        torch.testing.assert_close(ours[i : i + 1], theirs)


def test_top_k_without_top_p_matches_transformers():
    """The top-k-only path (topk instead of a full sort), with a mix of k and k=0."""
    logits = random_logits(4, seed=7)
    rows = [make_row(top_k=k) for k in (0, 1, 7, 3)]
    ours = sampling_probs(logits, rows)
    for i, row in enumerate(rows):
        torch.testing.assert_close(ours[i : i + 1], hf_probs(logits[i : i + 1], row.params))


@settings(max_examples=150, deadline=None)
@given(
    # Distinct logits: with ties, which of two equal tokens top-p drops depends on sort order.
    logits=st.lists(st.integers(-300, 300), min_size=2, max_size=40, unique=True),
    temperature=st.sampled_from([0.1, 0.5, 1.0, 2.0]),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_never_samples_outside_the_allowed_set(logits, temperature, top_k, top_p, min_p, seed):
    logits_t = torch.tensor([logits], dtype=torch.float32) / 10
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed = set(torch.nonzero(hf_probs(logits_t, SamplingParams(**params))[0] > 0).flatten().tolist())
    rows = [make_row(seed=seed + i, **params) for i in range(8)]
    tokens = Sampler()(logits_t.repeat(8, 1), rows).token_ids
    assert set(tokens) <= allowed


def mixed_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Even rows peaked (a few tokens hold most of the mass), odd rows flat (top-p keeps more
    than CANDIDATES tokens): both ways `sampling_choices` decides a row."""
    logits = random_logits(rows, vocab, seed=seed, scale=1.0)
    logits[0::2] *= 6.0
    logits[1::2] *= 0.3
    return logits


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=0.9),
        dict(top_p=0.5, temperature=0.7),
        dict(top_k=40, top_p=0.95),
        dict(top_k=1000, top_p=0.9),  # more than CANDIDATES
        dict(top_k=300),
        dict(top_p=0.8, min_p=0.02, temperature=1.3),
    ],
)
def test_truncation_over_a_real_vocabulary_matches_transformers(params):
    """At a model's vocabulary size only the most likely tokens are looked at, unless top-p
    could keep more: either way the same tokens survive with the same probabilities."""
    vocab = 8 * CANDIDATES
    logits = mixed_logits(8, vocab, seed=13)
    rows = [make_row(**params) for _ in range(8)]
    ours = sampling_probs(logits, rows)
    for i in range(8):
        theirs = hf_probs(logits[i : i + 1], rows[i].params)
        assert torch.equal(ours[i : i + 1] > 0, theirs > 0), f"row {i}: the same tokens survive truncation"
        torch.testing.assert_close(ours[i : i + 1], theirs)


def test_each_row_is_decided_over_as_few_tokens_as_it_needs():
    """A peaked row over CANDIDATES tokens, a row whose top-p set is wider over WIDER_CANDIDATES,
    a flat row over its whole vocabulary; all three as transformers would have them."""
    vocab = 4 * WIDER_CANDIDATES
    logits = random_logits(3, vocab, seed=14, scale=0.1)
    logits[0, :50] += 8.0 + torch.linspace(0.0, 1.0, 50)
    logits[1, : 2 * CANDIDATES] += 7.0 + torch.linspace(0.0, 0.3, 2 * CANDIDATES)
    rows = [make_row(top_p=0.9) for _ in range(3)]
    widths = {tuple(part.rows): part.probs.shape[1] for part in sampling_choices(logits, rows)}
    assert widths == {(0,): CANDIDATES, (1,): WIDER_CANDIDATES, (2,): vocab}
    ours = sampling_probs(logits, rows)
    for i in range(3):
        theirs = hf_probs(logits[i : i + 1], rows[i].params)
        assert torch.equal(ours[i : i + 1] > 0, theirs > 0)
        torch.testing.assert_close(ours[i : i + 1], theirs)


def test_top_k_ties_past_the_candidates_are_kept():
    """transformers keeps every token tied with the k-th; ties that run past the candidates too."""
    vocab = 4 * CANDIDATES
    logits = torch.full((1, vocab), -5.0)
    logits[0, :10] = torch.linspace(3.0, 2.0, 10)
    logits[0, 100 : 100 + 2 * CANDIDATES] = 1.0  # 512 tokens tied with the 20th best
    row = make_row(top_k=20)
    ours = sampling_probs(logits, [row])
    theirs = hf_probs(logits, row.params)
    assert (theirs > 0).sum().item() == 10 + 2 * CANDIDATES
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs)


def test_seeded_row_draws_the_same_whatever_its_batch_needs():
    """A batch with a top_k past CANDIDATES (wider candidates) and flat rows (sorted whole)
    around a seeded row does not change what the row draws."""
    vocab = 8 * CANDIDATES
    target = dict(temperature=0.8, top_p=0.9)
    alone_row, batch_row = make_row(seed=77, **target), make_row(seed=77, **target)
    others = [make_row(seed=1, top_k=1000, top_p=0.9), make_row(seed=2, top_p=0.95), make_row(seed=3)]
    sampler = Sampler()
    for step in range(25):
        logits = mixed_logits(4, vocab, seed=200 + step)
        logits[0] = random_logits(1, vocab, seed=300 + step, scale=4.0)
        alone_row.output_token_ids += sampler(logits[:1], [alone_row]).token_ids
        batch_row.output_token_ids.append(sampler(logits, [batch_row, *others]).token_ids[0])
    assert batch_row.output_token_ids == alone_row.output_token_ids
    assert len(set(alone_row.output_token_ids)) > 1, "the row really sampled"


def test_empirical_distribution_over_candidates_matches():
    """Draws from a row's most likely tokens (top-p over a vocabulary past CANDIDATES) come out
    as often as transformers' probabilities say."""
    draws, vocab = 20_000, 4 * CANDIDATES
    logits = random_logits(1, vocab, seed=15, scale=1.0)
    logits[0, :6] = torch.tensor([4.0, 3.5, 3.0, 2.5, 2.0, 1.5])
    params = SamplingParams(top_p=0.9, temperature=0.9)
    generator = torch.Generator().manual_seed(8)
    rows = [SamplingRow(params, [], [], generator) for _ in range(draws)]
    tokens = Sampler()(logits.expand(draws, -1), rows).token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=vocab).float() / draws
    expected = hf_probs(logits, params)[0]
    assert set(tokens) <= set(torch.nonzero(expected > 0).flatten().tolist())
    assert (frequencies - expected).abs().max().item() < 0.016, (frequencies[:8], expected[:8])


# --- the draw --------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.4, top_k=3)])
def test_empirical_distribution_matches(params):
    draws = 20_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0]])
    generator = torch.Generator().manual_seed(7)
    # Rows may share a generator: each consumes its own stretch of the stream.
    rows = [SamplingRow(SamplingParams(**params), [], [], generator) for _ in range(draws)]
    tokens = Sampler()(logits.expand(draws, -1), rows).token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=5).float() / draws
    expected = hf_probs(logits, SamplingParams(**params))[0]
    # 4.5 standard errors of a frequency estimated from 20k draws is at most ~0.016.
    assert (frequencies - expected).abs().max().item() < 0.016, (frequencies, expected)


def other_rows(count: int, seed: int) -> list[SamplingRow]:
    """Rows with mixed params (greedy, penalties, top-k/p, min-p) to share a batch with."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        params = {**random_params(rng), "temperature": rng.choice([0.0, 0.7, 1.0])}
        params["repetition_penalty"] = rng.choice([1.0, 1.2])
        params["presence_penalty"] = rng.choice([0.0, 0.5])
        generator_seed = None if params["temperature"] == 0.0 else rng.randrange(2**31)
        rows.append(make_row(seed=generator_seed, prompt=[5, 6], banned=rng.choice([(), (0,)]), **params))
    return rows


def test_seeded_row_is_reproducible_alone_or_in_a_batch():
    target = dict(temperature=0.9, top_p=0.95, frequency_penalty=0.3, prompt=[1, 2, 3])
    alone_row = make_row(seed=1234, **target)
    batch_row = make_row(seed=1234, **target)
    others = other_rows(31, seed=0)
    batch = others[:13] + [batch_row] + others[13:]
    sampler = Sampler()
    for step in range(20):
        logits = random_logits(32, seed=100 + step, scale=2.0)
        alone_row.output_token_ids += sampler(logits[13:14], [alone_row]).token_ids
        for row, token in zip(batch, sampler(logits, batch).token_ids):
            row.output_token_ids.append(token)
    assert batch_row.output_token_ids == alone_row.output_token_ids
    assert len(set(alone_row.output_token_ids)) > 1, "the row really sampled"


def test_same_seed_same_tokens_different_seed_different_tokens():
    rows = [make_row(seed=42), make_row(seed=42), make_row(seed=43)]
    logits = random_logits(1, seed=8, scale=0.5).repeat(3, 1)
    first, second, third = zip(*[Sampler()(logits, rows).token_ids for _ in range(30)])
    assert first == second
    assert first != third


def test_row_without_generator_still_samples():
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=2), [], [], None)]
    token = Sampler()(torch.tensor([[0.0, 3.0, 3.0, -9.0]]), rows).token_ids[0]
    assert token in (1, 2)


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution():
    logits = random_logits(3, seed=9)
    rows = [
        make_row(seed=1, output=[0, 1], logprobs=5, temperature=0.5, top_k=3, frequency_penalty=1.0),
        make_row(seed=None, logprobs=2, temperature=0.0, repetition_penalty=1.5, prompt=[3]),
        make_row(seed=3),
    ]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for i, k in [(0, 5), (1, 2)]:
        logprob = out.logprobs[i]
        assert logprob.token_id == out.token_ids[i]
        assert logprob.logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        values, ids = raw[i].topk(k)
        assert list(logprob.top) == ids.tolist()
        assert list(logprob.top.values()) == pytest.approx(values.tolist(), abs=1e-6)
        assert list(logprob.top.values()) == sorted(logprob.top.values(), reverse=True)


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = random_logits(2, seed=10)
    rows = [make_row(seed=1, logprobs=0), make_row(seed=2, logprobs=3)]
    out = Sampler()(logits, rows)
    assert out.logprobs[0].top == {}
    assert math.isfinite(out.logprobs[0].logprob)
    assert len(out.logprobs[1].top) == 3


def test_no_logprobs_requested():
    out = Sampler()(random_logits(2), [make_row(seed=1), make_row(seed=None, temperature=0.0)])
    assert out.logprobs == [None, None]


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("generator_device", ["cpu", "cuda"])
def test_cuda_logits_reproducible_with_either_generator(generator_device):
    logits = random_logits(32, seed=11).cuda()
    rng = random.Random(11)
    rows = [make_row(seed=i, device=generator_device, output=[1, 2], presence_penalty=0.5, **random_params(rng)) for i in range(32)]
    again = [make_row(seed=i, device=generator_device, output=[1, 2], presence_penalty=0.5, **row_params(r)) for i, r in enumerate(rows)]
    first = Sampler()(logits, rows).token_ids
    alone = [Sampler()(logits[i : i + 1], [again[i]]).token_ids[0] for i in range(32)]
    assert first == alone
    for i, row in enumerate(rows):
        allowed = hf_probs(logits[i : i + 1].cpu(), row.params)[0] > 0
        assert allowed[first[i]]


def row_params(row: SamplingRow) -> dict:
    p = row.params
    return dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)

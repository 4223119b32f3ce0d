"""A prompt's own token logprobs (SamplingParams.prompt_logprobs), computed in the prefill: equal
to transformers' log-softmax over the same random weights, whether the prompt is prefilled in one
step or in chunks, whether its blocks are in the prefix cache or not, for every family."""

from __future__ import annotations

import pytest
import torch

from chatd.engine import SamplingParams
from tests.engine.conftest import _hf_models, make_llm

PROMPT = [(7 * i + 3) % 500 + 2 for i in range(45)]  # 45 tokens: past several blocks of 8


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of its logits at each position, [len(prompt), vocab]."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(path)
    if model is None:
        model = _hf_models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def check_against_hf(found, reference: torch.Tensor, prompt: list[int], top: int) -> None:
    assert len(found) == len(prompt) and found[0] is None
    for position, logprob in enumerate(found[1:]):
        expected = reference[position]
        assert logprob.token_id == prompt[position + 1]
        assert logprob.logprob == pytest.approx(expected[prompt[position + 1]].item(), abs=1e-4)
        assert logprob.rank == int((expected > expected[prompt[position + 1]]).sum()) + 1
        assert len(logprob.top) == top
        if top:
            assert max(logprob.top.values()) == pytest.approx(expected.max().item(), abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prompt_logprobs_equal_transformers_in_one_step_and_in_chunks(model_dirs, family):
    path = model_dirs[family]
    reference = hf_prompt_logprobs(path, PROMPT)
    for options in ({}, {"max_num_batched_tokens": 16}):  # a 45-token prompt in one step, or in chunks of 16
        with make_llm(path, **options) as llm:
            [out] = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
        check_against_hf(out.prompt_logprobs, reference, PROMPT, 3)
        assert len(out.outputs[0].token_ids) == 2  # and the reply is generated as ever


def test_a_cached_prefix_still_gets_its_logprobs_and_other_requests_keep_the_cache(model_dirs):
    path = model_dirs["llama"]
    reference = hf_prompt_logprobs(path, PROMPT)
    with make_llm(path) as llm:
        plain = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([PROMPT], plain)  # its blocks are in the prefix cache now
        [scored] = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        assert scored.num_cached_tokens == 0  # computed, not read from the cache
        check_against_hf(scored.prompt_logprobs, reference, PROMPT, 0)
        [again] = llm.generate([PROMPT], plain)
        assert again.num_cached_tokens == 40 and again.prompt_logprobs is None  # the cache still serves the rest
        # Several choices: the prompt's logprobs once, and each choice generated.
        [two] = llm.generate([PROMPT], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=1))
        check_against_hf(two.prompt_logprobs, reference, PROMPT, 1)
        assert [len(o.token_ids) for o in two.outputs] == [3, 3]


def test_prompt_logprobs_are_bounded_and_named():
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=99).validate()


@pytest.mark.slow
def test_two_ranks_compute_the_prompts_logprobs_one_rank_does(model_dirs):
    """Under tensor parallelism each rank takes part in the logits' gather; rank 0 reports them."""
    path = model_dirs["qwen2"]
    reference = hf_prompt_logprobs(path, PROMPT)
    with make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        [out] = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    check_against_hf(out.prompt_logprobs, reference, PROMPT, 2)

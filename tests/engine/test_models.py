"""Model and loader tests: tiny random checkpoints of each family, transformers' forward as the reference."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from chatd.engine.attention import SdpaBackend, build_step
from chatd.engine.models import (
    LlamaForCausalLM,
    load_model,
    max_model_len,
    resolve_dtype,
    resolve_model_path,
)
from chatd.engine.models.loader import Checkpoint

BLOCK_SIZE = 16
NUM_BLOCKS = 8
PROMPT_LEN = 40  # crosses two block boundaries

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    initializer_range=0.3,  # large weights make logits decisive, so a wrong op shows up clearly
)

# The supported families (chatd.engine.models.demo.FAMILIES) and rope variants of them, as transformers configs.
CONFIG_VARIANTS = {
    "llama": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama3-tied": lambda: LlamaConfig(
        **SMALL,
        tie_word_embeddings=True,
        # original_max_position_embeddings small enough that all three llama3 bands (kept,
        # smoothed, scaled) occur at head_dim 16.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: MistralConfig(**SMALL, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    "qwen2-yarn": lambda: Qwen2Config(
        **SMALL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),  # head_dim != hidden / heads
}

HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


def make_hf_model(family: str, path: Path, **save_kwargs) -> transformers.PreTrainedModel:
    """A tiny random transformers model of `family`, saved as safetensors to `path`."""
    config = CONFIG_VARIANTS[family]()
    torch.manual_seed(0)
    model = HF_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        # transformers initialises norms to 1 and biases to 0; random values make a norm or bias
        # that is skipped or misloaded change the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path, **save_kwargs)
    return model


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for one sequence: [len, vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Chunk:
    """One sequence's new tokens in a step."""

    token_ids: list[int]
    start: int  # position of the first new token = tokens already in the cache
    block_table: list[int]


class PagedRunner:
    """A minimal stand-in for the runner: owns KV caches and builds AttentionMetadata for each step."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        shape = (NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        weight = model.embed_tokens.weight
        self.device = weight.device  # the step's tensors and the caches live where the model does
        self.kv_caches = [
            (torch.zeros(shape, dtype=weight.dtype, device=self.device),
             torch.zeros(shape, dtype=weight.dtype, device=self.device)) for _ in range(model.num_layers)
        ]
        self.backend = SdpaBackend()

    def step(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run one flat batch (decodes first) and return logits for every new token: [T, vocab]."""
        step = build_step(
            [t for chunk in chunks for t in chunk.token_ids],
            starts=[c.start for c in chunks],
            query_lens=[len(c.token_ids) for c in chunks],
            block_tables=[c.block_table for c in chunks],
            block_size=BLOCK_SIZE,
            device=self.device,
        )
        with torch.inference_mode():
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, self.backend)
            return self.model.compute_logits(hidden)


def load_tiny(family: str, path: Path) -> tuple[transformers.PreTrainedModel, LlamaForCausalLM]:
    hf_model = make_hf_model(family, path)
    model, _ = load_model(Checkpoint(path), torch.float32, torch.device("cpu"))
    return hf_model, model


@pytest.mark.parametrize("family", CONFIG_VARIANTS)
def test_full_prompt_logits_match_transformers(family, tmp_path):
    hf_model, model = load_tiny(family, tmp_path)
    ids = prompt(seed=1)
    logits = PagedRunner(model).step([Chunk(ids, 0, [5, 2, 7])])
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", CONFIG_VARIANTS)
def test_prefill_then_decodes_match_transformers(family, tmp_path):
    hf_model, model = load_tiny(family, tmp_path)
    ids, table = prompt(seed=2), [3, 6, 1]
    expected = hf_logits(hf_model, ids)
    runner = PagedRunner(model)
    prefill = runner.step([Chunk(ids[:25], 0, table)])
    torch.testing.assert_close(prefill, expected[:25], atol=1e-4, rtol=1e-4)
    for pos in range(25, len(ids)):
        decode = runner.step([Chunk([ids[pos]], pos, table)])
        torch.testing.assert_close(decode[0], expected[pos], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_and_prefill_chunk_in_one_batch_match_each_alone(family, tmp_path):
    hf_model, model = load_tiny(family, tmp_path)
    a, b = prompt(seed=3, length=31), prompt(seed=4, length=36)
    table_a, table_b = [4, 0], [7, 2, 5]
    runner = PagedRunner(model)
    runner.step([Chunk(a[:30], 0, table_a)])
    runner.step([Chunk(b[:16], 0, table_b)])
    # A decodes its 31st token while B prefills the rest of its prompt (a chunk after a cached block).
    logits = runner.step([Chunk(a[30:], 30, table_a), Chunk(b[16:], 16, table_b)])
    torch.testing.assert_close(logits[0], hf_logits(hf_model, a)[30], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1:], hf_logits(hf_model, b)[16:], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = make_hf_model("llama", tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, _ = load_model(Checkpoint(tmp_path), torch.float32, torch.device("cpu"))
    ids = prompt(seed=5)
    logits = PagedRunner(model).step([Chunk(ids, 0, [0, 1, 2])])
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4)


def test_bfloat16_load_keeps_greedy_tokens(tmp_path):
    hf_model = make_hf_model("qwen2", tmp_path)
    model, _ = load_model(Checkpoint(tmp_path), torch.bfloat16, torch.device("cpu"))
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    ids = prompt(seed=6)
    logits = PagedRunner(model).step([Chunk(ids, 0, [0, 1, 2])])
    assert logits.dtype == torch.float32
    agree = (logits.argmax(-1) == hf_logits(hf_model, ids).argmax(-1)).float().mean()
    assert agree > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_load_keeps_greedy_tokens(tmp_path):
    hf_model = make_hf_model("qwen3", tmp_path)
    model, _ = load_model(Checkpoint(tmp_path), torch.bfloat16, torch.device("cuda"))
    runner = PagedRunner(model)
    ids = prompt(seed=7)
    logits = runner.step([Chunk(ids, 0, [0, 1, 2])]).cpu()
    agree = (logits.argmax(-1) == hf_logits(hf_model, ids).argmax(-1)).float().mean()
    assert agree > 0.9


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(Checkpoint(tmp_path), torch.float32, torch.device("cpu"))


def test_load_weights_rejects_missing_and_unexpected_tensors(tmp_path):
    hf_model = make_hf_model("llama", tmp_path)
    state = dict(hf_model.state_dict())
    model = LlamaForCausalLM(hf_model.config)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.9.mlp.up_proj.weight'"):
        model.load_weights([*state.items(), ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="'model.norm.weight' appears more than once"):
        model.load_weights([*state.items(), ("model.norm.weight", state["model.norm.weight"])])
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match="missing 1 tensors: lm_head.weight"):
        model.load_weights(state.items())


def edit_checkpoint(path: Path, edit) -> None:
    """Rewrite the single-file checkpoint at `path` with `edit` applied to its {name: tensor} dict."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_checkpoint_without_a_k_proj_tensor_names_it(tmp_path):
    # q, k and v load into one fused qkv_proj, but the error still names the checkpoint's tensor.
    make_hf_model("qwen2", tmp_path)
    edit_checkpoint(tmp_path, lambda tensors: tensors.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.k_proj\.bias$"):
        load_model(Checkpoint(tmp_path), torch.float32, torch.device("cpu"))


def test_checkpoint_with_a_misshapen_v_proj_names_it_and_both_shapes(tmp_path):
    make_hf_model("llama", tmp_path)
    name = "model.layers.0.self_attn.v_proj.weight"
    # kv_heads * head_dim = 2 * 16 rows; a q-sized tensor would silently spill into the next shard.
    edit_checkpoint(tmp_path, lambda tensors: tensors.update({name: torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(64, 64\), the model expects \(32, 64\)"):
        load_model(Checkpoint(tmp_path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_projections_hold_the_checkpoint_tensors_in_order(family, tmp_path):
    make_hf_model(family, tmp_path)
    model, _ = load_model(Checkpoint(tmp_path), torch.float32, torch.device("cpu"))
    tensors = load_file(tmp_path / "model.safetensors")
    for i, layer in enumerate(model.layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        # Rows are q, then k, then v: the order forward() splits them back apart.
        for kind in ("weight", "bias") if family == "qwen2" else ("weight",):
            qkv = torch.cat([tensors[f"{attn}.{proj}.{kind}"] for proj in ("q_proj", "k_proj", "v_proj")])
            assert torch.equal(getattr(layer.self_attn.qkv_proj, kind), qkv)
        gate_up = torch.cat([tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)


def test_max_model_len_is_capped_by_an_active_sliding_window():
    assert max_model_len(CONFIG_VARIANTS["llama"]()) == 256
    assert max_model_len(MistralConfig(**SMALL, sliding_window=32)) == 32
    # Qwen2's sliding_window is inert unless use_sliding_window is set.
    assert max_model_len(Qwen2Config(**SMALL, sliding_window=32, use_sliding_window=False)) == 256
    assert max_model_len(Qwen2Config(**SMALL, sliding_window=32, use_sliding_window=True)) == 32
    # yarn stretches the original context by its factor (Qwen2.5's 32k -> 128k): 256 * 4
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    assert max_model_len(Qwen2Config(**SMALL, rope_parameters=yarn)) == 1024


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("auto", cuda, config_dtype=torch.float16) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="'float16' is not supported on cpu; choose one of: auto, float32, bfloat16"):
        resolve_dtype("float16", cpu)
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8", cuda)


def test_resolve_model_path(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="neither a local folder nor a downloadable Hugging Face hub id"):
        resolve_model_path(str(tmp_path / "no" / "such" / "folder"))

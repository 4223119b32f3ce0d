"""Shared factories: tiny random-weight models of each family, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatd.engine import LLM
from chatd.engine.models.demo import FAMILIES, build_model_dir


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random-weight model folder per supported family (weights + the demo tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    return {family: build_model_dir(root / family, family, seed=1) for family in FAMILIES}


@pytest.fixture(scope="session")
def q8_gguf(model_dirs, tmp_path_factory) -> Path:
    """The llama family's random model as a GGUF file of Q8_0 blocks (llama.cpp's 8-bit format)."""
    import gguf

    from tests.engine.test_gguf import write_gguf

    return write_gguf(model_dirs["llama"], tmp_path_factory.mktemp("q8") / "llama.Q8_0.gguf",
                      quant=gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="session")
def q5_1_gguf(model_dirs, tmp_path_factory) -> Path:
    """The llama family's random model as a GGUF file of Q5_1 blocks (5-bit values, a scale and a min per 32 weights)."""
    import gguf

    from tests.engine.test_gguf import write_gguf

    return write_gguf(model_dirs["llama"], tmp_path_factory.mktemp("q5_1") / "llama.Q5_1.gguf",
                      quant=gguf.GGMLQuantizationType.Q5_1)


def make_llm(path: Path, **options) -> LLM:
    """chatd's offline engine on CPU in fp32, with small blocks so prompts cross block boundaries."""
    defaults = dict(device="cpu", dtype="float32", block_size=8, num_blocks=256, max_num_batched_tokens=512)
    return LLM(str(path), **{**defaults, **options})


_hf_models: dict[Path, torch.nn.Module] = {}


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` on the same weights: the reference chatd must equal."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get(path)
    if model is None:
        model = _hf_models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()

"""Rotary position embeddings as the Llama family's checkpoints define them: the settings, the
cos/sin table for every position, and the rotation.

Apart from llama.py because the loader needs the context length the rope allows (`max_positions`)
without the model, and because matching transformers' frequencies bit for bit (llama3, linear and
yarn scaling) is a concern of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Rope types whose frequencies are fixed at load time; "dynamic" and "longrope" change with the
# batch's length, which a precomputed table cannot follow.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def max_positions(config: PretrainedConfig) -> int:
    """The longest context the model's rope supports: linear and yarn scaling stretch the original length."""
    rope = rope_parameters(config)
    if rope["rope_type"] in ("linear", "yarn"):
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        return max(config.max_position_embeddings, int(original * rope["factor"]))
    return config.max_position_embeddings


def rope_parameters(config: PretrainedConfig) -> dict:
    """Rope settings; transformers 5 keeps them (rope_theta included) in `config.rope_parameters`."""
    # transformers 4.x named the dict `rope_scaling` and kept rope_theta beside it.
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def build_rope_cache(config: PretrainedConfig, head_dim: int, device: torch.device | None = None) -> Tensor:
    """cos | sin for every position: [max_positions, head_dim], float32, computed as transformers does."""
    rope = rope_parameters(config)
    rope_type = rope["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim
        inv_freq, attention_scaling = 1.0 / (rope["rope_theta"] ** exponents), 1.0
    else:
        # transformers' own init functions, so llama3/linear/yarn frequencies match it bit for bit.
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError("partial rotary embeddings (rotary dim < head_dim) are not supported")
    positions = torch.arange(max_positions(config), dtype=torch.float, device=device)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [positions, head_dim // 2]
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (the "rotate_half" layout Hugging Face checkpoints use)."""
    # x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim // 2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

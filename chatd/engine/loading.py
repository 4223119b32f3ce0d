"""From a Config to the engine's parts: device, dtype, model, tokenizer, KV pool size, runner.

Kept apart from `engine.py` so the engine itself can be built around a fake runner in tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from chatd.config import CacheConfig, Config
from chatd.engine.attention import select_backend
from chatd.engine.demo import DEMO_WARNING, ensure_demo_model, is_demo_model
from chatd.engine.models.loader import load_model, max_model_len, resolve_dtype, resolve_model_path
from chatd.engine.runner import ModelRunner, kv_block_bytes
from chatd.engine.tokenizer import Tokenizer

log = logging.getLogger("chatd.engine")


@dataclass
class EngineParts:
    """Everything LLMEngine needs that had to be loaded or measured."""

    runner: ModelRunner
    tokenizer: Tokenizer | None
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    model_path: Path
    is_demo: bool


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return device


def num_kv_blocks(cache: CacheConfig, device: torch.device, block_bytes: int, max_useful: int) -> int:
    """How many KV blocks fit the memory budget (capped at what max_num_seqs full sequences could use)."""
    if cache.num_blocks:
        return cache.num_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - cache.gpu_memory_utilization)
    else:
        budget = cache.cpu_kv_cache_gb * 2**30
    return max(0, min(int(budget // block_bytes), max_useful))


def load_engine_parts(config: Config) -> EngineParts:
    """Load the model (or build the demo model), size the KV pool and build the runner."""
    path = config.model.path
    model_path = ensure_demo_model() if not path else resolve_model_path(path)
    demo = is_demo_model(model_path)
    if demo:
        log.warning(DEMO_WARNING)
    device = resolve_device(config.model.device)
    checkpoint_dtype = AutoConfig.from_pretrained(model_path).dtype
    dtype = resolve_dtype(config.model.dtype, device, checkpoint_dtype)
    model, hf_config = load_model(model_path, dtype, device)

    context = max_model_len(hf_config)
    if config.model.max_model_len:
        if config.model.max_model_len > context:
            raise ValueError(f"max_model_len {config.model.max_model_len} exceeds the model's context length {context}")
        context = config.model.max_model_len

    tokenizer = None
    try:
        tokenizer = Tokenizer.from_pretrained(model_path)
    except Exception as exc:  # a weights-only folder still serves token-id prompts
        log.warning("no usable tokenizer in %s (%s); only token-id prompts will work", model_path, exc)
    eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    if not eos:
        config_eos = hf_config.eos_token_id
        eos = frozenset(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])

    block_size = config.cache.block_size
    blocks_per_seq = -(-context // block_size)
    block_bytes = kv_block_bytes(model.num_layers, block_size, model.num_kv_heads, model.head_dim, dtype)
    num_blocks = num_kv_blocks(config.cache, device, block_bytes, config.scheduler.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq and not config.cache.num_blocks:
        raise ValueError(
            f"the KV cache budget gives {num_blocks} blocks of {block_size} tokens, fewer than one sequence of "
            f"max_model_len {context} needs ({blocks_per_seq}); raise the KV memory budget or lower max_model_len"
        )
    backend = select_backend(config.model.attention_backend, device)
    runner = ModelRunner(model, backend, num_blocks, block_size, device, dtype, eos, seed=config.model.seed)
    log.info(
        "loaded %s: dtype %s, device %s, attention %s, %d KV blocks of %d tokens (%.2f GiB), context %d",
        model_path, str(dtype).removeprefix("torch."), device, backend.name, num_blocks, block_size,
        num_blocks * block_bytes / 2**30, context,
    )
    return EngineParts(runner, tokenizer, num_blocks, context, model.vocab_size, eos, model_path, demo)

"""From a Config to the engine's parts: device, dtype, model, tokenizer, KV pool size, runner.

Kept apart from `engine.py` so the engine itself can be built around a fake runner in tests.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from chatd.config import Config, ModelConfig, chatd_home
from chatd.engine.attention import AttentionShape, resolve_kv_dtype, select_backend
from chatd.engine.engine import kv_bytes_per_token
from chatd.engine.models.demo import DEMO_WARNING, ensure_demo_model, is_demo_model
from chatd.engine.models.loader import (
    DEFAULT_MODEL_INSTALL,
    default_model_path,
    load_model,
    max_model_len,
    open_checkpoint,
    resolve_dtype,
    resolve_model_path,
    sampling_defaults,
)
from chatd.engine.tokenizer import Tokenizer
from chatd.engine.worker.runner import ModelRunner, kv_block_bytes

log = logging.getLogger("chatd.engine")

# A folder holds a tokenizer when it has one of these (fast tokenizer, SentencePiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


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
    sampling_defaults: dict[str, float]  # what requests that leave a sampling field out get
    num_host_blocks: int = 0  # the host KV tier's size (0: off)


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


def kv_budget_bytes(total: int, used: int, activation_peak: int, utilization: float) -> int:
    """Bytes the KV pool may take: the configured share of the GPU, less what is in use now
    (weights, CUDA context, other processes) and the peak a step's activations reach."""
    return int(total * utilization) - used - activation_peak


def profile_kv_blocks(runner: ModelRunner, config: Config, block_bytes: int) -> int:
    """On CUDA: run the largest step, measure its peak, and size the pool from what is left."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.profile_step(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before - runner.num_blocks * block_bytes
    runner.allocate_kv(0)  # free the profiling pool before measuring what is in use
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, total - free, activation_peak, config.cache.gpu_memory_utilization)
    log.info(
        "GPU memory: %.1f GiB total, %.1f GiB in use after loading, step peak %.2f GiB; KV budget %.1f GiB "
        "(gpu_memory_utilization %.2f)",
        total / 2**30, (total - free) / 2**30, activation_peak / 2**30, max(budget, 0) / 2**30,
        config.cache.gpu_memory_utilization,
    )
    return max(0, budget // block_bytes)


def load_engine_parts(config: Config) -> EngineParts:
    """Load the model (or build the demo model), size the KV pool and build the runner, in the steps below."""
    model_path, demo = locate_model(config.model)
    checkpoint = open_checkpoint(model_path, chatd_home() / "gguf")
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device, checkpoint.hf_config.dtype)
    model, hf_config = load_model(checkpoint, dtype, device)
    context = context_length(hf_config, config.model)
    tokenizer, eos = load_tokenizer(checkpoint.config_dir, hf_config, config.model)

    block_size = config.cache.block_size
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype)
    shape = AttentionShape(hf_config.num_attention_heads, model.num_kv_heads, model.head_dim, block_size, dtype, kv_dtype)
    backend = select_backend(config.model.attention_backend, device, shape)
    make_runner = functools.partial(ModelRunner, model, backend, block_size=block_size, device=device, dtype=dtype,
                                    eos_token_ids=eos, seed=config.model.seed, max_model_len=context, kv_dtype=kv_dtype)
    block_bytes = kv_block_bytes(model.num_layers, block_size, model.num_kv_heads, model.head_dim, kv_dtype)
    num_blocks = size_kv_pool(config, device, block_bytes, context, make_runner)
    runner = make_runner(num_blocks=num_blocks)
    log.info(
        "loaded %s: dtype %s, device %s, attention %s, %d KV blocks of %d tokens in %s (%.2f GiB), context %d",
        model_path, str(dtype).removeprefix("torch."), device, backend.name, num_blocks, block_size,
        str(kv_dtype).removeprefix("torch."),
        num_blocks * block_bytes / 2**30, context,
    )
    num_host_blocks = size_host_tier(runner, config)
    if device.type == "cuda":
        capture_cuda_graphs(runner, config)
    sampling = sampling_defaults(checkpoint, model_path)
    if sampling:
        log.info("sampling defaults from the model (requests that leave them out): %s",
                 ", ".join(f"{name} {value:g}" for name, value in sampling.items()))
    return EngineParts(runner, tokenizer, num_blocks, context, model.vocab_size, eos, model_path, demo, sampling,
                       num_host_blocks)


def size_host_tier(runner: ModelRunner, config: Config) -> int:
    """Allocate the host KV tier from cache.host_kv_cache_gb (blocks as the device pool stores
    them) and say what it holds; returns its blocks (0: off)."""
    if not config.cache.host_kv_cache_gb:
        return 0
    if not config.cache.enable_prefix_caching:
        raise ValueError("cache.host_kv_cache_gb keeps blocks by their prefix hash: it needs cache.enable_prefix_caching")
    block_bytes = kv_bytes_per_token(runner.kv_caches) * config.cache.block_size
    num_host_blocks = int(config.cache.host_kv_cache_gb * 2**30 // block_bytes)
    runner.allocate_host_kv(num_host_blocks)
    log.info("host KV tier: %d blocks (%.2f GiB%s) keep blocks evicted from the device pool for reuse",
             num_host_blocks, num_host_blocks * block_bytes / 2**30, ", pinned" if runner.device.type == "cuda" else "")
    return num_host_blocks


def locate_model(config: ModelConfig) -> tuple[Path, bool]:
    """The model's folder or GGUF file, and whether it is the random demo model.

    No path: the default model where its package is installed, else (with the command that adds
    it) the demo model. `demo`: the demo model, built on first use.
    """
    if config.path == "demo":
        model_path = ensure_demo_model()
    elif config.path:
        model_path = resolve_model_path(config.path)
    elif (default := default_model_path()) is not None:
        model_path = default
    else:
        log.warning("the default model (SmolLM2-135M-Instruct) is not installed; `%s` adds it (98 MB). "
                    "Serving the random demo model meanwhile.", DEFAULT_MODEL_INSTALL)
        model_path = ensure_demo_model()
    demo = is_demo_model(model_path)
    if demo:
        log.warning(DEMO_WARNING)
    return model_path, demo


def context_length(hf_config, config: ModelConfig) -> int:
    """The model's context window, or the configured max_model_len when that is shorter."""
    context = max_model_len(hf_config)
    if config.max_model_len:
        if config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {context}")
        context = config.max_model_len
    return context


def load_tokenizer(model_path: Path, hf_config, config: ModelConfig) -> tuple[Tokenizer | None, frozenset[int]]:
    """The model's tokenizer (None for a weights-only folder) and its end-of-sequence ids."""
    tokenizer = None
    if not any((model_path / name).exists() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json's model type alone (Qwen2's
        # encodes every text to no tokens): a folder without tokenizer files has none.
        log.warning("no tokenizer files in %s; only token-id prompts will work", model_path)
    else:
        try:
            tokenizer = Tokenizer.from_pretrained(model_path, config.special_tokens_in_messages)
        except Exception as exc:  # a weights-only folder still serves token-id prompts
            log.warning("no usable tokenizer in %s (%s); only token-id prompts will work", model_path, exc)
    eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
    if not eos:
        config_eos = hf_config.eos_token_id
        eos = frozenset(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    return tokenizer, eos


def size_kv_pool(config: Config, device: torch.device, block_bytes: int, context: int,
                 make_runner: Callable[..., ModelRunner]) -> int:
    """How many KV blocks: as configured, else what the memory budget holds (measured on CUDA),
    never more than max_num_seqs full-length sequences could use; fewer than one such sequence is an error."""
    if config.cache.num_blocks:
        return config.cache.num_blocks
    blocks_per_seq = -(-context // config.cache.block_size)
    max_useful = config.scheduler.max_num_seqs * blocks_per_seq
    if device.type == "cuda":
        num_blocks = min(profile_kv_blocks(make_runner(num_blocks=0), config, block_bytes), max_useful)
    else:
        num_blocks = min(int(config.cache.cpu_kv_cache_gb * 2**30 // block_bytes), max_useful)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache budget gives {num_blocks} blocks of {config.cache.block_size} tokens, fewer than one sequence of "
            f"max_model_len {context} needs ({blocks_per_seq}); raise the KV memory budget "
            f"({'gpu_memory_utilization' if device.type == 'cuda' else 'cpu_kv_cache_gb'}) or lower max_model_len"
        )
    return num_blocks


def capture_cuda_graphs(runner: ModelRunner, config: Config) -> None:
    """Capture decode graphs when configured and the backend allows it; a failed capture serves eagerly."""
    if not (config.model.cuda_graphs and config.model.cuda_graph_max_batch > 0):
        return
    if not runner.backend.capturable():
        log.info("CUDA graphs off: attention backend %s cannot be captured", runner.backend.name)
        return
    max_batch = min(config.model.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    try:
        seconds = runner.enable_decode_graphs(max_batch)
    except Exception as exc:  # serve eagerly rather than not at all; the log says why
        runner.graphs = None
        log.warning("CUDA graph capture failed (%s: %s); every step runs eagerly", type(exc).__name__, exc)
    else:
        log.info("captured CUDA graphs for decode batches up to %d in %.1f s", max_batch, seconds)

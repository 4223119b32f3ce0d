"""A ModelRunner from a Config and a checkpoint: what every tensor-parallel rank does to get its runner.

Rank 0 (chatd/engine/loading.py) and each worker process (parallel_worker.py) call `build_runner`
the same way, so it lives here, in the worker, below both: the loader that assembles the whole
engine (tokenizer, KV pool size, compiled steps) sits above and imports it; a worker process never
needs the loader. It knows nothing of the tokenizer or the scheduler.
"""

from __future__ import annotations

import logging

import torch

from chatd.config import Config, ModelConfig
from chatd.engine.attention import AttentionShape, resolve_kv_dtype, select_backend
from chatd.engine.models.loader import Checkpoint, load_model, max_model_len, resolve_dtype
from chatd.engine.models.quantized.quantize_model import pack_float_weights, quantized_layers
from chatd.engine.models.tensor_parallel import TPGroup
from chatd.engine.worker.heap import keep_freed_memory
from chatd.engine.worker.runner import ModelRunner

log = logging.getLogger("chatd.engine")


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


def build_runner(config: Config, checkpoint: Checkpoint, tp: TPGroup, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset()) -> ModelRunner:
    """What every rank does: load its part of the model, choose the attention backend, and make a
    runner with an empty KV pool (sized afterwards, the same on every rank)."""
    dtype = resolve_dtype(config.model.dtype, device, checkpoint.hf_config.dtype)
    model, hf_config = load_model(checkpoint, dtype, device, tp, config.model.quantization)
    if device.type == "cpu":  # from now on a step's freed buffers are kept for the next step
        keep_freed_memory()
        pack_where_it_fits(model, tp)
    context = context_length(hf_config, config.model)
    quantized_on_cpu = device.type == "cpu" and set(quantized_layers(model)) != {"float"}
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, quantized_on_cpu)
    heads = hf_config.num_attention_heads // tp.size
    shape = AttentionShape(heads, model.num_kv_heads, model.head_dim, config.cache.block_size, dtype, kv_dtype)
    backend = select_backend(config.model.attention_backend, device, shape)
    return ModelRunner(model, backend, num_blocks=0, block_size=config.cache.block_size, device=device, dtype=dtype,
                       eos_token_ids=eos_token_ids, seed=config.model.seed, max_model_len=context, kv_dtype=kv_dtype)


def pack_where_it_fits(model, tp: TPGroup) -> None:
    """Pack the float32 weights for oneDNN (models/quantized/packed.py) when their copy fits in a quarter of
    the memory the system has available now; a float32 model too large for that keeps one copy."""
    weights = sum(p.numel() * 4 for p in model.parameters() if p.dtype == torch.float32 and p.dim() == 2)
    available = available_memory()
    if weights == 0 or available is None or weights > available // 4:
        if weights and tp.rank == 0:
            log.info("float32 weights not packed for oneDNN: a %.2f GiB copy, %s GiB available", weights / 2**30,
                     "?" if available is None else f"{available / 2**30:.1f}")
        return
    packed = pack_float_weights(model)
    if packed and tp.rank == 0:
        log.info("float32 weights packed for oneDNN: %d of %d projections and the LM head (%.2f GiB more)",
                 packed, 4 * model.num_layers + 1, weights / 2**30)


def available_memory() -> int | None:
    """Bytes of memory the system has available (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def context_length(hf_config, config: ModelConfig) -> int:
    """The model's context window, or the configured max_model_len when that is shorter."""
    context = max_model_len(hf_config)
    if config.max_model_len:
        if config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {context}")
        context = config.max_model_len
    return context

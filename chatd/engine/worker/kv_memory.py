"""How many KV blocks fit: the bytes of one block, and on CUDA the memory left for the pool once the
largest step the scheduler can plan has been run and its activations' peak measured.

A CPU pool is sized by cache.num_kv_blocks or the host's memory (loading.py); only a GPU is profiled.
"""

from __future__ import annotations

import logging

import torch

from chatd.engine.attention import build_step
from chatd.engine.params import SamplingParams
from chatd.engine.worker.sampler import SamplingRow

log = logging.getLogger("chatd.engine")


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget_bytes(total: int, used: int, activation_peak: int, utilization: float) -> int:
    """Bytes the KV pool may take: the configured share of the GPU, less what is in use now
    (weights, CUDA context, other processes) and the peak a step's activations reach."""
    return int(total * utilization) - used - activation_peak


def profile_kv_blocks(runner, num_tokens: int, num_seqs: int, utilization: float, block_bytes: int) -> int:
    """On CUDA: run the largest step (`profile_step`) on a ModelRunner, measure its peak, and say how many KV
    blocks fit in what is left of `utilization` of the GPU's memory."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_step(runner, num_tokens, num_seqs)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before - runner.num_blocks * block_bytes
    runner.allocate_kv(0)  # free the profiling pool before measuring what is in use
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, total - free, activation_peak, utilization)
    log.info(
        "GPU memory on %s: %.1f GiB total, %.1f GiB in use after loading, step peak %.2f GiB; KV budget %.1f GiB "
        "(gpu_memory_utilization %.2f)",
        device, total / 2**30, (total - free) / 2**30, activation_peak / 2**30, max(budget, 0) / 2**30, utilization,
    )
    return max(0, budget // block_bytes)


@torch.inference_mode()
def profile_step(runner, num_tokens: int, num_seqs: int) -> None:
    """Run the largest step the scheduler can plan, so its peak memory can be measured.

    num_tokens new tokens (prompts of at most max_model_len) through the model, then logits
    and top-p sampling for num_seqs rows: the sampler's most memory-hungry path. It replaces
    the KV pool with one just large enough; the caller allocates the real pool afterwards.
    """
    max_len = runner.max_model_len or num_tokens
    lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
    blocks = iter(range(10**9))  # consecutive blocks, each prompt starting a new one
    tables = [[next(blocks) for _ in range(-(-n // runner.block_size))] for n in lens]
    runner.allocate_kv(sum(map(len, tables)))
    step = build_step([0] * num_tokens, [0] * len(lens), lens, tables, runner.block_size, runner.device)
    hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta, runner.backend)
    rows_index = torch.arange(num_seqs, device=runner.device) % num_tokens
    logits = runner.model.compute_logits(hidden[rows_index])
    if logits is None:  # a tensor-parallel rank other than 0: it never samples
        return
    params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=1)
    generator = torch.Generator(device=runner.device).manual_seed(0)
    runner.sampler(logits, [SamplingRow(params, [0], [], generator) for _ in range(num_seqs)])


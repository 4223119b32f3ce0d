"""The machine's ceilings and a model's per-step cost: what benchmarks/steps.py sets step times against.

Ceilings are measured in the same run on the same device (copy bandwidth, matmul rate); costs
are counted from the model's shape (bytes a step must move, FLOPs it must compute). The random
checkpoint writer is here too, because its parameter counts feed the costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INITIALIZER_RANGE = 0.02  # the usual std; hidden states stay far from bf16's limits


# -- the machine's ceilings -----------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(device: torch.device, fn, repeats: int) -> float:
    """Median wall time of fn() over repeats calls, after one untimed call."""
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy of num_bytes, counting its reads and its writes."""
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(device, lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of a size^3 matmul in dtype."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median_seconds(device, lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds


def measure_ceilings(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    return dict(
        copy_bytes_per_s=copy_bandwidth(device, args.copy_mib * 2**20),
        matmul_flops_per_s=matmul_rate(device, DTYPES[args.dtype], args.gemm_size),
    )


# -- the model and its per-step cost --------------------------------------------------------------


def build_checkpoint(dir: Path, shape: dict, dtype: torch.dtype, device: torch.device, seed: int) -> dict:
    """Write the demo tokenizer, a Llama config of shape and seeded random weights in dtype; return the weights' sizes.

    Not `demo.build_model_dir`: that draws and saves float32 weights on the CPU (32 GB for 8B); here
    they are drawn on `device` in dtype and written in shards, so 8B is 16 GB and a minute or so.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from chatd.engine.models.demo import build_tokenizer

    build_tokenizer(dir)  # its fixed ids: unk 0, bos 1, eos 2, pad 3
    config = AutoConfig.for_model(
        "llama", architectures=["LlamaForCausalLM"], dtype=str(dtype).removeprefix("torch."),
        bos_token_id=1, eos_token_id=2, pad_token_id=3, initializer_range=INITIALIZER_RANGE, **shape,
    )
    config.save_pretrained(str(dir))
    with torch.device("meta"):
        names = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    generator = torch.Generator(device).manual_seed(seed)
    weight_map, shard, shard_bytes, total_bytes, num_files = {}, {}, 0, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, num_files
        num_files += 1
        file = f"model-{num_files:05d}.safetensors"
        save_file(shard, str(dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        shard, shard_bytes = {}, 0

    for name, tensor_shape in sorted(names.items()):
        if name.endswith("norm.weight"):
            tensor = torch.ones(tensor_shape, dtype=dtype, device=device)
        else:
            tensor = torch.randn(tensor_shape, generator=generator, dtype=dtype, device=device).mul_(INITIALIZER_RANGE)
        shard[name] = tensor.cpu()
        shard_bytes += tensor.nbytes
        total_bytes += tensor.nbytes
        if shard_bytes >= 4 * 2**30:
            flush()
    if shard:
        flush()
    index = dict(metadata=dict(total_size=total_bytes), weight_map=weight_map)
    (dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    hidden, vocab = config.hidden_size, config.vocab_size
    total = sum(torch.Size(s).numel() for s in names.values())
    lm_head = vocab * hidden
    return dict(
        total_params=total,
        non_embedding_params=total - vocab * hidden - (0 if config.tie_word_embeddings else lm_head),
        lm_head_params=lm_head,  # a tied head reads the embedding matrix whole, all the same
        checkpoint_bytes=total_bytes,
        num_files=num_files,
    )


def step_cost(shape: dict, params: dict, dtype_bytes: int, contexts: list[int], weight_bytes: float | None = None) -> dict:
    """Bytes and FLOPs of one decode step whose sequences attend to `contexts` tokens each (see FORMULAS);
    `weight_bytes`: bytes per quantized weight (default dtype_bytes)."""
    batch, total_context = len(contexts), sum(contexts)
    layers, heads = shape["num_hidden_layers"], shape["num_attention_heads"]
    kv_per_token = layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes
    weights = (weight_bytes or dtype_bytes) * (params["non_embedding_params"] + params["lm_head_params"])
    weights += dtype_bytes * batch * shape["hidden_size"]
    flops = 2 * (params["non_embedding_params"] + params["lm_head_params"]) * batch
    flops += 4 * layers * heads * shape["head_dim"] * total_context
    return dict(weight_bytes=weights, kv_read_bytes=kv_per_token * total_context,
                kv_write_bytes=kv_per_token * batch, flops=flops)


def prefill_cost(shape: dict, params: dict, dtype_bytes: int, prompt_len: int, num_cached: int,
                 weight_bytes: float | None = None) -> dict:
    """Bytes and FLOPs of computing a prompt's last prompt_len - num_cached tokens, then one token's logits."""
    layers, heads = shape["num_hidden_layers"], shape["num_attention_heads"]
    computed = prompt_len - num_cached
    total_context = sum(range(num_cached + 1, prompt_len + 1))  # token i attends to i + 1 tokens
    kv_per_token = layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes
    weights = (weight_bytes or dtype_bytes) * (params["non_embedding_params"] + params["lm_head_params"])
    weights += dtype_bytes * computed * shape["hidden_size"]
    flops = 2 * params["non_embedding_params"] * computed + 2 * params["lm_head_params"]
    flops += 4 * layers * heads * shape["head_dim"] * total_context
    return dict(weight_bytes=weights, kv_read_bytes=kv_per_token * prompt_len,
                kv_write_bytes=kv_per_token * computed, flops=flops)


def rooflines(cost: dict, ceilings: dict) -> tuple[float, float]:
    """(memory, compute) seconds of a step of this cost on this machine."""
    num_bytes = cost["weight_bytes"] + cost["kv_read_bytes"] + cost["kv_write_bytes"]
    return num_bytes / ceilings["copy_bytes_per_s"], cost["flops"] / ceilings["matmul_flops_per_s"]

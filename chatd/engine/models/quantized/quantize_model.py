"""A loaded Llama's projections and LM head made quantized layers (quant.py), or packed for oneDNN;
and which quantization a checkpoint gets (model.quantization "auto": a GGUF file's own blocks on a CPU).

Weight-only: the embedding, norms and biases stay as they are. A GGUF file's own blocks are kept
where they can be (gguf.py reads them, gguf_quant.py lays them out): 4-bit blocks as int4, Q8_0 and
Q6_K blocks as int8 with a scale per block. llama.py knows nothing of this: every projection
(layers.py) takes a `quantized` layer that its forward runs instead of its float weight, and the
model its `quantized_head`.
"""

from __future__ import annotations

import itertools
import logging
from typing import Protocol

import torch
from torch import Tensor, nn

from chatd.engine.models.layers import FusedLinear, RowParallelLinear
from chatd.engine.models.llama import FUSED_SHARDS, LlamaForCausalLM
from chatd.engine.models.quantized.gguf import GGUFCheckpoint
from chatd.engine.models.quantized.packed import PackedLinear, can_pack
from chatd.engine.models.quantized.quant import ConcatLinear, Int4Linear, Int8Linear, quantize_linear, unavailable_reason
from chatd.engine.models.tensor_parallel import TPGroup

log = logging.getLogger("chatd.engine")

def _int4_layer(parts: list[tuple], bias: Tensor | None) -> Int4Linear:
    """One int4 layer of a fused projection's parts, each (q, scales, zeros) numpy arrays."""
    q, scales, zeros = (torch.cat([torch.from_numpy(part[i]) for part in parts]) for i in range(3))
    return Int4Linear(q.to(torch.int32), scales, zeros, bias)


def _int8_blocks_layer(parts: list[tuple], bias: Tensor | None) -> Int8Linear:
    """One int8 layer of a fused projection's parts, each (q, scales, zeros or None) numpy arrays.
    Parts of different types, as Q4_K_M and Q5_K_M files' fused projections have (Q5_0 or Q5_1 q/k
    beside a Q8_0 or Q6_K v), take the finest part's blocks, each part's scales (and zeros: 0 for a
    type without) repeated to them, exactly."""
    width = max(part[1].shape[1] for part in parts)

    def per_finest_block(values) -> Tensor:  # [rows, blocks] numpy -> [rows, width] float32
        return torch.from_numpy(values).float().repeat_interleave(width // values.shape[1], dim=1)

    q = torch.cat([torch.from_numpy(part[0]) for part in parts])
    scales = torch.cat([per_finest_block(part[1]) for part in parts])
    zeros = None
    if any(part[2] is not None for part in parts):
        zeros = torch.cat([per_finest_block(part[2]) if part[2] is not None else torch.zeros(len(part[1]), width)
                           for part in parts])
    return Int8Linear(q, scales, bias, zeros)


class GGUFBlocks(Protocol):
    """What quantize_model(model, "gguf") reads of a GGUF file (gguf.GGUFCheckpoint), by Hugging Face tensor name."""

    def int4_parts(self, name: str) -> tuple | None:
        """(q, scales, zeros) numpy arrays of a 4-bit tensor, rows as the model wants them; None otherwise."""

    def int8_parts(self, name: str) -> tuple | None:
        """(q, a scale per block of 32 or 16 weights, a zero per block or None) numpy arrays of a tensor
        of a type gguf_quant.INT8_TYPES names, rows as the model wants them; None otherwise."""

    def is_quantized(self, name: str) -> bool:
        """Whether the file stores the tensor quantized (in any block format)."""



def quantize_model(model: LlamaForCausalLM, kind: str, gguf: GGUFBlocks | None = None) -> list[str]:
    """Weight-only quantization of every projection and the LM head; the embedding,
    norms and biases stay as they are. A tied head gets a quantized copy of the embedding.
    `kind` "gguf": a layer whose GGUF tensors are 4-bit blocks keeps them (int4, exactly), one of
    Q8_0 or Q6_K blocks keeps them too (int8 with a scale per block), another quantized one is
    int8 with a scale per row, a float one stays float. `kind` "int4" on a GGUF file keeps its
    4-bit blocks too (they are the int4 kernel's groups). Returns the checkpoint tensors that
    were quantized in the file and have been rounded a second time (the caller warns)."""
    model.quantization = kind
    rounded_again: list[str] = []
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, FusedLinear):
            parent, _, fused = name.rpartition(".")
            parts = [f"model.{parent}.{shard}.weight" for shard, (owner, _) in FUSED_SHARDS.items() if owner == fused]
            layers.append((module, module.weight, module.bias, parts))
        elif isinstance(module, RowParallelLinear):
            layers.append((module, module.weight, None, [f"model.{name}.weight"]))
    for module, weight, bias, parts in layers:
        module.quantize(_quantized(model, kind, weight, bias, parts, gguf, rounded_again))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    head_name = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    model.quantized_head = _quantized(model, kind, head, None, [head_name], gguf, rounded_again)
    if model.quantized_head is not None and model.lm_head is not None:
        model.lm_head.register_parameter("weight", None)
    return rounded_again


def pack_float_weights(model: LlamaForCausalLM) -> int:
    """Give every float32 projection left unquantized, and the LM head, a copy of its weight
    packed for oneDNN (packed.py), kept beside the weight; returns how many were packed."""
    linears = [m for m in model.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
    packed = 0
    for module in linears:
        if module.quantized is None and can_pack(module.weight):
            module.quantize(PackedLinear(module.weight, module.bias if isinstance(module, FusedLinear) else None))
            packed += 1
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if model.quantized_head is None and can_pack(head):
        model.quantized_head, packed = PackedLinear(head), packed + 1
    return packed


def int8_blocks_per_row(model: LlamaForCausalLM) -> int:
    """Make every int8 layer with a scale per block (a GGUF file's types) one with a scale per row; returns
    how many were. For eager decode steps: a block layer has no kernel, so each eager step
    dequantized all of them (SmolLM2 Q8_0: 185 ms a step against 25 per row)."""
    changed = 0
    for module in model.modules():
        if isinstance(module, (FusedLinear, RowParallelLinear)) and getattr(module.quantized, "per_block", False):
            module.quantized, changed = module.quantized.per_row(), changed + 1
    if getattr(model.quantized_head, "per_block", False):
        model.quantized_head, changed = model.quantized_head.per_row(), changed + 1
    return changed


def quantized_layers(model: LlamaForCausalLM) -> dict[str, int]:
    """How many projections (and the head) each kind of layer computes, for the startup log."""
    layers = [m.quantized for m in model.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
    counts: dict[str, int] = {}
    for layer in [*layers, model.quantized_head]:
        name = "float" if layer is None else layer.kind
        counts[name] = counts.get(name, 0) + 1
    return counts


def _quantized(model: LlamaForCausalLM, kind: str, weight: Tensor, bias: Tensor | None, names: list[str],
                gguf: GGUFBlocks | None, rounded_again: list[str]) -> nn.Module | None:
    # The blocks are whole rows and columns of the file's tensors: exact only on one rank.
    keeps_blocks = gguf is not None and model.tp.size == 1 and weight.device.type == "cpu"
    if kind != "gguf":
        if kind == "int4" and keeps_blocks:
            int4 = [gguf.int4_parts(name) for name in names]
            if all(part is not None for part in int4):
                return _int4_layer(int4, bias)
        layer = quantize_linear(weight, bias, kind)
        if layer is not None and gguf is not None:
            rounded_again.extend(name for name in names if gguf.is_quantized(name))
        return layer
    if keeps_blocks:
        int4 = [gguf.int4_parts(name) for name in names]
        int8 = [gguf.int8_parts(name) if part is None else None for name, part in zip(names, int4)]
        if all(part is not None for part in int4):
            return _int4_layer(int4, bias)
        if all(part is not None for part in int8):
            return _int8_blocks_layer(int8, bias)
        if all(a is not None or b is not None for a, b in zip(int4, int8)):
            # 4-bit parts beside others: each run of one kind a layer of its own, side by side.
            layers, start = [], 0
            for is_int4, run in itertools.groupby(range(len(names)), key=lambda i: int4[i] is not None):
                parts = [int4[i] if is_int4 else int8[i] for i in run]
                rows = sum(len(part[0]) for part in parts)
                run_bias = None if bias is None else bias[start : start + rows]
                layers.append(_int4_layer(parts, run_bias) if is_int4 else _int8_blocks_layer(parts, run_bias))
                start += rows
            return ConcatLinear(layers)
    if gguf is not None and any(gguf.is_quantized(name) for name in names):
        return quantize_linear(weight, bias, "int8")
    return None


def chosen_quantization(quantization: str, gguf: GGUFCheckpoint | None, device: torch.device, tp: TPGroup) -> str:
    """model.quantization as it will be applied: "auto" resolved (and logged by rank 0); a
    ValueError for one this checkpoint or device cannot have."""
    if quantization == "auto":
        quantization, why = resolve_quantization(gguf, device, tp.size)
        if tp.rank == 0:
            log.info("quantization auto: %s (%s)", quantization, why)
    if quantization == "gguf" and gguf is None:
        raise ValueError("model.quantization \"gguf\" keeps a GGUF file's blocks; this model is not a GGUF file "
                         "(use \"int8\" or \"int4\")")
    reason = unavailable_reason(quantization, device)
    if reason:
        raise ValueError(reason)
    return quantization


def quantize_loaded(model: LlamaForCausalLM, quantization: str, gguf: GGUFCheckpoint | None,
                    device: torch.device) -> None:
    """Quantize a model whose float weights are loaded, and say at start what each layer became."""
    rounded_again = quantize_model(model, quantization, gguf)
    if rounded_again:
        warn_rounded_again(gguf, quantization, rounded_again)
    if device.type == "cuda":  # the float weights' memory goes back to the GPU, for the KV pool
        torch.cuda.empty_cache()
    log.info("quantization %s: %s (of %d projections and the LM head)", quantization,
             ", ".join(f"{n} {kind}" for kind, n in quantized_layers(model).items()), 4 * model.num_layers)
    if quantization == "int4" and device.type == "cuda":
        log.warning("quantization int4 on CUDA: torch's int4 kernel is fast for a few sequences and slow for "
                    "many (H100, an 8B model: one stream 0.66x bfloat16's step time, 64 streams 3.0x, a "
                    "2000-token prompt 15x); fp8 or none serve many users faster")


def warn_rounded_again(gguf, quantization: str, names: list[str]) -> None:
    """Say at start that weights the file had already quantized were rounded a second time (which
    costs quality: the default model's Q4_1 file in int4 answered "L'Étoile" for France's capital)."""
    log.warning("quantization %s rounded %d tensors of %s a second time, which the file stores quantized already "
                "(%s ...): `--quantization gguf` (model.quantization = \"gguf\") keeps the file's own blocks, nothing "
                "rounded again", quantization, len(names), gguf.path.name, ", ".join(names[:3]))


def resolve_quantization(gguf: GGUFCheckpoint | None, device: torch.device, tp_size: int) -> tuple[str, str]:
    """What model.quantization "auto" means for this checkpoint, and why: a GGUF file that stores
    its weights in blocks is served as its blocks ("gguf") on a CPU, by one rank, as llama.cpp and
    Ollama serve it (SmolLM2's Q4_1: ~2x the tokens per second of its float32 weights, the same
    perplexity); anything else is served as its float weights ("none")."""
    if gguf is None:
        return "none", "not a GGUF file"
    if device.type != "cpu":
        return "none", f"a GGUF file's blocks are kept on a CPU; on {device.type} its weights are dequantized"
    if tp_size > 1:
        return "none", "a GGUF file's blocks are kept by one rank; split over ranks its weights are dequantized"
    types = gguf.quantized_types()
    if not types:
        return "none", "the GGUF file stores float weights"
    return "gguf", f"the GGUF file's own {', '.join(types)} blocks, not dequantized; --quantization none for float weights"

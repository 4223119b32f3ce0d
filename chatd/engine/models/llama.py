"""One decoder for the Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 and Qwen3.

The model runs a flat batch: the new tokens of many sequences concatenated, each with its own
position. It knows nothing of scheduling or of how the KV cache is allocated: every attention
layer hands its new K/V and queries to the attention backend with the step's metadata.
The families differ only in a few switches read from the Hugging Face config: bias on the q/k/v
projections (Qwen2), per-head RMSNorm on q and k (Qwen3), an explicit head_dim, rope scaling,
and whether the output projection shares the embedding matrix.

Projections that read the same input are fused: q, k and v are one `qkv_proj`, the MLP's gate
and up are one `gate_up_proj`. One GEMM instead of three (or two) per layer means fewer kernel
launches and a wider matrix, which keeps the GPU busier when the batch is only a few tokens.
Checkpoints still hold the separate Hugging Face tensors; load_weights copies each into its row
range of the fused weight, using the FUSED_SHARDS table below.

Under tensor parallelism (`tp`, tensor_parallel.py) each rank builds the same modules at its own
sizes: its query and key/value heads, its slice of the MLP and of the vocabulary. Every
parallel module (layers.py) says which part of a checkpoint tensor it holds (`checkpoint_shard`),
so a rank reads only that part; o_proj, down_proj and the embedding end in an all-reduce. Rotary
embeddings are rope.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from chatd.engine.attention import AttentionBackend, AttentionMetadata, KVCache
from chatd.engine.models.layers import FusedLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from chatd.engine.models.matvec import dense
from chatd.engine.models.packed import PackedLinear, can_pack
from chatd.engine.models.quant import ConcatLinear, Int4Linear, Int8Linear, quantize_linear
from chatd.engine.models.rope import apply_rope, build_rope_cache, max_positions
from chatd.engine.models.tensor_parallel import HeadLayout, Shard, TPGroup


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
    """What quantize("gguf") reads of a GGUF file (gguf.GGUFCheckpoint), by Hugging Face tensor name."""

    def int4_parts(self, name: str) -> tuple | None:
        """(q, scales, zeros) numpy arrays of a 4-bit tensor, rows as the model wants them; None otherwise."""

    def int8_parts(self, name: str) -> tuple | None:
        """(q, a scale per block of 32 or 16 weights, a zero per block or None) numpy arrays of a tensor
        of a type gguf_quant.INT8_TYPES names, rows as the model wants them; None otherwise."""

    def is_quantized(self, name: str) -> bool:
        """Whether the file stores the tensor quantized (in any block format)."""


# Checkpoint module name -> (our fused module, which of its row blocks). The index is the order of
# the blocks in the fused weight, and so the order of the outputs its forward splits apart.
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache."""

    def __init__(self, config: PretrainedConfig, head_dim: int, tp: TPGroup):
        super().__init__()
        heads = HeadLayout.of(tp, config.num_attention_heads, config.num_key_value_heads)
        self.num_heads = heads.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        attention_bias = getattr(config, "attention_bias", False)
        # Qwen2 always has q/k/v biases (and none on o_proj); its config has no field that says so.
        qkv_bias = attention_bias or config.model_type == "qwen2"
        hidden = config.hidden_size
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        q_rows, kv_rows = Shard(0, heads.q_start * head_dim, q_size), Shard(0, heads.kv_start * head_dim, kv_size)
        self.qkv_proj = FusedLinear(hidden, [q_size, kv_size, kv_size], bias=qkv_bias,
                                    shards=[q_rows, kv_rows, kv_rows] if tp.size > 1 else None)
        self.o_proj = RowParallelLinear(q_size, hidden, attention_bias, tp, q_rows)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    # In three parts (DecoderLayer composes them), so a compiled prefill can compile the first and
    # last apart from the attention backend: project, attend, output.
    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The new tokens' queries [tokens, heads, head_dim], keys and values [tokens, kv_heads, head_dim], rope applied."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # qkv: [tokens, (heads + 2 * kv_heads) * head_dim]
        # split() returns views into qkv, not copies; k and v reach the backend non-contiguous.
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # q: [tokens, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # k: [tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, meta: AttentionMetadata,
               backend: AttentionBackend) -> Tensor:
        """The new K/V into the cache, then each query's attention over its context: [tokens, heads, head_dim]."""
        backend.write_kv(kv_cache, k, v, meta)
        return backend.attend(q, k, v, kv_cache, meta, self.scale)

    def output(self, attended: Tensor) -> Tensor:
        """The output projection of attention's result: [tokens, hidden]."""
        return self.o_proj(attended.reshape(attended.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        rows = tp.split(config.intermediate_size, "the model's intermediate_size")
        self.gate_up_proj = FusedLinear(config.hidden_size, [rows.length, rows.length], bias=bias,
                                        shards=[rows, rows] if tp.size > 1 else None)
        self.down_proj = RowParallelLinear(rows.length, config.hidden_size, bias, tp, rows)

    def forward(self, x: Tensor) -> Tensor:
        # x: [tokens, hidden]; gate, up: [tokens, intermediate], views into one GEMM's output
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.output_sizes, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: PretrainedConfig, head_dim: int, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(config, head_dim, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend
    ) -> Tensor:
        q, k, v = self.before_attention(x, cos, sin)
        return self.after_attention(x, self.self_attn.attend(q, k, v, kv_cache, meta, backend))

    # The layer in two halves around attention, which a compiled prefill (worker/compiled_prefill.py)
    # compiles apart from the attention backend's own kernels between them.
    def before_attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The norm, then the new tokens' queries, keys and values (Attention.project)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: Tensor, attended: Tensor) -> Tensor:
        """x plus the output projection of attention's result [tokens, heads, head_dim], then plus the MLP's."""
        x = x + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The Llama-family decoder, built from a Hugging Face config; weights come in through load_weights.
    With `tp` of size N it is one rank's part of the model (the module docstring)."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only silu")
        self.config = config
        self.tp = tp
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_kv_heads = HeadLayout.of(tp, config.num_attention_heads, config.num_key_value_heads).num_kv_heads
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Module names mirror Hugging Face's (minus the "model." prefix), so loading is a name lookup,
        # except for the fused projections, which FUSED_SHARDS maps.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim, tp) for _ in range(self.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A tied head reuses embed_tokens.weight at compute time rather than sharing a Parameter:
        # Module.to_empty() (used to load without a random init) silently unties shared Parameters.
        self.lm_head = None
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, tp.padded_vocab(config.vocab_size), bias=False)
        self.quantized_head: nn.Module | None = None  # the LM head as quant.py computes it (quantize())
        self.quantization = "none"  # what quantize() was asked for
        # On "meta" (load_model builds there, then calls reset_rope_cache on the device) only its
        # shape: computing it there would import dynamo (torch's reference decompositions).
        if torch.get_default_device().type == "meta":
            rope_cache = torch.empty(max_positions(config), self.head_dim)
        else:
            rope_cache = build_rope_cache(config, self.head_dim)
        self.register_buffer("rope_cache", rope_cache, persistent=False)

    def reset_rope_cache(self) -> None:
        """Recompute the cos/sin table on the model's device (after `to_empty()` left it uninitialized)."""
        self.rope_cache = build_rope_cache(self.config, self.head_dim, self.embed_tokens.weight.device)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:
        """input_ids, positions: [T] flat batch -> hidden states [T, hidden_size] after the final norm."""
        x, cos, sin = self.embed(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta, backend)
        return self.norm(x)

    def embed(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What the first layer takes: the tokens' embeddings [T, hidden] and their rope cos, sin [T, 1, head_dim // 2]."""
        x = self.embed_tokens(input_ids)
        # Like transformers, cos/sin are computed in float32 and cast to the activations' dtype.
        cos, sin = self.rope_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
        return x, cos, sin

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32 (on rank 0; None on the others)."""
        if self.quantized_head is not None:
            local = self.quantized_head(hidden)
        else:
            local = dense(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        logits = self.tp.gather_columns(local)  # [N, ranks * vocab rows per rank]
        return None if logits is None else logits[:, : self.vocab_size].float()

    def quantize(self, kind: str, gguf: GGUFBlocks | None = None) -> list[str]:
        """Weight-only quantization of every projection and the LM head (quant.py); the embedding,
        norms and biases stay as they are. A tied head gets a quantized copy of the embedding.
        `kind` "gguf": a layer whose GGUF tensors are 4-bit blocks keeps them (int4, exactly), one of
        Q8_0 or Q6_K blocks keeps them too (int8 with a scale per block), another quantized one is
        int8 with a scale per row, a float one stays float. `kind` "int4" on a GGUF file keeps its
        4-bit blocks too (they are the int4 kernel's groups). Returns the checkpoint tensors that
        were quantized in the file and have been rounded a second time (the caller warns)."""
        self.quantization = kind
        rounded_again: list[str] = []
        layers = []
        for name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                parent, _, fused = name.rpartition(".")
                parts = [f"model.{parent}.{shard}.weight" for shard, (owner, _) in FUSED_SHARDS.items() if owner == fused]
                layers.append((module, module.weight, module.bias, parts))
            elif isinstance(module, RowParallelLinear):
                layers.append((module, module.weight, None, [f"model.{name}.weight"]))
        for module, weight, bias, parts in layers:
            module.quantize(self._quantized(kind, weight, bias, parts, gguf, rounded_again))
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        head_name = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        self.quantized_head = self._quantized(kind, head, None, [head_name], gguf, rounded_again)
        if self.quantized_head is not None and self.lm_head is not None:
            self.lm_head.register_parameter("weight", None)
        return rounded_again

    def pack_float_weights(self) -> int:
        """Give every float32 projection left unquantized, and the LM head, a copy of its weight
        packed for oneDNN (packed.py), kept beside the weight; returns how many were packed."""
        linears = [m for m in self.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
        packed = 0
        for module in linears:
            if module.quantized is None and can_pack(module.weight):
                module.quantize(PackedLinear(module.weight, module.bias if isinstance(module, FusedLinear) else None))
                packed += 1
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.quantized_head is None and can_pack(head):
            self.quantized_head, packed = PackedLinear(head), packed + 1
        return packed

    def int8_blocks_per_row(self) -> int:
        """Make every int8 layer with a scale per block (a GGUF file's types) one with a scale per row; returns
        how many were. For eager decode steps: a block layer has no kernel, so each eager step
        dequantized all of them (SmolLM2 Q8_0: 185 ms a step against 25 per row)."""
        changed = 0
        for module in self.modules():
            if isinstance(module, (FusedLinear, RowParallelLinear)) and getattr(module.quantized, "per_block", False):
                module.quantized, changed = module.quantized.per_row(), changed + 1
        if getattr(self.quantized_head, "per_block", False):
            self.quantized_head, changed = self.quantized_head.per_row(), changed + 1
        return changed

    def quantized_layers(self) -> dict[str, int]:
        """How many projections (and the head) each kind of layer computes, for the startup log."""
        layers = [m.quantized for m in self.modules() if isinstance(m, (FusedLinear, RowParallelLinear))]
        counts: dict[str, int] = {}
        for layer in [*layers, self.quantized_head]:
            name = "float" if layer is None else layer.kind
            counts[name] = counts.get(name, 0) + 1
        return counts

    def _quantized(self, kind: str, weight: Tensor, bias: Tensor | None, names: list[str],
                   gguf: GGUFBlocks | None, rounded_again: list[str]) -> nn.Module | None:
        # The blocks are whole rows and columns of the file's tensors: exact only on one rank.
        keeps_blocks = gguf is not None and self.tp.size == 1 and weight.device.type == "cpu"
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

    def checkpoint_destinations(self) -> dict[str, tuple[Tensor, Shard | None]]:
        """Every tensor a checkpoint must hold, by Hugging Face name -> the parameter, or rows of one,
        it fills, and the part of the checkpoint tensor this rank takes (None: all of it)."""

        def checkpoint_name(name: str) -> str:
            return name if name.startswith("lm_head") else f"model.{name}"

        destinations = {}
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = checkpoint_name(f"{module_name}.{param_name}")
                if module is self.lm_head:
                    shard = self.embed_tokens.checkpoint_shard("weight")  # the same vocabulary rows
                elif not isinstance(module, FusedLinear):
                    shard = module.checkpoint_shard(param_name) if hasattr(module, "checkpoint_shard") else None
                else:
                    parent, _, fused_name = module_name.rpartition(".")
                    for shard_name, (fused, index) in FUSED_SHARDS.items():
                        if fused == fused_name:
                            # A view: copying into it writes those rows of the fused parameter.
                            rows = param[module.shard_rows(index)]
                            destinations[checkpoint_name(f"{parent}.{shard_name}.{param_name}")] = rows, module.shards[index]
                    continue
                if shard is not None and shard.dim == 0:
                    param = param[: shard.length]  # vocabulary rows past the end are padding
                destinations[name] = param, shard
        return destinations

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model; every one it needs must be given exactly
        once, as this rank's part of it (`checkpoint_destinations` says which part)."""
        with torch.no_grad():
            destinations = self.checkpoint_destinations()
            held = self.embed_tokens.shard.length if self.tp.size > 1 else self.vocab_size
            for table in (self.embed_tokens, self.lm_head):  # rows past the vocabulary: never read, kept finite
                if table is not None:
                    table.weight[held:].zero_()
            # Tracked by checkpoint name, so a missing k_proj is reported as such, not as "qkv_proj".
            missing = set(destinations)
            for hf_name, tensor in weights:
                if "rotary_emb.inv_freq" in hf_name:
                    continue  # old checkpoints saved the rope buffer; we compute our own
                if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                    continue  # some tied checkpoints still carry a copy of the embedding
                if hf_name not in destinations:
                    raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint for {self.config.model_type}")
                if hf_name not in missing:
                    raise ValueError(f"tensor {hf_name!r} appears more than once in the checkpoint")
                destination, _ = destinations[hf_name]
                given, expected = tuple(tensor.shape), tuple(destination.shape)
                if given != expected:
                    raise ValueError(f"tensor {hf_name!r} has shape {given}, the model expects {expected}")
                destination.copy_(tensor)
                missing.discard(hf_name)
        if missing:
            names = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {names}")

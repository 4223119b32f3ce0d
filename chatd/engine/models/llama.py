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
sizes (its heads, its slice of the MLP and of the vocabulary); layers.py's parallel modules say
which part of each checkpoint tensor a rank reads. Rotary embeddings are rope.py.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from chatd.engine.attention import AttentionBackend, AttentionMetadata, KVCache
from chatd.engine.models.layers import FusedLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from chatd.engine.models.matvec import dense
from chatd.engine.models.rope import apply_rope, build_rope_cache, max_positions
from chatd.engine.models.tensor_parallel import HeadLayout, Shard, TPGroup


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

    # The layer in two halves around attention, which a compiled prefill (worker/fast_steps/compiled_prefill.py)
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
        self.quantized_head: nn.Module | None = None  # the LM head as a quantized layer computes it (quantized/quantize_model.py)
        self.quantization = "none"  # what quantize_model() was asked for
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

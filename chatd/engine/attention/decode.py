"""Decode-only attention as plain tensor operations, for a decode step compiled by torch.compile.

The sdpa backend copies each group's context out of the page pool (`index_select`) and hands the
copy to a fused kernel. Written instead as an indexed read inside two reductions (the scores, then
the weighted sum of values), the page gather is something inductor folds into the loops that read
K and V: no copy of the context is made, and the scores, softmax and sum run as a few fused
loops per layer. Every row is one sequence's one new token. Its context is `DecodeContext`'s
slots, padded to the step's longest and masked past each row's end by an additive bias; the
context width is a dynamic size of the compiled graph, so a longer context does not recompile.
Grouped-query attention reads each KV head once for its group of query heads.

It runs eagerly too (that is how it is tested against sdpa), but eagerly its indexed reads are
copies: the sdpa backend is the eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatd.engine.attention.common import AttentionBackend, AttentionMetadata, KVCache
from chatd.engine.attention.kv_dtypes import dequantize_kv


@dataclass
class DecodeContext:
    """What decode-only attention reads of a step: one row per sequence, one new token each."""

    slot_mapping: torch.Tensor  # [B] int64: the cache slot the row's new token is written to
    context_slots: torch.Tensor  # [B, W] int64: cache slots of the row's context, padded to the longest
    context_bias: torch.Tensor  # [B, W]: 0 where a slot is context, -inf past the row's end

    @classmethod
    def of(cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> DecodeContext:
        """From a decode-only step's metadata."""
        positions = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64) - 1
        return cls.of_tables(positions, meta.block_tables_cpu.long(), block_size, dtype)

    @classmethod
    def of_tables(cls, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  dtype: torch.dtype) -> DecodeContext:
        """From each row's position ([B] int64: its new token's) and block table ([B, N] int64,
        shorter rows padded with any block). Tensor operations only: a compiled step computes this
        itself, fused into a few loops, rather than a host building it each step."""
        row_block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        slot_mapping = row_block * block_size + positions % block_size
        context_slots = (block_tables.unsqueeze(2) * block_size + torch.arange(block_size, device=block_tables.device)).flatten(1)
        past_end = torch.arange(context_slots.shape[1], device=positions.device).unsqueeze(0) > positions.unsqueeze(1)
        bias = torch.zeros(context_slots.shape, dtype=dtype, device=positions.device).masked_fill(past_end, float("-inf"))
        return cls(slot_mapping, context_slots, bias)


class DecodeAttention(AttentionBackend):
    """Attention of one new token per row over its paged context; `meta` is a DecodeContext."""

    name = "decode"
    converts_kv = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: DecodeContext,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        rows, num_heads = q.shape[0], q.shape[1]
        # keys, values: [B, W, kv_heads, head_dim], read through the slots (fused, not copied, when compiled)
        keys = dequantize_kv(k_cache.view(-1, num_kv_heads, head_dim)[meta.context_slots], q.dtype, self.k_scale)
        values = dequantize_kv(v_cache.view(-1, num_kv_heads, head_dim)[meta.context_slots], q.dtype, self.v_scale)
        grouped = q.view(rows, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, 1, kv_heads, group, d]
        scores = (grouped * keys[:, :, :, None, :]).sum(-1) * scale + meta.context_bias[:, :, None, None]
        weights = torch.softmax(scores.float(), dim=1).to(q.dtype)  # [B, W, kv_heads, group], over the context
        out = (weights[..., None] * values[:, :, :, None, :]).sum(1)  # [B, kv_heads, group, head_dim]
        return out.reshape(rows, num_heads, head_dim)

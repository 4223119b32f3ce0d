"""The portable reference backend: gathers pages and calls torch's scaled_dot_product_attention.

It runs wherever torch runs (CPU and CUDA) and is what every faster backend is tested against.
Decodes run in groups of similar context length, one call per group: their context slots are
gathered (padded to the group's longest, masked past each row's end) and each KV head's query
heads are treated as a short query, so grouped-query attention copies no K/V. Prefill chunks
run one call per sequence; a chunk with no earlier context attends to its own new K/V without
touching the cache. A cache in another dtype than the queries' (fp8, float16 under float32) is
widened (and scaled) after the gather, only the slots read; a chunk with no earlier context then
rounds its new K/V as the cache stores them, so its output does not depend on whether it was
computed or found in the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatd.engine.attention.common import AttentionBackend, AttentionMetadata, KVCache
from chatd.engine.attention.gpu_io import to_device
from chatd.engine.attention.kv_dtypes import dequantize_kv, quantize_kv

DECODE_GROUP_SIZE = 16  # decodes gathered per attention call; groups of similar length waste little padding


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended in one call over their gathered, padded context."""

    rows: torch.Tensor  # [g] int64: which of the step's decode rows
    slots: torch.Tensor  # [g, L] int64: cache slots of each row's context, padded to the group's longest
    bias: torch.Tensor  # [g, L]: 0 where a slot is context, -inf past its end


def decode_groups(meta: AttentionMetadata, block_size: int, dtype: torch.dtype, device: torch.device) -> list[DecodeGroup]:
    """Group the step's decodes by context length; built by the first layer, reused by the rest."""
    groups = meta.scratch.get("sdpa_decode_groups")
    if groups is not None:
        return groups
    tables, seq_lens = meta.block_tables_cpu, meta.seq_lens_cpu
    by_length = sorted(range(meta.num_decodes), key=lambda i: seq_lens[i])
    host = []
    for first in range(0, meta.num_decodes, DECODE_GROUP_SIZE):
        rows = torch.tensor(by_length[first : first + DECODE_GROUP_SIZE])
        group_lens = torch.tensor([seq_lens[i] for i in rows.tolist()])
        blocks = -(-int(group_lens.max()) // block_size)
        slots = (tables[rows, :blocks].long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
        host += [rows, slots, group_lens]
    moved = to_device(host, device)
    groups = []
    for rows, slots, group_lens in zip(moved[0::3], moved[1::3], moved[2::3]):
        past_end = torch.arange(slots.shape[1], device=device)[None, :] >= group_lens[:, None]
        bias = torch.zeros(past_end.shape, dtype=dtype, device=device).masked_fill_(past_end, float("-inf"))
        groups.append(DecodeGroup(rows, slots, bias))
    meta.scratch["sdpa_decode_groups"] = groups
    return groups


class SdpaBackend(AttentionBackend):
    """Portable reference: gathers pages and calls torch's scaled_dot_product_attention."""

    name = "sdpa"
    converts_kv = True

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_kv_heads, block_size, head_dim = k_cache.shape[2], k_cache.shape[1], k_cache.shape[3]
        num_heads = q.shape[1]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_slots, v_slots = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        for group in decode_groups(meta, block_size, q.dtype, q.device):
            g, context = group.slots.shape
            # keys: [g, kv_heads, context, head_dim]; queries: [g, kv_heads, heads per kv head, head_dim]
            index = group.slots.view(-1)
            keys = dequantize_kv(k_slots.index_select(0, index), q.dtype, self.k_scale)
            values = dequantize_kv(v_slots.index_select(0, index), q.dtype, self.v_scale)
            keys = keys.view(g, context, num_kv_heads, head_dim).transpose(1, 2)
            values = values.view(g, context, num_kv_heads, head_dim).transpose(1, 2)
            grouped_q = q.index_select(0, group.rows).view(g, num_kv_heads, num_heads // num_kv_heads, head_dim)
            bias = group.bias[:, None, None, :]
            group_out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=bias, scale=scale)
            out.index_copy_(0, group.rows, group_out.reshape(g, num_heads, head_dim))
        starts = meta.query_starts_cpu
        for i in range(meta.num_decodes, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_cpu[i]
            if q_len == 0:  # a padding row
                continue
            # 4-D [1, heads, len, head_dim]: torch's CPU flash kernel only takes batched inputs.
            seq_q = q[start:end].transpose(0, 1)[None]
            if q_len == seq_len:  # no earlier context: the new K/V are the whole context
                keys, values = k[start:end], v[start:end]
                if k_cache.dtype != q.dtype:  # what the cache holds, as a later chunk would read it
                    keys = dequantize_kv(quantize_kv(keys, k_cache.dtype, self.k_scale), q.dtype, self.k_scale)
                    values = dequantize_kv(quantize_kv(values, v_cache.dtype, self.v_scale), q.dtype, self.v_scale)
                keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                table = meta.block_tables[i, : -(-seq_len // block_size)]
                keys = dequantize_kv(k_cache[table].flatten(0, 1)[:seq_len], q.dtype, self.k_scale)
                values = dequantize_kv(v_cache[table].flatten(0, 1)[:seq_len], q.dtype, self.v_scale)
                keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, kv_heads, seq_len, head_dim]
                # The chunk's queries sit at positions seq_len - q_len .. seq_len - 1.
                query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                future = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
                bias = torch.zeros(future.shape, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
            out[start:end] = seq_out[0].transpose(0, 1)
        return out

"""Attention over the paged KV cache, behind one small interface.

The runner describes a step's flat batch once in `AttentionMetadata`; every layer hands its
new K/V and queries to the chosen backend, which writes K/V into their slots and attends over
each sequence's pages. KV layout per layer: `[num_blocks, block_size, kv_heads, head_dim]`.

Backends: `sdpa` (portable: CPU and CUDA, gathers pages and calls torch's
scaled_dot_product_attention). Faster GPU backends plug in here with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, block_size, kv_heads, head_dim]


@dataclass
class AttentionMetadata:
    """One step's batch layout. Sequences are ordered decodes first, then prefill chunks."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's new tokens start in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical blocks, padded with 0
    query_lens_cpu: list[int]  # the same facts as host lists, for Python loops without syncs
    seq_lens_cpu: list[int]
    num_decodes: int  # the first num_decodes sequences have exactly one new token

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it."""

    name = "base"

    def write_kv(self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store new keys/values ([T, kv_heads, head_dim]) into their slots: one fused copy per tensor."""
        k_cache, v_cache = kv_cache
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> out: [T, heads, head_dim], causal over each sequence's context."""
        raise NotImplementedError


class SdpaBackend(AttentionBackend):
    """Portable reference: gathers each sequence's pages and calls scaled_dot_product_attention.

    Decodes are batched into one call (keys padded to the longest context and masked);
    prefill chunks run one call per sequence with a causal mask aligned to the chunk's end.
    """

    name = "sdpa"

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        block_size = k_cache.shape[1]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_cpu[:nd])
            num_blocks = -(-max_len // block_size)
            tables = meta.block_tables[:nd, :num_blocks]
            # keys: [nd, kv_heads, num_blocks * block_size, head_dim]
            keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
            values = v_cache[tables].flatten(1, 2).transpose(1, 2)
            positions = torch.arange(num_blocks * block_size, device=q.device)
            mask = positions[None, :] < meta.seq_lens[:nd, None]  # [nd, L]
            decode_q = q[:nd].unsqueeze(2)  # [nd, heads, 1, head_dim]
            decode_out = F.scaled_dot_product_attention(
                decode_q, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
            )
            out[:nd] = decode_out.squeeze(2)
        starts = meta.query_start_loc.tolist() if meta.num_seqs > nd else []
        for i in range(nd, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_cpu[i]
            num_blocks = -(-seq_len // block_size)
            table = meta.block_tables[i, :num_blocks]
            keys = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            values = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)
            seq_q = q[start:end].transpose(0, 1)  # [heads, q_len, head_dim]
            if q_len == seq_len:
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # The chunk's queries sit at positions seq_len - q_len .. seq_len - 1.
                query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                key_pos = torch.arange(seq_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = seq_out.transpose(0, 1)
        return out


BACKENDS: dict[str, type[AttentionBackend]] = {"sdpa": SdpaBackend}


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend named in config; `auto` picks the best one available on this device."""
    if name == "auto":
        name = "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not available; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]()

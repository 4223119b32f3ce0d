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
    """One step's batch layout. Sequences are ordered one-token rows (decodes) first, then prefill chunks."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's new tokens start in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical blocks, padded with 0
    query_starts_cpu: list[int]  # the same facts as host lists, for Python loops without device syncs
    seq_lens_cpu: list[int]
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    # For gathering backends, built once per step rather than once per layer:
    decode_slots: torch.Tensor | None = None  # [num_decodes, L] int64: slots of each decode's context, padded
    decode_bias: torch.Tensor | None = None  # [num_decodes, L]: 0 where a slot is context, -inf past its end

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def build_metadata(
    starts: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Describe a flat batch: sequence i has `starts[i]` cached tokens and `query_lens[i]` new ones.

    Returns the positions of the new tokens ([T] int64) and the metadata, both on `device`.
    One-token rows must come first.
    """
    num_seqs = len(starts)
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32)
    lens = torch.tensor(query_lens)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=query_start_loc[1:])
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    # Per token: which sequence it belongs to, and its position within that sequence.
    row = torch.repeat_interleave(torch.arange(num_seqs), lens)
    positions = torch.arange(int(lens.sum())) - query_start_loc[:-1].long()[row] + torch.tensor(starts)[row]
    slots = tables[row, positions // block_size].long() * block_size + positions % block_size
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), num_seqs)
    decode_slots = decode_bias = None
    if num_decodes:
        blocks = -(-max(seq_lens[:num_decodes]) // block_size)
        decode_slots = (tables[:num_decodes, :blocks].long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
        past_end = torch.arange(blocks * block_size)[None, :] >= torch.tensor(seq_lens[:num_decodes])[:, None]
        decode_bias = torch.zeros(past_end.shape, dtype=dtype).masked_fill_(past_end, float("-inf"))
    to = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=to(slots),
        query_start_loc=to(query_start_loc),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=to(tables),
        query_starts_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens,
        num_decodes=num_decodes,
        decode_slots=to(decode_slots),
        decode_bias=to(decode_bias),
    )
    return to(positions), meta


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it."""

    name = "base"

    def write_kv(self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store new keys/values ([T, kv_heads, head_dim]) into their slots: one fused copy per tensor."""
        k_cache, v_cache = kv_cache
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> out: [T, heads, head_dim], causal over each sequence's context.

        k, v ([T, kv_heads, head_dim]) are this step's new keys and values, already in the cache;
        a backend may use them directly where a sequence has no earlier context.
        """
        raise NotImplementedError


class SdpaBackend(AttentionBackend):
    """Portable reference: gathers pages and calls torch's scaled_dot_product_attention.

    Decodes run as one call: their context slots are gathered (padded to the longest, masked
    with `decode_bias`) and each KV head's group of query heads is treated as a short query, so
    grouped-query attention needs no copies of K/V. Prefill chunks run one call per sequence;
    a chunk with no earlier context attends to its own new K/V without touching the cache.
    """

    name = "sdpa"

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        num_heads = q.shape[1]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            slots = meta.decode_slots.view(-1)
            context = meta.decode_slots.shape[1]
            # keys: [nd, kv_heads, context, head_dim]; queries: [nd, kv_heads, group, head_dim]
            keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(nd, context, num_kv_heads, head_dim).transpose(1, 2)
            values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(nd, context, num_kv_heads, head_dim).transpose(1, 2)
            grouped_q = q[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
            bias = meta.decode_bias[:, None, None, :].to(q.dtype)
            decode_out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=bias, scale=scale)
            out[:nd] = decode_out.reshape(nd, num_heads, head_dim)
        block_size = k_cache.shape[1]
        starts = meta.query_starts_cpu
        for i in range(nd, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_cpu[i]
            seq_q = q[start:end].transpose(0, 1)  # [heads, q_len, head_dim]
            if q_len == seq_len:  # no earlier context: the new K/V are the whole context
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                table = meta.block_tables[i, : -(-seq_len // block_size)]
                keys = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
                values = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)
                # The chunk's queries sit at positions seq_len - q_len .. seq_len - 1.
                query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
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

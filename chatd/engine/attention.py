"""Attention over the paged KV cache, behind one small interface.

The runner describes a step's flat batch once in `AttentionMetadata`; every layer hands its
new K/V and queries to the chosen backend, which writes K/V into their slots and attends over
each sequence's pages. KV layout per layer: `[num_blocks, block_size, kv_heads, head_dim]`.

Backends: `sdpa` (portable: CPU and CUDA, gathers pages and calls torch's
scaled_dot_product_attention). Faster GPU backends plug in here with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, block_size, kv_heads, head_dim]


DECODE_GROUP_SIZE = 16  # decodes gathered per attention call; groups of similar length waste little padding


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended in one call over their gathered, padded context."""

    rows: torch.Tensor  # [g] int64: which of the step's decode rows
    slots: torch.Tensor  # [g, L] int64: cache slots of each row's context, padded to the group's longest
    bias: torch.Tensor  # [g, L]: 0 where a slot is context, -inf past its end


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
    # For gathering backends, built once per step rather than once per layer.
    decode_groups: list[DecodeGroup] = field(default_factory=list)

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
    to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    decode_groups = []
    by_length = sorted(range(num_decodes), key=lambda i: seq_lens[i])
    for first in range(0, num_decodes, DECODE_GROUP_SIZE):
        rows = torch.tensor(by_length[first : first + DECODE_GROUP_SIZE])
        group_lens = torch.tensor([seq_lens[i] for i in rows.tolist()])
        blocks = -(-int(group_lens.max()) // block_size)
        slots_ = (tables[rows, :blocks].long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
        past_end = torch.arange(blocks * block_size)[None, :] >= group_lens[:, None]
        bias = torch.zeros(past_end.shape, dtype=dtype).masked_fill_(past_end, float("-inf"))
        decode_groups.append(DecodeGroup(to(rows), to(slots_), to(bias)))
    meta = AttentionMetadata(
        slot_mapping=to(slots),
        query_start_loc=to(query_start_loc),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=to(tables),
        query_starts_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens,
        num_decodes=num_decodes,
        decode_groups=decode_groups,
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

    Decodes run in groups of similar context length, one call per group: their context slots
    are gathered (padded to the group's longest, masked with the group's bias) and each KV
    head's query heads are treated as a short query, so grouped-query attention copies no K/V. Prefill chunks run one call per sequence;
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
        k_slots, v_slots = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        for group in meta.decode_groups:
            g, context = group.slots.shape
            # keys: [g, kv_heads, context, head_dim]; queries: [g, kv_heads, heads per kv head, head_dim]
            keys = k_slots.index_select(0, group.slots.view(-1)).view(g, context, num_kv_heads, head_dim).transpose(1, 2)
            values = v_slots.index_select(0, group.slots.view(-1)).view(g, context, num_kv_heads, head_dim).transpose(1, 2)
            grouped_q = q.index_select(0, group.rows).view(g, num_kv_heads, num_heads // num_kv_heads, head_dim)
            bias = group.bias[:, None, None, :]
            group_out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=bias, scale=scale)
            out.index_copy_(0, group.rows, group_out.reshape(g, num_heads, head_dim))
        nd = meta.num_decodes
        block_size = k_cache.shape[1]
        starts = meta.query_starts_cpu
        for i in range(nd, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_cpu[i]
            # 4-D [1, heads, len, head_dim]: torch's CPU flash kernel only takes batched inputs.
            seq_q = q[start:end].transpose(0, 1)[None]
            if q_len == seq_len:  # no earlier context: the new K/V are the whole context
                keys, values = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
            else:
                table = meta.block_tables[i, : -(-seq_len // block_size)]
                keys = k_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None]  # [1, kv_heads, seq_len, head_dim]
                values = v_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)[None]
                # The chunk's queries sit at positions seq_len - q_len .. seq_len - 1.
                query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                future = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
                bias = torch.zeros(future.shape, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
                seq_out = F.scaled_dot_product_attention(seq_q, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
            out[start:end] = seq_out[0].transpose(0, 1)
        return out


BACKENDS: dict[str, type[AttentionBackend]] = {"sdpa": SdpaBackend}


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend named in config; `auto` picks the best one available on this device."""
    if name == "auto":
        name = "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not available; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]()

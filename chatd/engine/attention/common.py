"""What every attention backend shares: the step's batch layout and the backend interface.

The runner describes a step's flat batch once, in `AttentionMetadata`; every layer hands its
new K/V and queries to the chosen backend, which writes K/V into their slots and attends over
each sequence's pages. KV layout per layer: `[num_blocks, block_size, kv_heads, head_dim]`;
slot = block * block_size + offset. This module knows nothing of models or scheduling.

The cache is in the model's dtype, in a 16-bit float, or in fp8 (`cache.kv_cache_dtype`):
kv_dtypes.py says how each stores a value and reads it back. On a GPU, a step's inputs travel in
one pinned copy and new K/V are written by one triton kernel (gpu_io.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from chatd.engine.attention.gpu_io import store_kv_triton, to_device, triton_available
from chatd.engine.attention.kv_dtypes import write_kv_slots
from chatd.engine.core.ragged import pad_ragged

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, block_size, kv_heads, head_dim]

@dataclass
class AttentionMetadata:
    """One step's batch layout. Sequences are ordered one-token rows (decodes) first, then prefill chunks.

    Device tensors are what kernels read; the host copies serve Python-side planning (the sdpa
    backend's loops) without device syncs. A padding row (CUDA-graph batches) has no queries,
    seq_len 0 and slot -1 for its token.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token; -1 = padding, not written
    query_start_loc: torch.Tensor  # [B + 1] int32: where each sequence's new tokens start in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical blocks, padded with 0
    query_starts_cpu: list[int]  # host copies of query_start_loc and seq_lens
    seq_lens_cpu: list[int]
    block_tables_cpu: torch.Tensor  # host copy of block_tables
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    max_query_len: int  # longest run of new tokens of one sequence (1: a decode-only step)
    max_seq_len: int  # longest context; a bound (max_model_len) in captured CUDA graphs
    # A backend's own per-step data (the sdpa backend's decode groups), made by its first layer.
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class StepInputs:
    """A step's model inputs on the device: token ids and positions ([T] int64) and the layout."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def build_step(
    token_ids: list[int],
    starts: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """Describe a flat batch: sequence i has `starts[i]` cached tokens and `query_lens[i]` new ones.

    token_ids are the new tokens of every sequence, concatenated. One-token rows must come first.
    Everything reaches the device in one copy.
    """
    # Host-side index arithmetic in numpy: at a few hundred sequences, torch's per-op overhead
    # on small CPU tensors costs milliseconds a step, which a GPU step would wait for.
    num_seqs = len(starts)
    lens = np.asarray(query_lens, dtype=np.int64)
    tables = pad_ragged(block_tables, fill=0, dtype=np.int32)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(lens, out=query_start_loc[1:])
    seq_lens = np.asarray(starts, dtype=np.int64) + lens
    # Per token: which sequence it belongs to, and its position within that sequence.
    row = np.repeat(np.arange(num_seqs), lens)
    positions = np.arange(int(lens.sum())) - query_start_loc[:-1][row] + np.asarray(starts, dtype=np.int64)[row]
    slots = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    host = [np.asarray(token_ids, dtype=np.int64), positions, slots, query_start_loc, seq_lens.astype(np.int32), tables]
    tables_t = torch.from_numpy(tables)
    input_ids_d, positions_d, slots_d, qsl_d, seq_lens_d, tables_d = to_device([torch.from_numpy(a) for a in host], device)
    meta = AttentionMetadata(
        slot_mapping=slots_d,
        query_start_loc=qsl_d,
        seq_lens=seq_lens_d,
        block_tables=tables_d,
        query_starts_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        block_tables_cpu=tables_t,
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), num_seqs),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
    )
    return StepInputs(input_ids_d, positions_d, meta)


class AttentionBackend:
    """Writes new K/V into the paged cache and attends over it."""

    name = "base"
    # A decode-only step can be captured in a CUDA graph: no host syncs, no Python that reads
    # the batch's data, launch shapes fixed by the padded batch size.
    supports_cuda_graphs = False
    # Reads a cache whose dtype is not the queries' (fp8, or a 16-bit float beside another model
    # dtype): it widens what it reads to the queries' dtype and applies fp8's k_scale and v_scale.
    converts_kv = False

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        # One pair for all layers, as vLLM uses without scales calibrated into the checkpoint.
        self.k_scale = k_scale
        self.v_scale = v_scale

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device` (a missing package, no CUDA); None when it can."""
        return None

    def capturable(self) -> bool:
        """Decode steps can run in CUDA graphs: its attention is graph-safe and the KV write is the
        triton kernel, the one that skips padding slots."""
        return self.supports_cuda_graphs and triton_available()

    def write_kv(self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store new keys/values ([T, kv_heads, head_dim]) into their slots, as the cache's dtype stores them."""
        if kv_cache[0].is_cuda and triton_available():  # one kernel for keys and values (gpu_io.py)
            return store_kv_triton(kv_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        for cache, new, scale in zip(kv_cache, (k, v), (self.k_scale, self.v_scale)):
            write_kv_slots(cache, meta.slot_mapping, new, scale)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> out: [T, heads, head_dim], causal over each sequence's context.

        k, v ([T, kv_heads, head_dim]) are this step's new keys and values, already in the cache;
        a backend may use them directly where a sequence has no earlier context.
        """
        raise NotImplementedError


"""GPU backends: each attends over the paged cache in one kernel call per layer for a whole mixed batch.

- `triton`: chatd's own kernels (chatd/engine/attention/triton_kernels.py): one launch writes K and V,
  one launch attends for decodes and prefill chunks over cached prefixes alike. Runs on CUDA,
  and on CPU under TRITON_INTERPRET=1 (slowly: that is how CI checks the kernels).
- `torch-varlen`: `torch.nn.attention.varlen.varlen_attn` with a block table: torch's bundled
  FlashAttention (torch >= 2.10, CUDA), no extra package.
- `flash-attn`: the optional flash-attn package's varlen kernel with a block table.

FlashAttention's paged mode has page-size rules of its own; `select_backend` checks each
backend against sdpa on a small problem with the configured block size before using it.

Of these, only `triton` reads an fp8 KV cache: torch's varlen_attn and flash-attn 2's varlen kernel
take K/V in the queries' dtype and no K/V scales, so with an fp8 cache `select_backend` passes
them over (widening the pages they would read, every step, would cost more than fp8 saves).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import torch
import torch.nn.functional as F

from chatd.engine.attention.common import AttentionBackend, AttentionMetadata, KVCache
from chatd.engine.attention.gpu_io import store_kv_triton, triton_available


def cu_seq_lens(meta: AttentionMetadata) -> torch.Tensor:
    """[B + 1] int32 running total of context lengths, made on the device (no sync; capturable)."""
    cu = meta.scratch.get("cu_seq_lens")
    if cu is None:
        cu = meta.scratch["cu_seq_lens"] = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return cu


def cuda_module_missing(device: torch.device, what: str, module: str, missing: str) -> str | None:
    """Why `what`, a CUDA-only backend built on `module`, cannot run on `device`; None when it can."""
    if device.type != "cuda":
        return f"{what} needs CUDA"
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        found = False
    return None if found else missing


# What varlen_attn must take to read a page pool; enable_gqa is passed only where it is taken
# (torch 2.13 has it; torch 2.11's FlashAttention refused it as an unknown keyword).
PAGED_VARLEN_PARAMETERS = ("block_table", "seqused_k", "window_size", "scale")


@functools.cache
def varlen_parameters() -> frozenset[str]:
    """The keyword parameters of this torch's `varlen_attn`."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


class TritonBackend(AttentionBackend):
    """chatd's paged-attention kernels: decodes and prefill chunks in one launch per layer."""

    name = "triton"
    supports_cuda_graphs = True
    converts_kv = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if not triton_available():
            return "the triton package is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "triton kernels need CUDA (or TRITON_INTERPRET=1, for tests)"
        return None

    def write_kv(self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        # Always the kernel: on a CPU too, where TRITON_INTERPRET=1 runs it (how CI checks it).
        store_kv_triton(kv_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        from chatd.engine.attention.triton_kernels import paged_attention

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_attention(
            q, kv_cache[0], kv_cache[1], out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale, k_scale=self.k_scale, v_scale=self.v_scale,
        )
        return out


class TorchVarlenBackend(AttentionBackend):
    """torch's own FlashAttention over the page pool: `varlen_attn(..., block_table=...)`."""

    name = "torch-varlen"
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        reason = cuda_module_missing(
            device, "torch's varlen attention", "torch.nn.attention.varlen", f"torch {torch.__version__} has no varlen attention (needs >= 2.10)"
        )
        missing = [] if reason else [name for name in PAGED_VARLEN_PARAMETERS if name not in varlen_parameters()]
        if missing:
            reason = f"torch {torch.__version__}'s varlen_attn takes no {', '.join(missing)} (a paged cache needs them)"
        return reason

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        k_cache, v_cache = kv_cache
        grouped = {"enable_gqa": q.shape[1] != k_cache.shape[2]} if "enable_gqa" in varlen_parameters() else {}
        # window (-1, 0) is causal, aligned to the end of each sequence: a chunk's queries are
        # the last q_len positions of its context.
        return varlen_attn(
            q.contiguous(), k_cache, v_cache, meta.query_start_loc, cu_seq_lens(meta), meta.max_query_len,
            meta.max_seq_len, scale=scale, window_size=(-1, 0), seqused_k=meta.seq_lens, block_table=meta.block_tables,
            **grouped,
        )


class FlashAttnBackend(AttentionBackend):
    """The flash-attn package's varlen kernel with a block table (only when the package is installed)."""

    name = "flash-attn"
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return cuda_module_missing(device, "flash-attn", "flash_attn", "the flash-attn package is not installed (pip install chatd[flash])")

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q.contiguous(), kv_cache[0], kv_cache[1], meta.query_start_loc, cu_seq_lens(meta), meta.max_query_len,
            meta.max_seq_len, softmax_scale=scale, causal=True, block_table=meta.block_tables,
        )

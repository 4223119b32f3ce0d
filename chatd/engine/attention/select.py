"""Choosing the attention backend: the one named in config, or the best that works here.

`auto` tries the GPU backends fastest first and keeps the first that is available and gives
sdpa's answer on a small paged problem shaped like the model (its heads, head_dim, dtype and
the configured block size), so a kernel with rules of its own (FlashAttention's page sizes)
is passed over with a logged reason instead of failing mid-request. With an fp8 KV cache only
backends that read one are candidates, and the probe runs over an fp8 cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from chatd.engine.attention.common import AttentionBackend, build_step
from chatd.engine.attention.kv_dtypes import quantize_kv
from chatd.engine.attention.gpu import FlashAttnBackend, TorchVarlenBackend, TritonBackend
from chatd.engine.attention.sdpa import SdpaBackend

log = logging.getLogger("chatd.engine")

BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (FlashAttnBackend, TorchVarlenBackend, TritonBackend, SdpaBackend)
}
AUTO_ORDER = ("flash-attn", "torch-varlen", "triton", "sdpa")  # fastest expected first


@dataclass(frozen=True)
class AttentionShape:
    """What a backend must handle: the model's attention and the cache's block size and dtype."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None  # the KV cache's; None: the model's dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


def select_backend(name: str, device: torch.device, shape: AttentionShape) -> AttentionBackend:
    """The backend named in config; `auto` picks the first of AUTO_ORDER that works on this device."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is unknown; choose one of: auto, {', '.join(BACKENDS)}")
    if name == "auto" and device.type != "cuda":
        return SdpaBackend()  # the only backend meant for CPU (triton there is an interpreter, for tests)
    for candidate in AUTO_ORDER if name == "auto" else (name,):
        backend_class = BACKENDS[candidate]
        reason = backend_class.unavailable_reason(device)
        if reason is None and shape.cache_dtype != shape.dtype and not backend_class.converts_kv:
            reason = f"it reads no {str(shape.cache_dtype).removeprefix('torch.')} KV cache (cache.kv_cache_dtype)"
        backend = backend_class()
        if reason is None and candidate != "sdpa" and device.type == "cuda":
            reason = probe(backend, device, shape)
        if reason is None:
            return backend
        if name != "auto":
            raise ValueError(f"attention_backend {name!r} cannot run here: {reason}")
        log.info("attention backend %s skipped: %s", candidate, reason)
    raise AssertionError("sdpa runs everywhere")


def probe(backend: AttentionBackend, device: torch.device, shape: AttentionShape) -> str | None:
    """Run `backend` and sdpa on the same small mixed batch; None if they agree, else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    bs = shape.block_size
    # A decode over 2.5 blocks, a chunk over a cached prefix, a whole prompt; blocks out of order.
    starts, query_lens = [int(2.5 * bs) - 1, bs + 3, 0], [1, bs, 5]
    num_blocks = 12
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for start, n in zip(starts, query_lens):
        need = -(-(start + n) // bs)
        tables.append(order[used : used + need])
        used += need
    step = build_step([0] * sum(query_lens), starts, query_lens, tables, bs, device)
    num_tokens = sum(query_lens)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device, shape.dtype)

    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    prefix = tuple(quantize_kv(rand(*cache_shape), shape.cache_dtype, 1.0) for _ in range(2))
    q = rand(num_tokens, shape.num_heads, shape.head_dim)
    k, v = rand(num_tokens, shape.num_kv_heads, shape.head_dim), rand(num_tokens, shape.num_kv_heads, shape.head_dim)
    scale = shape.head_dim**-0.5
    outputs = []
    for candidate in (backend, SdpaBackend()):
        cache = (prefix[0].clone(), prefix[1].clone())
        try:
            candidate.write_kv(cache, k, v, step.meta)
            outputs.append(candidate.attend(q, k, v, cache, step.meta, scale).float())
            torch.cuda.synchronize(device)
        except Exception as exc:  # any failure means "not usable here"; say why
            return f"failed on a test batch: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        step.meta.scratch.clear()
    error = (outputs[0] - outputs[1]).abs().max().item()
    if not error < 0.05:
        return f"differs from sdpa by {error:.3g} on a test batch (block_size {bs})"
    return None

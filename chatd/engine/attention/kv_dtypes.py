"""The KV cache's dtypes: what `cache.kv_cache_dtype` means, and how each stores a value.

A float16 cache saturates at its largest finite value (a large key never becomes inf); an fp8 cache
stores clamp(x / scale) in one byte and is read back as stored * scale, with one key scale and one
value scale per backend (1.0 unless set: chatd reads no calibrated scales from checkpoints). A cache
in the model's own dtype is a plain copy, and reading it back a no-op.
"""

from __future__ import annotations

import torch

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_dtype(setting: str, model_dtype: torch.dtype, quantized_on_cpu: bool = False) -> torch.dtype:
    """The KV cache's dtype for a `cache.kv_cache_dtype` setting. "auto" is the model's own dtype,
    except float32 beside quantized weights on a CPU: float16 there, as llama.cpp's default cache.
    Measured on SmolLM2's Q4_1 file (benchmarks/README.md): decode steps at 64 rows 10% faster,
    perplexity 25.64 -> 25.67, logprobs moved less than the quantized layers' own bfloat16
    rounding moves them between a compiled and an eager step; and the same memory holds twice the
    blocks. A float32 model's exact numbers stay exact where no quantization was asked for."""
    if setting != "auto":
        return KV_DTYPES[setting]
    return torch.float16 if quantized_on_cpu and model_dtype == torch.float32 else model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype is quantized (stores x / scale, read back times scale)."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it: for fp8, x / scale clamped to the format's largest
    finite value (saturating: a large key never becomes inf or NaN); for float16 clamped likewise;
    otherwise a plain cast."""
    if is_fp8(cache_dtype):
        limit = torch.finfo(cache_dtype).max
        return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)
    if cache_dtype == torch.float16 and x.dtype != torch.float16:
        limit = torch.finfo(torch.float16).max
        return x.clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache contents as values of `dtype`: fp8 times its scale (fp8 widens to fp16, bf16 or fp32 exactly)."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return stored.to(dtype) * scale


def write_kv_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor, scale: float) -> None:
    """new ([T, kv_heads, head_dim]) into the cache's slots ([T] int64), as its dtype stores them."""
    stored = quantize_kv(new, cache.dtype, scale)
    if is_fp8(cache.dtype):  # index_copy_ has no fp8 kernel on CPU: copy the bytes
        cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, stored)

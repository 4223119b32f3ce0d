"""Attention over the paged KV cache, behind one small interface.

`common` holds the step's batch layout (`AttentionMetadata`, built once per step by
`build_step`) and the backend interface: `write_kv` (new K/V into their slots) and `attend`,
with the KV cache in the model's dtype or fp8 (`resolve_kv_dtype`, `quantize_kv`, `dequantize_kv`).
Backends: `sdpa` (portable reference, CPU and CUDA), and on CUDA `triton`, `torch-varlen` and
`flash-attn`; `select_backend` picks one.
"""

from chatd.engine.attention.common import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    StepInputs,
    build_step,
    to_device,
    triton_available,
)
from chatd.engine.attention.kv_dtypes import dequantize_kv, is_fp8, quantize_kv, resolve_kv_dtype
from chatd.engine.attention.gpu import FlashAttnBackend, TorchVarlenBackend, TritonBackend
from chatd.engine.attention.sdpa import SdpaBackend
from chatd.engine.attention.select import BACKENDS, AttentionShape, select_backend

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionShape",
    "FlashAttnBackend",
    "KVCache",
    "SdpaBackend",
    "StepInputs",
    "TorchVarlenBackend",
    "TritonBackend",
    "build_step",
    "dequantize_kv",
    "is_fp8",
    "quantize_kv",
    "resolve_kv_dtype",
    "select_backend",
    "to_device",
    "triton_available",
]

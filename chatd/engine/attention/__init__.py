"""Attention over the paged KV cache, behind one small interface.

`common` holds the step's batch layout (`AttentionMetadata`, built once per step by
`build_step`) and the backend interface: `write_kv` (new K/V into their slots) and `attend`.
`sdpa` is the portable reference backend (CPU and CUDA), the one the core path reads. Beside them:
`kv_dtypes` (a cache in a 16-bit float or fp8: `resolve_kv_dtype`, `quantize_kv`,
`dequantize_kv`), `gpu_io` (on a GPU: a step's inputs in one pinned copy, the triton KV write),
`gpu` (on CUDA: `triton`, `torch-varlen`, `flash-attn`; triton_kernels.py),
`decode` (decode attention as plain tensor operations, for compiled steps), and `select`
(`select_backend` picks one). Imports: core and params only.
"""

from chatd.engine.attention.common import AttentionBackend, AttentionMetadata, KVCache, StepInputs, build_step
from chatd.engine.attention.gpu_io import to_device, triton_available
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

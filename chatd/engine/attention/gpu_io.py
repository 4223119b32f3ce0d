"""A step's data on a GPU: small host tensors in one pinned copy, new K/V into the cache in one kernel.

What every backend shares (common.py) calls these where the device is CUDA; on a CPU `to_device`
hands the tensors back as they are and write_kv takes its indexed copy instead.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    """Triton is importable (it ships with CUDA builds of torch; CPU tests install it to interpret kernels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move small host tensors to `device` in one pinned host-to-device copy (on CPU: as they are).

    Each separate `.to(device)` of pageable memory is its own staged copy; packing them into one
    pinned buffer makes a step's inputs one transfer that overlaps with queued GPU work.
    Tensors of 4- and 8-byte dtypes travel as int32 words, bit for bit.
    """
    if device.type == "cpu" or not tensors:  # (a step without decodes has no decode groups to move)
        return tensors
    # 8-byte tensors first, so each keeps an 8-byte aligned offset in the staging buffer.
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    words = [tensors[i].reshape(-1).view(torch.int32) for i in order]  # 4- and 8-byte dtypes, bit for bit
    staged = torch.empty(sum(w.numel() for w in words), dtype=torch.int32, pin_memory=True)
    torch.cat(words, out=staged)
    on_device = staged.to(device, non_blocking=True)
    moved: list[torch.Tensor] = [on_device] * len(tensors)
    offset = 0
    for i, w in zip(order, words):
        moved[i] = on_device[offset : offset + w.numel()].view(tensors[i].dtype).view(tensors[i].shape)
        offset += w.numel()
    return moved


def store_kv_triton(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Keys and values ([T, kv_heads, head_dim]) into their slots in one triton launch, quantized as
    the cache's dtype stores them; padding slots (-1, in CUDA graphs) are skipped."""
    from chatd.engine.attention.triton_kernels import store_kv

    store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping, k_scale, v_scale)

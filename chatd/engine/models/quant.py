"""Weight-only quantized linears: int8 per output channel, int4 in groups of 32 values.

A decode step at batch 1 reads every weight once, so on a CPU its time is the weights' bytes over
the memory bandwidth: fewer bytes per weight is what makes one stream fast. The kernels are
PyTorch's own (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`): they take
activations in bfloat16 and give bfloat16, so a quantized layer computes in bfloat16 and hands
back the model's dtype. Measured on the 2-core CPU machine for SmolLM2-135M's shapes at one
token (benchmarks/README.md): both are 2-3x faster than a float32 matmul of the same layer, and
11x for its 49152-row LM head; int8 with float32 activations was 5-8x *slower* than float32,
hence bfloat16 activations for both.

int4 is asymmetric, as llama.cpp's Q4_1: each group of 32 weights of a row has a scale and a
zero, w = (q - 8) * scale + zero for q in 0..15. GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly
that (gguf_quant.py converts them without rounding anything again).

The kernels' shape rules: the reduced dimension (in_features) a multiple of 32, and for int4 the
rows a multiple of 16 (padded with zero rows here, cut from the output). A layer outside those
rules stays in floating point.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from chatd.engine.models.matvec import as_reductions, row_products

QUANTIZATIONS = ("none", "int8", "int4")
GROUP_SIZE = 32  # int4: weights of a row sharing one scale and zero (GGUF's block)


def can_quantize(weight: Tensor) -> bool:
    """Whether the kernels take a [out_features, in_features] weight of this shape."""
    return weight.dim() == 2 and weight.shape[1] % GROUP_SIZE == 0


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 and one bfloat16 scale per output row."""

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())  # [out, in] int8
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())  # [out]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """Symmetric per-row quantization: scale = max |w| / 127."""
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(qweight, scales, bias)

    def dequantized(self) -> Tensor:
        """The weight the kernel computes with, in float32 (for tests and references)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if as_reductions(x):  # a compiled decode step's few rows: 2x the kernel's speed (matvec.py)
            # In x's dtype, not rounded to bfloat16 as the kernel's input and output are: rounding
            # here made the step 7% slower and agreed no better with the kernel's results.
            y = (row_products(x, self.qweight) * self.scales).to(x.dtype)
            return y if self.bias is None else y + self.bias
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight,
                                               self.scales)  # [tokens, out]
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W as 4-bit values in groups of GROUP_SIZE, each with a scale and a zero."""

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor, bias: Tensor | None) -> None:
        """q: [out, in] integers 0..15; scales, zeros: [out, in / GROUP_SIZE]: w = (q - 8) * scale + zero."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        padded = -(-self.out_features // 16) * 16  # the kernel's rows come in sixteens
        if padded != self.out_features:
            extra = padded - self.out_features
            q = torch.cat([q, torch.full((extra, self.in_features), 8, dtype=q.dtype)])
            scales = torch.cat([scales, torch.zeros(extra, scales.shape[1], dtype=scales.dtype)])
            zeros = torch.cat([zeros, torch.zeros(extra, zeros.shape[1], dtype=zeros.dtype)])
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8))
        # The kernel's layout: [groups, rows, (scale, zero)].
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int4Linear:
        """Each group's range [min, max] in 16 steps (as Q4_1): zero and scale from its ends."""
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-12)
        q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).reshape(out_features, in_features)
        return cls(q.to(torch.int32), scales, low + 8 * scales, bias)

    def dequantized(self) -> Tensor:
        """The weight the kernel computes with, in float32 (for tests and references)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        columns = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return columns.float().T[: self.out_features]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(torch.bfloat16), self.packed,
                                                       GROUP_SIZE, self.scales_and_zeros)  # [tokens, padded out]
        y = y[:, : self.out_features].to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


QUANTIZED_LINEARS = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linear(weight: Tensor, bias: Tensor | None, kind: str) -> nn.Module | None:
    """The quantized layer for a float weight, or None when the kernels cannot take its shape."""
    if not can_quantize(weight):
        return None
    return QUANTIZED_LINEARS[kind].from_float(weight, bias)


def linear(x: Tensor, layer: nn.Module) -> Tensor:
    """x through a float Linear or a quantized one (whatever `layer` is)."""
    if isinstance(layer, nn.Linear):
        return F.linear(x, layer.weight, layer.bias)
    return layer(x)

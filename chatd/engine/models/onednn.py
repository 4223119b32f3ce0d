"""float32 matmuls on CPU through oneDNN rather than MKL.

torch multiplies a float32 Linear on CPU with MKL's sgemm, and MKL takes its AVX2 path on AMD
CPUs even where they have AVX-512. On the 2-core EPYC (Zen 5) measured here, SmolLM2-135M's
projections and LM head took 29-30 ms at 1 row, 55 at 16, 136 at 64 (216-240 GFLOP/s at 256 to
1024 rows), while oneDNN, which torch ships too and which picks its kernels by the CPU's
instruction sets, not its vendor, took 16, 25 and 62 ms (505-530 GFLOP/s): 1.8-2.3x at every
row count, on the same weights as they are stored (quantized/packed.py keeps a copy laid out for 16 rows
where memory allows, faster again from 1 to 64 rows). llama.cpp's own
float32 kernels sit between the two, which is why chatd's float32 batches trailed it (design
notes, issue 54). The results differ from MKL's by float32 rounding only: the same sums in
another order.

Inside torch.compile the call is the custom op `chatd::onednn_linear`, one opaque call to the
compiler: inductor lowers torch's own oneDNN op only for weights frozen into the graph as
constants, and chatd's compiled steps take the weights as inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

AVAILABLE = torch.backends.mkldnn.is_available()


def _onednn(x: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@torch.library.custom_op("chatd::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., in] . weight [out, in] -> [..., out], by oneDNN (no bias)."""
    return _onednn(x.contiguous(), weight)


@onednn_linear.register_fake
def _onednn_linear_shape(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def takes(x: Tensor, weight: Tensor) -> bool:
    """Whether this product goes to oneDNN: float32 on a CPU, a 2-D weight."""
    return (AVAILABLE and weight.dtype == torch.float32 and x.dtype == torch.float32 and weight.dim() == 2
            and weight.device.type == "cpu")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear by oneDNN (for a product `takes` accepts): the op itself when eager, which skips
    the custom op's dispatch (~8 us a call), the custom op inside torch.compile."""
    out = onednn_linear(x, weight) if torch.compiler.is_compiling() else _onednn(x.contiguous(), weight)
    return out if bias is None else out + bias

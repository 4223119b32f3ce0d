"""Projections of one or two rows inside a compiled decode step, written as reductions.

A decode step at batch 1 or 2 multiplies every weight by one or two vectors. The matmul
libraries' path for that can be far below the memory bandwidth it is bound by: MKL's one-row
float32 path streams a weight at 11-12 GB/s on the 2-core EPYC measured here (one thread or two,
the same), and PyTorch's int8 kernel at ~14 GB/s, while a plain reduction reads 30 GB/s. Written
as one `(weight * x[i]).sum(-1)` per row, inductor (worker/compiled.py) makes each projection a
loop that streams the weight once at 26-29 GB/s (design notes, "Compiled decode steps"). Outside
torch.compile, and for more rows, the library's matmul is used as before: it pays there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROWS_AS_REDUCTIONS = 4  # at most this many rows: reductions (a compiled graph per row count)


def as_reductions(x: Tensor) -> bool:
    """Whether x [rows, in] is multiplied as reductions here: inside torch.compile, with few rows."""
    return torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] <= ROWS_AS_REDUCTIONS


def row_products(x: Tensor, weight: Tensor) -> Tensor:
    """x [rows, in] . weight [out, in] -> [rows, out], one reduction per row (weight of any dtype x promotes to)."""
    return torch.stack([(weight * x[i]).sum(-1) for i in range(x.shape[0])])


def dense(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, as reductions where `as_reductions` says so."""
    if not as_reductions(x):
        return F.linear(x, weight, bias)
    out = row_products(x, weight)
    return out if bias is None else out + bias

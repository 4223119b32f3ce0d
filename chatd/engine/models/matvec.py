"""Projections of a few rows inside a compiled decode step, written as reductions.

A decode step at batch 1 or 2 multiplies every weight by one or two vectors. The matmul
libraries' path for that can be far below the memory bandwidth it is bound by: MKL's one-row
float32 path streams a weight at 11-12 GB/s on the 2-core EPYC measured here (one thread or two,
the same), and PyTorch's int8 kernel at ~14 GB/s, while a plain reduction reads 30 GB/s. Written
as one `(weight * x[i]).sum(-1)` per row, inductor (worker/fast_steps/compiled.py) makes each projection a
loop that streams the weight once at 26-29 GB/s (design notes, "Compiled decode steps"). Outside
torch.compile, and for more rows, the library's matmul is used as before: it pays there. An
int8 weight's loop is bound by its arithmetic, not its bytes, so what feeds it is stored first
(`stored`), and a weight with a scale per block (GGUF's types) scales each product in the same
loop (`block_products`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from chatd.engine.models import onednn

ROWS_AS_REDUCTIONS = 4  # compiled decode steps of 1 to this many rows are reductions (one graph per row count)
# ... and with speculative decoding, whose verify steps are a few rows more, up to this many.
MAX_ROWS_AS_REDUCTIONS = 8


def as_reductions(x: Tensor) -> bool:
    """Whether x [rows, in] is multiplied as reductions here: inside torch.compile, in a step
    compiled for a fixed number of rows (a step of dynamic size gets matmuls), and few of them."""
    # A dynamic size is not known to be small (no guard is made of it): the step of every larger batch.
    return (torch.compiler.is_compiling() and x.dim() == 2
            and statically_known_true(x.shape[0] <= MAX_ROWS_AS_REDUCTIONS))


def row_products(x: Tensor, weight: Tensor) -> Tensor:
    """x [rows, in] . weight [out, in] -> [rows, out], one reduction per row (weight of any dtype x promotes to)."""
    return torch.stack([(weight * x[i]).sum(-1) for i in range(x.shape[0])])


def block_products(x: Tensor, weight: Tensor, scales: Tensor, zeros: Tensor | None = None) -> Tensor:
    """x [rows, in] . (weight [out, in] with a scale per block of its row: scales [out, in / block],
    and a zero per block or none: w = q * scale + zero) -> [rows, out]: one reduction per row that
    scales each product by its block's scale, plus, with zeros, each block's zero times the sum
    of x over the block (a reduction 1/block the weight's size, not an add per weight)."""
    out_features, num_blocks = scales.shape
    blocks = weight.view(out_features, num_blocks, -1)  # [out, blocks, block]
    block_scales = scales.view(out_features, num_blocks, 1)
    y = torch.stack([(blocks * x[i].view(num_blocks, -1) * block_scales).sum((-2, -1)) for i in range(x.shape[0])])
    if zeros is None:
        return y
    return y + row_products(x.view(x.shape[0], num_blocks, -1).sum(-1), zeros)


def stored(x: Tensor) -> Tensor:
    """x computed once into memory before the reductions of an int8 weight read it, not recomputed inside them.

    Inductor inlines a pointwise producer into the reduction that consumes it: the RMSNorm (and
    the residual add before it) that feeds q/k/v and gate/up was recomputed for every output
    row, several loads and multiplies per weight. A float32 weight hides that behind its own
    bytes (its step did not move either way, so it is left as it was); an int8 weight does not:
    its loop became compute-bound, and SmolLM2's Q8_0 step went from 12.6 to 8.9 ms once the
    norm was stored first. `as_strided` is an op inductor gives only stored inputs, so this
    identity view makes it store x (outside torch.compile it is a view).
    """
    return x.as_strided(x.shape, x.stride())


def dense(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, as reductions where `as_reductions` says so, and by oneDNN for float32 on a CPU
    (onednn.py: 1.8-2.3x MKL's rate on AMD CPUs)."""
    if not as_reductions(x):
        return onednn.linear(x, weight, bias) if onednn.takes(x, weight) else F.linear(x, weight, bias)
    # Three or four rows: the norm before a projection, inlined into its reductions, made them
    # compute-bound (SmolLM2's compiled step of 3 rows took 41 ms, of 4 56 ms, against 21 ms for
    # one); stored first, 24 and 29 ms. One or two rows hide it behind the weight's bytes.
    out = row_products(stored(x) if x.shape[0] > 2 else x, weight)
    return out if bias is None else out + bias

"""float32 weights packed for oneDNN's kernels: a copy laid out once, beside the weight as stored.

onednn.py sends float32 products to oneDNN with the weight as stored, which oneDNN lays out for
its kernels again on every call. Packed once at load for 16 rows (`_reorder_linear_weight`), the
16-row products of a SmolLM2-135M step took 19.5 ms against 25-31 (2-core Zen 5; design notes,
issue 54). The packed copy is an opaque oneDNN tensor: nothing but oneDNN reads it, and it cannot
be a compiled graph's input, so the op takes the layer's `handle` (a one-element tensor, an input
like a weight) and finds the packed weight by it; and the weight as stored is kept for the
reductions of compiled 1-4 row decode steps (matvec.py), which stream it faster than any matmul
at one row. So packing costs a second copy of every float32 weight; build.py packs only where
that fits in memory with room to spare.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor, nn

from chatd.engine.models import onednn
from chatd.engine.models.matvec import as_reductions, dense

_PACKED: dict[int, weakref.ref] = {}  # handle -> the packed weight, held by its PackedLinear
_handles = itertools.count()
PACK_ROWS = 16  # the row count oneDNN lays a packed weight out for


def can_pack(weight: Tensor | None) -> bool:
    """Whether a weight can be packed: one onednn.py multiplies (float32, 2-D, on a CPU, oneDNN present)."""
    return weight is not None and onednn.takes(weight, weight)


def _packed_product(x: Tensor, handle: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _PACKED[int(handle)](), None, "none", [], "")


@torch.library.custom_op("chatd::packed_linear", mutates_args=())
def packed_linear(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    """x [..., in] times the packed weight `handle` names -> [..., out_features] (no bias)."""
    return _packed_product(x, handle)


@packed_linear.register_fake
def _packed_linear_shape(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """A float32 projection with a copy of its weight packed for oneDNN (laid out for PACK_ROWS
    rows: a 16-row step of SmolLM2 19.5 ms against 25-31 on the weight as stored), used for every
    product but the few-row reductions of compiled decode steps, which read the weight as stored
    (it is kept: the packed copy is opaque, nothing else can read it). Twice the weight's memory."""

    kind = "float"  # float weights (llama.py quantized_layers: the KV cache stays as for float weights)
    per_block = False

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        number = next(_handles)
        _PACKED[number] = weakref.ref(self._packed, lambda _, number=number: _PACKED.pop(number, None))
        self.register_buffer("handle", torch.tensor(number), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if as_reductions(x):
            return dense(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            out = packed_linear(x, self.handle, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, None, "none", [], "")
        return out if self.bias is None else out + self.bias

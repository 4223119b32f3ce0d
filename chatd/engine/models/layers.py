"""The decoder's building blocks that are not attention: RMSNorm, and the linear layers and
embedding that tensor parallelism splits.

Each parallel module says which part of a checkpoint tensor it holds (`checkpoint_shard`), so a
rank reads only that part, and ends in an all-reduce where its outputs are partial. The fused and
row-parallel linears can hand their compute to a quantized layer (quantized/quant.py). llama.py assembles
them into layers; it is apart from them so the model reads as the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from chatd.engine.models.matvec import dense
from chatd.engine.models.tensor_parallel import Shard, TPGroup


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and scaled after casting back, in transformers' order."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class FusedLinear(nn.Linear):
    """Several Linear layers over the same input, stacked row-wise into one weight: one GEMM for all.

    Column-parallel under tensor parallelism: `shards[i]` are the rows of the i-th checkpoint
    layer this rank holds (None: all of them)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, shards: list[Shard] | None = None):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.shards = shards or [None] * len(output_sizes)
        self.quantized: nn.Module | None = None

    def shard_rows(self, index: int) -> slice:
        """The rows of the weight (and bias) that belong to the index-th stacked layer."""
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def quantize(self, quantized: nn.Module | None) -> None:
        """Compute with `quantized` (quantized/quant.py: the weight and bias in it) and drop the float
        weight; None: stay float."""
        self.quantized = quantized
        if quantized is not None:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        return self.quantized(x) if self.quantized is not None else dense(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """A Linear whose input features are split over the ranks: each computes a partial sum of the
    output, one all-reduce adds them up, and the bias (held whole by every rank) comes after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, shard: Shard):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.shard = Shard(1, shard.start, shard.length)  # columns of the checkpoint's weight
        self.quantized: nn.Module | None = None

    def checkpoint_shard(self, param_name: str) -> Shard | None:
        return self.shard if param_name == "weight" and self.tp.size > 1 else None

    def quantize(self, quantized: nn.Module | None) -> None:
        """Compute the partial sums with `quantized` (no bias in it: the bias comes after the sum); None: stay float."""
        self.quantized = quantized
        if quantized is not None:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.quantized is None and self.tp.size == 1:
            return dense(x, self.weight, self.bias)
        out = self.quantized(x) if self.quantized is not None else F.linear(x, self.weight)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The embedding with the vocabulary split by rows: each rank looks up the ids it holds (zeros
    for the rest) and one all-reduce joins them. Rows past the vocabulary's end are padding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__(tp.padded_vocab(vocab_size), hidden_size)
        self.tp = tp
        self.shard = tp.vocab_shard(vocab_size)

    def reset_parameters(self) -> None:
        # Built on "meta" (loader.py), the checkpoint fills it: a random init there is waste, and
        # through torch's reference decompositions it imports dynamo (half a second of each start).
        if not self.weight.is_meta:
            super().reset_parameters()

    def checkpoint_shard(self, param_name: str) -> Shard | None:
        return self.shard if self.tp.size > 1 else None

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        held = (local >= 0) & (local < self.shard.length)
        x = F.embedding(torch.where(held, local, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(~held.unsqueeze(-1), 0))

"""What one tensor-parallel rank holds of the model, and the two collectives its forward needs.

Megatron-style: q/k/v and gate/up are split by output rows (each rank computes its own heads and
its slice of the MLP), o_proj and down_proj by input columns (each rank's partial sum is added
up by one all-reduce per projection), and the vocabulary is split by rows for the embedding
(each rank looks up the ids it holds, one all-reduce joins them) and the LM head (logits are
gathered on rank 0, the one that samples). Key/value heads are split too, or, when there are
fewer of them than ranks, each rank keeps the one its query heads read.

This module knows nothing of processes: `TPGroup` wraps a torch.distributed group that someone
else (worker/parallel.py) has set up. Size 1 is the plain model: no collectives at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank loads: `length` entries from `start` along `dim`."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the ranks, and the collectives over them."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # the torch.distributed process group (None: the default one)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks, in place (each rank held a partial sum)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: Tensor) -> Tensor | None:
        """Rank 0: every rank's `x` side by side along the last dim; other ranks: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def split(self, total: int, name: str) -> Shard:
        """This rank's equal share of `total` rows; ValueError naming `name` when it does not divide."""
        if total % self.size:
            raise ValueError(f"{name} ({total}) is not divisible by tensor_parallel_size {self.size}")
        length = total // self.size
        return Shard(0, self.rank * length, length)

    def vocab_shard(self, vocab_size: int) -> Shard:
        """This rank's rows of the vocabulary: ceil(vocab / ranks) each, the last rank's cut short
        where the vocabulary ends (its tensor is padded to the same length with zero rows)."""
        length = -(-vocab_size // self.size)
        start = min(self.rank * length, vocab_size)
        return Shard(0, start, min(length, vocab_size - start))

    def padded_vocab(self, vocab_size: int) -> int:
        """Rows each rank's vocabulary tensors have."""
        return -(-vocab_size // self.size)


@dataclass(frozen=True)
class HeadLayout:
    """Which attention heads one rank computes: its query heads and the key/value heads they read."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # key/value heads on this rank
    q_start: int  # first query head (of the model's)
    kv_start: int  # first key/value head

    @classmethod
    def of(cls, tp: TPGroup, num_heads: int, num_kv_heads: int) -> HeadLayout:
        check_head_layout(num_heads, num_kv_heads, tp.size)
        local_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            local_kv = num_kv_heads // tp.size
            return cls(local_heads, local_kv, tp.rank * local_heads, tp.rank * local_kv)
        # Fewer KV heads than ranks: each rank keeps the one its query heads belong to.
        return cls(local_heads, 1, tp.rank * local_heads, tp.rank * num_kv_heads // tp.size)


def check_head_layout(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError naming the model's numbers when its heads cannot be split over `size` ranks."""
    if num_heads % size:
        raise ValueError(f"the model's {num_heads} attention heads are not divisible by tensor_parallel_size {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"the model's {num_kv_heads} key/value heads cannot be split over tensor_parallel_size {size}: "
                         "one must divide the other")


def check_weights_fit(model: torch.nn.Module, device: torch.device, tp: TPGroup) -> None:
    """ValueError naming the sizes when the weights (this rank's part) cannot fit the GPU's free memory."""
    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(device)
    if needed > free:
        part = f"rank {tp.rank}'s part of the weights ({tp.size} ranks)" if tp.size > 1 else "the weights"
        hint = "raise tensor_parallel_size" if tp.size > 1 else "use tensor_parallel_size > 1 or a smaller dtype"
        raise ValueError(f"{part} need {needed / 2**30:.1f} GiB, but {device} has {free / 2**30:.1f} of "
                         f"{total / 2**30:.1f} GiB free; {hint}")

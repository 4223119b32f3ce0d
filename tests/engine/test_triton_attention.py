"""The triton paged-attention kernels against a dense torch reference.

With CUDA the kernels run for real (bf16); without it they run in triton's CPU interpreter
(float32), so these tests run in CI on any machine with triton installed. Every batch gives its
sequences shuffled, non-contiguous physical blocks and fills every other cache slot with large
garbage, so a read outside a sequence's own context shows up in the result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the interpreter is the only way to run a kernel. triton reads this variable when
    # `@triton.jit` decorates a kernel, i.e. when the module under test is imported below.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from chatd.engine.attention.triton_kernels import paged_attention, store_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's bfloat16 is unreliable
GARBAGE = 1e3  # what every slot outside a sequence's context holds; finite, but wrecks any result it leaks into
SENTINEL = 7.0  # what `out` holds before the kernel; rows nobody owns must keep it


def reference_paged_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale) -> None:
    """Dense torch attention, one sequence at a time: gather its context, repeat kv heads, explicit causal mask."""
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:  # a padding row
            continue
        pages = block_tables[i, : -(-seq_len // block_size)].long()
        # keys, values: [seq_len, heads, head_dim]
        keys = k_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        values = v_cache[pages].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [heads, q_len, seq_len]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        future = torch.arange(seq_len, device=q.device)[None, :] > query_pos[:, None]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)


@dataclass
class Step:
    """One step's inputs: queries (a view into a fused qkv output), this step's new K/V, the paged caches."""

    qkv: torch.Tensor  # [T, (heads + 2 * kv_heads) * head_dim]
    q: torch.Tensor  # [T, heads, head_dim], non-contiguous
    k: torch.Tensor  # [T, kv_heads, head_dim], non-contiguous
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]; the cached prefixes only
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, -1 for tokens of no sequence
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    scale: float

    def attend(self, attention=paged_attention, num_splits: int | None = None) -> torch.Tensor:
        """Store this step's K/V, then attend with `attention`; returns `out`, prefilled with SENTINEL."""
        store_kv(self.k, self.v, self.k_cache, self.v_cache, self.slot_mapping)
        out = torch.full(self.q.shape, SENTINEL, dtype=self.q.dtype, device=DEVICE)
        args = (self.q, self.k_cache, self.v_cache, out, self.query_start_loc, self.seq_lens, self.block_tables)
        if attention is paged_attention:
            paged_attention(*args, max_query_len=self.max_query_len, scale=self.scale, num_splits=num_splits)
        else:
            attention(*args, scale=self.scale)
        return out


def make_step(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    num_padding_tokens: int = 0,
    seed: int = 0,
    dtype: torch.dtype = DTYPE,
) -> Step:
    """A batch whose sequences own shuffled, non-contiguous blocks, with unused blocks between them.

    Table entries past a sequence's end point at other sequences' blocks or garbage blocks; the
    slots past each sequence's end hold GARBAGE. `num_padding_tokens` tokens at the end of the
    batch belong to no sequence (CUDA-graph padding: slot -1).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 2  # half of them unused: holes between sequences' blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    owned = [[free.pop() for _ in range(n)] for n in blocks_needed]
    max_blocks = max(blocks_needed) + 2
    tables = []
    for i, blocks in enumerate(owned):
        stranger = owned[(i + 1) % len(owned)] + free  # another sequence's blocks, then never-used ones
        tables.append(blocks + stranger[: max_blocks - len(blocks)])
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), GARBAGE, dtype=dtype)
    v_cache = k_cache.clone()
    slots = []
    for blocks, q_len, seq_len in zip(owned, query_lens, seq_lens):
        positions = torch.arange(seq_len)
        pages = torch.tensor(blocks, dtype=torch.long)[positions // block_size]
        context_slots = pages * block_size + positions % block_size
        num_prefix = seq_len - q_len
        for cache in (k_cache, v_cache):  # the cached prefix; this step's tokens come through store_kv
            prefix = torch.randn(num_prefix, num_kv_heads, head_dim, generator=gen).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[context_slots[:num_prefix]] = prefix
        slots += context_slots[num_prefix:].tolist()
    slots += [-1] * num_padding_tokens
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(query_lens), 0, out=query_start_loc[1:])
    return Step(
        qkv=qkv,
        q=q.view(num_tokens, num_heads, head_dim),
        k=k.view(num_tokens, num_kv_heads, head_dim),
        v=v.view(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        scale=head_dim**-0.5,
    )


def assert_matches_reference(step: Step, num_splits: int | None = None) -> torch.Tensor:
    """The kernel's output equals the dense reference's, including rows it must leave alone."""
    out = step.attend(num_splits=num_splits)
    expected = step.attend(reference_paged_attention)
    # Half precision rounds the probabilities before they weight the values; float32 matches closely.
    tolerance = 1e-4 if out.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    return out


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 2), (8, 1)])
def test_decode_batch_matches_reference(num_heads, num_kv_heads, head_dim):
    # Contexts of one token, exactly one page, one past a page, and several tiles of 64 keys.
    step = make_step([1, 1, 1, 1], [1, 16, 17, 150], num_heads, num_kv_heads, head_dim, seed=head_dim)
    assert_matches_reference(step)


@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_decode_with_split_contexts_matches_reference(num_splits):
    """Flash-decoding: each context in parts merged by their softmax sums; with 16 parts most
    short contexts leave parts empty, which must weigh nothing."""
    step = make_step([1, 1, 1, 1, 1], [1, 16, 17, 150, 300], num_heads=8, num_kv_heads=2, head_dim=32, seed=num_splits)
    assert_matches_reference(step, num_splits=num_splits)


def test_split_decode_leaves_padding_rows_untouched():
    step = make_step([1, 1, 1, 0, 0], [3, 18, 133, 0, 0], num_padding_tokens=2)
    out = assert_matches_reference(step, num_splits=4)
    assert (out[3:] == SENTINEL).all()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_reference(block_size):
    # Decodes first; then a chunk after a cached prefix crossing block boundaries, a whole prompt,
    # and a chunk longer than one query tile (16 tokens at 4 query heads per kv head).
    query_lens, seq_lens = [1, 1, 7, 12, 37], [5, 30, 20, 12, 45]
    step = make_step(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=24, block_size=block_size)
    assert_matches_reference(step)


def test_float16_matches_reference():
    step = make_step([1, 7, 12, 37], [30, 20, 12, 45], head_dim=24, block_size=4, dtype=torch.float16)
    assert_matches_reference(step)


def test_attention_reads_only_its_own_pages():
    step = make_step([1, 9, 6], [12, 9, 21], block_size=4, seed=3)
    out = assert_matches_reference(step)
    # Each output is a convex combination of real values (|v| < GARBAGE): nothing from other slots.
    assert out.abs().max() < 10


def test_padding_rows_leave_out_and_caches_untouched():
    step = make_step([1, 1, 1, 0, 0], [3, 18, 33, 0, 0], num_padding_tokens=2)
    store_kv(step.k, step.v, step.k_cache, step.v_cache, step.slot_mapping)
    caches, q = (step.k_cache.clone(), step.v_cache.clone()), step.qkv.clone()
    out = assert_matches_reference(step)
    assert (out[3:] == SENTINEL).all()
    assert torch.equal(step.k_cache, caches[0]) and torch.equal(step.v_cache, caches[1])
    assert torch.equal(step.qkv, q)


def test_store_kv_writes_exactly_the_given_slots():
    step = make_step([3, 5], [10, 5], num_padding_tokens=2, block_size=4)
    expected_k, expected_v = step.k_cache.clone(), step.v_cache.clone()
    real = step.slot_mapping >= 0
    for cache, new in ((expected_k, step.k), (expected_v, step.v)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, step.slot_mapping[real], new[real])
    assert not step.k.is_contiguous()  # a slice of the fused qkv output, read through its strides
    store_kv(step.k, step.v, step.k_cache, step.v_cache, step.slot_mapping)
    assert torch.equal(step.k_cache, expected_k)
    assert torch.equal(step.v_cache, expected_v)

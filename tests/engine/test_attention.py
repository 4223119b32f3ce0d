"""Attention backends against the sdpa reference on random paged inputs, and how one is chosen.

Every backend must write the same cache and give sdpa's output for a mixed batch (decodes, a
chunk over a cached prefix, whole prompts) whose block tables are shuffled and have holes, with
unused blocks full of large values so a read past a sequence's end shows. GPU backends run the
full matrix on CUDA in bf16; on CPU the triton backend runs a small case under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from chatd.engine.attention import (
    BACKENDS,
    AttentionShape,
    SdpaBackend,
    StepInputs,
    build_step,
    select_backend,
    to_device,
)

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@dataclass
class PagedProblem:
    step: StepInputs
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    q: torch.Tensor  # [T, heads, head_dim]
    k: torch.Tensor  # [T, kv_heads, head_dim]
    v: torch.Tensor
    scale: float


def make_problem(
    starts: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device, seed: int = 0,
) -> PagedProblem:
    """Sequence i has starts[i] cached tokens and query_lens[i] new ones (decodes first)."""
    generator = torch.Generator().manual_seed(seed)
    needs = [-(-(s + n) // block_size) for s, n in zip(starts, query_lens)]
    num_blocks = 2 * sum(needs) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for need in needs:
        tables.append(order[used : used + need])
        used += need + 1  # skip one block: tables have holes and are out of order
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Blocks no sequence owns hold large values: attending to them would swamp the output.
    k_cache, v_cache = torch.full(shape, 50.0), torch.full(shape, 50.0)
    for table in tables:
        k_cache[table] = torch.randn(len(table), *shape[1:], generator=generator)
        v_cache[table] = torch.randn(len(table), *shape[1:], generator=generator)
    num_tokens = sum(query_lens)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device, dtype)

    step = build_step([0] * num_tokens, starts, query_lens, tables, block_size, device)
    return PagedProblem(
        step, k_cache.to(device, dtype), v_cache.to(device, dtype), rand(num_tokens, heads, head_dim),
        rand(num_tokens, kv_heads, head_dim), rand(num_tokens, kv_heads, head_dim), head_dim**-0.5,
    )


def run(backend, problem: PagedProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backend's output and the caches after its write."""
    cache = (problem.k_cache.clone(), problem.v_cache.clone())
    problem.step.meta.scratch.clear()
    backend.write_kv(cache, problem.k, problem.v, problem.step.meta)
    out = backend.attend(problem.q, problem.k, problem.v, cache, problem.step.meta, problem.scale)
    return out.float(), cache[0], cache[1]


def assert_matches_sdpa(backend, problem: PagedProblem, atol: float) -> None:
    out, k_cache, v_cache = run(backend, problem)
    want, want_k, want_v = run(SdpaBackend(), problem)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert out.isfinite().all()
    torch.testing.assert_close(out, want, atol=atol, rtol=atol)


# Three decodes (one over a single token), then a chunk over a cached prefix that crosses
# block boundaries, a whole prompt, and a chunk whose prefix ends mid-block.
MIXED = dict(starts=[37, 0, 63, 16, 0, 40], query_lens=[1, 1, 1, 24, 9, 30])


def test_triton_backend_matches_sdpa_on_cpu():
    """The triton backend's wiring (under the interpreter): write and attend equal sdpa."""
    pytest.importorskip("triton")
    backend = select_backend("triton", CPU, AttentionShape(4, 2, 16, 8, torch.float32))
    problem = make_problem(**MIXED, heads=4, kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32, device=CPU)
    assert_matches_sdpa(backend, problem, atol=1e-4)


def test_auto_is_sdpa_on_cpu_and_unknown_names_are_refused():
    shape = AttentionShape(4, 2, 16, 16, torch.float32)
    assert select_backend("auto", CPU, shape).name == "sdpa"
    with pytest.raises(ValueError, match="attention_backend 'paged' is unknown; choose one of: auto, flash-attn"):
        select_backend("paged", CPU, shape)
    with pytest.raises(ValueError, match="'torch-varlen' cannot run here: .*needs CUDA"):
        select_backend("torch-varlen", CPU, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "sdpa"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (16, 4), (32, 4), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_backend_matches_sdpa(name, heads, kv_heads, head_dim):
    """GQA ratios 1, 4 and 8, head dims 64 and 128, bf16, the configured block size of 16."""
    backend_class = BACKENDS[name]
    reason = backend_class.unavailable_reason(CUDA)
    if reason:
        pytest.skip(reason)
    problem = make_problem(**MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                           dtype=torch.bfloat16, device=CUDA, seed=heads + head_dim)
    try:
        out, _, _ = run(backend_class(), problem)
    except Exception as exc:  # e.g. FlashAttention's page-size rules: auto selection skips it too
        if name == "triton":
            raise
        pytest.skip(f"{name} refuses this problem: {exc}")
    assert_matches_sdpa(backend_class(), problem, atol=2e-2)


@pytest.mark.gpu
def test_gpu_long_prefill_and_decode_batch_match_sdpa():
    """A 2,000-token prompt over a cached prefix next to 64 decodes of uneven length."""
    starts = [(i * 37) % 900 + 1 for i in range(64)] + [1500]
    query_lens = [1] * 64 + [500]
    problem = make_problem(starts, query_lens, heads=32, kv_heads=8, head_dim=128, block_size=16,
                           dtype=torch.bfloat16, device=CUDA, seed=5)
    assert_matches_sdpa(select_backend("triton", CUDA, AttentionShape(32, 8, 128, 16, torch.bfloat16)), problem, 2e-2)


@pytest.mark.gpu
def test_auto_on_cuda_picks_a_working_gpu_backend():
    backend = select_backend("auto", CUDA, AttentionShape(16, 8, 128, 16, torch.bfloat16))
    assert backend.name in ("flash-attn", "torch-varlen", "triton")


@pytest.mark.gpu
def test_step_inputs_reach_the_device_in_one_copy_bit_for_bit():
    tensors = [torch.arange(7, dtype=torch.int32), torch.arange(5) * 2**40, torch.randn(3, 2), torch.arange(6, dtype=torch.int32).view(2, 3)]
    moved = to_device(tensors, CUDA)
    for sent, got in zip(tensors, moved):
        assert got.device.type == "cuda" and got.dtype == sent.dtype and torch.equal(got.cpu(), sent)

"""Narrow KV caches (`cache.kv_cache_dtype`: bfloat16, float16, fp8): what a write stores and a
read gives back, attention over them next to attention over a float32 cache, and generation.

bfloat16 keeps 8 significant bits and float16 11 (within its range, which a write saturates at);
fp8 keeps 3 mantissa bits (e4m3) or 2 (e5m2), so one stored value is off by at most 2^-4 or 2^-3
of itself; attention averages many of them, so its outputs move much less. On CPU the triton
kernels run in triton's interpreter, which reads fp8 exactly but converts float32 -> fp8 wrongly
when rounding up carries into the exponent (triton 3.9: 7.94 becomes 4.0, not 8.0): the kernels'
attention is tested here over caches torch wrote, their fp8 store only on values that need no
rounding, and the rounding store on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from chatd.engine import SamplingParams
from chatd.engine.attention import (
    SdpaBackend,
    TritonBackend,
    build_step,
    dequantize_kv,
    quantize_kv,
    resolve_kv_dtype,
)
from chatd.engine.models.demo import build_model_dir
from tests.engine.conftest import make_llm
from tests.engine.test_attention import MIXED, make_problem

CPU = torch.device("cpu")
# setting -> (dtype, the largest relative error one stored value may have: half its mantissa step)
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 2**-4), "fp8_e5m2": (torch.float8_e5m2, 2**-3)}
SIXTEEN_BIT = {"bfloat16": (torch.bfloat16, 2**-8), "float16": (torch.float16, 2**-11)}
NARROW = FP8 | SIXTEEN_BIT


def write(backend, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype, block_size: int = 4):
    """k, v: [T, kv_heads, head_dim] written by `backend` as one prompt into a fresh cache; returns
    the cache and the slots the tokens went to."""
    num_tokens, kv_heads, head_dim = k.shape
    num_blocks = -(-num_tokens // block_size)
    step = build_step([0] * num_tokens, [0], [num_tokens], [list(range(num_blocks))[::-1]], block_size, CPU)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = (torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype))
    backend.write_kv(cache, k, v, step.meta)
    return cache, step.meta.slot_mapping


def read(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    return dequantize_kv(cache.view(-1, *cache.shape[2:])[slots], torch.float32, scale)


def test_kv_cache_dtype_setting_names_the_dtype():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert resolve_kv_dtype("float16", torch.float32) == torch.float16
    assert resolve_kv_dtype("bfloat16", torch.float32) == torch.bfloat16


@pytest.mark.parametrize("setting", NARROW)
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.125, 3.0)])
def test_write_then_read_is_within_the_formats_precision(setting, k_scale, v_scale):
    """Magnitudes over e4m3's normal range (2^-5 .. 2^8, times the scale) come back within half a
    mantissa step (a 16-bit cache has no scales: the values are stored as they are)."""
    dtype, precision = NARROW[setting]
    generator = torch.Generator().manual_seed(0)

    def values(scale: float) -> torch.Tensor:
        magnitude = 2 ** (torch.rand(37, 2, 16, generator=generator) * 13 - 5)
        sign = torch.randint(0, 2, magnitude.shape, generator=generator) * 2 - 1
        return sign * magnitude * scale

    k, v = values(k_scale), values(v_scale)
    (k_cache, v_cache), slots = write(SdpaBackend(k_scale, v_scale), k, v, dtype)
    for cache, new, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        relative = (read(cache, slots, scale) - new).abs() / new.abs()
        assert relative.max() <= precision
        assert relative.mean() < precision / 2  # rounding, not an off-by-a-step bias


@pytest.mark.parametrize("setting", FP8)
def test_write_saturates_at_the_formats_largest_value(setting):
    """A value past fp8's range is stored as its largest finite value (times the scale), never inf or NaN."""
    dtype, _ = FP8[setting]
    largest = torch.finfo(dtype).max
    k = torch.tensor([1e9, -1e9, 3 * largest, 0.0]).view(4, 1, 1).expand(4, 1, 8).contiguous()
    (k_cache, v_cache), slots = write(SdpaBackend(k_scale=2.0), k, k.clone(), dtype)
    assert read(k_cache, slots, 2.0)[:, 0, 0].tolist() == [2 * largest, -2 * largest, 2 * largest, 0.0]
    assert read(v_cache, slots, 1.0)[:, 0, 0].tolist() == [largest, -largest, largest, 0.0]


def test_float16_write_saturates_at_its_largest_value():
    """A key past float16's range (65504) is stored as its largest finite value, never inf: one inf
    key would make its row's attention NaN."""
    k = torch.tensor([1e9, -1e9, 70000.0, 1.5]).view(4, 1, 1).expand(4, 1, 8).contiguous()
    (k_cache, _), slots = write(SdpaBackend(), k, k.clone(), torch.float16)
    assert read(k_cache, slots, 1.0)[:, 0, 0].tolist() == [65504.0, -65504.0, 65504.0, 1.5]


def run_sdpa(problem, cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """sdpa's output for `problem` with its cached prefixes and new K/V in a cache of `cache_dtype`."""
    backend = SdpaBackend(k_scale, v_scale)
    cache = (quantize_kv(problem.k_cache, cache_dtype, k_scale), quantize_kv(problem.v_cache, cache_dtype, v_scale))
    problem.step.meta.scratch.clear()
    backend.write_kv(cache, problem.k, problem.v, problem.step.meta)
    return backend.attend(problem.q, problem.k, problem.v, cache, problem.step.meta, problem.scale)


# Largest output error against a float32 cache, max and mean over every output value, on unit
# normal K/V: measured 0.11 / 0.0083 (e4m3), 0.26 / 0.017 (e5m2), 0.0083 / 0.00051 (bfloat16) and
# 0.00096 / 0.000064 (float16) over five seeds.
SDPA_TOLERANCE = {"fp8_e4m3": (0.2, 0.015), "fp8_e5m2": (0.4, 0.03), "bfloat16": (0.02, 0.001), "float16": (0.002, 0.00015)}


@pytest.mark.parametrize("setting", NARROW)
@pytest.mark.parametrize("kv_scale", [1.0, 0.25])
def test_sdpa_over_narrow_cache_is_close_to_float32_cache(setting, kv_scale):
    """Decodes, chunks over a cached prefix and whole prompts (whose new K/V are rounded as the
    cache holds them), 4 query heads per kv head."""
    dtype, _ = NARROW[setting]
    problem = make_problem(**MIXED, heads=8, kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, device=CPU)
    want = run_sdpa(problem, torch.float32, 1.0, 1.0)
    got = run_sdpa(problem, dtype, kv_scale, kv_scale)
    error = (got - want).abs()
    max_error, mean_error = SDPA_TOLERANCE[setting]
    assert got.isfinite().all()
    assert error.max() < max_error and error.mean() < mean_error


@pytest.mark.parametrize("setting", FP8)
def test_triton_attention_reads_fp8_as_sdpa_does(setting):
    """The kernel widens fp8 tiles and applies both scales (unequal here, so a swap shows) as sdpa does."""
    pytest.importorskip("triton")
    dtype, _ = FP8[setting]
    problem = make_problem(**MIXED, heads=4, kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32, device=CPU)
    k_scale, v_scale = 0.5, 2.0
    cache = (quantize_kv(problem.k_cache, dtype, k_scale), quantize_kv(problem.v_cache, dtype, v_scale))
    # torch writes the new K/V (see the module docstring); both backends then read the same bytes.
    SdpaBackend(k_scale, v_scale).write_kv(cache, problem.k, problem.v, problem.step.meta)
    outputs = []
    for backend in (TritonBackend(k_scale, v_scale), SdpaBackend(k_scale, v_scale)):
        problem.step.meta.scratch.clear()
        outputs.append(backend.attend(problem.q, problem.k, problem.v, cache, problem.step.meta, problem.scale))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("setting", FP8)
def test_triton_split_decode_reads_fp8_as_sdpa_does(setting):
    """Flash-decoding's parts carry the value scale into the merge."""
    pytest.importorskip("triton")
    from chatd.engine.attention.triton_kernels import paged_attention

    dtype, _ = FP8[setting]
    problem = make_problem([5, 40, 90], [1, 1, 1], heads=4, kv_heads=2, head_dim=16, block_size=8,
                           dtype=torch.float32, device=CPU, seed=2)
    cache = (quantize_kv(problem.k_cache, dtype, 0.5), quantize_kv(problem.v_cache, dtype, 2.0))
    sdpa = SdpaBackend(0.5, 2.0)
    sdpa.write_kv(cache, problem.k, problem.v, problem.step.meta)
    want = sdpa.attend(problem.q, problem.k, problem.v, cache, problem.step.meta, problem.scale)
    meta = problem.step.meta
    out = torch.empty_like(problem.q)
    paged_attention(problem.q, *cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 1, problem.scale,
                    num_splits=3, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def store_with_triton_and_torch(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float):
    """The caches the triton store and torch's write make of the same K/V, as bytes."""
    made = []
    for backend in (TritonBackend(k_scale, v_scale), SdpaBackend(k_scale, v_scale)):
        (k_cache, v_cache), _ = write(backend, k, v, dtype)
        made.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    return made


@pytest.mark.parametrize("setting", FP8)
def test_triton_store_scales_and_saturates_as_torch_does(setting):
    """Values that are fp8 values times the scale (no rounding: see the module docstring), and
    values past the range, give torch's bytes."""
    pytest.importorskip("triton")
    dtype, _ = FP8[setting]
    generator = torch.Generator().manual_seed(1)
    exact = quantize_kv(torch.randn(21, 2, 16, generator=generator) * 20, dtype, 1.0).float()
    exact[0, 0, :4] = torch.tensor([1e9, -1e9, 1e5, -1e5])
    (triton_k, triton_v), (torch_k, torch_v) = store_with_triton_and_torch(dtype, exact * 0.5, exact * 4.0, 0.5, 4.0)
    assert torch.equal(triton_k, torch_k) and torch.equal(triton_v, torch_v)


def test_triton_store_saturates_float16_as_torch_does():
    """Past 65504 a float16 cache holds its largest value, not inf; the scales, fp8's, are not applied."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(1)
    k, v = torch.randn(21, 2, 16, generator=generator) * 30, torch.randn(21, 2, 16, generator=generator)
    k[0, 0, :4] = torch.tensor([1e9, -1e9, 7e4, -7e4])
    (triton_k, triton_v), (torch_k, torch_v) = store_with_triton_and_torch(torch.float16, k, v, 0.5, 4.0)
    assert torch.equal(triton_k, torch_k) and torch.equal(triton_v, torch_v)
    assert torch_k.view(torch.float16).isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("setting", FP8)
def test_triton_store_rounds_as_torch_does_on_gpu(setting):
    """Any values: the kernel's float32 -> fp8 conversion gives torch's bytes."""
    from chatd.engine.attention.triton_kernels import store_kv

    dtype, _ = FP8[setting]
    generator = torch.Generator().manual_seed(1)
    k, v = (torch.randn(64, 2, 16, generator=generator).cuda() * 30 for _ in range(2))
    cache = [torch.zeros(16, 4, 2, 16, dtype=dtype, device="cuda") for _ in range(2)]
    store_kv(k, v, *cache, torch.arange(64, device="cuda"), 0.5, 2.0)
    for stored, new, scale in zip(cache, (k, v), (0.5, 2.0)):
        assert torch.equal(stored.view(torch.uint8).view(64, 2, 16), quantize_kv(new, dtype, scale).view(torch.uint8))


# -- generation ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calm_model(tmp_path_factory):
    """A tiny random-weight llama with small weights: its greedy choices are not knife-edge ties
    (at the factories' usual 0.3, 5% noise in K flips most of them; a real model is far calmer)."""
    return build_model_dir(tmp_path_factory.mktemp("fp8") / "llama", "llama", seed=1, initializer_range=0.05)


@pytest.fixture(scope="module")
def float32_greedy(calm_model):
    return greedy(calm_model, "auto")


def greedy(path, kv_cache_dtype: str) -> list[tuple[list[int], list[float]]]:
    """Each prompt's 16 greedy tokens and their log-probabilities."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 60, (8,), generator=generator).tolist()
    prompts = [torch.randint(4, 1000, (n,), generator=generator).tolist() for n in lengths]
    llm = make_llm(path, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in llm.generate(prompts, params)]


# Measured on this model: 87% (e4m3), 60% (e5m2), 100% (bfloat16, float16) of tokens agree; mean
# |logprob difference| before a sequence's first divergence 0.008, 0.014, 0.00043 and 0.00007.
GENERATION_FLOOR = {"fp8_e4m3": (0.75, 0.02), "fp8_e5m2": (0.45, 0.04), "bfloat16": (0.95, 0.002),
                    "float16": (0.95, 0.0005)}


@pytest.mark.parametrize("setting", NARROW)
def test_greedy_generation_with_a_narrow_cache_mostly_agrees_with_float32(calm_model, float32_greedy, setting):
    reference, quantized = float32_greedy, greedy(calm_model, setting)
    num_same = num_tokens = 0
    logprob_differences = []
    for (want_ids, want_logprobs), (ids, logprobs) in zip(reference, quantized):
        num_same += sum(a == b for a, b in zip(want_ids, ids))
        num_tokens += len(want_ids)
        agree = next((i for i, (a, b) in enumerate(zip(want_ids, ids)) if a != b), len(want_ids))
        logprob_differences += [abs(a - b) for a, b in zip(want_logprobs[:agree], logprobs[:agree])]
    min_agreement, max_logprob_difference = GENERATION_FLOOR[setting]
    assert num_same / num_tokens >= min_agreement
    assert sum(logprob_differences) / len(logprob_differences) < max_logprob_difference


def test_pool_holds_the_blocks_its_bytes_allow(calm_model):
    """The pool is sized by bytes: two bytes a value hold twice float32's blocks, one byte four times."""
    sizes = {}
    for setting, dtype in (("auto", torch.float32), ("float16", torch.float16), ("fp8_e4m3", torch.float8_e4m3fn)):
        llm = make_llm(calm_model, kv_cache_dtype=setting, num_blocks=0, cpu_kv_cache_gb=2**-9, max_model_len=256)
        runner = llm.engine.runner
        sizes[setting] = runner.num_blocks
        assert runner.kv_caches[0][0].dtype == dtype
    assert sizes["fp8_e4m3"] == 2 * sizes["float16"] == 4 * sizes["auto"] > 0


@pytest.mark.parametrize("quantization, setting, dtype", [
    ("none", "auto", torch.float32),  # a float32 model's numbers stay exact
    ("int4", "auto", torch.float16),  # beside quantized weights: float16, as llama.cpp's default cache
    ("int8", "auto", torch.float16),
    ("int4", "bfloat16", torch.bfloat16),  # a setting is taken as given
    ("int4", "float32", torch.float32),
])
def test_auto_cache_is_float16_beside_quantized_weights_on_a_cpu(calm_model, quantization, setting, dtype):
    llm = make_llm(calm_model, quantization=quantization, kv_cache_dtype=setting)
    assert llm.engine.runner.kv_caches[0][0].dtype == dtype
    assert llm.engine.model_info().details()["kv_cache_dtype"] == str(dtype).removeprefix("torch.")

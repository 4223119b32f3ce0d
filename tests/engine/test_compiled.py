"""Compiled decode steps (worker/fast_steps/compiled.py) and prefill steps (compiled_prefill.py): the same
tokens as eager steps, no compile after start.

The suite runs with torch.compile off (tests/conftest.py); these tests turn it on. Decode-only
attention (attention/decode.py) is checked against the sdpa backend on its own, eagerly; the
compiled engine is checked against the eager engine on the same weights, over a generation whose
decode batch shrinks from five sequences to one (every graph: batches 1 to 4 and the dynamic one)
with contexts that cross block boundaries, and whose first step (220 tokens) is a compiled prefill.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from chatd.engine import SamplingParams
from chatd.engine.attention import SdpaBackend, build_step, quantize_kv
from chatd.engine.attention.decode import DecodeAttention, DecodeContext
from chatd.engine.models.quantized.quant import Int8Linear
from chatd.engine.models.quantized.quantize_model import quantized_layers
from chatd.engine.worker.fast_steps.compiled import DYNAMIC_BATCH, CompiledDecode, compile_count
from chatd.engine.worker.fast_steps.compiled_prefill import PREFILL_TOKENS, CompiledPrefill
from tests.engine.conftest import make_llm
from tests.engine.test_attention import make_problem


def has_cpp_compiler() -> bool:
    """Inductor compiles C++ with $CXX (default g++): without it chatd serves eagerly (test_compiled_serve.py)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


needs_cpp_compiler = pytest.mark.skipif(not has_cpp_compiler(), reason="no C++ compiler: torch.compile cannot run here")


@pytest.fixture
def compile_on():
    with torch._dynamo.config.patch(disable=False):
        yield


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_decode_attention_matches_sdpa(heads, kv_heads, kv_dtype):
    # Contexts of 1, 8 (one whole block), 38 and 64 tokens; tables out of order, with holes; blocks
    # no sequence owns hold large values, so attending past a row's end would show.
    problem = make_problem([0, 7, 37, 63], [1, 1, 1, 1], heads, kv_heads, 16, 8, torch.float32, torch.device("cpu"))
    caches = [quantize_kv(c, kv_dtype, 0.5) for c in (problem.k_cache, problem.v_cache)]
    outputs = []
    for backend in (DecodeAttention(0.5, 0.5), SdpaBackend(0.5, 0.5)):
        cache = (caches[0].clone(), caches[1].clone())
        meta = problem.step.meta
        if isinstance(backend, DecodeAttention):
            meta = DecodeContext.of(meta, 8, torch.float32)
        backend.write_kv(cache, problem.k, problem.v, meta)
        outputs.append((backend.attend(problem.q, problem.k, problem.v, cache, meta, problem.scale), cache))
    (out, cache), (want, want_cache) = outputs
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cache, want_cache))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


PROMPTS = [[5 + i, 40, 41, 42] * (3 + 4 * i) for i in range(5)]  # 12 to 76 tokens: across blocks of 8
MAX_TOKENS = [3, 9, 14, 20, 27]  # the decode batch shrinks 5, 4, 3, 2, 1 as they finish


def generate(llm) -> list:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in MAX_TOKENS]
    return [out.outputs[0] for out in llm.generate(PROMPTS, params)]


@pytest.mark.slow
@needs_cpp_compiler
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # GQA; q/k/v biases; q/k norms
def test_compiled_decode_gives_the_eager_tokens_and_never_compiles_after_start(model_dirs, family, compile_on):
    with make_llm(model_dirs[family], compile=False) as eager_llm:
        assert eager_llm.engine.runner.fast.compiled is None
        want = generate(eager_llm)
    with make_llm(model_dirs[family]) as llm:  # model.compile defaults to true
        assert llm.engine.runner.fast.compiled is not None
        assert llm.engine.model_info().details()["compiled_decode"] is True
        before = compile_count()
        got = generate(llm)
        assert compile_count() == before, "a decode step compiled after start"
    for g, w in zip(got, want, strict=True):
        assert list(g.token_ids) == list(w.token_ids)
        for g_lp, w_lp in zip(g.logprobs, w.logprobs):
            assert abs(g_lp.logprob - w_lp.logprob) < 1e-4


@needs_cpp_compiler
# Slow, like every test here that compiles: a cold compile took 22 s of the fast suite's 5 minutes
# on a fresh CI machine (303 s with the install), where its warm runs take 6.
@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "float16"])
def test_compiled_decode_over_a_narrow_cache_gives_the_eager_tokens(model_dirs, compile_on, kv_cache_dtype, monkeypatch):
    with make_llm(model_dirs["llama"], compile=False, kv_cache_dtype=kv_cache_dtype) as eager_llm:
        want = generate(eager_llm)
    # Fixed-size steps of 1 and 2 rows, the dynamic one from 3: both kinds for three compiles, not five.
    monkeypatch.setattr("chatd.engine.worker.fast_steps.fast_steps.ROWS_AS_REDUCTIONS", 2)
    with make_llm(model_dirs["llama"], kv_cache_dtype=kv_cache_dtype) as llm:
        assert llm.engine.runner.fast.compiled is not None and len(llm.engine.runner.fast.compiled.steps) == 3
        got = generate(llm)
    assert [list(g.token_ids) for g in got] == [list(w.token_ids) for w in want]


@pytest.mark.slow
@needs_cpp_compiler
# A scale per row; Q8_0's per 32 weights; Q5_1's scale and zero per 32 weights; int4
@pytest.mark.parametrize("case, kind", [("int8", "int8"), ("gguf", "int8 per 32-weight block"),
                                        ("gguf-q5_1", "int8 per 32-weight block with zeros"), ("int4", "int4")])
def test_compiled_quantized_decode_stays_close_to_eager(model_dirs, q8_gguf, q5_1_gguf, case, kind, compile_on):
    """Quantized layers compute in bfloat16, where fusing changes the rounding: logprobs stay within
    bfloat16's step at the demo model's logits (8 bits of mantissa: ~0.4% of logits of 10-30)."""
    model = {"gguf": q8_gguf, "gguf-q5_1": q5_1_gguf}.get(case, model_dirs["llama"])
    quantization = case.partition("-")[0]
    # Eager steps serve a GGUF file's blocks per row (no kernel takes a scale per block): the blocks'
    # own reference is the file's weights in float32, which they equal exactly.
    with make_llm(model, compile=False, quantization="none" if quantization == "gguf" else quantization) as eager_llm:
        want = generate(eager_llm)
    with make_llm(model, quantization=quantization) as llm:
        assert llm.engine.runner.fast.compiled is not None
        assert quantized_layers(llm.engine.runner.model) == {kind: 9}
        before = compile_count()
        got = generate(llm)
        assert compile_count() == before, "a decode step compiled after start"
    # The first token of each prompt comes from the (eager) prefill; then compare while the tokens agree.
    compared = 0
    for g, w in zip(got, want, strict=True):
        for g_tok, w_tok, g_lp, w_lp in zip(g.token_ids, w.token_ids, g.logprobs, w.logprobs):
            if g_tok != w_tok:
                break
            assert abs(g_lp.logprob - w_lp.logprob) < 0.15
            compared += 1
    assert compared >= len(PROMPTS) + 10


LONG_PROMPTS = [[9 + i, 60, 61, 62, 63] * (40 + 13 * i) for i in range(3)]  # 200, 265 and 330 tokens


@pytest.mark.slow  # 6-18 s of compiling; the fast suite's compiled decode test compiles prefill halves too
@needs_cpp_compiler
def test_compiled_prefill_alone_and_beside_decode_rows_gives_the_eager_tokens(model_dirs, compile_on):
    """Steps of PREFILL_TOKENS or more run each layer's halves compiled: chunks of prompts alone, and
    chunks beside other sequences' decode rows (a budget of 256 tokens makes both). Tokens and
    logprobs are the eager engine's, and nothing compiles after start."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 8, 5)]
    with make_llm(model_dirs["llama"], compile=False, max_num_batched_tokens=256) as eager_llm:
        want = [out.outputs[0] for out in eager_llm.generate(LONG_PROMPTS, params)]
    with make_llm(model_dirs["llama"], max_num_batched_tokens=256) as llm:
        prefill, steps = llm.engine.runner.fast.compiled_prefill, []
        hidden = prefill.hidden

        def counted(step, *args):
            steps.append((len(step.input_ids), step.meta.num_decodes))
            return hidden(step, *args)

        prefill.hidden = counted
        before = compile_count()
        got = [out.outputs[0] for out in llm.generate(LONG_PROMPTS, params)]
        assert compile_count() == before, "a step compiled after start"
    assert all(tokens >= PREFILL_TOKENS for tokens, _ in steps)
    assert any(decodes == 0 for _, decodes in steps) and any(decodes > 0 for _, decodes in steps)
    for g, w in zip(got, want, strict=True):
        assert list(g.token_ids) == list(w.token_ids)
        for g_lp, w_lp in zip(g.logprobs, w.logprobs):
            assert abs(g_lp.logprob - w_lp.logprob) < 1e-4


@pytest.mark.slow
@needs_cpp_compiler
def test_a_layer_of_another_structure_gets_its_own_compiled_halves(model_dirs, compile_on):
    """A GGUF file may mix quant types across layers. A layer whose modules differ is compiled apart
    and computes with its own weights: the step stays within bfloat16's rounding of the eager forward."""
    with make_llm(model_dirs["llama"], quantization="int4", compile=False) as llm:
        runner = llm.engine.runner
        model = runner.model
        down = model.layers[1].mlp.down_proj
        down.quantized = Int8Linear.from_float(down.quantized.dequantized())
        prefill = CompiledPrefill(model)
        prefill.warm_up()
        assert len(prefill.halves) == 2 and prefill.keys[0] != prefill.keys[1]
        prompt = [3 + i % 50 for i in range(250)]
        step = build_step(prompt, [0], [len(prompt)], [list(range(32))], runner.block_size, runner.device)
        with torch.inference_mode():
            want = model(step.input_ids, step.positions, runner.kv_caches, step.meta, runner.backend)
            got = prefill.hidden(step, runner.kv_caches, runner.backend)
    assert ((got - want).norm() / want.norm()).item() < 0.02


@pytest.mark.slow
@needs_cpp_compiler
def test_a_later_start_reads_the_compiled_steps_back(model_dirs, tmp_path, monkeypatch, compile_on):
    """Compiled steps are saved under CHATD_HOME; a later start of the same model reads them back
    instead of compiling, gives the same tokens, and compiles again only a file that does not read."""
    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    with make_llm(model_dirs["llama"]) as llm:
        assert llm.engine.runner.fast.compiled.read_back == 0
        first = generate(llm)
    saved = sorted((tmp_path / "compiled" / "steps").glob("decode-*.bin"))
    assert len(saved) == DYNAMIC_BATCH  # batches 1 to 4, and the one for larger batches
    halves = sorted((tmp_path / "compiled" / "steps").glob("prefill-*.bin"))
    assert len(halves) == 2  # before and after attention, for the demo's one layer structure
    for cut in (saved[2], halves[1]):
        cut.write_bytes(cut.read_bytes()[:1000])  # cut short, as by a full disk
    with make_llm(model_dirs["llama"]) as llm:
        assert llm.engine.runner.fast.compiled.read_back == DYNAMIC_BATCH - 1
        assert llm.engine.runner.fast.compiled_prefill.read_back == 1
        again = generate(llm)
    assert [list(g.token_ids) for g in again] == [list(f.token_ids) for f in first]
    with make_llm(model_dirs["llama"]) as llm:  # the files compiled again were saved again
        assert llm.engine.runner.fast.compiled.read_back == DYNAMIC_BATCH
        assert llm.engine.runner.fast.compiled_prefill.read_back == 2


def test_compiled_steps_of_a_different_model_or_cache_are_kept_apart(model_dirs):
    """A saved step is named by what it was compiled for: a norm's eps (a constant inside the step,
    which its guards do not check), the KV cache's block size or dtype give another name."""
    with make_llm(model_dirs["llama"], compile=False) as llm:
        runner = llm.engine.runner
        model, caches = runner.model, runner.kv_caches

        def key(**changes) -> str:
            options = dict(block_size=runner.block_size, k_scale=1.0, v_scale=1.0) | changes
            return CompiledDecode(model, options.pop("caches", caches), **options)._key()

        same = key()
        assert key() == same
        assert key(block_size=16) != same
        assert key(caches=[tuple(pool.to(torch.float8_e4m3fn) for pool in cache) for cache in caches]) != same
        norm = model.layers[0].input_layernorm
        eps, norm.eps = norm.eps, norm.eps * 10
        try:
            assert key() != same
        finally:
            norm.eps = eps
        assert key() == same


def test_compile_is_off_when_configured_or_disabled(model_dirs):
    with make_llm(model_dirs["llama"]) as llm:  # TORCH_COMPILE_DISABLE=1 here: chatd respects it
        assert llm.engine.runner.fast.compiled is None
    with torch._dynamo.config.patch(disable=False), make_llm(model_dirs["llama"], compile=False) as llm:
        assert llm.engine.runner.fast.compiled is None


def test_compiled_code_is_kept_under_chatd_home_unless_the_user_named_a_place(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from chatd.engine.worker.fast_steps.compiled import keep_compiled_in

    for before in (None, default_cache_dir()):  # unset, or the default importing torch._dynamo set
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        keep_compiled_in(tmp_path / "compiled")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compiled")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    keep_compiled_in(tmp_path / "compiled")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")

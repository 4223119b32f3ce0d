"""GGUF's block formats as quant.py's int4 groups and int8 blocks, without rounding anything again.

Every block format llama.cpp writes stores a run of weights of a row as small integers q with a
scale and, for some, a zero per run: w = q * scale + zero. What differs is how they are packed:

  Q8_0  32 weights: int8 q, a float16 d            w = d * q
  Q4_0  32 weights: 4-bit q, d                     w = d * (q - 8)
  Q4_1  32 weights: 4-bit q, d and m               w = d * q + m
  Q5_0  32 weights: 5-bit q (a nibble and a bit)   w = d * (q - 16)
  Q5_1  32 weights: 5-bit q, d and m               w = d * q + m
  Q4_K  256 weights: 4-bit q in runs of 32, each with a 6-bit scale sc and min mn, and a float16 d
        and dmin for the 256                       w = d * sc * q - dmin * mn
  Q5_K  as Q4_K, with 5-bit q                      w = d * sc * q - dmin * mn
  Q6_K  256 weights: 6-bit q in runs of 16, each with an int8 scale sc, and a float16 d
                                                   w = d * sc * (q - 32)

`file_blocks` reads any of them as (q, scale, zero) with the file's own numbers, computed as
llama.cpp computes them: d * sc is exact in float32 (a float16 times a small integer), so is
dmin * mn, and w = q * scale + zero is then the gguf library's dequantization bit for bit.

`int4_parts` hands the 4-bit types to the int4 kernel, whose form is (q - 8) * scale + zero over
0..15: the same numbers with the zero moved by 8 scales. The kernel keeps scales and zeros in
bfloat16: that rounding is the only difference from llama.cpp's dequantization. `int8_parts`
hands the other types to quant.py's int8 layer with a scale (and a zero) per block, exactly.

Q4_K_M and Q5_K_M files mix types: a small model's rows (SmolLM2's 576 columns) are not a
multiple of the K types' 256, so llama-quantize writes most of its tensors in Q5_0 (Q4_K_M) or
Q5_1 (Q5_K_M) instead, and ffn_down, attn_v or the output head in Q6_K or Q8_0.
"""

from __future__ import annotations

import numpy as np

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF types that map exactly onto the int4 kernel's groups of 32
INT8_TYPES = ("Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K")  # ... and onto int8 blocks (of 32, or 16 for Q6_K)
# Bytes per block: 32 weights, or 256 for the K types.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "Q8_0": 34, "Q6_K": 210}


def file_blocks(data: np.ndarray, type_name: str, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A tensor's raw blocks ([rows, bytes per row] uint8, as the gguf library reads them) as the
    file's w = q * scale + zero: q [rows, columns] int8, and scales and zeros [rows, runs] float32
    (one per run of 32 weights, of 16 for Q6_K); zeros is None for the types without them."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, BLOCK_BYTES[type_name])  # [rows, blocks, bytes]
    if type_name == "Q6_K":
        q, scales, zeros = *_q6_k(blocks), None
    elif type_name in ("Q4_K", "Q5_K"):
        q, scales, zeros = _k_quant(blocks, high_bits=type_name == "Q5_K")
    else:
        d = _float16(blocks, 0)  # [rows, blocks]
        if type_name == "Q8_0":
            q, zeros = blocks[..., 2:].copy().view(np.int8), None
        else:
            with_min = type_name in ("Q4_1", "Q5_1")
            start = 4 if with_min else 2  # after d (and m)
            if type_name.startswith("Q5"):  # 32 high bits (a little-endian uint32), then the nibbles
                high = np.unpackbits(blocks[..., start : start + 4], axis=-1, bitorder="little")
                q = _nibbles(blocks[..., start + 4 : start + 20]) | (high << 4)
            else:
                q = _nibbles(blocks[..., start : start + 16])
            q = q.astype(np.int8)
            if with_min:
                zeros = _float16(blocks, 2)
            else:
                q, zeros = q - (16 if type_name == "Q5_0" else 8), None
        scales = d
    return q.reshape(rows, columns), scales.reshape(rows, -1), None if zeros is None else zeros.reshape(rows, -1)


def int4_parts(data: np.ndarray, type_name: str, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0, Q4_1 or Q4_K tensor's raw blocks as the int4 kernel's form (q - 8) * scale + zero:
    q [rows, columns] in 0..15 and scales, zeros [rows, columns / 32] float32."""
    q, scales, zeros = file_blocks(data, type_name, columns)
    if zeros is None:  # Q4_0: q already centred
        return (q + 8).astype(np.uint8), scales, np.zeros_like(scales)
    return q.astype(np.uint8), scales, zeros + 8 * scales


def int8_parts(data: np.ndarray, columns: int, type_name: str = "Q8_0") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A type of INT8_TYPES as int8 blocks: `file_blocks`, with Q8_0's scales kept as the file's float16."""
    q, scales, zeros = file_blocks(data, type_name, columns)
    return q, scales.astype(np.float16) if type_name == "Q8_0" else scales, zeros


def _float16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at `offset` of every block, as float32: [rows, blocks]."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are the first 16, the high nibbles the next 16."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _k_quant(blocks: np.ndarray, high_bits: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K and Q5_K super-blocks of 256 weights: d, dmin (float16), 12 bytes of eight 6-bit scales
    and eight 6-bit mins, (Q5_K: 32 bytes of high bits,) then 128 bytes of 4-bit values: four chunks
    of 32 bytes, each holding two runs of 32 weights (its low nibbles, then its high nibbles). Run r's
    weight i takes bit r of high byte i as its fifth bit. Returns q [rows, blocks, 256] and a scale
    d * sc and a zero -dmin * mn per run [rows, blocks, 8]."""
    d, dmin = _float16(blocks, 0)[..., None], _float16(blocks, 2)[..., None]  # [rows, blocks, 1]
    packed = blocks[..., 4:16].astype(np.uint16)  # [rows, blocks, 12]
    sc = np.empty((*blocks.shape[:2], 8), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., :4] = packed[..., 0:4] & 63
    mn[..., :4] = packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    values = 48 if high_bits else 16
    chunks = blocks[..., values : values + 128].reshape(*blocks.shape[:2], 4, 32)  # [rows, blocks, 4, 32]
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(*blocks.shape[:2], 8, 32)  # run 2c, then 2c + 1
    if high_bits:
        high = blocks[..., 16:48].reshape(*blocks.shape[:2], 1, 32)  # [rows, blocks, 1, 32]
        q = q | (((high >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    return q.astype(np.int8).reshape(*blocks.shape[:2], 256), d * sc, -(dmin * mn)


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks of 256 weights: 128 bytes of low nibbles, 64 bytes of high bit pairs,
    16 int8 scales, then d (float16). Each half of 128 weights takes 64 low-nibble bytes and 32
    high bytes: its four runs of 32 are the low nibbles of bytes 0-31 and 32-63, then their high
    nibbles, each with bit pair 0, 1, 2, 3 of the high byte at the same place as its top two bits."""
    rows, num = blocks.shape[:2]
    low = blocks[..., 0:128].reshape(rows, num, 2, 2, 32)  # [rows, blocks, half, bytes 0-31 | 32-63, 32]
    high = blocks[..., 128:192].reshape(rows, num, 2, 1, 32)  # [rows, blocks, half, 1, 32]
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, blocks, 16]
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1]
    runs = np.concatenate([low & 0x0F, low >> 4], axis=3)  # [rows, blocks, half, 4 runs, 32]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)  # run r's top bits: pair r
    q = (runs | ((high >> shifts) & 3) << 4).astype(np.int8) - 32
    return q.reshape(rows, num * 256), d * sc

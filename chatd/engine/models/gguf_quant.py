"""GGUF's 4-bit and 8-bit blocks as quant.py's int4 groups and int8 blocks, without rounding anything again.

llama.cpp's Q4_0, Q4_1 and Q4_K store each run of 32 weights of a row as 4-bit values q with
one scale and one offset: Q4_0 `d * (q - 8)`, Q4_1 `d * q + m`, Q4_K `d * sc * q - dmin * mn`
(sc and mn are 6-bit numbers per 32 weights, inside 256-weight super-blocks). All three are
`(q - 8) * scale + zero`, the int4 kernel's form (quant.py), with scale and zero computed here
from the block's own numbers. The kernel keeps scales and zeros in bfloat16: that rounding is
the only difference from llama.cpp's dequantization (tested against the gguf library's).

Q8_0 stores each run of 32 weights as int8 values q and one float16 scale d: `d * q`. That is
quant.py's int8 layer with a scale per block, which keeps q and d as they are: exactly
llama.cpp's weights. Q6_K (in 256-weight super-blocks: a float16 d and an int8 scale sc per 16
weights) is `d * sc * (q - 32)` with q a 6-bit number: int8 values q - 32 with a float32 scale
d * sc per block of 16, also exactly (a float16 times an int8 is exact in float32). Q4_K_M and
Q5_K_M files keep some tensors (often ffn_down, attn_v, the output head) in Q6_K.
"""

from __future__ import annotations

import numpy as np

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF types that map exactly onto int4 groups of 32
INT8_TYPES = ("Q8_0", "Q6_K")  # ... and onto int8 blocks (of 32, and of 16) with a scale each
# Bytes per block: 32 weights (Q4_0, Q4_1, Q8_0) or 256 (the K types).
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q6_K": 210}


def int4_parts(data: np.ndarray, type_name: str, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's raw blocks ([rows, bytes per row] uint8, as the gguf library reads them) as
    q [rows, columns] in 0..15 and scales, zeros [rows, columns / 32] float32."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, BLOCK_BYTES[type_name])  # [rows, blocks, bytes]
    if type_name == "Q4_K":
        q, scales, zeros = _q4_k(blocks)
    else:
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
        offset = 2 if type_name == "Q4_0" else 4
        q = _nibbles(blocks[..., offset : offset + 16])  # [rows, blocks, 32]
        if type_name == "Q4_0":
            scales, zeros = d, np.zeros_like(d)
        else:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            scales, zeros = d, m + 8 * d
    return q.reshape(rows, columns), scales.reshape(rows, -1), zeros.reshape(rows, -1)


def int8_parts(data: np.ndarray, columns: int, type_name: str = "Q8_0") -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 or Q6_K tensor's raw blocks ([rows, bytes per row] uint8) as q [rows, columns] int8
    and a scale per block: [rows, columns / 32] float16 (Q8_0, the file's own numbers) or
    [rows, columns / 16] float32 (Q6_K, d * sc)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, BLOCK_BYTES[type_name])
    if type_name == "Q6_K":
        q, scales = _q6_k(blocks)
        return q.reshape(rows, columns), scales.reshape(rows, -1)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [rows, blocks]
    q = blocks[..., 2:].copy().view(np.int8)  # [rows, blocks, 32]
    return q.reshape(rows, columns), scales


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles are the first 16, the high nibbles the next 16."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks of 256 weights: d, dmin (float16), 12 bytes of eight 6-bit scales and
    eight 6-bit mins, then 128 bytes of values: four chunks of 32 bytes, each holding two runs
    of 32 weights (its low nibbles, then its high nibbles)."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]  # [rows, blocks, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    packed = blocks[..., 4:16].astype(np.uint16)  # [rows, blocks, 12]
    sc = np.empty((*blocks.shape[:2], 8), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., :4] = packed[..., 0:4] & 63
    mn[..., :4] = packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    chunks = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 32)  # [rows, blocks, 4, 32]
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=3)  # [rows, blocks, 4, 2, 32]: run 2c, then 2c + 1
    scales = d * sc
    return q.reshape(*blocks.shape[:2], 256), scales, 8 * scales - dmin * mn


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

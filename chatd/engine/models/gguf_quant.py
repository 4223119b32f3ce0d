"""GGUF's 4-bit and 8-bit blocks as quant.py's int4 groups and int8 blocks, without rounding anything again.

llama.cpp's Q4_0, Q4_1 and Q4_K store each run of 32 weights of a row as 4-bit values q with
one scale and one offset: Q4_0 `d * (q - 8)`, Q4_1 `d * q + m`, Q4_K `d * sc * q - dmin * mn`
(sc and mn are 6-bit numbers per 32 weights, inside 256-weight super-blocks). All three are
`(q - 8) * scale + zero`, the int4 kernel's form (quant.py), with scale and zero computed here
from the block's own numbers. The kernel keeps scales and zeros in bfloat16: that rounding is
the only difference from llama.cpp's dequantization (tested against the gguf library's).

Q8_0 stores each run of 32 weights as int8 values q and one float16 scale d: `d * q`. That is
quant.py's int8 layer with a scale per block, which keeps q and d as they are: exactly
llama.cpp's weights.
"""

from __future__ import annotations

import numpy as np

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF types that map exactly onto int4 groups of 32
INT8_TYPES = ("Q8_0",)  # ... and onto int8 blocks of 32 with a scale each
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34}  # bytes per block (32, 32, 256 and 32 weights)


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


def int8_parts(data: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's raw blocks ([rows, bytes per row] uint8) as q [rows, columns] int8 and
    scales [rows, columns / 32] float16, the file's own numbers."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, BLOCK_BYTES["Q8_0"])  # [rows, blocks, 2 + 32]
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

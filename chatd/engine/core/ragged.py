"""Ragged host lists (block tables, token histories) to one padded numpy array, without a Python loop per row.

Per step the engine turns a few hundred lists of different lengths into rectangular tensors;
building them as padded Python lists costs tens of milliseconds at that size, which a GPU
step would wait for. numpy does it in a few.

It sits in core, the bottom of the engine's ladder, because two layers above use it: attention
(block tables) and the worker's sampler (token histories for penalties). It needs numpy, not torch.
"""

from __future__ import annotations

import itertools

import numpy as np


def pad_ragged(rows: list[list[int]], fill: int, dtype: type = np.int64) -> np.ndarray:
    """[len(rows), longest row] array: row i holds rows[i], then `fill`."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(lens.max()) if len(rows) else 0
    out = np.full((len(rows), width), fill, dtype=dtype)
    # Row-major boolean assignment fills each row's first len(row) entries, in order.
    out[np.arange(width) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lens.sum()))
    return out

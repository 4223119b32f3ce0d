"""Structured output in the sampler: each constrained row's logits masked to what its grammar allows.

The masks are computed ahead, off the engine thread (structured/grammar_threads.py), as bits: uint32 words
per row; here they become [rows, vocab] booleans on the logits' device, and every token a grammar
forbids gets -inf before any draw. A step without a constrained row costs one pass over its rows.
"""

from __future__ import annotations

import numpy as np
import torch

from chatd.engine.core.grammar_matcher import fill_masks


def apply_grammars(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Keep only the tokens each constrained row's grammar allows (rows: the sampler's SamplingRows);
    other rows are not touched."""
    # logits: [B, V]; never modified in place (they may be the raw logits kept for logprobs).
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    # Computed ahead, off the engine thread (grammar_threads.MaskWorkers): uint32 bits -> [C, V] booleans.
    words = fill_masks([rows[i].grammar for i in constrained], vocab_size)  # [C, words] uint32
    words = torch.from_numpy(words.view(np.int32)).to(device)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]  # [C, V]
    index = torch.tensor(constrained, device=device)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    return logits.index_put((index,), masked)

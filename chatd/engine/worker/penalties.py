"""Bans and penalties: a sampled row's logits changed by what it has seen, before anything is drawn.

A banned token (EOS while min_tokens is not reached) gets -inf; the repetition penalty (Hugging
Face's, over prompt and output) makes every token seen before less likely; presence and frequency
penalties (OpenAI's, over the output only) subtract per occurrence. A row that asks for none of
these costs nothing; the raw logits are never changed in place (logprobs describe the model).
"""

from __future__ import annotations

import torch

from chatd.engine.core.ragged import pad_ragged


def apply_penalties(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """Bans, then repetition penalty (prompt + output), then presence/frequency (output only)."""
    # logits: [B, V]; never modified in place, the caller keeps the raw logits for logprobs.
    num_rows, vocab_size = logits.shape
    device = logits.device

    banned = [(i, token_id) for i, row in enumerate(rows) for token_id in row.banned_token_ids]
    if banned:
        row_index, token_index = torch.tensor(banned, device=device).unbind(dim=1)
        logits = logits.index_put((row_index, token_index), torch.tensor(float("-inf"), device=device))

    repetition = [row.params.repetition_penalty for row in rows]
    presence = [row.params.presence_penalty for row in rows]
    frequency = [row.params.frequency_penalty for row in rows]
    needs_repetition = any(p != 1.0 for p in repetition)
    needs_additive = any(presence) or any(frequency)
    if not (needs_repetition or needs_additive):
        return logits

    output_counts = _token_counts([row.output_token_ids for row in rows], vocab_size, device)  # [B, V]
    if needs_repetition:
        # HF/CTRL: a token seen anywhere before (prompt or output) is made less likely; dividing
        # a negative logit would make it *more* likely, so those are multiplied instead.
        prompt_counts = _token_counts([row.prompt_token_ids for row in rows], vocab_size, device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        penalty = torch.tensor(repetition, device=device).unsqueeze(1)  # [B, 1]
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalized, logits)
    if needs_additive:
        # OpenAI: only generated tokens count, so a long prompt does not mute its own words.
        presence_t = torch.tensor(presence, device=device).unsqueeze(1)
        frequency_t = torch.tensor(frequency, device=device).unsqueeze(1)
        logits = logits - frequency_t * output_counts - presence_t * (output_counts > 0)
    return logits


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    # How often each token occurs in each row: [B, V]. Rows are padded with `vocab_size`, an
    # extra bin that is counted and then cut off, so one scatter_add serves the whole batch.
    index = torch.from_numpy(pad_ragged(token_lists, fill=vocab_size)).to(device)  # [B, longest]
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]

"""Turn one step's logits into tokens: bans, penalties, grammars, greedy, temperature, top-k/p, min-p.

The sampler knows nothing of sequences, blocks or the model: the runner hands it a [B, V]
logits tensor and one SamplingRow per row, and gets back a token (and maybe logprobs) per
row. Everything that is cheap to batch is batched, and work no row asks for is skipped.

Reproducibility: each row draws its randomness from its own generator (the exponential-race
trick: argmax(probs / q) with q ~ Exp(1) is a draw from `probs`), so a seeded sequence gets
the same tokens whether it is alone or in a batch of 32 with other requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chatd.engine.grammar import GrammarMatcher, fill_masks
from chatd.engine.params import Logprob, SamplingParams
from chatd.engine.worker.ragged import pad_ragged

# Below this, dividing logits by the temperature can overflow float32; the limit T -> 0 is
# greedy anyway (vLLM draws the same line).
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # per-sequence RNG owned by the runner; None only for greedy
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS while min_tokens is not reached
    grammar: GrammarMatcher | None = None  # structured output: only tokens it allows may be sampled

    @property
    def greedy(self) -> bool:
        return self.params.temperature < MIN_TEMPERATURE


@dataclass
class SamplerOutput:
    """One token per row, and per row a Logprob where the request asked for logprobs."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


class Sampler:
    """Picks one token per row of a [B, V] logits tensor, on whatever device the logits are."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample a token for each row.

        Logprobs are those of the model's raw distribution: log_softmax of the logits before
        bans, penalties, temperature and truncation (vLLM's default), so they describe the
        model rather than the request's sampling settings.
        """
        # logits: [B, V]
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per SamplingRow"
        raw_logits = logits.float()
        logits = apply_penalties(raw_logits, rows)
        logits = apply_grammars(logits, rows)

        sampled_rows = [i for i, row in enumerate(rows) if not row.greedy]
        if len(sampled_rows) < len(rows):
            token_ids = logits.argmax(dim=-1)  # [B]
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if sampled_rows:
            index = torch.tensor(sampled_rows, device=logits.device)
            subset = [rows[i] for i in sampled_rows]
            probs = sampling_probs(logits[index], subset)  # [S, V]
            token_ids[index] = draw(probs, [row.generator for row in subset])

        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprob_tensors = _logprob_tensors(raw_logits, token_ids, wanted, rows) if wanted else []
        # The step's one wait for the device: sampled ids (and logprobs) come back together.
        token_ids, *logprob_tensors = to_host([token_ids, *logprob_tensors])
        token_list = token_ids.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=_logprobs(token_list, wanted, logprob_tensors, rows))


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors into pinned host memory and wait once for all of them (CPU tensors: as they are)."""
    if not tensors or tensors[0].device.type == "cpu":
        return tensors
    copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return copies


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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


def apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Keep only the tokens each constrained row's grammar allows; other rows are not touched."""
    # logits: [B, V]; never modified in place (they may be the raw logits kept for logprobs).
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    # Computed on the host while (on CUDA) the forward may still run: uint32 bits -> [C, V] booleans.
    words = fill_masks([rows[i].grammar for i in constrained], vocab_size)  # [C, words] uint32
    words = torch.from_numpy(words.view(np.int32)).to(device)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]  # [C, V]
    index = torch.tensor(constrained, device=device)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    return logits.index_put((index,), masked)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then normalized probabilities for rows that sample."""
    # logits: [S, V] (already penalized) -> probs: [S, V], zero where truncated
    device = logits.device
    temperatures = [max(row.params.temperature, MIN_TEMPERATURE) for row in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)

    top_ks = [row.params.top_k for row in rows]
    top_ps = [row.params.top_p for row in rows]
    if any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    elif any(top_ks):
        logits = _top_k_only(logits, top_ks)

    probs = logits.softmax(dim=-1)
    min_ps = [row.params.min_p for row in rows]
    if any(min_ps):
        # Relative to the most likely token, so min-p adapts: strict when the model is sure.
        threshold = torch.tensor(min_ps, device=device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs`, each row's randomness from its own generator."""
    # probs: [S, V] -> token ids: [S]
    vocab_size = probs.shape[1]
    noise = torch.stack([_exponential(g, vocab_size, probs.device) for g in generators])  # [S, V]
    # An Exp(1) draw can round to 0; 0/0 would be NaN for a truncated token.
    noise = noise.clamp_min(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _exponential(generator: torch.Generator | None, size: int, device: torch.device) -> torch.Tensor:
    # Made on the generator's own device (a CPU generator cannot fill a CUDA tensor), then moved.
    # A row without a generator falls back to torch's global RNG: random, but not reproducible.
    where = generator.device if generator is not None else device
    return torch.empty(size, device=where).exponential_(generator=generator).to(device)


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    # One ascending sort serves both, in the same order of operations as HF's warpers.
    # logits: [S, V]
    num_rows, vocab_size = logits.shape
    device = logits.device
    sorted_logits, sorted_index = logits.sort(dim=-1)  # ascending: the most likely token is last
    if any(top_ks):
        ks = torch.tensor([min(k, vocab_size) or vocab_size for k in top_ks], device=device)
        kth_largest = sorted_logits.gather(1, (vocab_size - ks).unsqueeze(1))  # [S, 1]
        # `<` keeps every token tied with the k-th, as HF's TopKLogitsWarper does.
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    # Drop the least likely tokens whose total mass stays within 1 - top_p: what remains is
    # the smallest set with mass >= top_p. The threshold is computed in Python like HF's.
    mass_to_drop = torch.tensor([1.0 - p for p in top_ps], device=device).unsqueeze(1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= mass_to_drop
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


def _top_k_only(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    # Without top-p no full sort is needed: topk up to the largest k finds each row's k-th value.
    # logits: [S, V]
    vocab_size = logits.shape[1]
    device = logits.device
    ks = [min(k, vocab_size) for k in top_ks]
    largest = logits.topk(max(ks), dim=-1).values  # [S, max_k], descending
    kth_index = torch.tensor([max(k, 1) - 1 for k in ks], device=device).unsqueeze(1)
    kth_largest = largest.gather(1, kth_index)  # [S, 1]
    top_k_off = torch.tensor([k == 0 for k in ks], device=device).unsqueeze(1)
    kth_largest = kth_largest.masked_fill(top_k_off, float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    # How often each token occurs in each row: [B, V]. Rows are padded with `vocab_size`, an
    # extra bin that is counted and then cut off, so one scatter_add serves the whole batch.
    index = torch.from_numpy(pad_ragged(token_lists, fill=vocab_size)).to(device)  # [B, longest]
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]


def _logprob_tensors(raw_logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int], rows: list[SamplingRow]) -> list[torch.Tensor]:
    """For the rows that asked: the sampled token's logprob [W] and the top-k values and ids [W, max_k]."""
    index = torch.tensor(wanted, device=raw_logits.device)
    logprobs = raw_logits[index].log_softmax(dim=-1)  # [W, V]
    sampled = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)  # [W]
    max_k = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [W, max_k], sorted descending
    return [sampled, top_values, top_ids]


def _logprobs(token_ids: list[int], wanted: list[int], tensors: list[torch.Tensor], rows: list[SamplingRow]) -> list[Logprob | None]:
    # Host-side: one Logprob per row that asked, None for the others.
    result: list[Logprob | None] = [None] * len(rows)
    if not wanted:
        return result
    sampled, top_values, top_ids = (t.tolist() for t in tensors)
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        top = dict(zip(top_ids[j][:k], top_values[j][:k]))
        result[i] = Logprob(token_id=token_ids[i], logprob=sampled[j], top=top)
    return result

"""Turn one step's logits into tokens: bans, penalties, grammars, greedy, temperature, top-k/p, min-p.

The sampler knows nothing of sequences, blocks or the model: the runner hands it a [B, V]
logits tensor and one SamplingRow per row, and gets back a token (and maybe logprobs) per
row. Everything that is cheap to batch is batched, and work no row asks for is skipped. A
structured output's grammar masks its row's logits (grammar_masks.py) before any draw.

Reproducibility: each row draws one uniform number a step from its own generator, and what it
may draw is worked out for it alone, so a seeded sequence gets the same tokens whether it is
alone or in a batch of 32 with other requests.

Where the logits are on a CPU, sampled rows are worked out one by one in numpy
(host_sampling.py): the same choices, at a fraction of the cost of torch's small operations.
`sampling_choices` below is the batched form, for logits on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from chatd.engine.core.grammar_matcher import GrammarMatcher
from chatd.engine.core.ragged import pad_ragged
from chatd.engine.params import Logprob, SamplingParams
from chatd.engine.worker.grammar_masks import apply_grammars
from chatd.engine.worker.host_sampling import host_choices, host_draw

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

    @cached_property  # a row's fields do not change once built (runner.py keeps one a sequence)
    def greedy(self) -> bool:
        return self.params.temperature < MIN_TEMPERATURE

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes or reports the logits: its token is their argmax."""
        params = self.params
        return (self.greedy and not self.banned_token_ids and self.grammar is None and params.logprobs is None
                and params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty)


@dataclass
class SamplerOutput:
    """One token per row, and per row a Logprob where the request asked for logprobs."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


class SampledTokens:
    """A step's draws as the device has them (`token_ids`, [B]: the next step may feed them to the
    model from there), on their way to the host: on a GPU their copies into pinned memory are
    queued behind the sampling, and `result()` is the step's one wait for the device."""

    def __init__(self, token_ids: torch.Tensor, logprob_tensors: list[torch.Tensor], wanted: list[int],
                 rows: list[SamplingRow]) -> None:
        self.token_ids = token_ids
        self._wanted, self._rows = wanted, rows
        self._host = [token_ids, *logprob_tensors]
        self._done = None
        if token_ids.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in self._host]
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> SamplerOutput:
        if self._done is not None:
            self._done.synchronize()
        token_ids, *logprob_tensors = self._host
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, _logprobs(token_list, self._wanted, logprob_tensors, self._rows))


class Sampler:
    """Picks one token per row of a [B, V] logits tensor, on whatever device the logits are."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample a token for each row, and wait for them."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampledTokens:
        """Sample a token for each row, without waiting for the device where it can (top-k and
        top-p rows on a GPU still wait once, to know whether their candidates decide them).

        Logprobs are those of the model's raw distribution: log_softmax of the logits before
        bans, penalties, temperature and truncation (vLLM's default), so they describe the
        model rather than the request's sampling settings.
        """
        # logits: [B, V]
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per SamplingRow"
        if all(row.plain_greedy for row in rows):  # the argmax is all there is to do
            return SampledTokens(_argmax(logits), [], [], rows)
        raw_logits = logits.float()
        logits = apply_penalties(raw_logits, rows)
        logits = apply_grammars(logits, rows)

        sampled_rows = [i for i, row in enumerate(rows) if not row.greedy]
        if len(sampled_rows) < len(rows):
            token_ids = logits.argmax(dim=-1)  # [B]
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if sampled_rows and logits.device.type == "cpu":
            token_ids[sampled_rows] = torch.tensor(_draw_on_host(logits, rows, sampled_rows))
        elif sampled_rows:
            subset = [rows[i] for i in sampled_rows]
            # Each row's uniform drawn in row order, so a sequence whose rows are one per position
            # (a verify step) uses its stream's numbers in the order it would one step at a time.
            uniforms = torch.cat([draw_uniform(row.generator, logits.device) for row in subset])
            for part in sampling_choices(_rows(logits, sampled_rows), subset):
                index = torch.tensor([sampled_rows[j] for j in part.rows], device=logits.device)
                token_ids[index] = draw(part, uniforms[torch.tensor(part.rows, device=logits.device)])

        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprob_tensors = _logprob_tensors(raw_logits, token_ids, wanted, rows) if wanted else []
        return SampledTokens(token_ids, logprob_tensors, wanted, rows)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, [B] int64. On a CPU through numpy: torch's argmax of SmolLM2's
    49152 logits took 79 us right after a decode step (it hands the rows to its thread pool), numpy's 48."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _draw_on_host(logits: torch.Tensor, rows: list[SamplingRow], sampled: list[int]) -> list[int]:
    """The tokens of the `sampled` rows, each worked out alone in numpy (host_sampling.py)."""
    host_logits = logits.numpy()  # [B, V], CPU float32
    return [host_draw(host_choices(host_logits[i], rows[i].params, MIN_TEMPERATURE), draw_uniform(rows[i].generator, logits.device).item())
            for i in sampled]


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


# A row that truncates (top-k, top-p) is worked out over its most likely tokens only. Sorting
# SmolLM2's 49152 logits took 3.8 ms a row on the 2-core machine (40% of a decode step); their
# top 256 (`topk`) 0.12-0.27 ms, top 4096 0.8 ms. Over 320 of its chat steps at temperature 1,
# top_p 0.95 kept at most 256 tokens in 79% of them and at most 4096 in all. A row whose kept set
# could reach past its candidates looks wider, up to its whole vocabulary sorted, so the result is
# the same either way.
CANDIDATES = 256
WIDER_CANDIDATES = 4096


@dataclass
class Choices:
    """Some rows' allowed tokens and their probabilities, for `draw`.

    probs [R, C] sum to 1 per row, zero where a token is cut; token_ids [R, C] names the token of
    each column, or is None where column j is token j (the whole vocabulary in its own order)."""

    rows: list[int]  # which rows of the batch
    probs: torch.Tensor
    token_ids: torch.Tensor | None


def sampling_choices(logits: torch.Tensor, rows: list[SamplingRow]) -> list[Choices]:
    """Temperature, top-k, top-p and min-p (in transformers' order): what each row may draw.

    Rows without top-k and top-p keep the vocabulary in its order. Rows with either keep their
    tokens most likely first: their top CANDIDATES (or top_k, if larger), or where top-p could
    keep more than those, their top WIDER_CANDIDATES, or their whole vocabulary sorted. A row's
    choices do not depend on the other rows of its batch, so neither does what it draws."""
    # logits: [S, V] (already penalized)
    device = logits.device
    vocab_size = logits.shape[1]
    temperatures = [max(row.params.temperature, MIN_TEMPERATURE) for row in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
    truncates = [bool(row.params.top_k) or row.params.top_p < 1.0 for row in rows]
    whole = [i for i, t in enumerate(truncates) if not t]
    cut = [i for i, t in enumerate(truncates) if t]
    choices = []
    if whole:
        probs = _rows(logits, whole).softmax(dim=-1)
        choices.append(Choices(whole, _min_p(probs, [rows[i] for i in whole]), None))
    if cut:
        pending, pending_logits = cut, _rows(logits, cut)
        top_k = max(rows[i].params.top_k for i in cut)
        for width in (max(CANDIDATES, top_k), max(WIDER_CANDIDATES, top_k), vocab_size):
            width = min(width, vocab_size)
            if width < vocab_size:
                values, token_ids = pending_logits.topk(width, dim=-1)  # most likely first
            else:
                values, token_ids = pending_logits.sort(dim=-1, descending=True)
            probs, covered = _top_k_top_p(values, pending_logits, [rows[i] for i in pending], complete=width == vocab_size)
            if all(covered):
                choices.append(Choices(pending, probs, token_ids))
                break
            decided = [j for j, ok in enumerate(covered) if ok]
            if decided:
                choices.append(Choices([pending[j] for j in decided], probs[decided], token_ids[decided]))
            left = [j for j, ok in enumerate(covered) if not ok]  # top-p may keep more: look wider
            pending, pending_logits = [pending[j] for j in left], pending_logits[left]
    return choices


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`sampling_choices` as one [S, V] table of probabilities over the vocabulary (zero where
    cut): the form transformers' warpers give, to compare against."""
    dense = torch.zeros_like(logits)
    for part in sampling_choices(logits, rows):
        index = torch.tensor(part.rows, device=logits.device)
        if part.token_ids is None:
            dense[index] = part.probs
        else:
            dense[index] = torch.zeros_like(dense[index]).scatter_(1, part.token_ids, part.probs)
    return dense


def draw(choices: Choices, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of `choices`, each from its uniform number ([R], in [0, 1), drawn from the
    row's own generator) by inverse transform: the first column whose cumulative probability passes it."""
    # float64 sums, so a tail of tiny probabilities keeps its share; a point short of the
    # total always lands on a column with probability > 0.
    cumulative = choices.probs.double().cumsum(dim=-1)  # [R, C]
    column = torch.searchsorted(cumulative, (uniform.double() * cumulative[:, -1]).unsqueeze(1), right=True)
    if choices.token_ids is None:
        return column.squeeze(1)
    return choices.token_ids.gather(1, column).squeeze(1)


def draw_uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) from a row's generator, as a [1] tensor on `device`."""
    # Made on the generator's own device (a CPU generator cannot fill a CUDA tensor), then moved.
    # A row without a generator falls back to torch's global RNG: random, but not reproducible.
    where = generator.device if generator is not None else device
    return torch.rand(1, device=where, generator=generator).to(device)


def _rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
    return logits if len(index) == len(logits) else logits[torch.tensor(index, device=logits.device)]


def _top_k_top_p(values: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow],
                 complete: bool) -> tuple[torch.Tensor, list[bool]]:
    """Top-k, then top-p, then min-p over each row's most likely tokens `values` ([R, C], sorted
    descending) of its `logits` ([R, V]); `complete`: they are the whole vocabulary.

    Returns their probabilities [R, C] (zero where cut) and, per row, whether the C tokens decide
    it: top-p reaches past them only if they hold less than top_p of the mass, top-k only if
    the k-th value is tied with values past them."""
    device = values.device
    num_rows, width = values.shape
    top_ks = [min(row.params.top_k, width) for row in rows]
    covered = [True] * num_rows
    if any(top_ks):
        kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in top_ks], device=device).unsqueeze(1))
        kth = kth.masked_fill(torch.tensor([[k == 0] for k in top_ks], device=device), float("-inf"))
        # `<` keeps every token tied with the k-th, as transformers' TopKLogitsWarper does.
        values = values.masked_fill(values < kth, float("-inf"))
        if not complete:
            tied = (values[:, -1:] == kth).squeeze(1).tolist()
            covered = [not (k and t) for k, t in zip(top_ks, tied)]
    # Top-k renormalizes over its kept tokens, all of which are here; otherwise the whole vocabulary counts.
    if all(top_ks):
        normalizer = values.logsumexp(dim=-1)
    elif not any(top_ks):
        normalizer = logits.logsumexp(dim=-1)
    else:
        with_k = torch.tensor([bool(k) for k in top_ks], device=device)
        normalizer = torch.where(with_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - normalizer.unsqueeze(1)).exp()
    top_ps = [row.params.top_p for row in rows]
    if any(p < 1.0 for p in top_ps):
        # Keep a token while the tokens before it hold less than top_p: the smallest set with
        # mass >= top_p (transformers drops those whose ascending cumulative mass is <= 1 - top_p).
        limit = torch.tensor(top_ps, device=device).unsqueeze(1)
        before = probs.cumsum(dim=-1) - probs
        drop = (before >= limit) & (limit < 1.0)
        drop[:, 0] = False  # always keep the most likely token
        if not complete:
            mass = probs.sum(dim=-1).tolist()
            covered = [ok and (bool(k) or p >= 1.0 or m >= p) for ok, k, p, m in zip(covered, top_ks, top_ps, mass)]
        probs = probs.masked_fill(drop, 0.0)
    return _min_p(probs / probs.sum(dim=-1, keepdim=True), rows), covered


def _min_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (strict when the model is sure)."""
    min_ps = [row.params.min_p for row in rows]
    if not any(min_ps):
        return probs
    threshold = torch.tensor(min_ps, device=probs.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


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

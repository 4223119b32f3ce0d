"""Turn one step's logits into tokens: bans, penalties, grammars, greedy, temperature, top-k/p, min-p.

The sampler knows nothing of sequences, blocks or the model: the runner hands it a [B, V]
logits tensor and one SamplingRow per row, and gets back a token (and maybe logprobs) per
row. Everything that is cheap to batch is batched, and work no row asks for is skipped. A
structured output's grammar masks its row's logits (grammar_masks.py) before any draw.

Reproducibility: each row draws one uniform number a step from its own generator, and what it
may draw is worked out for it alone, so a seeded sequence gets the same tokens whether it is
alone or in a batch of 32 with other requests.

A greedy row's token is the argmax; what a sampled row may draw (temperature, top-k, top-p,
min-p) is sampling_choices.py's, batched, for logits on a GPU; where the logits are on a CPU,
sampled rows are worked out one by one in numpy (host_sampling.py): the same choices, at a
fraction of the cost of torch's small operations. Bans and penalties come first (penalties.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from chatd.engine.core.grammar_matcher import GrammarMatcher
from chatd.engine.params import Logprob, SamplingParams
from chatd.engine.worker.grammar_masks import apply_grammars
from chatd.engine.worker.penalties import apply_penalties
from chatd.engine.worker.sampling_choices import MIN_TEMPERATURE, draw, sampling_choices, select_rows
from chatd.engine.worker.host_sampling import host_choices, host_draw
from chatd.engine.worker.logprobs import host_logprobs, logprob_tensors

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
        return SamplerOutput(token_list, host_logprobs(token_list, self._wanted, logprob_tensors, self._rows))


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
            for part in sampling_choices(select_rows(logits, sampled_rows), subset):
                index = torch.tensor([sampled_rows[j] for j in part.rows], device=logits.device)
                token_ids[index] = draw(part, uniforms[torch.tensor(part.rows, device=logits.device)])

        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        logprobs = logprob_tensors(raw_logits, token_ids, wanted, rows) if wanted else []  # logprobs.py
        return SampledTokens(token_ids, logprobs, wanted, rows)


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


def draw_uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) from a row's generator, as a [1] tensor on `device`."""
    # Made on the generator's own device (a CPU generator cannot fill a CUDA tensor), then moved.
    # A row without a generator falls back to torch's global RNG: random, but not reproducible.
    where = generator.device if generator is not None else device
    return torch.rand(1, device=where, generator=generator).to(device)

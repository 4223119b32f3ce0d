"""Turn one step's logits into tokens: the argmax of greedy rows, and the dispatch to the rest.

The sampler knows nothing of sequences, blocks or the model: the runner hands it a [B, V]
logits tensor and one SamplingRow per row, and gets back a token (and maybe logprobs) per
row. A step whose rows are all plain greedy (no bans, penalties, grammar or logprobs) is one
argmax; any other goes through full_sampling.py: bans, penalties, grammar masks, temperature,
top-k, top-p, min-p, logprobs.

Reproducibility: each sampled row draws one uniform number a step from its own generator, and what
it may draw is worked out for it alone, so a seeded sequence gets the same tokens whether it is
alone or in a batch of 32 with other requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from chatd.engine.core.grammar_matcher import GrammarMatcher
from chatd.engine.params import Logprob, SamplingParams
from chatd.engine.worker.full_sampling import sample_rows
from chatd.engine.worker.logprobs import host_logprobs
from chatd.engine.worker.sampling_choices import MIN_TEMPERATURE

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
        return SampledTokens(*sample_rows(logits, rows), rows)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token, [B] int64. On a CPU through numpy: torch's argmax of SmolLM2's
    49152 logits took 79 us right after a decode step (it hands the rows to its thread pool), numpy's 48."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)

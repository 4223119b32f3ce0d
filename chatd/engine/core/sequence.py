"""A Sequence: one choice of one request, with its tokens, status, block table and counters.

Plain Python (no torch), so the block manager and the scheduler are tested without a model.
The block manager changes a sequence only through `allocate`, `allocate_slots`, `fork`, `free`,
`cache_blocks`; the scheduler moves its status and counters.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from chatd.engine.params import FinishReason, SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # not holding KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds blocks; gets tokens computed each step
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One generated choice. `token_ids` = prompt + output; KV exists for the first `num_computed_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # the choice index within its request (OpenAI `choices[i].index`)
    priority: int = 0  # its class: lower runs first (vLLM's convention)
    arrival: int = 0  # admission order; within a tenant, first come first served
    tenant: str | None = None  # whose share of the batch it uses (fairness.py); None: one shared tenant
    weight: float = 1.0  # its tenant's share relative to others of the same class
    cache_salt: str | None = None  # keeps prefix-cache hits within one tenant where set
    num_shared_prefix_tokens: int = 0  # the salt applies after these tokens' full blocks (shared ones)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of this sequence's full blocks, in order
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    # Tokens sampled by a step that has not handed them back yet: from when that step is planned
    # until its results are folded in (`Scheduler.postprocess`). With async scheduling the next
    # step is planned meanwhile, and feeds such a token to the model straight from the device.
    num_pending_tokens: int = 0
    forks: list[Sequence] = field(default_factory=list)  # choices 1..n-1: forked off this one at its first token
    # Speculative decoding: tokens a proposer guessed will follow (engine/speculative/), verified
    # by the next step that schedules this sequence, which consumes them either way.
    draft_token_ids: list[int] = field(default_factory=list)
    proposer_state: Any = None  # what its proposer keeps between steps (an n-gram index)
    num_draft_tokens: int = 0  # proposed tokens its steps verified
    num_accepted_tokens: int = 0  # of those, accepted
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Structured output: a grammar/GrammarMatcher (accept(token_id) -> bool, is_terminated, error);
    # None for free text. The sampler masks with it, `Scheduler.postprocess` advances it.
    grammar: Any = None
    # What the sampler needs of it each step once nothing about that changes any more (min_tokens
    # reached): the runner's SamplingRow, built once instead of every step.
    sampling_row: Any = None
    # params.prompt_logprobs: the prompt tokens' logprobs computed so far, [None] first (nothing
    # precedes the first token); the prefill's steps add to it (the runner's `prompt_rows`).
    prompt_logprobs: list | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.index == 0:  # choices 1..n-1 share the first's prompt
            self.prompt_logprobs = [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt's logprobs are asked for and not all computed yet: until they are, it
        reads nothing from the prefix cache (a cached block's positions would have none)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every token it has, pending ones included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, pending ones included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to go through the model before this sequence can sample again."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens  # (num_tokens, inline: per step)

    @property
    def is_prefilling(self) -> bool:
        """True until the prompt (and, after a preemption, the output so far) is all computed."""
        computed = self.num_computed_tokens  # (the properties' sums inline: asked of every sequence, every step)
        return len(self.token_ids) + self.num_pending_tokens - computed > 1 or computed < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token: the value of its oldest pending one (a sampled token is pending from
        when its step is planned until here), or a new token where none is pending."""
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

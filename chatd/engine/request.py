"""One request inside the engine, and what a request must pass before anything is allocated for it.

A `Request` is the engine's record of one request: its `n` sequences and their detokenizers, and
the times a server reports. `checked_params` holds the request to the model and the pool: the
context window, the vocabulary and the KV blocks it could need, each refusal a ParamError that
names the field and the limit. Apart from engine.py because these rules are admission's, read
and changed on their own; the engine tokenizes, calls them and builds the sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from chatd.engine.core.scheduler import Scheduler
from chatd.engine.core.sequence import Sequence
from chatd.engine.params import CacheScope, LimitError, ParamError, Placement, SamplingParams
from chatd.engine.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class Request:
    """One request: its `n` sequences and their detokenizers. Built (and validated) before it is added."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # choices 1..n-1 wait in seqs[0].forks until the first one's prompt is computed
    detokenizers: list[IncrementalDetokenizer | None]
    placement: Placement = Placement()
    cache: CacheScope = CacheScope()
    num_cached_tokens: int = 0
    queued_at: float = 0.0  # engine clock when added
    queue_time: float | None = None  # seconds from being added to first being scheduled

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def guesses(self) -> tuple[int, int]:
        """Speculative decoding over its choices so far: tokens proposed and verified, and accepted."""
        return sum(s.num_draft_tokens for s in self.seqs), sum(s.num_accepted_tokens for s in self.seqs)


def checked_params(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                   scheduler: Scheduler) -> SamplingParams:
    """`params` with max_tokens filled in (what the context window leaves, when unset), once the
    prompt and params fit the model and the KV pool; ParamError naming the field if they do not."""
    if not prompt_token_ids:
        raise LimitError("prompt", lambda prompt, _: f"{prompt} must not be empty")
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:  # checked first: it costs nothing however long the prompt
        raise LimitError("prompt", lambda prompt, _: f"{prompt} has {num_prompt} tokens; the context window is "
                                                     f"{max_model_len} tokens and must leave room for at least one "
                                                     "generated token", context_exceeded=True)
    # Ints in range, checked in C (a tokenizer's ids, most prompts); else the loop finds the first
    # bad one (a client's ids: a string, a float, a negative), or finds none (bools count as ints).
    ids = prompt_token_ids
    fast = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size
    bad = None if fast else next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise LimitError("prompt", lambda prompt, _: f"{prompt} token id {bad!r} is out of range [0, {vocab_size})")
    bad = next((t for t in params.stop_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise ParamError("stop_token_ids", f"stop token id {bad!r} is out of range [0, {vocab_size})")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise LimitError("max_tokens", lambda prompt, field: f"{prompt} ({num_prompt} tokens) + {field} ({max_tokens}) = "
                                                             f"{num_prompt + max_tokens} exceeds the context window of "
                                                             f"{max_model_len} tokens")
    blocks, num_blocks = scheduler.kv_blocks_needed(num_prompt + max_tokens), scheduler.num_kv_blocks
    if blocks > num_blocks:
        raise LimitError("max_tokens", lambda prompt, field: f"{prompt} + {field} = {num_prompt + max_tokens} tokens "
                                                             f"need {blocks} KV blocks, but the KV cache holds only "
                                                             f"{num_blocks} blocks")
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    return params

"""Factories shared by every test file: engine parts built without a model, and what a server is told of one.

As vLLM's `tests/v1/core/utils.py` does: a scheduler with no KV tensors at all, sequences made
in one line, and a `FakeRunner` so engine tests run without a model where the model does not
matter (validation, bookkeeping, aborts, clocks). Tests that compare tokens use a real model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from chatd.config import CacheConfig, SchedulerConfig
from chatd.engine import LLMEngine, ModelInfo, SamplingParams, Tokenizer
from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.scheduler import ScheduledSequence, Scheduler
from chatd.engine.core.sequence import Sequence
from chatd.engine.worker.sampler import SamplerOutput

_arrivals = itertools.count()


def make_seq(prompt_len: int = 6, max_tokens: int = 3, priority: int = 0, first_token: int = 0,
             tokens: Iterable[int] | None = None, salt: str | None = None, shared: int = 0) -> Sequence:
    """A sequence whose prompt is `tokens`, or `prompt_len` ids counting up from `first_token`."""
    tokens = list(range(first_token, first_token + prompt_len)) if tokens is None else list(tokens)
    return Sequence(f"r{first_token}", tokens, SamplingParams(max_tokens=max_tokens), priority=priority,
                    arrival=next(_arrivals), cache_salt=salt, num_shared_prefix_tokens=shared)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   prefix_caching: bool = True, max_model_len: int | None = None,
                   eos_token_ids: frozenset[int] = frozenset()) -> Scheduler:
    """A scheduler over a block pool of `num_blocks` blocks; no tensors behind them."""
    blocks = BlockManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, blocks, max_model_len, eos_token_ids)


class FakeRunner:
    """Stands in for ModelRunner: each sequence that samples gets `next_token(seq)` (by default its
    last token + 1, wrapping at `vocab_size`); no tensors, no model. Counts steps and releases."""

    def __init__(self, vocab_size: int = 100, next_token: Callable[[Sequence], int] | None = None) -> None:
        self.next_token = next_token or (lambda seq: (seq.token_ids[-1] + 1) % vocab_size)
        self.num_steps = 0
        self.released: list[Sequence] = []

    def execute(self, scheduled: list[ScheduledSequence]) -> SamplerOutput:
        self.num_steps += 1
        token_ids = [self.next_token(s.seq) for s in scheduled if s.samples]
        return SamplerOutput(token_ids, [None] * len(token_ids))

    def release(self, seq: Sequence) -> None:
        self.released.append(seq)


def make_engine(runner: FakeRunner | None = None, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
                vocab_size: int = 100, tokenizer: Tokenizer | None = None, eos_token_ids: frozenset[int] = frozenset(),
                budget: int = 64, max_seqs: int = 8) -> LLMEngine:
    """An LLMEngine around a FakeRunner (or the runner given): the whole engine but the model."""
    return LLMEngine(
        runner or FakeRunner(vocab_size),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        CacheConfig(block_size=block_size),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
    )


def make_model_info(max_model_len: int = 64, **fields) -> ModelInfo:
    """What `AsyncEngine.start` would report for a small CPU model."""
    defaults = dict(path="/models/m", max_model_len=max_model_len, vocab_size=1000, dtype="float32", device="cpu",
                    attention_backend="sdpa", cuda_graph_max_batch=0, num_kv_blocks=64, block_size=8, is_demo=True)
    return ModelInfo(**{**defaults, **fields})

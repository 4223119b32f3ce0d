"""Factories shared by every test file: engine parts built without a model, and what a server is told of one.

As vLLM's `tests/v1/core/utils.py` does: a scheduler with no KV tensors at all, sequences made
in one line, and a `FakeRunner` so engine tests run without a model where the model does not
matter (validation, bookkeeping, aborts, clocks). Tests that compare tokens use a real model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from chatd.config import CacheConfig, SchedulerConfig
from chatd.engine import EngineStats, LLMEngine, ModelInfo, SamplingParams, Tokenizer
from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.scheduler import ScheduledSequence, Scheduler
from chatd.engine.core.sequence import Sequence
from chatd.engine.worker.sampler import SamplerOutput

_arrivals = itertools.count()


def make_seq(prompt_len: int = 6, max_tokens: int = 3, priority: int = 0, first_token: int = 0,
             tokens: Iterable[int] | None = None, salt: str | None = None, shared: int = 0,
             tenant: str | None = None, weight: float = 1.0) -> Sequence:
    """A sequence whose prompt is `tokens`, or `prompt_len` ids counting up from `first_token`."""
    tokens = list(range(first_token, first_token + prompt_len)) if tokens is None else list(tokens)
    return Sequence(f"r{first_token}", tokens, SamplingParams(max_tokens=max_tokens), priority=priority,
                    arrival=next(_arrivals), cache_salt=salt, num_shared_prefix_tokens=shared, tenant=tenant,
                    weight=weight)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   prefix_caching: bool = True, max_model_len: int | None = None,
                   eos_token_ids: frozenset[int] = frozenset()) -> Scheduler:
    """A scheduler over a block pool of `num_blocks` blocks; no tensors behind them."""
    blocks = BlockManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, blocks, max_model_len, eos_token_ids)


class FakeRunner:
    """Stands in for ModelRunner: each sequence that samples gets `next_token(seq, last)`, where
    `last` is the token it was fed (by default `last + 1`, wrapping at `vocab_size`); no tensors, no
    model. Counts steps and releases. Its steps may be launched ahead (async scheduling): a token
    the step in flight drew is fed from that step's draws, as ModelRunner does."""

    supports_async_scheduling = True

    def __init__(self, vocab_size: int = 100, next_token: Callable[[Sequence, int], int] | None = None) -> None:
        self.next_token = next_token or (lambda seq, last: (last + 1) % vocab_size)
        self.num_steps = 0
        self.released: list[Sequence] = []

    def launch(self, scheduled: list[ScheduledSequence], previous: FakeStep | None = None) -> FakeStep:
        self.num_steps += 1
        draws, rows = [], {}
        for s in scheduled:
            if not s.samples:
                continue
            end = s.start + s.num_new_tokens
            last = s.seq.token_ids[end - 1] if end <= len(s.seq.token_ids) else previous.draws[previous.rows[s.seq.seq_id]]
            rows[s.seq.seq_id] = len(draws)
            draws.append(self.next_token(s.seq, last))
        return FakeStep(draws, rows)

    def release(self, seq: Sequence) -> None:
        self.released.append(seq)


class FakeStep:
    """A FakeRunner step: its draws, and each sampling sequence's row in them."""

    def __init__(self, draws: list[int], rows: dict[int, int]) -> None:
        self.draws, self.rows = draws, rows
        self.prompt_logprobs: dict = {}  # a fake computes none

    def result(self) -> SamplerOutput:
        return SamplerOutput(self.draws, [None] * len(self.draws))


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


# -- a chat server without a model (tests/http/test_page.py, test_cors.py) -----------------------


class ScriptedChatEngine:
    """Stands in for AsyncEngine behind a chat server: each reply is the next text of `replies`
    (else `default`), sent a word per delta with `pause` seconds before each; an abort ends it
    as the real engine does (a last output with finish_reason abort). With a `tokenizer` set, a
    request that asks for logprobs gets each word's real token ids, with logprobs and, as
    alternatives, the ids of `alternatives`' texts. One that asks for prompt_logprobs k gets, on its
    first output, made-up ones: each prompt token at -0.5 - position / 100, below its k alternatives
    at -0.25 - j / 100 (`alternatives`' ids with a tokenizer, else the next k ids, modulo 256)."""

    def __init__(self, pause: float = 0.02, default: str = "Hello from the scripted engine.") -> None:
        self.pause, self.default = pause, default
        self.replies: list[str] = []
        self.prompts: list[list[int]] = []  # every request's prompt, in order
        self.aborted: set[str] = set()
        self.num_requests = 0
        self.error = None
        self.is_running = True
        self.tokenizer = None  # a chatd Tokenizer: words become their token ids, logprobs come with them
        self.alternatives: list[str] = []  # texts of one token each, offered as every token's alternatives

    def generate(self, prompt, params, placement=None, cache=None) -> ScriptedReply:
        self.num_requests += 1
        self.prompts.append(list(prompt))
        text = self.replies.pop(0) if self.replies else self.default
        return ScriptedReply(self, f"scripted-{self.num_requests}", prompt, text, params)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def check_structured(self, spec, tenant=None) -> None:
        """Every grammar compiles (the scripted replies follow none)."""

    def stage_times(self) -> dict[str, float]:
        """No engine thread, no steps."""
        return {}

    def compile_state(self) -> str:
        return "off"

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=64, num_free_blocks=64,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_prompt_tokens=0,
                           num_generation_tokens=0)

    def health(self) -> str | None:
        return None


class ScriptedReply:
    """What ScriptedChatEngine.generate returns: AsyncEngine's RequestStream interface over one text."""

    def __init__(self, engine: ScriptedChatEngine, request_id: str, prompt: list[int], text: str, params=None) -> None:
        self.engine, self.request_id, self.prompt, self.text, self.params = engine, request_id, prompt, text, params

    async def __aiter__(self):
        import asyncio
        import re

        from chatd.engine import CompletionOutput, FinishReason, Logprob, RequestOutput

        words = re.split(r"(?<=\s)(?=\S)", self.text)  # each word with the spaces after it
        for i, word in enumerate(words):
            await asyncio.sleep(self.engine.pause)
            if self.request_id in self.engine.aborted:
                yield RequestOutput(self.request_id, self.prompt, [CompletionOutput(0, finish_reason=FinishReason.ABORT)],
                                    finished=True)
                return
            last = i == len(words) - 1
            out = CompletionOutput(0, text=word, token_ids=[7], finish_reason=FinishReason.STOP if last else None)
            if self.engine.tokenizer is not None and self.params is not None and self.params.logprobs is not None:
                out.token_ids = self.engine.tokenizer.encode(word, add_special_tokens=False)
                alternatives = {self.engine.tokenizer.encode(alt, add_special_tokens=False)[0]: -3.0
                                for alt in self.engine.alternatives}
                out.logprobs = [Logprob(t, -0.5, {t: -0.5, **alternatives}) for t in out.token_ids]
            prompt_logprobs = self.prompt_logprobs() if i == 0 else None
            yield RequestOutput(self.request_id, self.prompt, [out], finished=last, prompt_logprobs=prompt_logprobs)

    def prompt_logprobs(self) -> list | None:
        """Made-up prompt logprobs, when the request asks for them (see ScriptedChatEngine)."""
        from chatd.engine import Logprob

        k = self.params.prompt_logprobs if self.params is not None else None
        if k is None:
            return None
        tokenizer = self.engine.tokenizer
        entries = [None][:len(self.prompt)]
        for position, token in enumerate(self.prompt[1:], 1):
            others = ([tokenizer.encode(alt, add_special_tokens=False)[0] for alt in self.engine.alternatives]
                      if tokenizer is not None else [(token + j) % 256 for j in range(1, k + 1)])
            top = {other: -0.25 - j / 100 for j, other in enumerate(others[:k])}
            entries.append(Logprob(token, -0.5 - position / 100, top, rank=len(top) + 1))
        return entries

    def abort(self) -> None:
        self.engine.abort(self.request_id)


async def make_server_state(engine, root, config=None, model_name: str = "scripted", **fields):
    """A ServerState around `engine`, with the demo tokenizer and a real SQLite store made in the
    folder `root`; `close_server_state` ends it."""
    from chatd.engine.models.demo import build_tokenizer
    from chatd.http.server.state import ServerState
    from chatd.store.db import Store
    from chatd.store.ledger import Ledger

    build_tokenizer(root / "tokenizer")
    store = await Store.open(root / "chatd.db")
    ledger = Ledger(store, retry_seconds=1.0)
    ledger.start()
    if config is not None:
        fields["config"] = config
    return ServerState(engine=engine, tokenizer=Tokenizer.from_pretrained(root / "tokenizer"), model=make_model_info(4096),
                       model_name=model_name, store=store, local_tenant=await store.local_tenant("paid"), ledger=ledger, **fields)


async def close_server_state(state) -> None:
    """Let the turns under way finish (cancelled after a few seconds), write what is left, close the store."""
    await state.wait_background(5.0)
    await state.ledger.stop(timeout=5.0)
    await state.store.close()

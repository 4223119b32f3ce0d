"""LLMEngine: add requests, abort them, and step. Synchronous; it knows nothing of asyncio.

A step asks the scheduler for a plan, runs it on the model, then folds the sampled tokens
back into the sequences: detokenize, check stops and lengths, fork `n > 1` choices off the
first one's prompt, free what finished. `LLM` wraps the engine for offline batch use.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import logging
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from chatd.config import Config, config_from_options
from chatd.engine.core.block_manager import BlockManager
from chatd.engine.params import CompletionOutput, FinishReason, Logprob, ParamError, RequestOutput, SamplingParams
from chatd.engine.core.scheduler import Scheduler
from chatd.engine.core.sequence import Sequence, SequenceStatus
from chatd.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("chatd.engine")


@dataclass
class EngineStats:
    """Counters for metrics; totals count since the engine started."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by sequences
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_prompt_tokens: int  # tokens computed in prefill (including recompute after preemption)
    num_generation_tokens: int  # tokens sampled
    num_request_streams: int = 0  # AsyncEngine only: requests whose output stream is still open


@dataclass(eq=False)
class Request:
    """One request: its `n` sequences and their detokenizers. Built (and validated) before it is added."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    waiting_children: list[Sequence] = field(default_factory=list)  # choices 1..n-1 until choice 0 forks them
    num_cached_tokens: int = 0
    queued_at: float = 0.0  # engine clock when added
    queue_time: float | None = None  # seconds from being added to first being scheduled

    @property
    def finished(self) -> bool:
        return not self.waiting_children and all(s.is_finished for s in self.seqs)


class LLMEngine:
    """The synchronous engine: `add_request`, `abort`, `step`."""

    def __init__(
        self,
        runner,  # ModelRunner (or a fake with `execute` and `release` in tests)
        config: Config,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        model_path: str = "",
        is_demo: bool = False,
        clock=time.monotonic,
    ) -> None:
        self.runner = runner
        self.clock = clock
        self.model_path = model_path
        self.is_demo = is_demo
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @classmethod
    def from_config(cls, config: Config) -> LLMEngine:
        """Load the model named in config (the demo model when none is) and build the engine."""
        from chatd.engine.worker.loading import load_engine_parts

        parts = load_engine_parts(config)
        return cls(
            parts.runner,
            config,
            num_blocks=parts.num_blocks,
            max_model_len=parts.max_model_len,
            vocab_size=parts.vocab_size,
            tokenizer=parts.tokenizer,
            eos_token_ids=parts.eos_token_ids,
            model_path=str(parts.model_path),
            is_demo=parts.is_demo,
        )

    # -- requests ---------------------------------------------------------------------------

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        num_shared_prefix_tokens: int = 0,
    ) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).

        `cache_salt` keeps the request's prefix-cache blocks apart from those of other salts,
        except its first `num_shared_prefix_tokens` tokens' full blocks, which anyone may share.
        """
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "prompt must be token ids: this model has no tokenizer")
            prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise ParamError("prompt", "prompt must not be empty")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:  # checked first: it costs nothing however long the prompt
            raise ParamError(
                "prompt",
                f"prompt has {num_prompt} tokens; the context window is {self.max_model_len} tokens "
                "and must leave room for at least one generated token",
            )
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad!r} is out of range [0, {self.vocab_size})")
        bad = next((t for t in params.stop_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ParamError("stop_token_ids", f"stop token id {bad!r} is out of range [0, {self.vocab_size})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"exceeds the context window of {self.max_model_len} tokens",
            )
        blocks = self.block_manager.blocks_needed(num_prompt + max_tokens)
        if blocks > self.block_manager.num_blocks:
            raise ParamError(
                "max_tokens",
                f"prompt + max_tokens = {num_prompt + max_tokens} tokens need {blocks} KV blocks, "
                f"but the KV cache holds only {self.block_manager.num_blocks} blocks",
            )
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        arrival = next(self._arrivals)
        seqs = [
            Sequence(request_id, prompt_token_ids, params, index=i, priority=priority, arrival=arrival,
                     cache_salt=cache_salt, num_shared_prefix_tokens=num_shared_prefix_tokens)
            for i in range(params.n)
        ]
        detokenizers = [self._detokenizer(prompt_token_ids, params) for _ in seqs]
        return Request(request_id, prompt_token_ids, params, seqs, detokenizers, waiting_children=seqs[1:])

    def add_prepared(self, request: Request) -> None:
        """Queue a request built by `prepare_request`."""
        if request.request_id in self.requests:
            raise ParamError("request_id", f"request id {request.request_id!r} is already running")
        request.queued_at = self.clock()
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        num_shared_prefix_tokens: int = 0,
    ) -> None:
        """Validate, tokenize and queue a request. Raises ValueError (naming the field) with nothing allocated."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority, cache_salt, num_shared_prefix_tokens))

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not (or no longer) running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self._finish(seq)
        request.waiting_children.clear()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch and return what each touched request produced in it."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        now = self.clock()
        for scheduled in plan.scheduled:
            request = self.requests[scheduled.seq.request_id]
            if request.queue_time is None:
                request.queue_time = now - request.queued_at
        try:
            sampled = self.runner.execute(plan.scheduled)
        except Exception as exc:  # the model failed: fail this batch's requests, keep serving the rest
            log.exception("step failed; failing %d sequences", len(plan.scheduled))
            failed = {s.seq.request_id for s in plan.scheduled}
            return [self._fail(self.requests[rid], f"engine step failed: {exc}") for rid in failed if rid in self.requests]

        deltas: dict[str, RequestOutput] = {}
        sampled_tokens = iter(zip(sampled.token_ids, sampled.logprobs))
        for scheduled in plan.scheduled:
            seq = scheduled.seq
            samples = scheduled.samples  # read it before the counters move
            if seq.is_prefilling:
                self.num_prompt_tokens += scheduled.num_new_tokens
            seq.num_computed_tokens += scheduled.num_new_tokens
            self.block_manager.cache_blocks(seq)
            if not samples:
                continue
            token_id, logprob = next(sampled_tokens)
            request = self.requests.get(seq.request_id)
            if request is None:  # failed earlier in this loop
                continue
            try:
                delta = self._append(request, seq, token_id, logprob)
            except Exception as exc:  # a bug in output handling fails this request only
                log.exception("request %s failed while handling its output", seq.request_id)
                deltas[seq.request_id] = self._fail(request, f"output processing failed: {exc}")
                continue
            out = deltas.get(seq.request_id)
            if out is None:
                deltas[seq.request_id] = out = RequestOutput(request.request_id, request.prompt_token_ids, [])
            out.outputs.append(delta)
        for request_id, out in deltas.items():
            request = self.requests.get(request_id)
            if request is None:  # failed above
                continue
            out.outputs.sort(key=lambda o: o.index)
            out.num_cached_tokens = request.num_cached_tokens
            out.queue_time = request.queue_time
            out.finished = request.finished
            if out.finished:
                del self.requests[request_id]
        return list(deltas.values())

    def _append(self, request: Request, seq: Sequence, token_id: int, logprob: Logprob | None) -> CompletionOutput:
        """Add a sampled token to a sequence; detokenize, check stops and length; return the delta."""
        self.num_generation_tokens += 1
        seq.append_token(token_id)
        params = seq.params
        if seq.index == 0 and seq.num_output_tokens == 1:
            request.num_cached_tokens = seq.num_cached_tokens
            self._fork_children(request, seq)
        delta = CompletionOutput(seq.index, token_ids=[token_id], logprobs=None if logprob is None else [logprob])
        enough = seq.num_output_tokens >= params.min_tokens
        if enough and token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token_id
        elif enough and not params.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        detokenizer = request.detokenizers[seq.index]
        if detokenizer is not None:
            if seq.finish_reason is None:  # a stop token's own text is not part of the answer
                delta.text, stop_string = detokenizer.step([token_id])
                if stop_string is not None:
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_string
        if seq.finish_reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            if detokenizer is not None and not isinstance(seq.stop_reason, str):
                delta.text += detokenizer.flush()  # release text held back in case a stop string began
            delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
            self._finish(seq)
        return delta

    def _fork_children(self, request: Request, parent: Sequence) -> None:
        """Start choices 1..n-1 sharing the full blocks of choice 0's prompt; each computes only the tail."""
        shared_blocks = (parent.num_prompt_tokens - 1) // self.block_manager.block_size
        for child in request.waiting_children:
            self.block_manager.fork(parent, child, shared_blocks)
            self.scheduler.add(child)
        request.waiting_children = []

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.runner.release(seq)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """End every choice of a request with an error output."""
        self.abort(request.request_id)
        outputs = [CompletionOutput(s.index, finish_reason=FinishReason.ERROR) for s in request.seqs]
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished=True, error=message)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens)

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the counters metrics are made of."""
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    def describe(self) -> dict:
        """Facts about the loaded model and cache, for logs and /v1/models."""
        runner = self.runner
        return {
            "dtype": str(getattr(runner, "dtype", "")).removeprefix("torch."),
            "device": str(getattr(runner, "device", "")),
            "attention_backend": getattr(getattr(runner, "backend", None), "name", ""),
            # Decode batches up to this size replay CUDA graphs; 0 = every step runs eagerly.
            "cuda_graph_max_batch": graphs.max_batch if (graphs := getattr(runner, "graphs", None)) else 0,
            "num_kv_blocks": self.block_manager.num_blocks,
            "block_size": self.block_manager.block_size,
            "max_model_len": self.max_model_len,
            "demo_model": self.is_demo,
        }

    def live_sequences(self) -> list[Sequence]:
        """Every sequence that may hold blocks (for invariant checks)."""
        return [s for r in self.requests.values() for s in r.seqs if s.status != SequenceStatus.FINISHED]


class LLM:
    """Offline batch generation: `LLM(model, **engine_options).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_options) -> None:
        if model is not None:
            engine_options["path"] = str(model)
        self.engine = LLMEngine.from_config(config_from_options(**engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | SequenceOf[str] | SequenceOf[list[int]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        prepared = [self.engine.prepare_request(rid, p, sp) for rid, p, sp in zip(request_ids, prompts, sampling_params)]
        for request in prepared:
            self.engine.add_prepared(request)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id in results:
                    results[out.request_id].merge(out)
                else:
                    results[out.request_id] = out
        return [results[rid] for rid in request_ids]

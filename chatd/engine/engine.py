"""LLMEngine: add requests, abort them, and step. Synchronous; it knows nothing of asyncio.

A step reads as four stages: the scheduler plans the batch (`schedule`), the runner launches
it on the model and samples (`launch`, then `result()` waits for the draws), the scheduler folds
the sampled tokens back into the sequences (`postprocess`: cached blocks, forks, stop tokens and
lengths), and step_outputs.py detokenizes them (text, stop strings) into each request's delta.
The engine talks to the scheduler, never to the block manager. The offline `LLM` wrapper is in llm.py;
what a request must pass to be admitted is request.py, what the engine reports of its model
model_info.py.

Async scheduling (SGLang's overlap scheduler, vLLM's `--async-scheduling`): on a GPU the host
plans and launches step N+1 before it waits for step N, and folds step N's tokens in while the
device runs N+1, so the device never waits for the host's Python between steps. The scheduler
counts a step's tokens when it plans it: a token step N samples is *pending* until N's results
are back, and step N+1 feeds it to the model straight from the device (runner.py). What needs
the token's value on the host to go on sits out step N+1 (core/scheduler.py `_ready_tokens`: a
grammar's next mask, penalties, a length limit the token reaches); what ends a sequence that the
host learns late (EOS, a stop string) costs one discarded token of the step already launched.
Greedy output is the same token for token either way.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from chatd.config import CacheConfig, Config, SchedulerConfig
from chatd.engine.core.block_manager import BlockManager
from chatd.engine.core.scheduler import Scheduler, SchedulerOutput
from chatd.engine.core.sequence import Sequence
from chatd.engine.core.stage_times import StageTimes
from chatd.engine.drain_rate import DrainRate
from chatd.engine.engine_reports import EngineReports
from chatd.engine.params import (
    CacheScope,
    CompletionOutput,
    FinishReason,
    ParamError,
    Placement,
    RequestOutput,
    SamplingParams,
)
from chatd.engine.request import Request, checked_params
from chatd.engine.step_outputs import step_outputs
from chatd.engine.structured.grammar import GrammarCompiler
from chatd.engine.structured.spec import StructuredOutput
from chatd.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("chatd.engine")

# How long an engine with nothing to run but sequences waiting for grammar masks sleeps before
# looking again (a mask that is ready wakes it sooner).
IDLE_MASK_WAIT_SECONDS = 0.01


def _async_scheduling(setting: str, runner) -> bool:
    """Whether steps are launched ahead: "on" where the runner can, "auto" where it can on a GPU."""
    if setting == "off" or not getattr(runner, "supports_async_scheduling", False):
        return False
    return setting == "on" or str(getattr(runner, "device", "cpu")).startswith("cuda")


@dataclass
class InFlight:
    """A launched step: its plan, the runner's handle, and what the drain rate needs of it."""

    plan: SchedulerOutput
    handle: object  # the runner's StepHandle: `.result()` waits for its draws; `.prompt_logprobs` by sequence
    started: float  # engine clock at launch
    queued: bool  # requests were left waiting when it was planned


class LLMEngine(EngineReports):
    """The synchronous engine: `add_request`, `abort`, `step`. What it reports (stats, model_info,
    stage_times, compile_state, health) is engine_reports.py's."""

    def __init__(
        self,
        runner,  # ModelRunner (or a fake with `execute` and `release` in tests)
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        model_path: str | Path = "",
        is_demo: bool = False,
        sampling_defaults: Mapping[str, float] | None = None,
        clock=time.monotonic,
        num_host_blocks: int = 0,
        compile_job=None,  # worker/fast_steps/compile_job.py: the runner's steps compiling on a thread, or None
        speculator=None,  # speculative/: proposes tokens for decoding sequences to verify, or None
    ) -> None:
        self.runner = runner
        self.compile_job = compile_job
        self.clock = clock
        self.model_path = str(model_path)
        self.is_demo = is_demo
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        block_manager = BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                     num_host_blocks)
        self.scheduler = Scheduler(scheduler_config, block_manager, max_model_len, eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.drain_rate = DrainRate()
        self.speculator = speculator  # a verify step's kept tokens are known once it is back: no steps launched ahead
        self.async_scheduling = speculator is None and _async_scheduling(scheduler_config.async_scheduling, runner)
        self.in_flight: InFlight | None = None  # async scheduling: the step launched and not yet waited for
        self.times = StageTimes()  # schedule, wait, postprocess, detokenize (the runner times its own)

    @classmethod
    def from_config(cls, config: Config, background_compile: bool = False) -> LLMEngine:
        """Load the model named in config (the demo model when none is) and build the engine.
        `background_compile`: on CPU, serve eagerly while the steps compile on a thread (`chatd serve`)."""
        from chatd.engine.loading import load_engine_parts

        parts = load_engine_parts(config, background_compile)
        return cls(scheduler_config=config.scheduler, cache_config=config.cache, **vars(parts))

    # -- requests ---------------------------------------------------------------------------

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        placement: Placement = Placement(), cache: CacheScope = CacheScope()) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread).
        `placement`: its class and fair share; `cache`: which prefix-cache blocks it may share."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "prompt must be token ids: this model has no tokenizer")
            prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            prompt_token_ids = list(prompt)
        params = checked_params(prompt_token_ids, params, self.max_model_len, self.vocab_size, self.scheduler)
        arrival = next(self._arrivals)
        seqs = [
            Sequence(request_id, prompt_token_ids, params, index=i, priority=placement.priority, arrival=arrival,
                     cache_salt=cache.salt, num_shared_prefix_tokens=cache.shared_prefix_tokens,
                     tenant=placement.tenant, weight=placement.weight)
            for i in range(params.n)
        ]
        if params.structured is not None:
            for seq in seqs:  # each choice walks its own copy of its tenant's compiled grammar
                seq.grammar = self.grammars.matcher(params.structured, scope=placement.tenant)
        seqs[0].forks = seqs[1:]
        detokenizers = [self._detokenizer(prompt_token_ids, params) for _ in seqs]
        return Request(request_id, prompt_token_ids, params, seqs, detokenizers, placement, cache)

    def check_structured(self, spec: StructuredOutput, tenant: str | None = None) -> None:
        """Compile a structured-output spec for a tenant's request now; ParamError (naming
        spec.param) if it cannot be. Cached per tenant, and safe from any thread: a server calls it
        off its event loop (a big schema can take a while), and the request's own compile is then a copy."""
        spec.validate()
        self.grammars.check(spec, scope=tenant)

    def default_params(self, **fields) -> SamplingParams:
        """SamplingParams with the model's recommended sampling, then `fields` (None leaves one as recommended)."""
        recommended = {name: int(value) if name == "top_k" else value for name, value in self.sampling_defaults.items()}
        return SamplingParams(**{**recommended, **{name: value for name, value in fields.items() if value is not None}})

    def add_prepared(self, request: Request) -> None:
        """Queue a request built by `prepare_request`."""
        if request.request_id in self.requests:
            raise ParamError("request_id", f"request id {request.request_id!r} is already running")
        request.queued_at = self.clock()
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])
        if request.params.structured is not None:
            self.grammars.masks.compute(seq.grammar for seq in request.seqs)  # their first masks

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    placement: Placement = Placement(), cache: CacheScope = CacheScope()) -> None:
        """Validate, tokenize and queue a request. Raises ValueError (naming the field) with nothing allocated."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, placement, cache))

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not (or no longer) running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.seqs[0].forks = []  # choices not forked yet never start
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self._finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests are running, or a step's results are still to be folded in."""
        return bool(self.requests) or self.in_flight is not None

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan and launch one batch and return what each touched request produced: in this step,
        or with async scheduling, in the step launched before it (which this one overlaps)."""
        self.grammars.masks.wait()  # a few milliseconds at most: a slow grammar's rows sit this step out
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.times.since("schedule", started)
        self.times.steps += 1
        if plan.kv_copies:
            self.runner.copy_kv(plan.kv_copies)
        previous, self.in_flight = self.in_flight, None
        outputs: list[RequestOutput] = []
        launched = None
        if not plan.is_empty:
            launched, failed = self._launch(plan, previous)
            outputs += failed
        elif previous is None:
            if self.scheduler.waiting_for_masks():
                self.grammars.masks.wait_any(IDLE_MASK_WAIT_SECONDS)  # nothing else to run: do not spin
            return []
        if self.async_scheduling:  # the device runs the new step while the last one's tokens are handled
            launched, previous = previous, launched
            self.in_flight = previous
        if launched is not None:
            outputs = self._complete(launched) + outputs
        return outputs

    def _launch(self, plan: SchedulerOutput, previous: InFlight | None) -> tuple[InFlight | None, list[RequestOutput]]:
        """Start a planned step (after `previous`, whose draws it may feed on); or fail its requests."""
        self._note_queue_times(plan)
        started, queued = self.clock(), self.scheduler.num_waiting > 0
        try:
            handle = self.runner.launch(plan.scheduled, previous.handle if previous is not None else None)
        except Exception as exc:  # the model failed: fail this batch's requests, keep serving the rest
            return None, self._fail_step(plan, exc)
        return InFlight(plan, handle, started, queued), []

    def _complete(self, step: InFlight) -> list[RequestOutput]:
        """Wait for a launched step's draws, fold them in, and detokenize them."""
        started = time.perf_counter()
        try:
            sampled = step.handle.result()
        except Exception as exc:
            return self._fail_step(step.plan, exc)
        started = self.times.since("wait", started)
        if step.queued:  # requests were left waiting: this step ran at the pace the queue drains
            self.drain_rate.note(step.plan.num_prefill_tokens, self.clock() - step.started)
        for seq_id, (first, logprobs) in step.handle.prompt_logprobs.items():  # (SamplingParams.prompt_logprobs)
            seq = next(s.seq for s in step.plan.scheduled if s.seq.seq_id == seq_id)
            if seq.prompt_logprobs is not None and first == len(seq.prompt_logprobs):
                seq.prompt_logprobs.extend(logprobs)
        seqs = self.scheduler.postprocess(step.plan, sampled.token_ids)
        if self.speculator is not None:  # what the step cost; guesses for the next (before grammars' mask jobs)
            self.speculator.observe(step.plan, self.clock() - step.started)
            self.runner.keep_draws(seqs)
            self.speculator.propose([s for s, _ in seqs if not s.is_finished], self.scheduler.num_running)
        # The next masks, computed while this step's tokens are detokenized.
        self.grammars.masks.compute(s.grammar for s, _ in seqs if s.grammar is not None and not s.is_finished)
        started = self.times.since("postprocess", started)
        outputs = step_outputs(self, seqs, sampled.token_ids, sampled.logprobs)
        self.times.since("detokenize", started)
        return outputs

    def _fail_step(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        log.error("step failed; failing %d sequences", len(plan.scheduled), exc_info=exc)
        failed = {s.seq.request_id for s in plan.scheduled}
        return [self.fail(self.requests[rid], f"engine step failed: {exc}") for rid in failed if rid in self.requests]

    def _note_queue_times(self, plan: SchedulerOutput) -> None:
        now = self.clock()
        for scheduled in plan.scheduled:
            request = self.requests[scheduled.seq.request_id]
            if request.queue_time is None:
                request.queue_time = now - request.queued_at

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def fail(self, request: Request, message: str, param: str | None = None) -> RequestOutput:
        """End every choice of a request with an error output (`param`: the field at fault, if the request's)."""
        self.abort(request.request_id)
        outputs = [CompletionOutput(s.index, finish_reason=FinishReason.ERROR) for s in request.seqs]
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished=True, error=message,
                             error_param=param)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens)

    def close(self) -> None:
        """Stop what the runner started (tensor-parallel workers) and the grammar threads; the engine serves no more."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        self.grammars.close()


"""A step's sampled tokens as each request's delta (`RequestOutput`): the text its detokenizer
makes of them (held back while a stop string may be starting, cut where one is found), the
finish, logprobs, and the request leaving the engine once its last choice has ended.

LLMEngine._complete calls `step_outputs` once the scheduler has folded the step's tokens in
(postprocess). It runs for every sequence of every step: a decode step's one token of a one-choice
request with no stop strings and no logprobs (most of them) takes a short path; anything else
(a finish, stop strings, logprobs, several choices or tokens) the general one.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from chatd.engine.core.scheduler import Scheduler
from chatd.engine.core.sequence import Sequence
from chatd.engine.params import CompletionOutput, FinishReason, Logprob, RequestOutput
from chatd.engine.request import Request

log = logging.getLogger("chatd.engine")


class LLMEngine(Protocol):
    """What this module reads of the engine (engine.py's LLMEngine)."""

    requests: dict[str, Request]
    scheduler: Scheduler
    runner: Any  # releases a finished sequence's draws
    speculator: Any  # None while speculative decoding is off

    def fail(self, request: Request, message: str, param: str | None = None) -> RequestOutput: ...


class GrammarFailed(Exception):
    """A sequence's grammar failed mid-reply (it reached a parser limit): the request's fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def step_outputs(engine: LLMEngine, seqs: list[tuple[Sequence, range]], token_ids: list[int],
                 logprobs: list[Logprob | None]) -> list[RequestOutput]:
    """Each request's delta from its sequences' new tokens (each sequence with the rows of its
    tokens: more than one after a verify step); requests that ended leave the engine."""
    requests = engine.requests
    speculating = engine.speculator is not None
    outputs: list[RequestOutput] = []
    deltas: dict[str, RequestOutput] = {}  # the general path's, by request: its choices gathered
    for seq, rows in seqs:
        request = requests.get(seq.request_id)
        if request is None:  # failed earlier in this loop
            continue
        if len(rows) == 1 and seq.finish_reason is None and len(request.seqs) == 1 and seq.prompt_logprobs is None:
            row = rows.start
            detokenizer = request.detokenizers[0]
            if logprobs[row] is None and (detokenizer is None or detokenizer.plain):
                token_id = token_ids[row]
                text = detokenizer.step_plain(token_id) if detokenizer is not None else ""
                if len(seq.output_token_ids) == 1:  # its first token: the prompt's cached part is known now
                    request.num_cached_tokens = seq.num_cached_tokens
                drafted, accepted = request.guesses() if speculating else (0, 0)
                outputs.append(RequestOutput(
                    request.request_id, request.prompt_token_ids, [CompletionOutput(0, text, [token_id])],
                    num_cached_tokens=request.num_cached_tokens, queue_time=request.queue_time,
                    num_draft_tokens=drafted, num_accepted_tokens=accepted))
                continue
        try:
            delta = _delta(engine, request, seq, [token_ids[r] for r in rows], [logprobs[r] for r in rows])
        except GrammarFailed as exc:  # the client's grammar, not a bug: the client hears which field
            log.warning("request %s: %s", seq.request_id, exc.message)
            deltas[seq.request_id] = engine.fail(request, exc.message, exc.param)
            continue
        except Exception as exc:  # a bug in output handling fails this request only
            log.exception("request %s failed while handling its output", seq.request_id)
            deltas[seq.request_id] = engine.fail(request, f"output processing failed: {exc}")
            continue
        out = deltas.get(seq.request_id)
        if out is None:
            deltas[seq.request_id] = out = RequestOutput(request.request_id, request.prompt_token_ids, [])
        if seq.prompt_logprobs is not None and len(seq.output_token_ids) == len(rows):  # its first tokens
            out.prompt_logprobs = seq.prompt_logprobs
        out.outputs.append(delta)
    for request_id, out in deltas.items():
        request = requests.get(request_id)
        if request is None:  # failed above
            outputs.append(out)
            continue
        if len(out.outputs) > 1:
            out.outputs.sort(key=lambda o: o.index)
        out.num_cached_tokens = request.num_cached_tokens
        out.queue_time = request.queue_time
        out.num_draft_tokens, out.num_accepted_tokens = request.guesses()
        # A request ends with the step that ends its last choice.
        out.finished = any(o.finish_reason is not None for o in out.outputs) and request.finished
        if out.finished:
            del requests[request_id]
        outputs.append(out)
    return outputs


def _delta(engine: LLMEngine, request: Request, seq: Sequence, token_ids: list[int],
           logprobs: list[Logprob | None]) -> CompletionOutput:
    """A sequence's new tokens as a delta: their text (held back while a stop string may be
    starting), and the end. A stop string ends it at its last token: any kept after it are dropped."""
    if seq.index == 0 and len(seq.output_token_ids) == len(token_ids):
        request.num_cached_tokens = seq.num_cached_tokens
    if seq.finish_reason == FinishReason.ERROR:  # only a failed grammar ends a sequence so: fail the request
        engine.runner.release(seq)
        raise GrammarFailed(seq.params.structured.param, seq.grammar.error or "structured output could not be followed")
    delta = CompletionOutput(seq.index, token_ids=[], logprobs=None if logprobs[0] is None else [])
    detokenizer = request.detokenizers[seq.index]
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        delta.token_ids.append(token_id)
        if delta.logprobs is not None:
            delta.logprobs.append(logprob)
        # A stop token's own text is not part of the answer (a grammar's last token is).
        stopped_by_token = i == len(token_ids) - 1 and seq.finish_reason == FinishReason.STOP and (
            token_id in engine.scheduler.eos_token_ids or token_id in seq.params.stop_token_ids)
        if detokenizer is not None and not stopped_by_token:
            text, stop_string = detokenizer.step([token_id])
            delta.text += text
            if stop_string is not None:  # wins over a length limit reached by the same token
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_string
                if not seq.is_finished:
                    engine.scheduler.finish(seq)
                break
    if seq.finish_reason is not None:
        if detokenizer is not None and not isinstance(seq.stop_reason, str):
            delta.text += detokenizer.flush()  # release text held back in case a stop string began
        delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
        engine.runner.release(seq)
        if engine.speculator is not None:
            engine.speculator.release(seq)
    return delta

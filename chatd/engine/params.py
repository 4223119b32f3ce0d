"""What a request asks for and what the engine answers: SamplingParams, Placement, CacheScope, RequestOutput.
(A request's grammar, StructuredOutput, is structured/spec.py's.)

Plain dataclasses with no torch, shared by every layer above the runner. Validation lives
here so that a bad value is refused, with the field and the limit named, before anything
is allocated. It imports nothing of chatd: it is the bottom rung of the engine's import ladder,
below core, because every layer speaks it (tests/test_layout.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16


class FinishReason(str, enum.Enum):
    """Why a sequence ended. `stop` covers EOS, stop token ids and stop strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    CONTENT_FILTER = "content_filter"  # never the engine's: a server's output check ended it


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI's fields plus top_k, min_p, repetition_penalty)."""

    n: int = 1
    max_tokens: int | None = 16  # None = up to the context window
    min_tokens: int = 0  # EOS and stop token ids are ignored until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k = the sampled token's plus top-k alternatives
    # None = none; k = each prompt token's logprob (the first's is None) plus top-k alternatives,
    # computed in the prefill: such a request reads nothing from the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # The grammar the output must follow: a StructuredOutput (structured/spec.py); None = free text.
    structured: Any = None

    def __post_init__(self) -> None:
        # Accept lists and a single stop string from callers; store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit for any out-of-range value."""
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature!r}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", "stop strings must be non-empty strings")
        if self.logprobs is not None:
            _check(isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            _check(isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                   f"must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.structured is not None:
            self.structured.validate()


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ParamError(field_name, f"{field_name} {message}")


@dataclass(frozen=True)
class Placement:
    """Where a request goes among the others: its class (`priority`, lower first) and whose fair
    share of the batch it uses within its class (`tenant`, at `weight`: core/fairness.py)."""

    priority: int = 0
    tenant: str | None = None
    weight: float = 1.0


@dataclass(frozen=True)
class CacheScope:
    """Which prefix-cache blocks a request may share. With a `salt` its blocks are only found by
    requests with the same salt, except its first `shared_prefix_tokens` tokens' full blocks,
    which anyone may share (a system prompt every tenant uses). No salt: shared with everyone."""

    salt: str | None = None
    shared_prefix_tokens: int = 0


class ParamError(ValueError):
    """A request value out of range. `param` names the field, as OpenAI's error shape wants."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class LimitError(ParamError):
    """A prompt, or a prompt with its reply's length, that the model or the KV pool cannot take.

    `param` is "prompt" or "max_tokens". `says(prompt, max_tokens)` is the message with those
    two fields named as the caller's client named them (a server's `messages`, `prompt[3]`,
    `max_completion_tokens`); str() names them `prompt` and `max_tokens`. `context_exceeded`:
    the prompt alone fills the context window.
    """

    def __init__(self, param: str, says: Callable[[str, str], str], context_exceeded: bool = False) -> None:
        super().__init__(param, says("prompt", "max_tokens"))
        self.says, self.context_exceeded = says, context_exceeded


@dataclass
class Logprob:
    """One sampled token's log-probability and its top alternatives ({token_id: logprob})."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None  # its place in the distribution, 1 = the likeliest (prompt tokens; None where not computed)


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request. In a step's output it holds only what is new since the last step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput) -> None:
        """Fold a later delta of the same choice into this one."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.stop_reason = later.stop_reason


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: per-choice deltas, or the whole when merged."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the engine failed this request
    # The request field the error is about, when the request itself caused it (a grammar that
    # could not be followed within the server's limits): the client's error (400), not the server's.
    error_param: str | None = None
    queue_time: float | None = None  # seconds from being added until first scheduled
    # Speculative decoding, over the request so far: tokens proposed and verified, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: one per prompt token (the first None), on the request's first output.
    prompt_logprobs: list[Logprob | None] | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one (used by streams and LLM)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if len(self.outputs) == len(later.outputs) == 1 and self.outputs[0].index == later.outputs[0].index:
            self.outputs[0].merge(later.outputs[0])  # one choice (most requests): a token's worth of work
        else:
            by_index = {o.index: o for o in self.outputs}
            for out in later.outputs:
                if out.index in by_index:
                    by_index[out.index].merge(out)
                else:
                    self.outputs.append(out)
                    by_index[out.index] = out
            self.outputs.sort(key=lambda o: o.index)
        self.finished = later.finished
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.num_draft_tokens = max(self.num_draft_tokens, later.num_draft_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, later.num_accepted_tokens)
        self.error = later.error or self.error
        self.error_param = later.error_param or self.error_param
        if self.queue_time is None:
            self.queue_time = later.queue_time

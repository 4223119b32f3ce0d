"""Constrained decoding: a request's StructuredOutput becomes a grammar, and each step's token mask.

The grammar work is llguidance's (Microsoft's Rust parser for JSON schema, regex and Lark
grammars; no dependencies, a 3 MB wheel). chatd picked it over xgrammar by measurement
(docs/design.md, benchmarks/README.md): masks cost about the same (12-56 us a token with a 49k
vocabulary on the 2-core machine, either library ahead depending on the schema), but llguidance
builds its parser lazily, so a schema is ready in 1-2 ms where xgrammar's ahead-of-time compile
took 9 ms to 1.4 s, and xgrammar would pull triton (~150 MB) into CPU installs.

How it runs, per sequence: the engine gives each sequence that asks for structured output a
`GrammarMatcher` at admission (a copy of the cached compiled grammar); before sampling, the
sampler asks the matchers of the constrained rows for their masks (`fill_masks`, one call for
the batch, in parallel threads) and keeps only allowed tokens; after sampling, the scheduler
feeds each sampled token to its matcher. Rows without a grammar are never touched.

No torch here: masks are numpy bit arrays (bit t of row r set = token t allowed), which the
sampler moves to the logits' device.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import numpy as np

from chatd.engine.params import ParamError, StructuredOutput
from chatd.engine.tokenizer import Tokenizer

# How many compiled grammars are kept (LRU). A hit costs a copy (~1 us) instead of a compile.
CACHE_SIZE = 256

# JSON is written compactly but as people and models write it: ", " and ": ", no newlines.
# Free whitespace would let a weak model pad forever between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarMatcher:
    """One sequence's position in its grammar: which tokens may come next, and whether it is done."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher  # an llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it (the matcher is then failed)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """Nothing may follow (but an end-of-sequence token): the output is complete."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed ("" while it has not), in a few lines: llguidance's own message
        dumps the parser state and the grammar."""
        return _first_lines(self._matcher.get_error())


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer, with a cache of compiled grammars. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width); the tokenizer's may be smaller
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on first use: ~0.4 s for a 49k vocabulary
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A matcher at the start of `spec`'s grammar. ParamError (naming spec.param) if it cannot compile."""
        return GrammarMatcher(self._compiled(spec).deep_copy())

    def check(self, spec: StructuredOutput) -> None:
        """Compile `spec` now (and cache it), so that a later `matcher` is a copy. ParamError if it cannot."""
        self._compiled(spec)

    def _compiled(self, spec: StructuredOutput):
        import llguidance

        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                return compiled
            tokenizer = self._llg_tokenizer()
        grammar = _grammar_text(spec)
        # Construction can take long for a huge grammar; it drops the GIL, and runs outside the lock.
        limits = _limits(llguidance)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error:
            raise ParamError(spec.param, f"{spec.param} cannot be compiled: {_first_lines(error)}")
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if compiled.is_error():
            raise ParamError(spec.param, f"{spec.param} cannot be compiled: {_first_lines(compiled.get_error())}")
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _llg_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer.hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer


def _limits(llguidance):
    """Bounds on what one client's grammar may cost everyone: its lexer's memory (~1-2 kB a state;
    llguidance allows 250,000 states, up to ~500 MB) and its mask time per token (the fuel runs at
    ~14k a ms, so ~7 ms at most where llguidance's default allows ~14 ms), since the whole batch
    waits for every row's mask. A grammar past them fails to compile (a 400), or its matcher fails
    mid-reply and the scheduler ends that sequence (finish reason error, logged)."""
    return llguidance.LLParserLimits(max_lexer_states=20_000, step_lexer_fuel=100_000)


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec (its syntax is checked when it is compiled)."""
    from llguidance import LLMatcher

    if spec.json_schema is not None:
        try:
            schema = json.loads(spec.json_schema)
        except ValueError as exc:
            raise ParamError(spec.param, f"{spec.param} json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ParamError(spec.param, f"{spec.param} json_schema must be a JSON object")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return LLMatcher.grammar_from_lark(spec.grammar)


def _first_lines(error: str, limit: int = 4) -> str:
    # llguidance's errors carry a caret diagram and sometimes the parser state; keep the head.
    lines = [line for line in error.strip().splitlines() if line.strip()]
    text = "; ".join(re.sub(r"\s+", " ", line).strip() for line in lines[:limit])
    return text[:500]


def mask_words(vocab_size: int) -> int:
    """32-bit words per row of a token mask."""
    return (vocab_size + 31) // 32


def fill_masks(matchers: list[GrammarMatcher], vocab_size: int) -> np.ndarray:
    """The next-token masks of these matchers, one row each: uint32 [len(matchers), words]."""
    import llguidance

    masks = np.zeros((len(matchers), mask_words(vocab_size)), dtype=np.uint32)
    row_bytes = masks.shape[1] * 4
    if len(matchers) == 1:
        matchers[0]._matcher.unsafe_compute_mask_ptr(masks.ctypes.data, row_bytes)
    else:
        _executor(llguidance).unsafe_compute_mask_ptr(
            [(m._matcher, i) for i, m in enumerate(matchers)], masks.ctypes.data, row_bytes, len(matchers))
    return masks


_executor_instance = None


def _executor(llguidance):
    # One pool of mask threads for the process (llguidance sizes it to the machine's cores).
    global _executor_instance
    if _executor_instance is None:
        _executor_instance = llguidance.LLExecutor()
    return _executor_instance

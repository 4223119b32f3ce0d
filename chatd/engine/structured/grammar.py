"""Constrained decoding: a request's StructuredOutput becomes a grammar, and each step's token mask.

The grammar work is llguidance's (Microsoft's Rust parser for JSON schema, regex and Lark
grammars; no dependencies, a 3 MB wheel). chatd picked it over xgrammar by measurement
(docs/design.md, benchmarks/README.md): masks cost about the same (12-56 us a token with a 49k
vocabulary on the 2-core machine, either library ahead depending on the schema), but llguidance
builds its parser lazily, so a schema is ready in 1-2 ms where xgrammar's ahead-of-time compile
took 9 ms to 1.4 s, and xgrammar would pull triton (~150 MB) into CPU installs.

How it runs, per sequence: the engine gives each sequence that asks for structured output a
`GrammarMatcher` at admission (a copy of the cached compiled grammar). Its next-token mask is
computed ahead, off the engine thread, by `MaskWorkers`: the engine hands them every matcher that
needs one after a step, and before the next step waits for them a few milliseconds at most. A
sequence whose mask is not ready is not sampled in that step (the scheduler computes all but its
last token), so one client's expensive grammar slows its own reply, never the batch. Grammars
whose masks cost more than `SLOW_MASK_SECONDS` a row move to a slow lane that may use only part
of one core. After sampling, the scheduler feeds each sampled token to its matcher.

Hostile grammars, and what bounds them: compiling runs in threads with a large stack (llguidance
recurses over deep chains of rules or `$ref`s, which overflowed an ordinary thread's stack and
crashed the process), under llguidance's own limits (`_limits`); a new grammar is then probed
(two masks and a token) so that most grammars that would fail later are a 400 now; and llguidance
keeps one lexer per compiled grammar, shared by its copies, whose failure is permanent, so a
grammar that fails is dropped from the cache and remembered as failed: it is never served as
valid again.

This module compiles, probes and caches grammars, and bounds what they may cost. A sequence's
matcher is core/grammar_matcher.py (core's scheduler and the worker's sampler both use it); the
threads that compile and compute masks ahead are grammar_threads.py.

No torch here: masks are numpy bit arrays (bit t of row r set = token t allowed), which the
sampler moves to the logits' device.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

from chatd.engine.core.grammar_matcher import CompiledGrammar, GrammarMatcher, failure_message, first_lines, mask_words
from chatd.engine.structured.grammar_threads import SLOW_MASK_SECONDS, GrammarThreads, MaskWorkers
from chatd.engine.params import ParamError
from chatd.engine.structured.spec import StructuredOutput
from chatd.engine.tokenizer import Tokenizer

log = logging.getLogger("chatd.engine")

# How many compiled grammars are kept (LRU). A hit costs a copy (~1 us) instead of a compile.
CACHE_SIZE = 256
# How many grammars that failed are remembered, so that sending one again is refused at once.
FAILED_CACHE_SIZE = 1024

# JSON is written compactly but as people and models write it: ", " and ": ", no newlines.
# Free whitespace would let a weak model pad forever between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The most times a regex (or a Lark grammar) may repeat something by count (`a{10000}`). A mask's
# cost grows with it: `a{10000}` takes ~3 ms a token on the 2-core machine, `a{100000}` ~25 ms.
MAX_REPEAT = 10_000
_REGEX_COUNT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # {n}, {n,}, {n,m}
_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # item ~ n, item ~ n..m


def compile_message(param: str, reason: str) -> str:
    """What a client is told when its grammar does not compile."""
    return f"{param} cannot be compiled: {reason}"


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer, with a cache of compiled grammars. Thread-safe.

    Grammars are cached per scope (the tenant, where tenants are kept apart): one tenant's
    grammar never shares a lexer, its cost or its failure with another's, and how fast a schema
    compiles tells nobody whether someone else sent it."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer  # None: the model has none, and every grammar is refused
        self.vocab_size = vocab_size  # the model's (logits width); the tokenizer's may be smaller
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on first use: ~0.4 s for a 49k vocabulary
        self._cache: OrderedDict[Hashable, CompiledGrammar] = OrderedDict()
        # key -> how it failed: the message builder (compile_message or failure_message) and the reason
        self._failed: OrderedDict[Hashable, tuple[Callable[[str, str], str], str]] = OrderedDict()
        self._lock = threading.Lock()
        self._compiling = GrammarThreads(2, "chatd-grammar-compile")
        self.masks = MaskWorkers(mask_words(vocab_size))

    def matcher(self, spec: StructuredOutput, scope: str | None = None) -> GrammarMatcher:
        """A matcher at the start of `spec`'s grammar. ParamError (naming spec.param) if it cannot compile."""
        return GrammarMatcher(self._compiled(spec, scope), self._forget)

    def check(self, spec: StructuredOutput, scope: str | None = None) -> None:
        """Compile and probe `spec` now (and cache it), so that a later `matcher` is a copy. ParamError if it cannot."""
        self._compiled(spec, scope)

    def close(self) -> None:
        """Stop the threads (the engine is closing)."""
        self._compiling.close()
        self.masks.close()

    def _compiled(self, spec: StructuredOutput, scope: str | None) -> CompiledGrammar:
        if self.tokenizer is None:
            raise ParamError(spec.param, f"{spec.param} needs a tokenizer, and this model has none")
        key = (scope, spec.key)
        with self._lock:
            failed = self._failed.get(key)
            if failed is not None:
                message, reason = failed
                raise ParamError(spec.param, message(spec.param, reason))
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        tokenizer = self._llg_tokenizer()
        try:
            # Construction can take long for a huge grammar; it drops the GIL, and runs outside the lock.
            grammar = self._compiling.run(
                lambda: _compile_and_probe(key, spec, tokenizer, self.masks.words, self.eos_token_ids))
        except _Refused as refused:
            with self._lock:
                self._remember_failure(key, refused.message, refused.reason)
            raise ParamError(spec.param, refused.message(spec.param, refused.reason)) from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _forget(self, grammar: CompiledGrammar, reason: str) -> None:
        """A grammar failed: no new request may use it (its copies in flight fail: they share its lexer)."""
        with self._lock:
            if grammar.error:
                return
            grammar.error = reason or "its parser reached a limit"
            if self._cache.get(grammar.key) is grammar:
                del self._cache[grammar.key]
            self._remember_failure(grammar.key, failure_message, grammar.error)
        log.warning("a grammar failed and was dropped from the cache: %s", grammar.error)

    def _remember_failure(self, key: Hashable, message: Callable[[str, str], str], reason: str) -> None:
        self._failed[key] = (message, reason)
        while len(self._failed) > FAILED_CACHE_SIZE:
            self._failed.popitem(last=False)

    def _llg_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer.hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer


class _Refused(Exception):
    """A grammar refused while compiling or probing: how to word it, and why."""

    def __init__(self, message: Callable[[str, str], str], reason: str) -> None:
        super().__init__(reason)
        self.message, self.reason = message, reason


def _compile_and_probe(key: Hashable, spec: StructuredOutput, tokenizer, words: int, eos_token_ids: list[int]) -> CompiledGrammar:
    """Compile a spec and try its first two masks and a token on a copy: a grammar that fails
    there is refused now (_Refused), before any request uses it, and one whose masks are slow
    starts in the slow lane."""
    import llguidance

    try:
        grammar_text = _grammar_text(spec)
    except ParamError as exc:
        raise _Refused(lambda param, reason: reason.replace(spec.param, param, 1), str(exc)) from None
    limits = _limits(llguidance)
    error = llguidance.LLMatcher.validate_grammar(grammar_text, tokenizer, limits=limits)
    if error:
        raise _Refused(compile_message, first_lines(error))
    compiled = llguidance.LLMatcher(tokenizer, grammar_text, log_level=0, limits=limits)
    if compiled.is_error():
        raise _Refused(compile_message, first_lines(compiled.get_error()))
    grammar = CompiledGrammar(key, spec.param, compiled)
    probe = compiled.deep_copy()
    for step in range(2):
        mask = np.zeros(words, dtype=np.uint32)
        started = time.perf_counter()
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        seconds = time.perf_counter() - started  # the first mask builds lexer states: the second tells more
        allowed = _first_allowed(mask, exclude=eos_token_ids)
        if not probe.is_error() and step == 0 and allowed is not None:
            probe.consume_token(allowed)
        if probe.is_error():
            raise _Refused(failure_message, first_lines(probe.get_error(), 1))
        if allowed is None or step == 1:
            grammar.slow = seconds > SLOW_MASK_SECONDS
            break
    return grammar


def _first_allowed(mask: np.ndarray, exclude: list[int]) -> int | None:
    """The lowest token id a mask allows, other than those in `exclude`; None if there is none."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    bits[[t for t in exclude if 0 <= t < len(bits)]] = 0
    allowed = np.flatnonzero(bits)
    return int(allowed[0]) if len(allowed) else None


def _limits(llguidance):
    """Bounds on what one client's grammar may cost everyone: its lexer's memory (~1-2 kB a state;
    llguidance allows 250,000 states, up to ~500 MB) and its mask time per token (the fuel runs at
    ~14k a ms, so ~7 ms at most where llguidance's default allows ~14 ms). Fuel does not count all
    the work (a mask of `a{100000}` takes ~25 ms): what it misses, the slow lane bounds. A grammar
    past them fails to compile (a 400), or its matcher fails mid-reply and the request ends with
    an error that names the field."""
    return llguidance.LLParserLimits(max_lexer_states=20_000, step_lexer_fuel=100_000)


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec (its syntax is checked when it is compiled)."""
    from llguidance import LLMatcher

    if spec.json_schema is not None:
        try:
            schema = json.loads(spec.json_schema)
        except (ValueError, RecursionError) as exc:
            raise ParamError(spec.param, f"{spec.param} json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ParamError(spec.param, f"{spec.param} json_schema must be a JSON object")
        for pattern in _patterns(schema):
            _check_repeats(pattern, _REGEX_COUNT, spec.param, "a pattern")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        _check_repeats(spec.regex, _REGEX_COUNT, spec.param, "the regex")
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    _check_repeats(spec.grammar, _REGEX_COUNT, spec.param, "the grammar")
    _check_repeats(spec.grammar, _LARK_COUNT, spec.param, "the grammar")
    return LLMatcher.grammar_from_lark(spec.grammar)


def _check_repeats(text: str, counts: re.Pattern, param: str, what: str) -> None:
    """ParamError naming `param` when a counted repetition in `text` goes past MAX_REPEAT (read from
    the text alone, before compiling: a count inside a string literal counts too)."""
    for found in counts.finditer(text):
        count = max(int(n) for n in found.groups() if n)
        if count > MAX_REPEAT:
            raise ParamError(param, f"{param}: {what} repeats something {count} times ({found.group()}); "
                                    f"the limit is {MAX_REPEAT}")


def _patterns(schema) -> list[str]:
    """Every regex in a JSON schema (`pattern` values and `patternProperties` keys), found without recursion."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found += list(node["patternProperties"])
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return found

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

No torch here: masks are numpy bit arrays (bit t of row r set = token t allowed), which the
sampler moves to the logits' device.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from collections import OrderedDict
import weakref
from collections.abc import Callable, Hashable, Iterable

import numpy as np

from chatd.engine.params import ParamError, StructuredOutput
from chatd.engine.tokenizer import Tokenizer

log = logging.getLogger("chatd.engine")

# How many compiled grammars are kept (LRU). A hit costs a copy (~1 us) instead of a compile.
CACHE_SIZE = 256
# How many grammars that failed are remembered, so that sending one again is refused at once.
FAILED_CACHE_SIZE = 1024

# JSON is written compactly but as people and models write it: ", " and ": ", no newlines.
# Free whitespace would let a weak model pad forever between tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# The longest a step waits for masks still being computed before it runs without their rows.
MASK_WAIT_SECONDS = 0.005
# A grammar whose masks cost more than this a row (a normal one costs 10-100 us) is slow: its
# masks are computed in the slow lane, which may keep one core busy only this share of the time.
SLOW_MASK_SECONDS = 0.002
SLOW_LANE_SHARE = 0.25
# Mask threads (llguidance's own pool sizes itself to the machine's cores the same way).
MAX_MASK_THREADS = 8
# The most times a regex (or a Lark grammar) may repeat something by count (`a{10000}`). A mask's
# cost grows with it: `a{10000}` takes ~3 ms a token on the 2-core machine, `a{100000}` ~25 ms.
MAX_REPEAT = 10_000
_REGEX_COUNT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # {n}, {n,}, {n,m}
_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # item ~ n, item ~ n..m
# Threads that compile and walk grammars get this much stack. llguidance's compiler recurses once
# per rule of a chain; 2,700 chained Lark rules (or 3,000 chained $refs) overflowed the 8 MB of an
# ordinary thread and killed the process. A 64 KB grammar holds fewer than 10,000 rules; 256 MB
# would hold 150,000. Untouched stack costs address space only.
GRAMMAR_STACK_BYTES = 256 << 20


class _Grammar:
    """One compiled grammar, and what the sequences following it share. llguidance keeps one
    lexer per compiled grammar behind a lock: its copies' masks are computed one at a time, and
    when its lexer fails (a limit reached) every copy fails with it."""

    def __init__(self, key: Hashable, param: str, compiled) -> None:
        self.key, self.param, self.compiled = key, param, compiled  # compiled: an llguidance.LLMatcher
        self.slow = False  # its masks go to the slow lane
        self.error = ""  # why its lexer failed ("" while it has not)
        self._jobs = 0  # mask jobs queued or running
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """A mask of one of its copies is being computed (holding the shared lexer)."""
        return self._jobs > 0

    def job_started(self) -> None:
        with self._lock:
            self._jobs += 1

    def job_ended(self) -> None:
        with self._lock:
            self._jobs -= 1


class GrammarMatcher:
    """One sequence's position in its grammar: which tokens may come next, and whether it is done."""

    def __init__(self, grammar: _Grammar, on_error: Callable[[_Grammar, str], None]) -> None:
        self.grammar = grammar
        self._matcher = grammar.compiled.deep_copy()  # an llguidance.LLMatcher
        self._on_error = on_error
        self.mask: np.ndarray | None = None  # the next token's mask, once computed (uint32 words)
        # Why this copy failed ("" while it has not). Kept here, not asked of llguidance: the engine
        # thread reads it while a worker may hold the matcher, which llguidance does not allow.
        self._reason = ""

    @property
    def ready(self) -> bool:
        """The next token's mask is computed, and nothing else holds the grammar's lexer, so the
        engine thread may sample and advance it without waiting. A failed matcher is ready at once:
        no mask will be computed for it, and `accept` ends its sequence with the error."""
        return self.failed or (self.mask is not None and not self.grammar.busy)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it or failed (it stays failed)."""
        self.mask = None
        if self.failed:
            return False
        if not self._matcher.consume_token(token_id) or self._matcher.is_error():
            self._fail(f"token {token_id} is not allowed here")
            return False
        return True

    @property
    def is_terminated(self) -> bool:
        """Nothing may follow (but an end-of-sequence token): the output is complete."""
        return self._matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return bool(self._reason or self.grammar.error)

    @property
    def error(self) -> str:
        """Why it failed, in words a client can act on ("" while it has not)."""
        reason = self._reason or self.grammar.error
        return failure_message(self.grammar.param, reason) if reason else ""

    def compute_mask(self, words: int) -> None:
        """Compute the next token's mask (llguidance drops the GIL meanwhile). Off the engine thread.
        A failed matcher's mask allows every token: `accept` refuses whichever is sampled."""
        mask = np.zeros(words, dtype=np.uint32)
        if self.failed:
            mask[:] = np.uint32(0xFFFFFFFF)
            self.mask = mask
            return
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        if self._matcher.is_error():
            self._fail("its parser reached a limit")
        self.mask = mask

    def _fail(self, fallback: str) -> None:
        """This copy failed (called by whoever holds it): say why, and fail its grammar for every copy."""
        self._reason = _first_lines(self._matcher.get_error(), 1) if self._matcher.is_error() else fallback
        self._on_error(self.grammar, self._reason)


def failure_message(param: str, reason: str) -> str:
    """What a client is told when its grammar exceeded llguidance's limits."""
    return (f"{param} is too complex to follow: its grammar needs more work per token than the server allows "
            f"({reason}); simplify it (fewer or smaller repetitions, a shorter pattern)")


def compile_message(param: str, reason: str) -> str:
    """What a client is told when its grammar does not compile."""
    return f"{param} cannot be compiled: {reason}"


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer, with a cache of compiled grammars. Thread-safe.

    Grammars are cached per scope (the tenant, where tenants are kept apart): one tenant's
    grammar never shares a lexer, its cost or its failure with another's, and how fast a schema
    compiles tells nobody whether someone else sent it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width); the tokenizer's may be smaller
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on first use: ~0.4 s for a 49k vocabulary
        self._cache: OrderedDict[Hashable, _Grammar] = OrderedDict()
        # key -> how it failed: the message builder (compile_message or failure_message) and the reason
        self._failed: OrderedDict[Hashable, tuple[Callable[[str, str], str], str]] = OrderedDict()
        self._lock = threading.Lock()
        self._compiling = _Threads(2, "chatd-grammar-compile")
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

    def _compiled(self, spec: StructuredOutput, scope: str | None) -> _Grammar:
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

    def _forget(self, grammar: _Grammar, reason: str) -> None:
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


def _compile_and_probe(key: Hashable, spec: StructuredOutput, tokenizer, words: int, eos_token_ids: list[int]) -> _Grammar:
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
        raise _Refused(compile_message, _first_lines(error))
    compiled = llguidance.LLMatcher(tokenizer, grammar_text, log_level=0, limits=limits)
    if compiled.is_error():
        raise _Refused(compile_message, _first_lines(compiled.get_error()))
    grammar = _Grammar(key, spec.param, compiled)
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
            raise _Refused(failure_message, _first_lines(probe.get_error(), 1))
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


def _first_lines(error: str, limit: int = 4) -> str:
    # llguidance's errors carry a caret diagram (worth keeping: it points at the mistake) or the
    # parser's state and the tokens so far (one line is enough: the reason is the first).
    lines = [line for line in error.strip().splitlines() if line.strip()]
    text = "; ".join(re.sub(r"\s+", " ", line).strip() for line in lines[:limit])
    return text[:500]


def mask_words(vocab_size: int) -> int:
    """32-bit words per row of a token mask."""
    return (vocab_size + 31) // 32


def fill_masks(matchers: list[GrammarMatcher], vocab_size: int) -> np.ndarray:
    """The next-token masks of these matchers, one row each: uint32 [len(matchers), words]. Masks
    computed ahead are used as they are; any other is computed now (the engine never lets that
    happen, but the sampler stands alone)."""
    words = mask_words(vocab_size)
    for matcher in matchers:
        if matcher.mask is None:
            matcher.compute_mask(words)
    return np.stack([matcher.mask for matcher in matchers])


class MaskWorkers:
    """Computes next-token masks ahead of the step that needs them, off the engine thread.

    One job per grammar (its copies share a lexer behind a lock, so their masks are computed one
    after another anyway). Jobs of fast grammars run in a pool of threads; a job that takes more
    than SLOW_MASK_SECONDS a row, or is still running when a step stops waiting, marks its grammar
    slow, and its later jobs run in the slow lane: one thread that rests after each job so that it
    is busy at most SLOW_LANE_SHARE of the time, leaving the cores to the batch."""

    def __init__(self, words: int, num_threads: int | None = None) -> None:
        import os

        self.words = words
        threads = num_threads or min(MAX_MASK_THREADS, max(1, os.cpu_count() or 1))
        self._fast = _Threads(threads, "chatd-grammar-mask")
        self._slow = _Threads(1, "chatd-grammar-slow", share=SLOW_LANE_SHARE)
        self._done = threading.Condition()
        self._running: set[_Grammar] = set()  # grammars with a job in the fast pool

    def compute(self, matchers: Iterable[GrammarMatcher]) -> None:
        """Start computing these matchers' next masks (their grammars must not be busy)."""
        by_grammar: dict[_Grammar, list[GrammarMatcher]] = {}
        for matcher in matchers:
            if matcher.mask is None and not matcher.failed:
                by_grammar.setdefault(matcher.grammar, []).append(matcher)
        for grammar, rows in by_grammar.items():
            grammar.job_started()
            if grammar.slow:
                self._slow.submit(lambda g=grammar, r=rows: self._job(g, r, fast=False))
            else:
                with self._done:
                    self._running.add(grammar)
                self._fast.submit(lambda g=grammar, r=rows: self._job(g, r, fast=True))

    def wait(self, timeout: float = MASK_WAIT_SECONDS) -> None:
        """Wait until the fast jobs are done, `timeout` seconds at most; those still running then
        have slow grammars (and are not waited for again)."""
        deadline = time.monotonic() + timeout
        with self._done:
            while any(not grammar.slow for grammar in self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    for grammar in self._running:
                        grammar.slow = True
                    return
                self._done.wait(left)

    def wait_any(self, timeout: float) -> None:
        """Sleep until some job ends, `timeout` seconds at most (the engine has nothing else to do)."""
        with self._done:
            self._done.wait(timeout)

    def close(self) -> None:
        self._fast.close()
        self._slow.close()

    def _job(self, grammar: _Grammar, rows: list[GrammarMatcher], fast: bool) -> None:
        started = time.perf_counter()
        try:
            for matcher in rows:
                matcher.compute_mask(self.words)
        except Exception:  # noqa: BLE001 - a bug here must not kill the thread; the rows' grammar fails
            log.exception("computing a grammar mask failed")
            grammar.error = grammar.error or "computing its mask failed"
        finally:
            if (time.perf_counter() - started) / len(rows) > SLOW_MASK_SECONDS:
                grammar.slow = True
            grammar.job_ended()
            with self._done:
                if fast:
                    self._running.discard(grammar)
                self._done.notify_all()


class _Threads:
    """A few daemon threads with a large stack that run submitted functions in order, started on
    first use and stopped when closed or dropped. With `share` < 1, each thread rests after a job
    in proportion to how long it took."""

    def __init__(self, count: int, name: str, share: float = 1.0) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count, self._name, self._share = count, name, share
        self._started = False
        self._start_lock = threading.Lock()
        weakref.finalize(self, _stop_threads, self._jobs, count)

    def submit(self, job: Callable[[], None]) -> None:
        if not self._started:
            self._start()
        self._jobs.put(job)

    def _start(self) -> None:
        with self._start_lock:
            if self._started:
                return
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                for i in range(self._count):
                    threading.Thread(target=_serve, args=(self._jobs, self._share), name=f"{self._name}-{i}",
                                     daemon=True).start()
            finally:
                threading.stack_size(previous)
            self._started = True

    def run(self, function: Callable):
        """Run `function` on one of the threads and return its result (or raise its exception)."""
        done = threading.Event()
        result: list = [None, None]

        def job() -> None:
            try:
                result[0] = function()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result[1] = exc
            finally:
                done.set()

        self.submit(job)
        done.wait()
        if result[1] is not None:
            raise result[1]
        return result[0]

    def close(self) -> None:
        _stop_threads(self._jobs, self._count)


def _stop_threads(jobs: queue.SimpleQueue, count: int) -> None:
    for _ in range(count):
        jobs.put(None)


def _serve(jobs: queue.SimpleQueue, share: float) -> None:
    while (job := jobs.get()) is not None:
        started = time.perf_counter()
        job()
        if share < 1:
            time.sleep((time.perf_counter() - started) * (1 / share - 1))

"""The threads grammar work runs on: masks computed ahead of the step that needs them, and
compiles, each on a thread with a stack large enough for llguidance's recursion.

Kept apart from grammar.py (what a grammar is compiled from, and what it may cost) because this
is scheduling of CPU work: which thread computes which grammar's masks, when a step stops waiting
for them, and how little of a core a slow grammar may take. It knows nothing of JSON schemas or
regexes; a matcher (core/grammar_matcher.py) computes its own mask when asked.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from chatd.engine.core.grammar_matcher import CompiledGrammar, GrammarMatcher

log = logging.getLogger("chatd.engine")

# The longest a step waits for masks still being computed before it runs without their rows.
MASK_WAIT_SECONDS = 0.005
# A grammar whose masks cost more than this a row (a normal one costs 10-100 us) is slow: its
# masks are computed in the slow lane, which may keep one core busy only this share of the time.
SLOW_MASK_SECONDS = 0.002
SLOW_LANE_SHARE = 0.25
# Mask threads (llguidance's own pool sizes itself to the machine's cores the same way).
MAX_MASK_THREADS = 8
# Threads that compile and walk grammars get this much stack. llguidance's compiler recurses once
# per rule of a chain; 2,700 chained Lark rules (or 3,000 chained $refs) overflowed the 8 MB of an
# ordinary thread and killed the process. A 64 KB grammar holds fewer than 10,000 rules; 256 MB
# would hold 150,000. Untouched stack costs address space only.
GRAMMAR_STACK_BYTES = 256 << 20


class MaskWorkers:
    """Computes next-token masks ahead of the step that needs them, off the engine thread.

    One job per grammar (its copies share a lexer behind a lock, so their masks are computed one
    after another anyway). Jobs of fast grammars run in a pool of threads; a job that takes more
    than SLOW_MASK_SECONDS a row, or is still running when a step stops waiting, marks its grammar
    slow, and its later jobs run in the slow lane: one thread that rests after each job so that it
    is busy at most SLOW_LANE_SHARE of the time, leaving the cores to the batch."""

    def __init__(self, words: int, num_threads: int | None = None) -> None:
        self.words = words
        threads = num_threads or min(MAX_MASK_THREADS, max(1, os.cpu_count() or 1))
        self._fast = GrammarThreads(threads, "chatd-grammar-mask")
        self._slow = GrammarThreads(1, "chatd-grammar-slow", share=SLOW_LANE_SHARE)
        self._done = threading.Condition()
        self._running: set[CompiledGrammar] = set()  # grammars with a job in the fast pool

    def compute(self, matchers: Iterable[GrammarMatcher]) -> None:
        """Start computing these matchers' next masks (their grammars must not be busy)."""
        by_grammar: dict[CompiledGrammar, list[GrammarMatcher]] = {}
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

    def _job(self, grammar: CompiledGrammar, rows: list[GrammarMatcher], fast: bool) -> None:
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


class GrammarThreads:
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

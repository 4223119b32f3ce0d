"""A sequence's place in its grammar: which tokens may come next, and whether it is done.

A `GrammarMatcher` is sequence state, as a block table is: core's scheduler asks it whether the
next mask is `ready`, feeds it each sampled token (`accept`) and ends the sequence when it
`is_terminated`; the worker's sampler reads its mask (`fill_masks`). It sits in core, the bottom of
the engine's ladder, so that both can import it. Compiling grammars and computing masks ahead on
threads are the engine's (structured/grammar.py, grammar_threads.py), above.

No torch here: masks are numpy bit arrays (bit t of row r set = token t allowed), which the
sampler moves to the logits' device. llguidance's matcher comes in compiled, from structured/grammar.py.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Hashable

import numpy as np


class CompiledGrammar:
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

    def __init__(self, grammar: CompiledGrammar, on_error: Callable[[CompiledGrammar, str], None]) -> None:
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

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar would accept from here (it does not move).
        On the engine thread, while no mask of its grammar is being computed."""
        if self.failed or not token_ids:
            return 0
        return self._matcher.validate_tokens(list(token_ids))

    def draft_masks(self, token_ids: tuple[int, ...]) -> list[DraftMask]:
        """The masks after each of these tokens (proposed ones the grammar accepts, `valid_prefix`),
        computed now, and the matcher moved back to where it was: a verify step samples after each.
        On the engine thread, once this matcher's own next mask is ready."""
        words = len(self.mask)
        valid = self.valid_prefix(list(token_ids))
        masks = []
        for token_id in token_ids[:valid]:
            mask = np.full(words, 0xFFFFFFFF, dtype=np.uint32)  # after the end: a moot row
            self._matcher.consume_token(token_id)
            if not self._matcher.is_stopped():
                self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            masks.append(DraftMask(mask))
        if self._matcher.is_error():  # a parser limit reached on the way: the sequence fails with it
            self._fail("its parser reached a limit")
        elif valid:
            self._matcher.rollback(valid)
        # Rows after a refused token are moot: the token sampled in its place differs from it.
        return masks + [DraftMask(np.full(words, 0xFFFFFFFF, dtype=np.uint32))] * (len(token_ids) - valid)

    def _fail(self, fallback: str) -> None:
        """This copy failed (called by whoever holds it): say why, and fail its grammar for every copy."""
        self._reason = first_lines(self._matcher.get_error(), 1) if self._matcher.is_error() else fallback
        self._on_error(self.grammar, self._reason)


class DraftMask:
    """The mask after a proposed token, as the sampler reads a matcher's (`mask`)."""

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask


def failure_message(param: str, reason: str) -> str:
    """What a client is told when its grammar exceeded llguidance's limits."""
    return (f"{param} is too complex to follow: its grammar needs more work per token than the server allows "
            f"({reason}); simplify it (fewer or smaller repetitions, a shorter pattern)")


def first_lines(error: str, limit: int = 4) -> str:
    """The first `limit` lines of an llguidance error, on one line (500 characters at most)."""
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

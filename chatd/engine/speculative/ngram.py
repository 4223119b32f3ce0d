"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens, in its own prompt and output.

No model: where a reply quotes its input (a rewrite, a summary, an edit of code, a chat turn
repeating an earlier one), the tokens after an earlier occurrence of what was just written are
likely what comes next. Each sequence keeps an index from every n-gram (prompt_lookup_min to
prompt_lookup_max tokens) to where its latest occurrence ended, extended by the tokens added since
the last lookup: a lookup costs a few dictionary reads, whatever the context's length. The
longest n-gram that occurred before wins.
"""

from __future__ import annotations

from chatd.engine.core.sequence import Sequence


class NgramIndex:
    """Where each n-gram of a token list last ended (its grams ending before `indexed`)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0

    def lookup(self, tokens: list[int], length: int) -> tuple[list[int], int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` that occurred before, and that suffix's length; ([], 0) when none did."""
        end = len(tokens)
        ends = self.ends
        for e in range(max(self.indexed, self.min_n), end):  # every gram ending before the last token's end
            for n in range(self.min_n, min(self.max_n, e) + 1):
                ends[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            found = ends.get(tuple(tokens[end - n :]))
            if found is not None:
                return tokens[found : found + length], n
        return [], 0


class NgramProposer:
    """Guesses from each sequence's own n-grams (`NgramIndex`, kept on its speculation state).

    A lookup costs next to nothing, so the Speculator looks first and then weighs how many of the
    tokens found to verify (`free`), by how often guesses from a match of that length held."""

    free = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def lookup(self, seq: Sequence, length: int) -> tuple[list[int], int]:
        """Up to `length` guesses for `seq`, and the length of the n-gram they follow (its kind)."""
        state = seq.proposer_state
        if state.proposer is None:
            state.proposer = NgramIndex(self.min_n, self.max_n)
        return state.proposer.lookup(seq.token_ids, length)

    def release(self, seq: Sequence) -> None:
        pass  # the index goes with the sequence's state

"""Speculative decoding in the scheduler: which proposed tokens a decode verifies, and how many of
them its step accepts, counted (the proposers are engine/speculative/).

A decoding sequence may carry tokens a proposer guessed (`Sequence.draft_token_ids`). The step that
schedules it computes its last token and the guesses together, and samples after each;
`Scheduler.postprocess` keeps the guesses up to the first that differs from what was sampled there,
plus that sampled token, and gives back the KV slots and blocks of the rest.
"""

from __future__ import annotations

from chatd.engine.core.sequence import Sequence


def drafts_to_verify(seq: Sequence, num_new: int, budget: int) -> tuple[int, ...]:
    """The proposed tokens a sequence whose `num_new` ready tokens fit the budget verifies with
    them: only a decode's (its one last token), as many as are left of the budget."""
    if not seq.draft_token_ids or num_new != 1 or seq.num_uncomputed_tokens != 1 or seq.is_prefilling:
        return ()
    return tuple(seq.draft_token_ids[: budget - num_new])


class DraftCounts:
    """Verify steps of a sequence, the proposed tokens they verified, and those accepted, in total."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def accepted(self, seq: Sequence, drafts: tuple[int, ...], sampled: list[int]) -> int:
        """How many of `drafts` equal the tokens sampled in their places (`sampled`, from the first
        draft's), up to the first that does not; counted here and on the sequence."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
            accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        seq.num_draft_tokens += len(drafts)
        seq.num_accepted_tokens += accepted
        return accepted

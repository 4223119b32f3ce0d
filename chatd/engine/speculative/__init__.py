"""Speculative decoding: guess a decoding sequence's next tokens cheaply, verify them in one step.

After each step the engine asks the `Speculator` for guesses (`propose`); a proposer makes them:
n-gram lookup in the sequence's own tokens (ngram.py: no model; strong where a reply quotes its
prompt) or a small draft model sharing the tokenizer (draft_model.py). The scheduler runs each
guessing sequence's last token and its guesses in one step, a sample after each (worker/verify_rows.py
makes them decode rows at consecutive positions), and keeps the guesses up to the first that differs
from the token sampled in its place, plus that sampled token (core/scheduler.py `postprocess`, with
core/drafts.py).

Why that keeps the model's distribution: both proposers guess one token, not a distribution (the
draft model its most likely one), so the rejection sampling of Leviathan et al. accepts a guess g
with probability p(g) (min(1, p/q) with q one-hot) and otherwise draws from p with g taken out,
normalized. Sampling the target's own token t at that position, from p with the row's own
uniform number, and accepting g exactly when t == g does the same: P(accept) = p(g), and on a
miss t is distributed as p without g. It also draws exactly as decoding one token at a time would
(each position uses the same uniform number of the sequence's generator: worker/verify_rows.py
rewinds what the rows past the first miss drew), so a seeded reply is the same with speculation
on or off, and greedy output is token for token the same (up to the arithmetic of a batch of
several rows).

Penalties, min_tokens' bans and logprobs are worked out per row as if the guesses before it were
already the sequence's; a grammar's mask after each guess is computed on the engine thread (a
guess the grammar refuses is cut off here, before it is verified; a slow grammar's sequences do
not guess). How many tokens a sequence guesses is weighed each step against what a step of more
rows costs (`Speculator`); above `disable_by_batch_size` running sequences nobody guesses (a big
batch is compute-bound: every guess costs a token's compute), and a sequence whose guesses keep
missing stops for a while that doubles.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from chatd.config import SpeculativeConfig
from chatd.engine.core.sequence import Sequence

# A sequence whose verify steps accept nothing this many times in a row stops guessing for a
# while: first PAUSE_STEPS steps, doubling each time it misses again, up to MAX_PAUSE_STEPS
# (a proposer that costs a model's steps to guess; a free one's misses only weigh on its odds).
MISSES_BEFORE_PAUSE = 2
PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64
# The chance that a guess holds, given the ones before it in the step did: counted over verify
# steps, older ones weighing less by DECAY a step (a sequence's own) or KIND_DECAY (a kind's, over
# every sequence), from a prior of PRIOR_RATE worth PRIOR_WEIGHT steps.
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 2.0
DECAY = 0.8
KIND_DECAY = 0.97
# How fast what steps of each size are seen to cost follows new steps (a step's weight: 1 - this).
SEEN_DECAY = 0.9


class Odds:
    """Guesses that held and verify steps that rejected one, decayed: the chance the next guess holds."""

    def __init__(self) -> None:
        self.held = PRIOR_RATE * PRIOR_WEIGHT
        self.missed = (1 - PRIOR_RATE) * PRIOR_WEIGHT

    def add(self, held: float, missed: float, decay: float) -> None:
        self.held = decay * self.held + held
        self.missed = decay * self.missed + missed

    @property
    def rate(self) -> float:
        return self.held / (self.held + self.missed)


@dataclass
class Guessing:
    """One sequence's speculation state: how its guesses have fared, and its back-off."""

    odds: Odds = field(default_factory=Odds)  # its own guesses' (a priced proposer's: a draft model's)
    # A free proposer's last lookup, scored against the tokens that came once they are in: where
    # they start in the sequence, their kind (the n-gram length they followed), and the tokens found.
    looked_up: tuple[int, int, list[int]] | None = None
    draft_tokens: int = 0  # its counters when it last guessed (the scheduler's, on the sequence)
    accepted_tokens: int = 0
    misses: int = 0  # verify steps in a row that accepted nothing
    pause: int = 0  # steps left without guessing
    next_pause: int = PAUSE_STEPS
    proposer: object = None  # what the proposer keeps for it (an n-gram index, a draft cache's place)


def flat_cost(rows: int) -> float:
    return 1.0


class Speculator:
    """Decides who guesses how many tokens each step, and asks its proposer for them.

    How many: as many as make the step's expected tokens per unit of its cost largest. A step of
    `rows` decode rows costs what such steps were seen to take lately against steps of one row
    (`observe`, from the engine: host work included), or before both were seen, `step_cost(rows)`
    (the runner's: measured at start on a CPU, where a compiled step of two rows costs 1.1-1.4x one
    of one row and of six about 2x; on a GPU taken as nearly flat); a guess adds a row, and a token
    with the chance that it and the guesses before it hold. Guesses are added one at a time, the
    likeliest to hold first, and as many kept as make the ratio largest.

    A proposer that costs a model's steps (a draft model) is asked for as many as are wanted, and
    its chance is the sequence's own rate. A free one (n-gram lookup: `free`) looks first, and its
    guesses' chance is how often tokens found by lookups of the same kind matched the tokens that
    came after them, over every sequence (`_score`, verified or not): the first of a lookup, and
    each after one that held. On the replies of benchmarks/speculative.py a first guess after a
    match of four tokens held 71-93% of the time, of two 34-52%, of one 15-29%. The kinds are
    counts only: what a sequence guesses comes from its own tokens alone."""

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), step_cost: Callable[[int], float] = flat_cost) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.step_cost = step_cost
        self.max_tokens = config.num_speculative_tokens
        self.seen: dict[int, float] = {}  # rows -> seconds decode-only steps of that many rows took lately
        self.free = getattr(proposer, "free", False)  # guessing costs nothing until verified: look first
        self.kinds: dict[int, tuple[Odds, Odds]] = {}  # kind -> odds of a step's first guess, of each after

    def observe(self, plan, seconds: float) -> None:
        """A step (a SchedulerOutput) took `seconds` (the engine's wall clock, host work included):
        kept for decode-only steps, by their rows."""
        rows = sum(s.num_samples for s in plan.scheduled)
        if not plan.num_prefill_tokens and rows <= 2 * self.max_tokens + 2:
            last = self.seen.get(rows)
            self.seen[rows] = seconds if last is None else SEEN_DECAY * last + (1 - SEEN_DECAY) * seconds

    def cost(self, rows: int) -> float:
        """A step of `rows` rows against one of one row: as steps of both took lately where both were
        seen, else as the runner measured at start; and never less than a step of fewer rows."""
        one = self.seen.get(1)
        most = 1.0
        for size in range(2, rows + 1):
            seen = self.seen.get(size)
            most = max(most, seen / one if seen is not None and one is not None else self.step_cost(size))
        return most

    @property
    def method(self) -> str:
        return self.config.method

    def propose(self, seqs: list[Sequence], num_running: int) -> None:
        """Set `draft_token_ids` of those of `seqs` (decoding sequences that just got tokens) that guess now."""
        if num_running > self.config.disable_by_batch_size:
            return  # a batch this big is bound by its compute: guesses would cost their tokens
        candidates, found = [], []  # (a sequence, its chance for a first guess, for each after, its most); free guesses
        for seq in seqs:
            state = seq.proposer_state
            if state is None:
                state = seq.proposer_state = Guessing()
            limit = self._limit(seq, state)
            if not limit:
                continue
            if not self.free:
                candidates.append((seq, state.odds.rate, state.odds.rate, limit))
                continue
            guesses, kind = self.proposer.lookup(seq, limit)
            if guesses:
                state.looked_up = (len(seq.token_ids), kind, guesses)
                first, later = self._kind(kind)
                candidates.append((seq, first.rate, later.rate, len(guesses)))
                found.append(guesses)
        lengths = self._lengths(candidates, num_running)
        if self.free:
            wanted = [(seq, guesses[:length]) for (seq, length), guesses in zip(lengths, found, strict=True) if length]
        else:
            asked = [(seq, length) for seq, length in lengths if length]
            wanted = list(zip([seq for seq, _ in asked], self.proposer.propose(asked) if asked else [], strict=True))
        for seq, guesses in wanted:
            seq.draft_token_ids = self._checked(seq, guesses)

    def release(self, seq: Sequence) -> None:
        """A sequence ended: forget what the proposer kept for it."""
        if seq.proposer_state is not None:
            self.proposer.release(seq)
            seq.proposer_state = None

    def _lengths(self, candidates: list[tuple[Sequence, float, float, int]], num_rows: int) -> list[tuple[Sequence, int]]:
        """How many guesses each candidate (a sequence, the chance its first guess holds, that each
        after one that held does, its most) makes in a step of `num_rows` rows besides: guesses in the
        order of their chance to hold, as many as make the step's expected tokens per cost largest."""
        gains = [(-first, i) for i, (_, first, _, _) in enumerate(candidates)]  # the next guess's chance, negated
        heapq.heapify(gains)
        added = []  # who guesses one more, in the order they are added
        rows, tokens = num_rows, float(num_rows)
        best, best_added = tokens / self.cost(rows), 0
        while gains:  # every guess, likeliest first; then keep as many as made the best ratio
            gain, i = heapq.heappop(gains)
            rows, tokens = rows + 1, tokens - gain
            added.append(i)
            if tokens / self.cost(rows) > best:  # (not only while it grows: a step's cost is not a smooth curve)
                best, best_added = tokens / self.cost(rows), len(added)
            if added.count(i) < candidates[i][3]:
                heapq.heappush(gains, (gain * candidates[i][2], i))  # held only if this one held too
        lengths = [0] * len(candidates)
        for i in added[:best_added]:
            lengths[i] += 1
        return [(seq, length) for (seq, _, _, _), length in zip(candidates, lengths)]

    def _limit(self, seq: Sequence, state: Guessing) -> int:
        """The most tokens `seq` may guess now (0: none), after counting how its last guesses fared."""
        drafted = seq.num_draft_tokens - state.draft_tokens
        if drafted and not self.free:  # its last guesses were verified (a free proposer's lookups are scored below)
            accepted = seq.num_accepted_tokens - state.accepted_tokens
            state.draft_tokens, state.accepted_tokens = seq.num_draft_tokens, seq.num_accepted_tokens
            state.odds.add(accepted, accepted < drafted, DECAY)
            if accepted:
                state.misses, state.next_pause = 0, PAUSE_STEPS
            else:
                state.misses += 1
                if state.misses >= MISSES_BEFORE_PAUSE:
                    state.pause, state.misses = state.next_pause, 0
                    state.next_pause = min(MAX_PAUSE_STEPS, 2 * state.next_pause)
        if state.looked_up is not None:
            self._score(seq, *state.looked_up)
            state.looked_up = None
        if state.pause:
            state.pause -= 1
            return 0
        grammar = seq.grammar
        if grammar is not None and (grammar.failed or grammar.grammar.slow or grammar.grammar.busy):
            return 0
        params = seq.params
        room = self.max_model_len - seq.num_tokens  # the last guess's position must fit the context
        if params.max_tokens is not None:  # the token sampled after the last guess counts too
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.max_tokens, room))

    def _score(self, seq: Sequence, start: int, kind: int, found: list[int]) -> None:
        """Count how a lookup's tokens fared against the tokens that came after it: all it found,
        verified or not (the step's sampled token shows whether the first unverified one would have
        held), so a kind whose guesses are not verified any more is still scored, and can come back."""
        came = seq.token_ids[start : start + len(found)]
        held = 0
        while held < len(came) and found[held] == came[held]:
            held += 1
        first, later = self._kind(kind)
        first.add(held > 0, held == 0, KIND_DECAY)
        if held:  # the ones after the first: held, and a miss if one was seen (past what came, unknown)
            later.add(held - 1, held < len(came), KIND_DECAY)

    def _kind(self, kind: int) -> tuple[Odds, Odds]:
        """The odds of a free proposer's guesses of `kind`: a step's first, and each after one that held."""
        odds = self.kinds.get(kind)
        if odds is None:
            odds = self.kinds[kind] = (Odds(), Odds())
        return odds

    def _checked(self, seq: Sequence, guesses: list[int]) -> list[int]:
        """Guesses worth verifying: none past an end-of-sequence or stop token, none a grammar refuses."""
        ends = self.eos_token_ids if not seq.params.ignore_eos else frozenset()
        for i, token_id in enumerate(guesses):
            if token_id in ends or token_id in seq.params.stop_token_ids:
                guesses = guesses[: i + 1]
                break
        if seq.grammar is not None and guesses:
            guesses = guesses[: seq.grammar.valid_prefix(guesses)]
        return guesses


def build_speculator(config: SpeculativeConfig, max_model_len: int, eos_token_ids: frozenset[int],
                     vocab_size: int, draft=None, step_cost: Callable[[int], float] = flat_cost) -> Speculator | None:
    """The speculator `config` asks for (None when speculation is off). `draft`: the draft model's
    proposer, built by the loader (it needs the target's device and tokenizer)."""
    if not config.method:
        return None
    if config.method == "ngram":
        from chatd.engine.speculative.ngram import NgramProposer

        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        proposer = draft
    return Speculator(config, proposer, max_model_len, eos_token_ids, step_cost)

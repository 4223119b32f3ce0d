"""Speculative decoding: guesses verified in one step change nothing a client gets.

Each comparison runs the same requests with speculation off and on, on tiny random-weight models:
greedy tokens, seeded samples, penalties, logprobs, stop strings, grammars, preemption, the prefix
cache and aborts. Random models seldom repeat themselves, so most tests guess with an oracle that
knows the reply (from the run without speculation) and gets every third guess wrong: the verify
steps then accept some guesses and reject others, which is what must not show. The n-gram and
draft-model proposers run end to end too, and a chi-square test on 20,000 draws shows sampling
with guesses keeps the model's distribution.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from chatd.config import SpeculativeConfig
from chatd.engine import FinishReason, SamplingParams, StructuredOutput
from chatd.engine.core.sequence import Sequence
from chatd.engine.models.demo import build_model_dir
from chatd.engine.speculative import PAUSE_STEPS, Speculator
from chatd.engine.speculative.ngram import NgramIndex
from tests.engine.conftest import make_llm
from tests.engine.invariants import check_invariants

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class Oracle:
    """Guesses a request's known reply, every `wrong`-th guess off by one; only for the requests in `only`."""

    def __init__(self, replies: dict[str, list[int]], wrong: int = 3, only: set[str] | None = None) -> None:
        self.replies, self.wrong, self.only, self.guessed = replies, wrong, only, 0

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        guesses = []
        for seq, length in wanted:
            if self.only is not None and seq.request_id not in self.only:
                guesses.append([])
                continue
            done = len(seq.output_token_ids)
            guess = list(self.replies[seq.request_id][seq.index][done : done + length])
            for i in range(len(guess)):
                self.guessed += 1
                if self.guessed % self.wrong == 0:
                    guess[i] = (guess[i] + 1) % 500 + 3
            guesses.append(guess)
        return guesses

    def release(self, seq: Sequence) -> None:
        pass


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def run(llm, batch: list, params, guesses: Oracle | None = None, abort_after: dict[str, int] | None = None):
    """Step the engine to the end, checking the block pool after every step; each request's merged output."""
    engine = llm.engine
    if guesses is not None:
        engine.speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                         disable_by_batch_size=8), guesses, engine.max_model_len,
                                       engine.scheduler.eos_token_ids)
        engine.async_scheduling = False
    params = params if isinstance(params, list) else [params] * len(batch)
    for i, (prompt, p) in enumerate(zip(batch, params)):
        engine.add_request(str(i), prompt, p)
    merged, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in merged:
                merged[out.request_id].merge(out)
            else:
                merged[out.request_id] = out
        steps += 1
        for request_id, after in (abort_after or {}).items():
            if steps == after:
                engine.abort(request_id)
        check_invariants(engine.scheduler.block_manager, engine.live_sequences())
    assert engine.stats().num_free_blocks == engine.stats().num_blocks  # rejected guesses' blocks given back
    return [merged[str(i)] for i in range(len(batch)) if str(i) in merged]


def replies(outputs) -> dict[str, list[list[int]]]:
    return {out.request_id: [o.token_ids for o in out.outputs] for out in outputs}


def tokens(outputs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    pytest.param(SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=3, max_tokens=24, ignore_eos=True, n=2),
                 marks=pytest.mark.slow),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.3, logprobs=2),
    pytest.param(SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, stop_token_ids=[7, 9, 11, 13]),
                 marks=pytest.mark.slow),
], ids=["greedy", "seeded-top-p", "seeded-n2", "penalties-logprobs", "min-tokens-bans"])
def test_guesses_change_no_token(params, model_dirs):
    """Greedy, seeded sampling (one generator per choice, rewound past rejected rows), penalties
    counting the guesses before each row, logprobs and min_tokens' bans: the same tokens as without."""
    path = model_dirs["llama"]
    batch = prompts([5, 17, 40, 9])
    plain = run(make_llm(path), batch, params)
    oracle = Oracle(replies(plain))
    guessed = run(make_llm(path), batch, params, oracle)
    assert tokens(guessed) == tokens(plain)
    assert [[o.finish_reason for o in out.outputs] for out in guessed] == [[o.finish_reason for o in out.outputs] for out in plain]
    if params.logprobs:
        for a, b in zip(plain, guessed):
            assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx([lp.logprob for lp in b.outputs[0].logprobs], abs=1e-4)
    drafted = sum(out.num_draft_tokens for out in guessed)
    accepted = sum(out.num_accepted_tokens for out in guessed)
    assert drafted > accepted > 0  # verify steps kept some guesses and threw others away


def test_engine_counts_guesses_and_mixes_guessing_and_plain_sequences(model_dirs):
    """Sequences with and without guesses share steps; the totals are the sum of the requests'."""
    path = model_dirs["qwen2"]
    batch = prompts([12, 30, 7])
    plain = run(make_llm(path), batch, GREEDY)
    llm = make_llm(path)
    guessed = run(llm, batch, GREEDY, Oracle(replies(plain), only={"0", "2"}))
    assert tokens(guessed) == tokens(plain)
    assert guessed[1].num_draft_tokens == 0 and guessed[0].num_draft_tokens > 0 and guessed[2].num_draft_tokens > 0
    stats = llm.engine.stats()
    assert stats.num_draft_tokens == sum(o.num_draft_tokens for o in guessed)
    assert stats.num_accepted_tokens == sum(o.num_accepted_tokens for o in guessed)
    assert stats.num_generation_tokens == sum(len(o.outputs[0].token_ids) for o in guessed)


def test_stop_strings_end_a_reply_mid_guesses(model_dirs):
    """A stop string completed by a kept guess ends the reply there: the tokens kept after it are dropped."""
    path = model_dirs["llama"]
    llm = make_llm(path)
    batch = prompts([10, 25])
    whole = run(llm, batch, GREEDY)
    text = whole[0].outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    plain = run(make_llm(path), batch, params)
    guessed = run(make_llm(path), batch, params, Oracle(replies(whole), wrong=5))
    assert plain[0].outputs[0].finish_reason == FinishReason.STOP
    for a, b in zip(plain, guessed):
        assert (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason) == (
            a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason)


def test_grammar_masks_each_guess_and_refused_guesses_are_cut(model_dirs):
    """Structured output: each verify row is masked by the grammar after the guesses before it, and
    a guess the grammar refuses is never verified; the reply is the one without guesses."""
    path = model_dirs["llama3"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}}, "required": ["name", "n"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=StructuredOutput(json_schema=json.dumps(schema))),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, structured=StructuredOutput(regex=r"[0-9]{3}-[a-z]{4}"))]
    batch = ["Describe a thing", "Code:"]
    plain = run(make_llm(path), batch, params)
    guessed = run(make_llm(path), batch, params, Oracle(replies(plain), wrong=2))
    assert tokens(guessed) == tokens(plain)
    assert sorted(json.loads(guessed[0].outputs[0].text)) == ["n", "name"]
    # Guesses were verified unless a mask job ran long enough (a loaded machine) to put the grammar
    # in the slow lane, whose sequences do not guess: counted over both requests, not required.
    assert sum(out.num_draft_tokens for out in guessed) >= sum(out.num_accepted_tokens for out in guessed)


def test_preemption_prefix_cache_and_aborts_with_guesses(model_dirs):
    """A pool too small for every sequence preempts some mid-reply (they recompute, prefix cache
    hits included), one request is aborted mid-reply: the others' tokens are as without guesses,
    and every block comes back."""
    path = model_dirs["llama"]
    shared = prompts([24])[0]
    batch = [shared + tail for tail in prompts([3, 9, 5, 2], seed=1)]
    options = dict(num_blocks=12, max_num_batched_tokens=64)
    plain = run(make_llm(path, **options), batch, GREEDY, abort_after={"2": 4})
    llm = make_llm(path, **options)
    guessed = run(llm, batch, GREEDY, Oracle(replies(plain) | {"2": [[0] * 24]}), abort_after={"2": 4})
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().prefix_cache_hits > 0
    kept = lambda outputs: [o.outputs[0].token_ids for o in outputs if o.request_id != "2"]  # noqa: E731
    assert kept(guessed) == kept(plain)


def test_ngram_index_finds_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    assert index.lookup(tokens, 3) == ([4, 9, 2], 3)  # 1 2 3 occurred before 4 9 2 (the shorter 2 3, later, loses)
    tokens += [4]
    assert index.lookup(tokens, 2) == ([9, 2], 3)  # 2 3 4 occurred once, before 9 2
    tokens += [8]
    assert index.lookup(tokens, 4) == ([], 0)  # 4 8 never occurred before
    assert NgramIndex(2, 4).lookup([5, 6], 3) == ([], 0)  # nothing earlier to find
    assert NgramIndex(2, 4).lookup([5, 6, 1, 5, 6, 2, 5, 6], 2) == ([2, 5], 2)  # the latest of two earlier 5 6


def test_ngram_proposer_speeds_up_a_reply_that_repeats_itself(model_dirs):
    """End to end with the n-gram proposer: a random model that falls into a loop gets its loop
    guessed, and the tokens are the same as without."""
    path = model_dirs["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, repetition_penalty=0.5)
    batch = prompts([6, 11, 20], seed=3)
    plain = make_llm(path).generate(batch, params)
    # Guessing whatever this machine's steps cost (how guesses are weighed is tested below).
    llm = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "weigh_step_cost": False})
    assert llm.engine.speculator is not None and not llm.engine.async_scheduling
    guessed = llm.generate(batch, params)
    assert tokens(guessed) == tokens(plain)
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    """A second random model with the llama family's tokenizer: a draft model that guesses badly."""
    return build_model_dir(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=2)


@pytest.mark.parametrize("draft", ["same", pytest.param("other", marks=pytest.mark.slow)])
def test_draft_model_guesses_are_verified(draft, model_dirs, other_model):
    """A draft model sharing the tokenizer: the served model itself as its own draft gets every
    greedy guess accepted; another random model gets most rejected. Either way the same tokens."""
    path = model_dirs["llama"]
    batch = prompts([5, 30, 12])
    plain = make_llm(path).generate(batch, GREEDY)
    draft_path = path if draft == "same" else other_model
    llm = make_llm(path, speculative_config={"method": "draft_model", "model": str(draft_path),
                                             "num_speculative_tokens": 3, "draft_kv_cache_gb": 0.01,
                                             "weigh_step_cost": False})
    guessed = llm.generate(batch, GREEDY)
    assert tokens(guessed) == tokens(plain)
    stats = llm.engine.stats()
    if draft == "same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens / 2
    proposer = llm.engine.speculator.proposer
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks  # each draft cache given back


def test_draft_model_with_another_vocabulary_is_refused(model_dirs, tmp_path):
    other = build_model_dir(tmp_path / "wide", "llama", seed=3, vocab_size=2048)
    with pytest.raises(ValueError, match="speculative.model .* must share the served model's tokenizer"):
        make_llm(model_dirs["llama"], speculative_config={"method": "draft_model", "model": str(other)})


@pytest.mark.parametrize("fields, message", [
    ({"method": "eagle"}, "speculative.method must be one of"),
    ({"method": "draft_model"}, "speculative.model must name the draft model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be 1 or more"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max must be at least"),
])
def test_bad_settings_name_the_setting(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)


def test_guessing_backs_off_in_big_batches_and_after_misses():
    """No guesses while more sequences run than disable_by_batch_size; a sequence whose guesses
    keep missing pauses, for longer each time; none past max_tokens."""

    class Always:
        def propose(self, wanted):
            return [[5] * length for _, length in wanted]

        def release(self, seq):
            pass

    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=2),
                            Always(), max_model_len=1000)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=100))

    def step(accepted: int | None = None, running: int = 1) -> list[int]:
        """The last guesses verified (`accepted` of them kept), as the scheduler does; the next guesses."""
        if accepted is not None:
            seq.num_draft_tokens += len(seq.draft_token_ids)
            seq.num_accepted_tokens += accepted
        seq.draft_token_ids = []
        speculator.propose([seq], num_running=running)
        return seq.draft_token_ids

    assert step(running=3) == []
    assert step(running=2) == [5, 5, 5, 5]
    assert step(accepted=0) == [5, 5, 5, 5]
    assert step(accepted=0) == []  # a second miss in a row pauses it
    pause = 1
    while not step():
        pause += 1
    assert pause == PAUSE_STEPS
    assert step(accepted=0) == [5, 5, 5, 5]
    assert step(accepted=0) == []
    pause = 1
    while not step():
        pause += 1
    assert pause == 2 * PAUSE_STEPS  # missing again pauses longer
    assert step(accepted=2) == [5, 5, 5, 5]
    seq.output_token_ids = [9] * 98
    assert step(accepted=1) == [5]  # only one guess fits before max_tokens


@pytest.mark.parametrize("costs, running, rates, expected", [
    ({1: 1.0, 2: 1.08, 3: 1.9, 4: 2.6}, 1, [0.9], [1]),  # a compiled CPU step: two rows cost one, three two
    ({1: 1.0, 2: 1.08, 3: 1.9, 4: 2.6}, 2, [0.9, 0.9], [0, 0]),  # two sequences: a guess would cost a third row
    ({n: 1.0 + 0.02 * (n - 1) for n in range(1, 40)}, 2, [0.9, 0.3], [4, 1]),  # a GPU: flat; the likely guess more
    ({n: float(n) for n in range(1, 10)}, 1, [0.99], [0]),  # eager CPU steps: a row costs a token, never worth it
])
def test_guesses_are_weighed_against_what_a_step_of_more_rows_costs(costs, running, rates, expected):
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4), None, 1000,
                            step_cost=lambda rows: costs[min(rows, max(costs))] + max(0, rows - max(costs)))
    seqs = [Sequence(str(i), [1, 2], SamplingParams()) for i in range(len(rates))]
    lengths = speculator._lengths([(seq, rate, rate, 4) for seq, rate in zip(seqs, rates)], running)
    assert [length for _, length in lengths] == expected


def test_a_step_of_more_rows_can_pay_where_one_more_row_does_not():
    """Two rows cost much more than one, three hardly more than two (a compiled CPU step on a fast
    memory day): one unlikely guess does not pay, two do when the second is likely once the first held."""
    costs = {1: 1.0, 2: 1.38, 3: 1.47, 4: 1.87}
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3), None, 1000,
                            step_cost=lambda rows: costs[min(rows, 4)] + max(0, rows - 4))
    seq = Sequence("r", [1, 2], SamplingParams())
    assert speculator._lengths([(seq, 0.3, 0.95, 1)], 1) == [(seq, 0)]
    assert speculator._lengths([(seq, 0.3, 0.95, 2)], 1) == [(seq, 2)]
    assert speculator._lengths([(seq, 0.1, 0.95, 3)], 1) == [(seq, 0)]


def test_free_guesses_are_weighed_by_how_often_their_kind_held():
    """A free proposer (n-gram lookup) looks first; what it found is scored against the tokens that
    came, verified or not. Guesses after a long match keep being verified; those after a short one,
    which keep missing, stop; misses pause nobody; and a kind that starts holding comes back."""

    class Lookup:
        free = True

        def __init__(self):
            self.kind = 6

        def lookup(self, seq, length):
            return [5] * length, self.kind

        def release(self, seq):
            pass

    lookup = Lookup()
    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3), lookup, 1000,
                            step_cost=lambda rows: costs[min(rows, 4)] + max(0, rows - 4))
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=5000))

    def step(kind: int, came: list[int]) -> list[int]:
        """The tokens that came since the last step (a verify step's kept guesses and its sampled
        token); the next guesses, after a lookup of `kind`."""
        for token_id in came:
            seq.append_token(token_id)
        seq.draft_token_ids = []
        lookup.kind = kind
        speculator.propose([seq], num_running=1)
        return seq.draft_token_ids

    assert step(6, []) == [5, 5, 5]  # the prior: likely enough for three
    for _ in range(10):
        assert step(6, [5, 5, 5, 7]) == [5, 5, 5]  # long matches keep holding
    guessed = [len(step(1, [9])) for _ in range(20)]  # guesses after a one-token match keep missing
    assert guessed[0] > 0 and guessed[-1] == 0
    assert step(6, [9]) == [5, 5, 5]  # not paused: a long match is still worth verifying
    assert speculator.kinds[1][0].rate < 0.2 < 0.8 < speculator.kinds[6][0].rate
    comeback = [len(step(1, [5])) for _ in range(30)]  # not verified, but what it found now comes
    assert comeback[-1] == 3


@pytest.mark.slow
def test_sampling_with_guesses_keeps_the_models_distribution(model_dirs):
    """Chi-square on 20,000 draws: with guesses (one a step, the model's likeliest second token,
    so verify steps accept about as often as they reject), the first three tokens' joint
    distribution under temperature 1 and top_k 3 is the model's own (computed with transformers)."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    path = model_dirs["llama"]
    prompt = prompts([7], seed=5)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def top3(context: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + context])).logits[0, -1]
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    expected = {}
    first = top3([])
    for a, pa in first.items():
        second = top3([a])
        for b, pb in second.items():
            for c, pc in top3([a, b]).items():
                expected[(a, b, c)] = pa * pb * pc
    likeliest = max(first, key=first.get)
    guess = max(top3([likeliest]), key=top3([likeliest]).get)

    class Fixed:
        def propose(self, wanted):
            return [[guess] if len(seq.output_token_ids) == 1 else [] for seq, _ in wanted]

        def release(self, seq):
            pass

    draws = 20_000
    llm = make_llm(path, num_blocks=2048, max_num_seqs=256)
    engine = llm.engine
    engine.speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=1,
                                                     disable_by_batch_size=1024), Fixed(), engine.max_model_len)
    engine.async_scheduling = False
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([prompt] * draws, params)
    counts = {}
    for out in outputs:
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(expected)
    stats = engine.stats()
    assert 0.2 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9
    cells = sorted(expected)
    observed = [counts.get(cell, 0) for cell in cells]
    total = sum(expected.values())  # 1, but for float rounding: chisquare wants the sums equal
    assert chisquare(observed, [expected[cell] / total * draws for cell in cells]).pvalue > 1e-3


def test_what_steps_are_seen_to_cost_overrides_the_start_measurement():
    """Steps as they ran (host work included) weigh guesses once steps of both sizes were seen."""
    from chatd.engine.core.scheduler import ScheduledSequence, SchedulerOutput

    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3), None, 1000)
    seq = Sequence("r", [1, 2], SamplingParams())
    candidates = [(seq, 0.9, 0.9, 3)]
    assert [n for _, n in speculator._lengths(candidates, 1)] == [3]  # flat at start: the most
    one = SchedulerOutput([ScheduledSequence(seq, 1, 5, samples=True)])
    two = SchedulerOutput([ScheduledSequence(seq, 2, 5, samples=True, draft_token_ids=(7,))])
    for _ in range(20):
        speculator.observe(one, 0.010)
        speculator.observe(two, 0.025)
    assert speculator.cost(2) == pytest.approx(2.5)
    assert speculator.cost(3) == pytest.approx(2.5)  # never seen, measured flat: at least what fewer rows cost
    assert [n for _, n in speculator._lengths(candidates, 1)] == [3]  # three guesses pay for 2.5 rows
    for rows, seconds in ((3, 0.035), (4, 0.045)):
        for _ in range(20):
            speculator.observe(SchedulerOutput([ScheduledSequence(seq, rows, 5, samples=True,
                                                                  draft_token_ids=(7,) * (rows - 1))]), seconds)
    assert [n for _, n in speculator._lengths(candidates, 1)] == [0]  # a guess costs more than it brings
    prefill = SchedulerOutput([ScheduledSequence(seq, 40, 0, samples=True, prefill=True)])
    speculator.observe(prefill, 1.0)
    assert speculator.cost(2) == pytest.approx(2.5)  # prefill steps are not decode steps


@pytest.mark.slow
def test_default_model_gives_the_same_reply_with_ngram_guesses():
    """SmolLM2-135M-Instruct (the default model, from its PyPI package): a reply that quotes its
    prompt is guessed from it, and greedy output is the same with and without guesses."""
    from chatd.engine import LLM
    from chatd.engine.models.sources import default_model_path

    if default_model_path() is None:
        pytest.skip("the default model's package is not installed")
    messages = [{"role": "user", "content": "Repeat this sentence exactly: the quick brown fox jumps over the lazy "
                                            "dog, and the lazy dog sleeps under the old oak tree by the river."}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM(device="cpu")
    prompt = plain.tokenizer.apply_chat_template(messages)
    expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    plain.close()
    guessing = LLM(device="cpu", speculative_config={"method": "ngram", "weigh_step_cost": False})
    got = guessing.generate([prompt], params)[0]
    assert got.outputs[0].token_ids == expected
    assert got.num_accepted_tokens > 0
    guessing.close()

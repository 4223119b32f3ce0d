"""Async scheduling (engine.py): step N+1 is planned and launched before step N's draws are back.

What a user sees must not change: the same tokens (greedy, seeded, penalized, constrained),
the same ends (stop tokens, stop strings, min_tokens, max_tokens), nothing left allocated after
an abort that lands while a step is in flight. Both ways are run here and compared; the
equality tests against transformers in test_engine.py run both ways too.
"""

from __future__ import annotations

import json
import random

import pytest

from chatd.engine import Placement, SamplingParams
from chatd.engine.structured.spec import StructuredOutput
from tests.engine.conftest import make_llm
from tests.factories import FakeRunner, make_engine


def run_to_the_end(engine, finished_at: dict[str, int] | None = None, limit: int = 10_000) -> dict[str, list[int]]:
    """Step until done; each request's tokens (and into `finished_at`, the step call that ended it)."""
    tokens: dict[str, list[int]] = {}
    for number in range(1, limit):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
            if out.finished and finished_at is not None:
                finished_at[out.request_id] = number
    raise AssertionError("the engine did not finish")


class OrderedRunner(FakeRunner):
    """A FakeRunner that notes when each step is launched and when its draws are taken."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events: list[str] = []

    def launch(self, scheduled, previous=None):
        step = super().launch(scheduled, previous)
        number = self.num_steps
        self.events.append(f"launch {number}")
        result = step.result
        step.result = lambda: (self.events.append(f"result {number}"), result())[1]
        return step


def test_the_next_step_is_launched_before_the_last_one_is_waited_for():
    runner = OrderedRunner()
    engine = make_engine(runner)
    engine.async_scheduling = True
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6))
    tokens = run_to_the_end(engine)
    assert tokens == {"r": [8, 9, 10, 11, 12, 13]}  # fed from the step in flight: each the last + 1
    assert runner.events[:4] == ["launch 1", "launch 2", "result 1", "launch 3"]
    # One launch per token, no step wasted: the one that reaches max_tokens is not followed by another.
    assert runner.num_steps == 6
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_penalized_rows_wait_for_their_last_token_and_free_rows_do_not():
    runner = FakeRunner()
    engine = make_engine(runner)
    engine.async_scheduling = True
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=8))
    engine.add_request("penalized", [20, 21], SamplingParams(max_tokens=8, presence_penalty=0.5))
    finished_at: dict[str, int] = {}
    tokens = run_to_the_end(engine, finished_at)
    assert tokens == {"free": list(range(8, 16)), "penalized": list(range(22, 30))}
    # The penalized row sat out every other step (its penalties count the token in flight); the
    # free one did not: its 8 tokens came back at the 9th step (each step returns the one before).
    assert finished_at["free"] == 9
    assert finished_at["penalized"] >= 15


def test_a_random_workload_gives_the_same_tokens_both_ways():
    """Priorities, preemption (a small pool), chunked prompts, stop tokens, n > 1: the same tokens."""
    rng = random.Random(0)
    requests = []
    for i in range(40):
        params = SamplingParams(max_tokens=rng.randint(3, 20), n=rng.choice([1, 1, 2]), min_tokens=rng.choice([0, 3]),
                                stop_token_ids=[rng.randrange(100)] if i % 3 == 0 else [], ignore_eos=True)
        requests.append((f"r{i}", [rng.randrange(100) for _ in range(rng.randint(1, 30))], params, rng.choice([0, 1])))

    def run(async_scheduling: bool) -> tuple[dict, int]:
        engine = make_engine(num_blocks=24, block_size=4, budget=16, max_seqs=6)
        engine.async_scheduling = async_scheduling
        outputs: dict[str, dict[int, list[int]]] = {}
        pending = list(requests)
        while pending or engine.has_unfinished_requests():
            for _ in range(2):  # two arrivals a step
                if pending:
                    rid, prompt, params, priority = pending.pop(0)
                    engine.add_request(rid, prompt, params, Placement(priority))
            for out in engine.step():
                assert out.error is None
                for choice in out.outputs:
                    outputs.setdefault(out.request_id, {}).setdefault(choice.index, []).extend(choice.token_ids)
        assert engine.stats().num_free_blocks == engine.stats().num_blocks
        return outputs, engine.stats().num_preemptions

    (off, preempted_off), (on, preempted_on) = run(False), run(True)
    assert preempted_off > 0 and preempted_on > 0
    assert on == off


def test_an_abort_while_a_step_is_in_flight_frees_everything_and_drops_its_tokens():
    engine = make_engine()
    engine.async_scheduling = True
    engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(30, 40)), SamplingParams(max_tokens=5))
    seen = []
    for _ in range(3):
        seen += engine.step()
    assert engine.in_flight is not None
    assert engine.abort("a")
    while engine.has_unfinished_requests():
        seen += engine.step()
    a_tokens = sum((o.outputs[0].token_ids for o in seen if o.request_id == "a"), [])
    assert len(a_tokens) <= 2  # what was handed back before the abort, nothing after it
    assert sum((o.outputs[0].token_ids for o in seen if o.request_id == "b"), []) == [40, 41, 42, 43, 44]
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert engine.scheduler.num_running == 0 and not engine.requests


@pytest.mark.slow
@pytest.mark.parametrize("case", ["min_tokens", "stop_string", "penalties", "logprobs"])
def test_ends_penalties_and_logprobs_are_the_same_both_ways(model_dirs, case):
    path = model_dirs["qwen3"]
    prompts = [[11, 12, 13, 14, 15], list(range(40, 75)), [7] * 9]
    base = make_llm(path).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    if case == "min_tokens":  # the first greedy token ends a reply unless min_tokens holds it back
        params = [SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4, stop_token_ids=[o.outputs[0].token_ids[0]])
                  for o in base]
    elif case == "stop_string":
        params = [SamplingParams(temperature=0.0, max_tokens=16, stop=[o.outputs[0].text.strip()[2:5]], ignore_eos=True)
                  for o in base]
    elif case == "penalties":
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4,
                                 ignore_eos=True) for i in range(3)]
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True) for _ in range(3)]
    off = make_llm(path).generate(prompts, params)
    on = make_llm(path, async_scheduling="on").generate(prompts, params)
    for a, b in zip(off, on):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in a.outputs] == \
               [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in b.outputs]
        if case == "logprobs":
            assert [lp.top for lp in a.outputs[0].logprobs] == [lp.top for lp in b.outputs[0].logprobs]
    if case == "min_tokens":  # the stop token was banned for the first four tokens
        for out, first in zip(on, base):
            stop = first.outputs[0].token_ids[0]
            assert len(out.outputs[0].token_ids) >= 4 and stop not in out.outputs[0].token_ids[:4]


@pytest.mark.slow
def test_grammars_and_preemption_give_the_same_json_both_ways(model_dirs):
    """Constrained rows under async scheduling sample only once their mask has seen the token in flight."""
    path = model_dirs["mistral"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    spec = StructuredOutput(json_schema=json.dumps(schema))
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=spec)] * 4 + \
             [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    prompts = [f"prompt number {i} " * 3 for i in range(6)]
    off = make_llm(path).generate(prompts, params)
    tight = make_llm(path, num_blocks=20, max_num_batched_tokens=16, async_scheduling="on")
    on = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    for out in on[:4]:
        assert set(json.loads(out.outputs[0].text)) == {"name", "tags"}
    assert tight.engine.stats().num_free_blocks == tight.engine.stats().num_blocks


def test_host_stage_times_are_counted(model_dirs):
    llm = make_llm(model_dirs["llama"], async_scheduling="on")
    llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    times = llm.engine.stage_times()
    assert times["steps"] >= 8
    for stage in ("schedule", "inputs", "forward", "sample", "wait", "postprocess", "detokenize"):
        assert times[stage] > 0, stage

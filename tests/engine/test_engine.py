"""LLMEngine and LLM end to end on CPU: greedy output equals transformers' own generate.

Every comparison runs chatd's paged, batched, chunked path against transformers' plain
forward on the same random weights (fp32, initializer range 0.3 so logits are decisive).
"""

from __future__ import annotations

import random

import pytest
import torch

from chatd.engine import FinishReason, ParamError, SamplingParams, Tokenizer
from tests.engine.conftest import FAMILIES, hf_greedy, make_llm
from tests.factories import FakeRunner, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(params=["off", "on"])
def scheduling(request) -> str:
    """Async scheduling off and on (engine.py): the same tokens either way."""
    return request.param


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_for_each_family(scheduling, family, model_dirs):
    llm = make_llm(model_dirs[family], async_scheduling=scheduling)
    batch = prompts(llm.engine.vocab_size, [5, 17, 40])  # 1, 3 and 5 blocks of 8
    got = token_ids(llm.generate(batch, GREEDY))
    want = [hf_greedy(model_dirs[family], p, GREEDY.max_tokens) for p in batch]
    assert got == want


@pytest.mark.slow
def test_small_prefill_chunks_give_the_same_tokens(scheduling, model_dirs):
    path = model_dirs["llama"]
    batch = prompts(500, [45, 30, 9], seed=1)
    llm = make_llm(path, max_num_batched_tokens=7, async_scheduling=scheduling)
    got = token_ids(llm.generate(batch, GREEDY))
    assert got == [hf_greedy(path, p, GREEDY.max_tokens) for p in batch]


def test_prefix_cache_hit_computes_only_the_rest(scheduling, model_dirs):
    path = model_dirs["qwen3"]
    llm = make_llm(path, async_scheduling=scheduling)
    shared = prompts(500, [24], seed=2)[0]  # exactly 3 blocks of 8
    first = shared + [7, 8]
    second = shared + [9, 10, 11]
    llm.generate(first, GREEDY)
    before = llm.engine.stats()
    out = llm.generate(second, GREEDY)[0]
    after = llm.engine.stats()
    assert out.num_cached_tokens == 24
    assert after.prefix_cache_hits - before.prefix_cache_hits == 24
    assert after.num_prompt_tokens - before.num_prompt_tokens == len(second) - 24
    assert out.outputs[0].token_ids == hf_greedy(path, second, GREEDY.max_tokens)


@pytest.mark.slow
def test_forced_preemption_recomputes_to_the_same_tokens(scheduling, model_dirs):
    path = model_dirs["mistral"]
    batch = prompts(500, [30, 26, 33, 20], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = make_llm(path, num_blocks=14, async_scheduling=scheduling)  # 4 sequences of ~50 tokens need ~28 blocks of 8
    got = token_ids(llm.generate(batch, params))
    assert llm.engine.stats().num_preemptions > 0
    assert got == [hf_greedy(path, p, params.max_tokens) for p in batch]
    assert llm.engine.stats().num_free_blocks == 14


@pytest.mark.slow
def test_batch_of_32_mixed_requests_equals_each_alone(scheduling, model_dirs):
    """Greedy and seeded sampling give the same tokens in a mixed batch as alone."""
    path = model_dirs["qwen2"]
    rng = random.Random(4)
    lengths = [rng.randint(1, 60) for _ in range(32)]
    batch = prompts(500, lengths, seed=4)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 16), ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, max_tokens=rng.randint(1, 16), ignore_eos=True, presence_penalty=0.5)
        for i in range(32)
    ]
    llm = make_llm(path, max_num_batched_tokens=128, async_scheduling=scheduling)
    together = token_ids(llm.generate(batch, params))
    alone = [token_ids(make_llm(path).generate(p, sp))[0] for p, sp in zip(batch, params)]
    assert together == alone
    for i in range(0, 32, 2):
        assert together[i] == hf_greedy(path, batch[i], params[i].max_tokens)


def test_n_choices_share_the_prompt_blocks(scheduling, model_dirs):
    path = model_dirs["llama"]
    llm = make_llm(path, async_scheduling=scheduling)
    prompt = prompts(500, [35], seed=5)[0]  # 4 full blocks + 3 tokens
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "different choices should differ"
    # Choice 0 computes the whole prompt; each sibling only the tail past the shared full blocks.
    assert llm.engine.stats().num_prompt_tokens == 35 + 2 * (35 - 32)
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == hf_greedy(path, prompt, 10)


def test_stop_token_id_ends_the_choice(scheduling, model_dirs):
    path = model_dirs["llama"]
    llm = make_llm(path, async_scheduling=scheduling)
    prompt = prompts(500, [12], seed=6)[0]
    full = hf_greedy(path, prompt, 12)
    stop_at = full[5]
    first = full.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop_at


def test_stop_string_ends_text_before_it(scheduling, model_dirs):
    path = model_dirs["llama"]
    llm = make_llm(path, async_scheduling=scheduling)
    prompt = prompts(500, [12], seed=8)[0]
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
    stop = full.strip()[3:6]
    assert len(stop) == 3
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop


def test_a_plain_decode_step_gives_what_the_general_path_gives(scheduling, model_dirs):
    """Most decode steps take step_outputs.py's short path (one choice, one token, no stop strings,
    no logprobs); a stop string that never comes, or logprobs, sends every step the general way:
    the same tokens, text (byte-fallback characters included), finish and counts, delta by delta."""
    prompt = prompts(500, [40], seed=8)[0]
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)

    def streamed(**extra):
        engine = make_llm(model_dirs["llama"], async_scheduling=scheduling).engine
        deltas = []
        for i in range(2):  # the second finds the first's prompt in the prefix cache
            engine.add_request(f"r{i}", prompt, SamplingParams(**base, **extra))
            while engine.has_unfinished_requests():
                deltas += [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.num_cached_tokens,
                            o.finished) for o in engine.step()]
        return deltas

    plain = streamed()
    assert streamed(stop=["\x00never"]) == plain
    assert [d[:2] for d in streamed(logprobs=1)] == [d[:2] for d in plain]


def test_logprobs_are_those_of_the_model(scheduling, model_dirs):
    from transformers import AutoModelForCausalLM

    path = model_dirs["qwen2"]
    llm = make_llm(path, async_scheduling=scheduling)
    prompt = prompts(500, [10], seed=9)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True))[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(want[i, lp.token_id].item(), abs=1e-4)
        top = want[i].topk(5)
        assert list(lp.top) == top.indices.tolist()


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ([1] * 300, SamplingParams(max_tokens=1), "prompt"),  # context window of 256
        ([1] * 200, SamplingParams(max_tokens=100), "max_tokens"),
        ([1, 2, 10**6], SamplingParams(), "prompt"),
        ([1, -1], SamplingParams(), "prompt"),
        ([1, "2"], SamplingParams(), "prompt"),  # not ints: the fast check in C passes them to the loop
        ([1, 2.0], SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(n=0), "n"),
        ([1, 2], SamplingParams(logprobs=21), "logprobs"),
        ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_requests_are_refused_with_nothing_allocated(model_dirs, prompt, params, field):
    llm = make_llm(model_dirs["llama"], max_model_len=256)
    engine = llm.engine
    with pytest.raises(ParamError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.param == field
    assert field.split("_")[0] in str(err.value)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_request_that_can_never_fit_the_pool_is_refused():
    engine = make_engine(num_blocks=4, block_size=8)  # 32 tokens of KV
    with pytest.raises(ParamError, match="KV cache holds only 4 blocks"):
        engine.add_request("big", [1] * 20, SamplingParams(max_tokens=20))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(model_dirs, monkeypatch, async_scheduling):
    path = model_dirs["llama"]
    llm = make_llm(path, async_scheduling=async_scheduling)
    engine = llm.engine
    assert engine.async_scheduling == (async_scheduling == "on")
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def flaky(scheduled, previous=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device error")
        return real_launch(scheduled, previous)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    engine.add_request("doomed", [5, 6, 7], GREEDY)
    outs = engine.step() + engine.step()
    failed = [o for o in outs if o.error]
    assert failed and failed[0].request_id == "doomed" and failed[0].finished
    assert failed[0].outputs[0].finish_reason == FinishReason.ERROR
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    ok = llm.generate([5, 6, 7], GREEDY)[0]
    assert ok.outputs[0].token_ids == hf_greedy(path, [5, 6, 7], GREEDY.max_tokens)


def test_abort_frees_blocks_at_once():
    engine = make_engine()
    engine.add_request("a", list(range(3, 40)), GREEDY)
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    assert engine.abort("a")
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert not engine.has_unfinished_requests() and engine.step() == []


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_equals_transformers_on_cuda(family, model_dirs, scheduling):
    """The same paged path on a GPU (fp32 so ties cannot hide a bug), batched and chunked."""
    from transformers import AutoModelForCausalLM

    path = model_dirs[family]
    llm = make_llm(path, device="cuda", max_num_batched_tokens=32, async_scheduling=scheduling)
    batch = prompts(llm.engine.vocab_size, [5, 17, 40, 63], seed=10)
    got = token_ids(llm.generate(batch, GREEDY))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt, tokens in zip(batch, got):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=GREEDY.max_tokens,
                min_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            )
        assert tokens == out[0, len(prompt):].tolist()


def test_evicted_prefix_is_recomputed_not_served_stale(model_dirs):
    """Blocks of an old prompt reused by another request must not be found under the old name."""
    path = model_dirs["llama"]
    llm = make_llm(path, num_blocks=12)  # 96 tokens of KV
    old, other = prompts(500, [40, 80], seed=11)
    llm.generate(old, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.generate(other, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # takes every block
    again = old + [3, 4, 5]
    out = llm.generate(again, GREEDY)[0]
    assert out.num_cached_tokens < 40
    assert out.outputs[0].token_ids == hf_greedy(path, again, GREEDY.max_tokens)


def test_queue_time_is_measured_on_the_engine_clock():
    engine = make_engine()
    now = [100.0]
    engine.clock = lambda: now[0]
    engine.add_request("q", [5, 6, 7], GREEDY)
    now[0] = 102.5
    out = engine.step()[0]
    assert out.queue_time == pytest.approx(2.5)


def test_a_stop_string_completed_by_the_last_allowed_token_ends_as_stop(model_dirs):
    """Token limits are checked before text is (postprocess, then detokenize); a stop string the
    last allowed token completes still wins, as a user reading the text expects."""
    tokenizer = Tokenizer.from_pretrained(model_dirs["llama"])
    reply = tokenizer.encode("the weather is fine today", add_special_tokens=False)
    text = tokenizer.decode(reply)
    stop = text[-3:]
    assert stop not in text[:-1]

    def run(params: SamplingParams):
        script = iter(reply)
        engine = make_engine(FakeRunner(next_token=lambda seq, last: next(script)), vocab_size=tokenizer.vocab_size,
                             tokenizer=tokenizer)
        engine.add_request("r", [5, 6, 7], params)
        outputs = [out for _ in range(len(reply) + 1) for out in engine.step()]
        assert outputs[-1].finished and not engine.has_unfinished_requests()
        assert engine.stats().num_free_blocks == engine.stats().num_blocks
        return "".join(o.outputs[0].text for o in outputs), outputs[-1].outputs[0]

    whole, last = run(SamplingParams(max_tokens=len(reply), ignore_eos=True))
    assert whole.endswith(stop) and last.finish_reason == FinishReason.LENGTH
    got, last = run(SamplingParams(max_tokens=len(reply), stop=[stop], ignore_eos=True))
    assert got == whole[:-3] and last.finish_reason == FinishReason.STOP and last.stop_reason == stop


def test_default_params_are_the_models_recommendation_under_what_is_given():
    engine = make_engine()
    engine.sampling_defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40.0}
    params = engine.default_params(max_tokens=5, temperature=None, seed=3)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (0.2, 0.9, 40, 5, 3)
    assert engine.default_params(temperature=0.0).temperature == 0.0
    assert make_engine().default_params() == SamplingParams()


def test_the_engine_measures_how_fast_its_queue_drains():
    """queued_prefill_rate: prompt tokens per second over steps that left requests waiting; a step
    that admits nothing while requests wait pulls it down; steps without a queue leave it be."""
    now = [0.0]

    class TimedRunner(FakeRunner):
        def launch(self, scheduled, previous=None):
            now[0] += 0.1  # every step takes 0.1 s
            return super().launch(scheduled, previous)

    engine = make_engine(TimedRunner(), max_seqs=1)
    engine.clock = lambda: now[0]
    for i in range(2):
        engine.add_request(f"r{i}", list(range(10 * i, 10 * i + 10)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.stats().queued_prefill_rate is None  # no queue has formed yet
    engine.step()  # r0's 10-token prompt while r1 waits
    assert engine.stats().queued_prefill_rate == pytest.approx(100.0)
    engine.step()  # r0 decodes, r1 still waits: nothing admitted
    assert engine.stats().queued_prefill_rate < 50
    while engine.has_unfinished_requests():
        engine.step()
    drained = engine.stats().queued_prefill_rate
    engine.add_request("alone", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().queued_prefill_rate == drained  # nobody waited: not a measure of the queue

"""Structured output in the engine: whatever the weights, a constrained request's output matches its grammar.

The models are tiny random-weight ones, so nothing but the token mask keeps them on the grammar:
if the output parses and validates, the mask did it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatd.engine import FinishReason, ParamError, SamplingParams
from chatd.engine.structured.spec import StructuredOutput
from tests.engine.conftest import make_llm


def schema_strategy(depth: int = 2):
    """JSON schemas whose every valid document is short, so any model finishes one in time."""
    leaves = st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-1000, 1000), st.integers(0, 5000)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
        st.builds(lambda n: {"type": "string", "minLength": n, "maxLength": n + 3}, st.integers(1, 4)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.sampled_from(["red", "green", "blue", "a b", 'q"uote', 7, None, True]), min_size=1, max_size=4, unique=True)
          .map(lambda values: {"enum": values}),
        st.builds(lambda v: {"const": v}, st.sampled_from(["yes", 3, False])),
        st.builds(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}, st.integers(1, 5)),
    )
    if depth == 0:
        return leaves
    inner = schema_strategy(depth - 1)
    names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
    # Closed objects: an open one takes extra keys, and a key is an unbounded string.
    objects = st.builds(
        lambda props, required_mask: {
            "type": "object",
            "properties": props,
            "required": [k for k, keep in zip(props, required_mask) if keep],
            "additionalProperties": False,
        },
        st.dictionaries(names, inner, min_size=1, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
    )
    arrays = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3))
    any_of = st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(leaves, objects, arrays, any_of)


def json_spec(schema) -> StructuredOutput:
    return StructuredOutput(json_schema=json.dumps(schema))


@pytest.fixture(scope="module")
def llm(model_dirs):
    # Small blocks and pool, a small prefill budget: long batches are chunked and preempted.
    return make_llm(model_dirs["llama"], num_blocks=160, max_num_batched_tokens=96)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(schema_strategy(), min_size=20, max_size=20))
def test_random_schemas_always_give_valid_json(llm, schemas):
    """200 random schemas (10 batches of 20, run together so they share steps): every output validates."""
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=600, structured=json_spec(schema))
              for i, schema in enumerate(schemas)]
    outputs = llm.generate(["Give me JSON:"] * len(schemas), params)
    for schema, out in zip(schemas, outputs):
        choice = out.outputs[0]
        assert choice.finish_reason == FinishReason.STOP, (schema, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_free_requests_are_untouched_by_constrained_ones_in_their_batch(model_dirs):
    """Greedy free requests give the same tokens (and logprobs) beside constrained rows as alone."""
    path = model_dirs["llama3"]
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in range(3)]
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(temperature=0.8, seed=1, max_tokens=200, n=2, structured=json_spec(
            {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}, "required": ["k"],
             "additionalProperties": False})),
    ]
    prompts = ["The first", "A second prompt", "Third"]
    alone = make_llm(path).generate(prompts, free)
    mixed = make_llm(path).generate(prompts + ["x", "y"], free + constrained)
    for a, b in zip(alone, mixed[:3]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == pytest.approx([lp.logprob for lp in b.outputs[0].logprobs], abs=1e-4)  # batch shape moves fp32 sums
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", mixed[3].outputs[0].text)
    assert [sorted(json.loads(o.text)) for o in mixed[4].outputs] == [["k"], ["k"]]


def test_regex_choice_and_lark_grammar(llm):
    specs = [
        StructuredOutput(regex=r"(yes|no), because [a-z ]{1,20}\."),
        StructuredOutput(choice=("positive", "negative", "neutral")),
        StructuredOutput(grammar='start: "x=" NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'),
    ]
    outs = llm.generate(["q"] * 3, [SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured=s) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", texts[0])
    assert texts[1] in ("positive", "negative", "neutral")
    assert outs[1].outputs[0].finish_reason == FinishReason.STOP  # ended by the grammar, no EOS needed
    assert re.fullmatch(r"x=[0-9]{1,3}(\+[0-9]{1,3})*", texts[2])
    # Any JSON object: its strings are unbounded, so a random model ends one only by luck (greedy
    # here writes "{}"); a real model ends it when it has said what it means, or max_tokens cuts it.
    obj = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=80, structured=StructuredOutput(json_object=True)))[0]
    assert isinstance(json.loads(obj.outputs[0].text), dict)


def test_preemption_and_chunked_prefill_keep_the_grammar(model_dirs):
    """A pool too small for the batch forces recomputation; each choice keeps its grammar's place."""
    path = model_dirs["mistral"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=json_spec(schema))
    prompts = [f"prompt number {i} " * 3 for i in range(6)]
    roomy = make_llm(path).generate(prompts, params)
    tight = make_llm(path, num_blocks=20, max_num_batched_tokens=16)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].text for o in squeezed] == [o.outputs[0].text for o in roomy]
    for out in squeezed:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_n_choices_each_follow_the_grammar_with_stop_strings_and_logprobs(llm):
    spec = StructuredOutput(regex=r"[a-c]{2,6};[a-c]{2,6}")
    out = llm.generate("q", SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=30, structured=spec, logprobs=1))[0]
    assert len({o.text for o in out.outputs}) > 1, "sampled choices should differ"
    for choice in out.outputs:
        assert re.fullmatch(r"[a-c]{2,6};[a-c]{2,6}", choice.text)
        assert len(choice.logprobs) == len(choice.token_ids)
    stopped = llm.generate("q", SamplingParams(temperature=0.0, max_tokens=30, structured=spec, stop=[";"]))[0].outputs[0]
    assert re.fullmatch(r"[a-c]{2,6}", stopped.text) and stopped.stop_reason == ";"


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput(json_schema='{"type": "objectx"}', param="response_format"), "objectx"),
    (StructuredOutput(json_schema="{not json", param="response_format"), "not valid JSON"),
    (StructuredOutput(json_schema='{"not": {"type": "string"}}', param="response_format"), "not"),
    (StructuredOutput(regex="[0-9", param="guided_regex"), "regex"),
    (StructuredOutput(grammar="start: missing", param="guided_grammar"), "missing"),
    (StructuredOutput(choice=(), param="guided_choice"), "1 to"),
    (StructuredOutput(regex="a", json_object=True), "exactly one"),
])
def test_bad_specs_are_refused_with_nothing_allocated(llm, spec, message):
    engine = llm.engine
    with pytest.raises(ParamError) as err:
        engine.add_request("bad", "q", SamplingParams(structured=spec))
    assert err.value.param == spec.param
    assert message in str(err.value)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_compiled_grammars_are_cached_per_spec(llm):
    engine = llm.engine
    spec = json_spec({"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"],
                      "additionalProperties": False})
    engine.check_structured(spec)
    before = len(engine.grammars._cache)
    engine.check_structured(StructuredOutput(json_schema=spec.json_schema, param="another field"))
    out = llm.generate("q", SamplingParams(temperature=0.0, max_tokens=20, structured=spec))[0].outputs[0]
    assert len(engine.grammars._cache) == before
    assert json.loads(out.text) in ({"cached": True}, {"cached": False})


def test_a_failed_grammar_fails_its_request_and_frees_everything(llm, monkeypatch):
    """A matcher that fails mid-reply (a parser limit reached) is an error the client hears, not a clean stop."""
    from chatd.engine.core.grammar_matcher import GrammarMatcher

    engine = llm.engine
    spec = StructuredOutput(regex=r"[a-z]{5,30}")
    calls = iter(range(100))
    monkeypatch.setattr(GrammarMatcher, "accept", lambda self, token_id: next(calls) < 3)  # the 4th token is refused
    free = llm.generate("q", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    failed = llm.generate(["q", "q"], [SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured=spec),
                                       SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)])
    assert failed[0].error and "could not be followed" in failed[0].error
    assert [o.finish_reason for o in failed[0].outputs] == [FinishReason.ERROR]
    assert failed[1].error is None and failed[1].outputs[0].token_ids == free.outputs[0].token_ids
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert not engine.runner.rows.generators


# -- hostile grammars: bounded cost, failures never served as valid, kept per tenant ------------

# An integer, then a string whose pattern is a huge counted repetition: the grammar compiles and
# its probe passes, and its lexer reaches its state limit only once a reply gets to "y".
FAILS_MID_REPLY = json_spec({"type": "object", "properties": {"x": {"type": "integer"},
                                                              "y": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                             "required": ["x", "y"], "additionalProperties": False})


def _run(engine, *requests, until: str | None = None) -> dict:
    """Add (request_id, prompt, params) requests, step until all end (or request `until` has);
    each request's merged output."""
    outputs = {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests() and not (until in outputs and outputs[until].finished):
        for out in engine.step():
            if out.request_id in outputs:
                outputs[out.request_id].merge(out)
            else:
                outputs[out.request_id] = out
    return outputs


def test_a_row_whose_mask_is_late_sits_out_and_the_batch_goes_on(model_dirs, monkeypatch):
    """A grammar whose mask never comes holds only its own row: the free request beside it runs
    to its end, then the late row finishes as its grammar says once its masks come."""
    import threading

    from chatd.engine.core.grammar_matcher import GrammarMatcher

    release = threading.Event()
    compute = GrammarMatcher.compute_mask

    def late(self, words):
        if self.grammar.param == "late":
            release.wait()
        compute(self, words)

    monkeypatch.setattr(GrammarMatcher, "compute_mask", late)
    engine = make_llm(model_dirs["llama"]).engine
    late_spec = StructuredOutput(regex=r"[a-c]{3}", param="late")
    engine.add_request("late", "q", SamplingParams(temperature=0.0, max_tokens=10, structured=late_spec))
    free = _run(engine, ("free", "a free prompt", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
                until="free")
    assert len(free["free"].outputs[0].token_ids) == 12 and free["free"].finished
    assert engine.requests["late"].seqs[0].num_output_tokens == 0  # never sampled without its mask
    release.set()
    late_out = _run(engine)["late"]
    assert re.fullmatch(r"[a-c]{3}", late_out.outputs[0].text) and late_out.outputs[0].finish_reason == FinishReason.STOP
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_a_grammar_that_fails_mid_reply_is_the_clients_error_and_never_served_again(model_dirs):
    engine = make_llm(model_dirs["llama"]).engine
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=40, structured=FAILS_MID_REPLY)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    out = _run(engine, ("bad", "hello", params), ("free", "free", free))
    assert out["bad"].error_param == "structured_outputs" and "too complex" in out["bad"].error
    assert all(o.finish_reason == FinishReason.ERROR for o in out["bad"].outputs)
    assert len(out["free"].outputs[0].token_ids) == 20 and out["free"].error is None
    with pytest.raises(ParamError, match="too complex") as refused:  # not a clean empty reply, as it once was
        engine.check_structured(FAILS_MID_REPLY)
    assert refused.value.param == "structured_outputs"
    engine.check_structured(FAILS_MID_REPLY, tenant="someone else")  # their copy is their own
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_grammars_that_fail_their_probe_are_refused_before_any_request_runs(llm):
    engine = llm.engine
    spec = StructuredOutput(regex="(a{1000}){1000}", param="guided_regex")
    for _ in range(2):  # the second time from what the first one learned
        with pytest.raises(ParamError, match="guided_regex is too complex") as refused:
            engine.check_structured(spec)
        assert refused.value.param == "guided_regex"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput(regex="a{100000}", param="guided_regex"), "the regex repeats something 100000 times"),
    (StructuredOutput(regex="(ab){2,20000}", param="guided_regex"), "20000 times"),
    (json_spec({"type": "object", "properties": {"k": {"type": "string", "pattern": "^a{1000000}$"}}}), "a pattern"),
    (StructuredOutput(grammar='start: "a" ~ 50000', param="guided_grammar"), "the grammar repeats"),
])
def test_counted_repetitions_past_the_limit_are_refused_by_name(llm, spec, words):
    with pytest.raises(ParamError, match="the limit is 10000") as refused:
        llm.engine.check_structured(spec)
    assert refused.value.param == spec.param and words in str(refused.value)


def test_grammars_are_cached_per_tenant(llm):
    engine = llm.engine
    spec = json_spec({"type": "object", "properties": {"per_tenant": {"type": "boolean"}}, "required": ["per_tenant"]})
    before = len(engine.grammars._cache)
    engine.check_structured(spec, tenant="alice")
    engine.check_structured(spec, tenant="bob")
    engine.check_structured(spec, tenant="alice")
    assert len(engine.grammars._cache) == before + 2


@pytest.mark.slow
def test_deep_chains_of_rules_compile_without_crashing_the_process(tmp_path):
    """llguidance's compiler recurses once per chained rule: 3,000 of them overflowed an ordinary
    thread's stack and killed the server. Run apart, so a regression cannot take the suite down."""
    script = tmp_path / "chains.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from pathlib import Path
from chatd.engine.models.demo import build_model_dir
from chatd.engine import ParamError
from chatd.engine.structured.spec import StructuredOutput
from tests.engine.conftest import make_llm
engine = make_llm(build_model_dir(Path({str(tmp_path)!r}) / "m", "llama", seed=1)).engine
lark = "start: r0\\n" + "\\n".join(f'r{{i}}: "x" r{{i + 1}} | "y"' for i in range(3000)) + '\\nr3000: "z"'
refs = {{"$defs": {{f"d{{i}}": {{"$ref": f"#/$defs/d{{i + 1}}"}} for i in range(3000)}}, "$ref": "#/$defs/d0"}}
refs["$defs"]["d3000"] = {{"type": "integer"}}
for spec in (StructuredOutput(grammar=lark, param="g"), StructuredOutput(json_schema=json.dumps(refs), param="j")):
    try:
        engine.check_structured(spec)
        print("compiled", spec.param)
    except ParamError as exc:
        print("refused", spec.param, exc)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiled g" in done.stdout and "compiled j" in done.stdout


def test_a_row_whose_grammar_failed_elsewhere_ends_with_the_error_instead_of_waiting(model_dirs):
    """Copies of one compiled grammar share its lexer: when another request's reply breaks it, a row
    that was waiting for its next mask ends with the error; it is not left waiting for a mask
    that is never computed."""
    engine = make_llm(model_dirs["llama"]).engine
    spec = StructuredOutput(regex=r"[a-c]{10,20}", param="guided_regex")
    engine.add_request("r", "hello", SamplingParams(temperature=0.0, max_tokens=30, structured=spec))
    steps, out = 0, None
    while out is None or not out.outputs[0].token_ids:
        out = next((o for o in engine.step() if o.request_id == "r"), None)
    matcher = engine.requests["r"].seqs[0].grammar
    engine.grammars.masks.wait(1.0)
    matcher.mask = None  # between its token and its next mask...
    engine.grammars._forget(matcher.grammar, "lexer error: too many states")  # ...another copy broke the lexer
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 200, "the row is stuck waiting for a mask"
        out = next((o for o in engine.step() if o.request_id == "r"), out)
    assert out.error_param == "guided_regex" and "too many states" in out.error
    assert engine.stats().num_free_blocks == engine.stats().num_blocks

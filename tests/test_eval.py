"""`chatd eval` as a user runs it against a real `chatd serve` (two tenants, the demo model): a
golden set of every scoring key is scored against the model's own greedy replies, a rubric is
graded by a judge (chatd itself), the gate (--min-score, a baseline) decides the exit status,
and `chatd eval add` turns a reply rated down into a golden item once. The scorers and the
interval are checked alone first."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from chatd.evals.golden import load_golden
from chatd.evals.run import wilson_interval
from chatd.evals.scoring import score
from tests.http.serving import tenants_server


def item(tmp_path, **fields):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "q", **fields}) + "\n")
    return load_golden(path)[0]


def test_each_scorer_passes_what_it_should_and_says_why_it_failed(tmp_path):
    assert score(item(tmp_path, exact="Paris"), "  Paris\n") == (True, "expected 'Paris'")
    assert not score(item(tmp_path, exact="Paris"), "paris")[0]
    assert score(item(tmp_path, regex=r"\bParis\b"), "It is Paris.")[0]
    assert score(item(tmp_path, number=42), "The answer is 42.")[0]
    assert score(item(tmp_path, number={"value": 3.14, "tolerance": 0.01}), "about 3.141")[0]
    assert score(item(tmp_path, number=1000), "It is 1,000.")[0]
    assert score(item(tmp_path, number=7), "none here") == (False, "no number in the reply (expected 7)")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert score(item(tmp_path, schema=schema), 'Sure: {"city": "Oslo"} done')[0]
    failed, why = score(item(tmp_path, schema=schema), '{"town": "Oslo"}')
    assert not failed and "'city' is a required property" in why
    assert score(item(tmp_path, schema=schema), "no json") == (False, "the reply holds no JSON")


def test_the_interval_is_wilsons_and_sound_at_the_edges():
    low, high = wilson_interval(0, 10)
    assert low == 0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "q"}', "give exactly one of exact, regex, schema, number, rubric"),
    ('{"prompt": "q", "exact": "a", "regex": "b"}', "give exactly one of"),
    ('{"exact": "a"}', "give a prompt"),
    ('{"prompt": "q", "regex": "("}', "regex is not a valid pattern"),
    ('{"prompt": "q", "number": {"value": 1, "tolerance": -1}}', "number must be"),
    ('{"prompt": "q", "exact": "a", "temperature": 1}', "unknown key 'temperature'"),
    ('{"messages": [{"role": "wizard", "content": "x"}], "exact": "a"}', "messages must be"),
    ("not json", "not JSON"),
])
def test_a_golden_set_mistake_names_its_line_and_key(tmp_path, line, message):
    path = tmp_path / "golden.jsonl"
    path.write_text('{"prompt": "fine", "exact": "x"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as raised:
        load_golden(path)
    assert f"{path}:2" in str(raised.value)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tenants_server(tmp_path_factory.mktemp("eval")) as running:
        yield running


def chatd(*args, **options) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chatd", *args], capture_output=True, text=True, timeout=300,
                          **options)


def test_a_golden_set_is_scored_against_the_model_and_gated(server, tmp_path):
    alice = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"]["alice"], max_retries=0)

    def greedy(question: str) -> str:
        return alice.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}],
                                             max_tokens=12, temperature=0).choices[0].message.content

    said = greedy("Name a colour.")
    first_word = said.split()[0]
    golden = tmp_path / "golden.jsonl"
    golden.write_text("".join(json.dumps(line) + "\n" for line in [
        {"id": "exact", "prompt": "Name a colour.", "exact": said, "max_tokens": 12},
        {"id": "exact-wrong", "prompt": "Name a colour.", "exact": said + " not", "max_tokens": 12},
        {"id": "regex", "messages": [{"role": "user", "content": "Name a colour."}], "regex": f"^{first_word}",
         "max_tokens": 12},
        {"id": "schema", "prompt": "Name a colour.", "schema": {"type": "object"}, "max_tokens": 12},
        {"id": "rubric", "prompt": "Name a colour.", "rubric": "It names a colour.", "max_tokens": 12},
    ]))
    common = ["--base-url", f"{server['url']}/v1", "--model", "demo", "--api-key", server["keys"]["alice"],
              "--judge-base-url", f"{server['url']}/v1", "--judge-model", "demo"]
    out = tmp_path / "run.json"
    run = chatd("eval", str(golden), *common, "--min-score", "0.4", "--json", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    passed = {i["id"]: i["passed"] for i in result["items"]}
    # The demo model's random words hold no JSON, and as a judge it says neither PASS nor FAIL.
    assert passed == {"exact": True, "exact-wrong": False, "regex": True, "schema": False, "rubric": False}
    assert "the judge gave no PASS or FAIL" in next(i["why"] for i in result["items"] if i["id"] == "rubric")
    assert result["score"] == 0.4 and result["interval_95"][0] < 0.4 < result["interval_95"][1]
    assert "demo: 2/5 passed, score 0.400" in run.stdout

    assert chatd("eval", str(golden), *common, "--min-score", "0.5").returncode == 1  # under the gate
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({**result, "score": 1.0, "items": [{"id": i, "passed": True} for i in passed]}))
    behind = chatd("eval", str(golden), *common, "--baseline", str(baseline))
    assert behind.returncode == 1 and "under the baseline's 1.000" in behind.stdout
    assert "regressed: exact-wrong, schema, rubric" in behind.stdout
    assert chatd("eval", str(golden), *common, "--baseline", str(out)).returncode == 0  # as good as itself
    no_judge = chatd("eval", str(golden), "--base-url", f"{server['url']}/v1", "--model", "demo")
    assert no_judge.returncode == 2 and "rubric items" in no_judge.stderr


def test_a_reply_rated_down_becomes_a_golden_item_once(server, tmp_path):
    alice = openai.OpenAI(base_url=f"{server['url']}/v1", api_key=server["keys"]["alice"], max_retries=0)
    conversation = alice.post("/conversations", cast_to=dict, body={})
    turn = alice.post(f"/conversations/{conversation['id']}/messages", cast_to=dict,
                      body={"content": "What is the capital of Peru?", "max_tokens": 6})
    alice.post("/feedback", cast_to=dict, body={"id": turn["id"], "rating": "down", "comment": "wrong city"})
    golden = tmp_path / "golden.jsonl"
    for _ in range(2):  # the second time finds nothing new
        added = chatd("eval", "add", str(golden), "--config", str(server["config"]))
        assert added.returncode == 0, added.stderr
    [line] = [json.loads(text) for text in golden.read_text().splitlines()]
    assert line["prompt"] == "What is the capital of Peru?" and "wrong city" in line["rubric"]
    assert line["failed_reply"] == turn["choices"][0]["message"]["content"] and line["source"].startswith("feedback fb_")
    assert load_golden(golden)[0].scoring == "rubric"

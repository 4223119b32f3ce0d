"""lm-evaluation-harness scores a model served by chatd as it scores the same weights itself: a
multiple-choice task written as local files (a task YAML over a local JSONL, no hub download)
through `local-completions` (echo, logprobs, the prompt's own token logprobs) gives the same
loglikelihood per choice (within 1e-3, float32) and the same accuracy as lm-eval's own `hf`
backend; a generative task runs through `local-chat-completions` and gets chatd's greedy replies."""

from __future__ import annotations

import json
import math

import openai
import pytest

from chatd.engine.models.demo import build_model_dir
from tests.http.serving import start_server, stop_server

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("What is two plus two?", ["three", "four", "five"], 1),
    ("Which animal barks?", ["a dog", "a cat", "a fish"], 0),
    ("What colour is the sky on a clear day?", ["green", "red", "blue"], 2),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What do bees make?", ["milk", "honey", "silk"], 1),
    ("Which is the largest?", ["a mouse", "an elephant", "a cat"], 1),
    ("What is frozen water called?", ["steam", "ice", "fog"], 1),
    ("Which month comes after March?", ["April", "May", "February"], 0),
]
MC_TASK = """task: chatd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: chatd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    model = build_model_dir(root / "llama", "llama", seed=1)
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "chatd_mc.yaml").write_text(MC_TASK.format(data=data))
    (tasks / "chatd_gen.yaml").write_text(GEN_TASK.format(data=data))
    config = f'[store]\ndb_path = "{root / "chatd.db"}"\n[model]\ndevice = "cpu"\ndtype = "float32"\ncompile = false\n'
    proc, url, _ = start_server(root, model, config,
                                environment={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    try:
        yield {"url": url, "model": model, "tasks": tasks, "name": model.name}
    finally:
        stop_server(proc)


def evaluate(served, monkeypatch, model: str, model_args: str, task: str, **options) -> dict:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                   task_manager=TaskManager(include_path=str(served["tasks"])), **options)


def test_a_multiple_choice_task_scores_the_same_through_chatd_as_in_lm_evals_own_hf_backend(served, monkeypatch):
    through_chatd = evaluate(served, monkeypatch, "local-completions",
                             f"model={served['name']},base_url={served['url']}/v1/completions,"
                             f"tokenizer_backend=huggingface,tokenizer={served['model']},num_concurrent=1,"
                             "max_retries=1,tokenized_requests=True,add_bos_token=True", "chatd_mc")
    own = evaluate(served, monkeypatch, "hf", f"pretrained={served['model']},dtype=float32,device=cpu,add_bos_token=True",
                   "chatd_mc", batch_size=1)  # (both with the model's BOS first, as a Llama is run)
    chatd_items = {s["doc_id"]: s for s in through_chatd["samples"]["chatd_mc"]}
    own_items = {s["doc_id"]: s for s in own["samples"]["chatd_mc"]}
    assert sorted(chatd_items) == sorted(own_items) == list(range(len(QUESTIONS)))
    for doc_id, item in own_items.items():
        theirs = [resp[0][0] for resp in item["resps"]]
        ours = [resp[0][0] for resp in chatd_items[doc_id]["resps"]]
        assert all(math.isfinite(x) and x < 0 for x in ours)
        assert ours == pytest.approx(theirs, abs=1e-3), doc_id
        assert [resp[0][1] for resp in chatd_items[doc_id]["resps"]] == [resp[0][1] for resp in item["resps"]]
    assert through_chatd["results"]["chatd_mc"]["acc,none"] == own["results"]["chatd_mc"]["acc,none"]


def test_a_generative_task_runs_through_chat_completions(served, monkeypatch):
    results = evaluate(served, monkeypatch, "local-chat-completions",
                       f"model={served['name']},base_url={served['url']}/v1/chat/completions,num_concurrent=1,"
                       "max_retries=1,tokenizer_backend=none", "chatd_gen", apply_chat_template=True)
    samples = results["samples"]["chatd_gen"]
    assert len(samples) == len(QUESTIONS)
    assert 0.0 <= results["results"]["chatd_gen"]["exact_match,none"] <= 1.0
    client = openai.OpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0)
    for sample in samples[:3]:  # each reply is chatd's greedy reply to the question, cut at the first newline
        question = QUESTIONS[sample["doc_id"]][0]
        direct = client.chat.completions.create(model=served["name"], messages=[{"role": "user", "content": question}],
                                                max_tokens=8, temperature=0.0, stop=["\n"])
        assert sample["resps"][0][0] == direct.choices[0].message.content

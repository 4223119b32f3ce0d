"""Speculative decoding as the server shows it: /metrics' chatd:spec_decode_* counters and each
request's `draft_tokens` / `accepted_tokens` on its `request finished` line. A real `chatd serve`
on the demo model with [speculative] method "ngram"; tests/engine/ checks the decoding itself.

The demo model's random weights seldom repeat themselves, so free text gives n-gram lookup little
to guess from. A repetition_penalty far below 1 makes it repeat its prompt and itself, and greedy
decoding of one request is deterministic: some of its guesses hold. (A grammar would force repeats
too, but a sequence whose grammar masks are slow, as on a loaded CPU, does not guess: the count
would depend on timing.)"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatd.engine import CompletionOutput, FinishReason, RequestOutput
from chatd.engine.models.demo import build_demo_model
from chatd.http.telemetry.metrics import ServerMetrics
from chatd.http.server.request_log import GenerationRecord, RequestLog
from tests.http.serving import start_server, stop_server

SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    model_dir = build_demo_model(root / "demo")
    # weigh_step_cost off: guess on this machine whatever its eager steps of several rows cost.
    proc, url, log_path = start_server(root, model_dir, "[speculative]\nmethod = \"ngram\"\nnum_speculative_tokens = 3\n"
                                       "weigh_step_cost = false\n")
    try:
        yield {"url": url, "log": log_path}
    finally:
        stop_server(proc)


def spec_counters(url: str) -> dict[str, float]:
    """/metrics' speculative decoding counters: drafts, draft_tokens, accepted_tokens."""
    samples = {s.name: s.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
               for s in family.samples}
    return {name: samples[f"chatd:spec_decode_num_{name}_total"] for name in SPEC_COUNTERS}


def logged_counts(log_path, request_id: str) -> tuple[int, int]:
    """(draft_tokens, accepted_tokens) from the request's `request finished` line (waited for: it is
    written as the answer ends, which may be just after the client has read it)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in log_path.read_text().splitlines()
                 if "request finished" in line and f"request_id={request_id} " in f"{line} "]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (line,) = lines
    draft, accepted = (re.search(rf" {name}=(\d+)", line) for name in ("draft_tokens", "accepted_tokens"))
    assert draft and accepted, line
    return int(draft.group(1)), int(accepted.group(1))


def generate(url: str, route: str, request_id: str, **body) -> dict:
    """A greedy reply of 48 tokens, however the random model would end it, from `route`."""
    body = {"temperature": 0, "max_tokens": 48, "ignore_eos": True, **body}
    response = httpx.post(f"{url}/v1/{route}", json=body, headers={"X-Request-Id": request_id}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 48
    return response.json()


@pytest.mark.slow  # a server of its own: kept out of the fast suite's five minutes
def test_the_server_speculates_and_counts_guesses_in_metrics_and_log_lines(server):
    url, log_path = server["url"], server["log"]
    assert "speculative decoding: ngram" in log_path.read_text()  # the [speculative] section reached the engine
    before = spec_counters(url)
    assert all(value >= 0 for value in before.values())

    # The raw prompt, then the same words in the chat template; the repetition penalty makes the
    # model repeat them (the completion's count is what this model and seed give: 28 guessed, 11 held).
    generate(url, "completions", "spec-repeat", prompt="one two three one two three", repetition_penalty=0.05)
    repeat = logged_counts(log_path, "spec-repeat")
    generate(url, "chat/completions", "spec-chat", repetition_penalty=0.05,
             messages=[{"role": "user", "content": "one two three one two three"}])
    in_chat = logged_counts(log_path, "spec-chat")

    after = spec_counters(url)
    grown = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    assert repeat[0] >= repeat[1] > 0, f"draft, accepted tokens: {repeat}"
    assert in_chat[0] >= in_chat[1] >= 0
    assert grown["draft_tokens"] >= grown["accepted_tokens"] > 0
    assert 0 < grown["drafts"] <= grown["draft_tokens"]
    # Nothing else ran: the server's totals are the two requests' own counts.
    assert (grown["draft_tokens"], grown["accepted_tokens"]) == (repeat[0] + in_chat[0], repeat[1] + in_chat[1])


def output(draft: int = 0, accepted: int = 0) -> RequestOutput:
    return RequestOutput("r", [1, 2, 3], [CompletionOutput(0, token_ids=[4, 5], finish_reason=FinishReason.STOP)], finished=True,
                         num_draft_tokens=draft, num_accepted_tokens=accepted)


def test_the_log_line_sums_its_requests_guesses_and_reads_0_without_speculation():
    for merged, expected in [
        ([output(6, 4), output(3, 1)], (9, 5)),  # a completion of two prompts: both engine requests' counts
        ([output(), None], (0, 0)),  # speculation off (or a prompt that never got an output)
    ]:
        entry = RequestLog("req", "POST", "/v1/completions", "/v1/completions")
        GenerationRecord("completions", entry).finished(ServerMetrics("m"), merged)
        assert (entry.fields["draft_tokens"], entry.fields["accepted_tokens"]) == expected
        assert entry.fields["cached_tokens"] == 0

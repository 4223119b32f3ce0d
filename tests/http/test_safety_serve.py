"""A real `chatd serve` with the whole safety pipeline configured: a guard model (a tiny random-weight
Llama on chatd's own engine, in the same process) judges every input beside the rules, its latency
is measured in /metrics, the shipped rules refuse a threat through the OpenAI SDK, and the server
stops cleanly with both engines."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from chatd.engine.models.demo import build_demo_model, build_model_dir
from tests.http.serving import start_server, stop_server

pytestmark = pytest.mark.slow


def test_a_server_with_a_guard_model_judges_every_input_and_measures_it(tmp_path):
    guard_dir = build_model_dir(tmp_path / "guard", "llama", seed=5)
    config = f"""
[safety]
check_input = true
check_output = true
guard_model = "{guard_dir}"
guard_max_model_len = 512
"""
    proc, url, log = start_server(tmp_path, build_demo_model(tmp_path / "demo"), config)
    try:
        assert re.search(r"guard model guard: llama-guard-3 verdicts, context 512", log.read_text())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:  # the rules refuse it before the guard is asked
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "I will kill you."}])
        assert refused.value.code == "content_policy_violation"
        # A plain question goes to the guard too: served, or refused by what the random guard says.
        try:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        except openai.BadRequestError as error:
            assert error.code == "content_policy_violation"
        moderation = client.moderations.create(input="Hi")
        assert len(moderation.results) == 1
        metrics = httpx.get(f"{url}/metrics").text
        judged = re.search(r'chatd:safety_check_seconds_count\{check="guard",model_name="demo"\} (\S+)', metrics)
        assert judged and float(judged.group(1)) == 1.0  # the one input the rules let through
    finally:
        stop_server(proc)

"""deploy/prometheus/chatd.rules.yml as Prometheus reads it: `promtool check rules` accepts it,
every series it names is one a real `chatd serve` exports (read from a live scrape, so a renamed
metric fails here), and `promtool test rules` fires each alert on the series that should fire it,
after its `for`, with its labels and runbook, and stays quiet on healthy ones."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "chatd.rules.yml"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) is not installed")
SERIES_NAME = re.compile(r"\bchatd:[a-z0-9_]+")

# Per alert: series that must fire it (values one a minute, promtool's notation), the labels the
# alert then carries beyond the rule's own, and the same series' healthy values, which must not.
FIRING = {
    "ChatdKVCacheNearlyFull": ({'chatd:kv_cache_usage_perc{instance="a",model_name="m"}': "0.9x15"},
                               {"instance": "a", "model_name": "m"},
                               {'chatd:kv_cache_usage_perc{instance="a",model_name="m"}': "0.5x15"}),
    "ChatdTTFTOverObjective": (
        {'chatd:tier_time_to_first_token_seconds_bucket{instance="a",tier="free",le="1"}': "0+1x15",
         'chatd:tier_time_to_first_token_seconds_bucket{instance="a",tier="free",le="5"}': "0+10x15",
         'chatd:tier_time_to_first_token_seconds_bucket{instance="a",tier="free",le="+Inf"}': "0+10x15",
         'chatd:tier_ttft_p95_objective_seconds{instance="a",tier="free"}': "2x15"},
        {"instance": "a", "tier": "free"},
        {'chatd:tier_time_to_first_token_seconds_bucket{instance="a",tier="free",le="1"}': "0+10x15",
         'chatd:tier_time_to_first_token_seconds_bucket{instance="a",tier="free",le="5"}': "0+10x15",
         'chatd:tier_time_to_first_token_seconds_bucket{instance="a",tier="free",le="+Inf"}': "0+10x15",
         'chatd:tier_ttft_p95_objective_seconds{instance="a",tier="free"}': "2x15"}),
    "ChatdErrorRatio": ({'chatd:request_success_total{instance="a",finished_reason="error"}': "0+10x15",
                         'chatd:request_success_total{instance="a",finished_reason="stop"}': "0+90x15"},
                        {"instance": "a"},
                        {'chatd:request_success_total{instance="a",finished_reason="error"}': "0+1x15",
                         'chatd:request_success_total{instance="a",finished_reason="stop"}': "0+99x15"}),
    "ChatdPreemptionSpike": ({'chatd:num_preemptions_total{instance="a",model_name="m"}': "0+300x15"},
                             {"instance": "a", "model_name": "m"},
                             {'chatd:num_preemptions_total{instance="a",model_name="m"}': "0+6x15"}),
    "ChatdStoreCannotRecordUsage": ({'chatd:store_writable{instance="a"}': "0x15"}, {"instance": "a"},
                                    {'chatd:store_writable{instance="a"}': "1x15"}),
    "ChatdLimitStoreUnreachable": ({'chatd:limit_store_up{instance="a"}': "0x15"}, {"instance": "a"},
                                   {'chatd:limit_store_up{instance="a"}': "1x15"}),
    "ChatdShedding": ({'chatd:tier_requests_shed_total{instance="a",tier="free",reason="overloaded"}': "0+5x15"},
                      {"instance": "a", "tier": "free", "reason": "overloaded"},
                      {'chatd:tier_requests_shed_total{instance="a",tier="free",reason="overloaded"}': "0x15"}),
    "ChatdEngineDead": ({'chatd:engine_failed{instance="a",model_name="m"}': "1x15"},
                        {"instance": "a", "model_name": "m"},
                        {'chatd:engine_failed{instance="a",model_name="m"}': "0x15"}),
}


def alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}


def test_promtool_accepts_the_rules_and_every_alert_has_a_runbook():
    run = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert set(alerts()) == set(FIRING)  # each alert is tested below
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["runbook"]) > 80, name


@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> set[str]:
    """The series names a real chatd serve exports, with a tier objective set and a request served."""
    root = tmp_path_factory.mktemp("alerts")
    demo = build_demo_model(root / "demo")
    config = f'[store]\ndb_path = "{root / "chatd.db"}"\n[tiers.paid]\nttft_p95_seconds = 2.0\n'
    proc, url, _ = start_server(root, demo, config)
    try:
        request = urllib.request.Request(f"{url}/v1/completions", data=b'{"prompt": "hi", "max_tokens": 2}',
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).read()
        text = urllib.request.urlopen(f"{url}/metrics", timeout=60).read().decode()
    finally:
        stop_server(proc)
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.slow  # (a server to scrape: 5 s)
def test_every_series_the_rules_and_their_tests_name_is_one_chatd_exports(scraped):
    named = set(SERIES_NAME.findall(RULES.read_text()))
    named |= {SERIES_NAME.match(series).group() for firing, _, quiet in FIRING.values() for series in {**firing, **quiet}}
    assert named and named <= scraped, sorted(named - scraped)


def test_each_alert_fires_on_its_signal_after_its_for_and_not_on_healthy_series(tmp_path):
    tests = []
    for name, (firing, labels, quiet) in FIRING.items():
        rule = alerts()[name]
        expected = {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": rule["annotations"]}
        series = lambda values: [{"series": s, "values": v} for s, v in values.items()]  # noqa: E731
        tests.append({"interval": "1m", "input_series": series(firing),
                      "alert_rule_test": [{"eval_time": "14m", "alertname": name, "exp_alerts": [expected]}]})
        tests.append({"interval": "1m", "input_series": series(quiet),
                      "alert_rule_test": [{"eval_time": "14m", "alertname": name, "exp_alerts": []}]})
    test_file = tmp_path / "chatd_rules_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": tests}))
    run = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "SUCCESS" in run.stdout

"""deploy/grafana/chatd.json against a real Prometheus (Debian's `prometheus`, started here) that
scrapes a real `chatd serve` under load (two models, an alias with a canary ramp, two tenants of
two tiers, a conversation, a rating): every query of every panel returns data."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import create_key, start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "chatd.json"
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed")]
CONFIG = """
[store]
db_path = "{db}"
[auth]
enabled = true
[model]
compile = false
[[models]]
name = "stable"
path = "{demo}"
[[models]]
name = "v2"
path = "{demo}"
[aliases.chat]
targets = {{ stable = 50, v2 = 50 }}
ramp = {{ canary = "v2", steps = [50, 100], bake_seconds = 600, min_requests = 1000 }}
[tiers.free]
ttft_p95_seconds = 5.0
[tiers.paid]
ttft_p95_seconds = 2.0
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def query(prometheus: str, expr: str) -> list:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    answer = json.loads(urllib.request.urlopen(url, timeout=30).read())
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    demo = build_demo_model(root / "demo")
    config = CONFIG.format(db=root / "chatd.db", demo=demo)
    (root / "config.toml").write_text(config)
    keys = {"alice": create_key(root / "config.toml", "alice", "free"), "bob": create_key(root / "config.toml", "bob")}
    proc, url, _ = start_server(root, demo, config)
    port = free_port()
    scrape = root / "prometheus.yml"
    # Every 2 s, with as long to answer: a scrape cut short on a busy machine would leave gaps.
    scrape.write_text(f"global: {{scrape_interval: 2s, scrape_timeout: 2s, evaluation_interval: 2s}}\n"
                      f"scrape_configs:\n  - job_name: chatd\n"
                      f"    static_configs: [{{targets: ['{url.removeprefix('http://')}']}}]\n")
    server = subprocess.Popen([PROMETHEUS, f"--config.file={scrape}", f"--storage.tsdb.path={root / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=open(root / "prometheus.log", "w"))
    prometheus_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{prometheus_url}/-/ready", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, (root / "prometheus.log").read_text()[-2000:]
                time.sleep(0.2)
        for who in ("alice", "bob"):  # load for a few scrapes
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys[who], max_retries=0)
            for _ in range(8):  # (the free tier allows 20 requests a minute)
                client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True).close()
                client.completions.create(model="stable", prompt="Once", max_tokens=4)
            conversation = client.post("/conversations", cast_to=dict, body={"model": "v2"})
            turn = client.post(f"/conversations/{conversation['id']}/messages", cast_to=dict,
                               body={"content": "hello", "max_tokens": 4})
            client.post("/feedback", cast_to=dict, body={"id": turn["id"], "rating": "down"})
        deadline = time.monotonic() + 60
        while not query(prometheus_url, 'chatd:feedback_total{model_name="v2",rating="down"} == 2'):  # the last act
            assert time.monotonic() < deadline, "Prometheus never scraped the load"
            time.sleep(0.5)
        yield prometheus_url
    finally:
        server.terminate()
        server.wait(timeout=30)
        stop_server(proc)


def test_every_panel_s_query_returns_data_from_a_real_prometheus(prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(panels) >= 20 and all(panel["targets"] for panel in panels)
    deadline = time.monotonic() + 90  # each rate needs scrapes on both sides of the load
    while True:
        empty = [f"{panel['title']}: {target['expr']}" for panel in panels for target in panel["targets"]
                 if not query(prometheus, target["expr"].replace("$__rate_interval", "30s"))]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert empty == []


def test_the_golden_signals_read_what_the_load_did(prometheus):
    by_tier = {r["metric"]["tier"]: float(r["value"][1]) for r in
               query(prometheus, 'sum by (tier) (chatd:usage_tokens_total{kind="completion"})')}
    assert by_tier["free"] > 0 and by_tier["paid"] > 0
    ratings = query(prometheus, 'sum by (model_name, rating) (chatd:feedback_total{rating="down"})')
    assert {r["metric"]["model_name"]: float(r["value"][1]) for r in ratings}["v2"] == 2
    weights = query(prometheus, "chatd:canary_weight")
    assert [float(r["value"][1]) for r in weights] == [50.0]

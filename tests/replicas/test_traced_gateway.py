"""Replicas behind real gateways (HAProxy, and the SGLang Model Gateway where it is installed)
with tracing on: a client's traceparent passes through the gateway, each replica continues the
client's trace under the client's span, and the spans say which replica served (service.instance.id)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.otlp_collector import FAST_EXPORT, Collector, one, trace_id_of
from tests.replicas import cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced(postgres, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("traced-replicas")
    model_dir = build_demo_model(root / "demo")
    store_url = postgres.create_database(f"chatd_{uuid.uuid4().hex[:12]}")
    collector = Collector()
    for name, value in FAST_EXPORT.items():  # the replicas' environment is this process's
        monkeypatch_module.setenv(name, value)
    config = cluster.replica_config(store_url, extra=f'[tracing]\notlp_endpoint = "{collector.url}"\n')
    replicas = [cluster.Replica(f"t{i}", root, model_dir, config) for i in range(2)]
    gateways = []
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        gateways.append(cluster.HAProxy(root, replicas))
        if not cluster.missing("smg"):
            gateways.append(cluster.Smg(root, replicas, "round_robin"))
        yield gateways, collector
    finally:
        for gateway in gateways:
            gateway.stop()
        for replica in replicas:
            replica.stop()
        collector.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_each_replica_continues_the_clients_trace_through_the_gateway(traced):
    gateways, collector = traced
    for gateway in gateways:
        instances = set()
        for _ in range(4):
            trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
            reply = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                               headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                               json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            assert trace_id_of(reply.headers) == trace_id  # the reply's header came back through the gateway
            spans = collector.trace(trace_id, "POST /v1/chat/completions")
            root = one(spans, "POST /v1/chat/completions")
            assert root["parent"] == parent
            assert {s["name"] for s in spans} >= {"chatd.check", "chatd.admit", "chat demo", "chatd.decode"}
            instances.add(root["service"]["service.instance.id"])
        assert len(instances) == 2, f"{type(gateway).__name__} sent every request to one replica"

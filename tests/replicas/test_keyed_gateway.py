"""Replicas with chatd's keys on, behind the SGLang Model Gateway: with `[auth] public_models`
smg learns the model's name from /v1/models without a key, every client's own key passes
through to the replicas, and each tenant is billed for its own requests only."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from chatd.engine.models.demo import build_demo_model
from tests.http.serving import create_key
from tests.replicas import cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keyed(postgres, tmp_path_factory):
    why = cluster.missing("smg")
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("keyed")
    model_dir = build_demo_model(root / "demo")
    store_url = postgres.create_database(f"chatd_{uuid.uuid4().hex[:12]}")
    config = cluster.replica_config(store_url, extra="[auth]\nenabled = true\npublic_models = true\n")
    replicas = [cluster.Replica(f"k{i}", root, model_dir, config) for i in range(2)]
    keys = {name: create_key(replicas[0].folder / "config.toml", name) for name in ("alice", "bob")}
    gateway = None
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        gateway = cluster.Smg(root, replicas, "cache_aware")
        yield gateway, keys, replicas
    finally:
        if gateway is not None:
            gateway.stop()
        for replica in replicas:
            replica.stop()


def test_tenants_keys_pass_through_smg_and_each_is_billed_alone(keyed):
    gateway, keys, replicas = keyed
    replica = replicas[0].url  # usage and cards asked of a replica: smg answers its own /v1/models
    with httpx.Client(timeout=60) as client:
        assert [m["id"] for m in client.get(f"{gateway.url}/v1/models").json()["data"]] == ["demo"]

        def chat(key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return client.post(f"{gateway.url}/v1/chat/completions", headers=headers, json={
                "model": "demo", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 4,
                "ignore_eos": True})

        for _ in range(3):
            r = chat(keys["alice"])
            assert r.status_code == 200, r.text
        for key in (None, keys["alice"][:-1] + "x"):
            r = chat(key)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # Only the list is open: a model's card, like every other route, still needs a key. (The
        # billing rows are in the one database, so any replica reads them.)
        assert client.get(f"{replica}/v1/models").json()["data"][0]["id"] == "demo"
        assert client.get(f"{replica}/v1/models/demo").status_code == 401

        def requests_of(name: str) -> int:
            r = client.get(f"{replica}/v1/usage?period=day", headers={"Authorization": f"Bearer {keys[name]}"})
            assert r.status_code == 200 and r.json()["tenant"] == name
            return r.json()["requests"]

        deadline = time.monotonic() + 10  # usage is written just after each response
        while requests_of("alice") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (requests_of("alice"), requests_of("bob")) == (3, 0)

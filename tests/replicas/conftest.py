"""Three chatd replicas on one real PostgreSQL database, for the tests of running past one node.
Each test module gets its own database and replicas; gateways are the tests' to start."""

from __future__ import annotations

import uuid

import pytest

from chatd.engine.models.demo import build_demo_model
from tests.postgres_server import PostgresServer
from tests.replicas import cluster


@pytest.fixture(scope="session")
def postgres():
    why = cluster.missing()
    if why:
        pytest.skip(why)
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="module")
def replicas(postgres, tmp_path_factory):
    """Three replicas of the demo model sharing one new database, all ready."""
    root = tmp_path_factory.mktemp("replicas")
    model_dir = build_demo_model(root / "demo")
    store_url = postgres.create_database(f"chatd_{uuid.uuid4().hex[:12]}")
    started = [cluster.Replica(f"r{i}", root, model_dir, cluster.replica_config(store_url)) for i in range(3)]
    try:
        for replica in started:
            replica.start()
        for replica in started:
            replica.wait_ready()
        yield started
    finally:
        for replica in started:
            replica.stop()

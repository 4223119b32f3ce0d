"""`chatd bench --responses` against a real `chatd serve`: each session is a chain of responses
by previous_response_id, each turn sending only its new message; per turn, what the server took
from its prefix cache; nothing left behind."""

from __future__ import annotations

import sqlite3

import pytest

from chatd.bench.load import run_bench
from chatd.bench.options import BenchOptions
from chatd.engine.models.demo import build_demo_model
from tests.http.serving import start_server, stop_server

# Slow: the load generator's other modes are tested fast (test_bench.py); this adds a server.
pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    db = tmp_path / "chatd.db"
    proc, url, _ = start_server(tmp_path, build_demo_model(tmp_path / "demo"), f'[store]\ndb_path = "{db}"\n')
    yield url, db
    stop_server(proc)


async def test_responses_mode_chains_turns_and_reports_the_cached_history(server):
    url, db = server
    options = BenchOptions(url=f"{url}/v1", concurrency=(2,), num_requests=2, multi_turn=3, prompt_tokens=(20, 30),
                           output_tokens=(6, 6), ignore_eos=True, responses=True)
    level = (await run_bench(options)).levels[0]
    assert [(r.session, r.turn, r.ok) for r in level.requests] == [(s, t, True) for s in (0, 1) for t in (1, 2, 3)]
    for session in (0, 1):
        turns = [r for r in level.requests if r.session == session]
        for earlier, later in zip(turns, turns[1:]):
            # The server rendered the history itself: all of the previous turn is cached, up to its last block.
            assert later.num_prompt_tokens > earlier.num_prompt_tokens + earlier.num_output_tokens
            assert later.num_cached_tokens >= (earlier.num_prompt_tokens + earlier.num_output_tokens) // 16 * 16 - 16
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM responses WHERE deleted_at IS NULL").fetchall() == [(0,)]
        assert conn.execute("SELECT COUNT(*) FROM usage_events WHERE endpoint = 'responses'").fetchall() == [(6,)]

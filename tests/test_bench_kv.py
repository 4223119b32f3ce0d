"""benchmarks/kv_sessions.py's quick run: the host tier gives back what the device pool let go."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_kv_sessions_quick_restores_from_the_host_what_the_pool_let_go_with_the_same_replies(tmp_path):
    path = tmp_path / "kv.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/kv_sessions.py", "--quick", "--model", "demo", "--kv-dtypes", "auto",
         "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    off, on = json.loads(path.read_text())["results"]
    assert (off["host_blocks"], off["blocks_from_host"]) == (0, 0) and on["host_blocks"] > 0
    assert on["blocks_from_host"] > 0 and on["host_hit_tokens"] == on["blocks_from_host"] * 16
    # What came back from the host was not computed again, and changed no reply.
    assert sum(off["computed_per_turn"]) - sum(on["computed_per_turn"]) == on["host_hit_tokens"]
    assert on["computed_per_turn"][0] == off["computed_per_turn"][0]  # nothing to restore on the first turn
    assert on["same_replies_as_first_run"]
    assert "last TTFT" in run.stdout

"""benchmarks/fleet.py's quick run: two engines' shared and lone throughput, a cold model's first
token, the mixed workload's escalated share and the share the small model's confidence sends up,
every number present and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.engine.models.sources import default_model_path

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_fleet_quick_measures_sharing_cold_starts_and_the_escalated_share(tmp_path):
    if default_model_path() is None:
        pytest.skip("the default model's package is not installed")
    path = tmp_path / "fleet.json"
    run = subprocess.run([sys.executable, "benchmarks/fleet.py", "--quick", "--json", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "stopped (exit 0)" in run.stdout  # the server shut down cleanly
    result = json.loads(path.read_text())
    for model in ("smol", "smol-b"):
        row = result["sharing"][model]
        assert row["alone_tok_s"] > 0 and row["shared_tok_s"] > 0 and row["tok_s_ratio"] > 0
        assert all(run["alone"]["num_failed"] == run["shared"]["num_failed"] == 0 for run in row["rounds"])
    for model in ("small", "smol"):
        cold = result["cold_start"][model]
        assert cold["cold_ttft_s"] > cold["warm_ttft_s"] > 0  # loading comes first
    mixed = result["escalation"]
    # Every kind but the short chat meets a rule; the short chats stay small.
    assert set(mixed["served_by_kind"]["short chat"]) <= {"small"}
    for kind in ("long prompt", "tools", "json format", "long conversation"):
        assert set(mixed["served_by_kind"][kind]) <= {"smol"}
    escalated = sum(count for kind, served in mixed["served_by_kind"].items() for model, count in served.items()
                    if model == "smol")
    assert mixed["escalated_share"] == escalated / mixed["requests"]
    assert "Escalation:" in run.stdout and "Cold start" in run.stdout
    probed = result["confidence"]
    assert probed["requests"] == 10 and 0 <= probed["sent_up_share"] <= 1 and probed["direct_ttft_s"] > 0
    assert probed["sent_up_share"] == sum(probed["sent_up_by_kind"].values()) * 2 / 10
    assert "Escalation by confidence" in run.stdout

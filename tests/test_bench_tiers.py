"""benchmarks/tiers.py's quick run drives every mode to the end and accounts for every request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_tiers_quick_runs_every_mode_and_every_free_request_ends_served_or_refused(tmp_path):
    path = tmp_path / "tiers.json"
    run = subprocess.run([sys.executable, "benchmarks/tiers.py", "--quick", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(path.read_text())
    for mode in ("paid_alone", "tiers", "fcfs"):
        paid = report[mode]["paid"]
        assert paid["served"] > 0 and paid["failed"] == 0, (mode, paid)
        assert 0 < paid["ttft_p50"] <= paid["ttft_p95"]
    assert report["paid_alone"]["free"] is None
    for mode in ("tiers", "fcfs"):
        for free in [report[mode]["free"]] + [run["free"] for run in report[mode]["runs"]]:
            assert free["sent"] == free["served"] + free["429"] + free["503"] + free["timeout"] + free["failed"] > 0
            assert free["failed"] == 0, free["errors"]
    assert report["fcfs"]["free"]["429"] == report["fcfs"]["free"]["503"] == 0  # tiers off: nothing refused
    assert "[tiers.free]" in report["tiers"]["config"] and "ttft_p95_seconds" in report["tiers"]["config"]
    assert set(report["ratios"]) == {"paid p95 with tiers / alone (goal <= 1.5)", "paid p95 without tiers (fcfs) / alone"}

"""benchmarks/hostile_grammars.py's quick run on the demo model: every mode measured, the worst
allowed grammar served, the refused grammars refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_hostile_grammars_quick_measures_each_mode_and_times_the_refusals(tmp_path):
    path = tmp_path / "hostile.json"
    run = subprocess.run([sys.executable, "benchmarks/hostile_grammars.py", "--quick", "--tokens", "8", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    report = json.loads(path.read_text())
    assert set(report["runs"]) == {"alone", "plain", "hostile"}
    [hostile] = report["runs"]["hostile"]
    assert hostile["hostile"]["status"] == 200
    assert [refused["status"] for refused in hostile["refused"]] == [400, 400, 400]
    assert all(report["summary"][mode]["health_max"] > 0 for mode in report["summary"])
    assert "hostile / alone, plain:" in run.stdout

"""benchmarks/parallel.py's quick run: one rank and two side by side, the same tokens, every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_parallel_quick_times_each_step_on_one_and_two_ranks_with_the_same_tokens(tmp_path):
    path = tmp_path / "parallel.json"
    run = subprocess.run([sys.executable, "benchmarks/parallel.py", "--quick", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["same_tokens"] is True
    assert set(result["steps"]) == {"decode_1", "decode_4", "prefill"}
    for row in result["steps"].values():
        assert row["tp1_ms"] > 0 and row["tp2_ms"] > 0
        assert row["ratio"] == pytest.approx(row["tp2_ms"] / row["tp1_ms"])
    assert [line.split()[0] for line in result["paper"][1:]] == ["decode,", "decode,", "prefill,"]
    assert "greedy tokens of TP=2 equal TP=1's: yes" in run.stdout

"""benchmarks/quant_quality.py's quick run on the demo model: every figure for every mode asked."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.engine.models.demo import build_demo_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quant_quality_measures_perplexity_agreement_and_step_time_per_mode(tmp_path):
    model = build_demo_model(tmp_path / "demo")
    path = tmp_path / "quant.json"
    run = subprocess.run([sys.executable, "benchmarks/quant_quality.py", "--model", str(model), "--modes", "none,int8",
                          "--max-tokens", "4", "--window", "128", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    none, int8 = json.loads(path.read_text())["results"]
    assert (none["mode"], int8["mode"]) == ("none", "int8")
    assert none["agreement"] == none["first_token"] == 1.0
    for result in (none, int8):
        assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1
        assert result["text_tokens"] > 500 and result["decode_step_ms"] > 0 and result["prefill_ms"] > 0
        assert 0 <= result["agreement"] <= 1

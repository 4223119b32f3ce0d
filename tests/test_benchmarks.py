"""benchmarks/steps.py's CPU smoke run gives every number it promises; offline.py runs it when it should."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_offline():
    spec = importlib.util.spec_from_file_location("offline_benchmark", ROOT / "benchmarks" / "offline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_steps_quick_on_cpu_reports_step_times_rooflines_and_a_prefix_cache_hit(tmp_path):
    path = tmp_path / "steps.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/steps.py", "--quick", "--device", "cpu", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["errors"] == []
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    for row in result["decode"]:
        assert row["step_seconds"] > 0
        assert 0 < row["roofline_fraction"] <= 1.5
        assert row["roofline_seconds"] == max(row["memory_roofline_seconds"], row["compute_roofline_seconds"])
    no_cache, cached = result["ttft"]
    assert no_cache["num_cached_tokens"] == [0] * 3
    assert all(n >= 144 for n in cached["num_cached_tokens"])  # 150 shared tokens: 9 whole blocks of 16
    assert no_cache["ttft_seconds"] > 0 and cached["ttft_seconds"] > 0
    # The table names how the rooflines were computed.
    assert "FLOPs = 2 x (non-embedding params + lm_head) x batch" in run.stdout
    assert "memory roofline  = (weights + KV read + KV written) / copy bandwidth" in run.stdout
    assert "(the prompt is one step)" in run.stdout


@pytest.mark.parametrize(
    ("flags", "runs_steps"),
    [(["--device", "cpu"], False), (["--device", "cpu", "--steps"], True),
     (["--device", "cuda"], True), (["--device", "cuda", "--skip-steps"], False)],
)
def test_offline_runs_the_steps_section_on_cuda_unless_skipped_and_on_cpu_when_asked(flags, runs_steps):
    assert load_offline().parse_args(flags).run_steps is runs_steps

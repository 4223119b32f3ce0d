"""benchmarks/structured.py's quick run on the demo model gives every number it promises, with or without xgrammar."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ["tool arguments", "person record", "anyOf event", "enum-heavy form", "any JSON object"]
TIMES = ("compile_seconds", "first_mask_seconds", "mask_seconds")


def run_quick(tmp_path: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "structured.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/structured.py", "--quick", "--model", "demo", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(path.read_text())


@pytest.mark.slow
def test_structured_quick_reports_library_times_and_step_cost_of_0_1_and_all_constrained_rows(tmp_path):
    run, result = run_quick(tmp_path)

    has_xgrammar = importlib.util.find_spec("xgrammar") is not None
    libraries = result["libraries"]
    assert sorted(libraries) == (["llguidance", "xgrammar"] if has_xgrammar else ["llguidance"])
    for library in libraries.values():
        assert library["tokenizer_setup_seconds"] > 0
        assert [row["schema"] for row in library["schemas"]] == SCHEMAS
        for row in library["schemas"]:
            assert all(row[key] > 0 for key in TIMES), row
            assert all(steps >= 1 for steps in row["walk_steps"])
    if has_xgrammar:
        assert result["xgrammar_skipped"] is None
        assert [row["schema"] for row in result["ratios"]] == SCHEMAS
        assert all(row[key] > 0 for row in result["ratios"] for key in TIMES)
        assert "xg/ll mask" in run.stdout
    else:
        assert result["xgrammar_skipped"] and result["ratios"] == []
        assert "xgrammar not measured" in run.stdout

    steps = result["steps"]
    batch = steps["batch"]
    assert [case["constrained_rows"] for case in steps["cases"]] == [0, 1, batch]
    for case in steps["cases"]:
        assert case["step_seconds"] > 0 and case["ratio"] > 0
        assert len(case["runs"]) == len(case["grammar_runs"]) == steps["timed_steps_per_case"]
        # The grammar work is part of the step it was measured in.
        assert all(0 <= grammar < step for grammar, step in zip(case["grammar_runs"], case["runs"]))
    assert steps["cases"][0]["ratio"] == 1.0
    assert all(case["grammar_seconds"] > 0 for case in steps["cases"][1:])
    # A constrained row writes the schema's JSON; the free rows write whatever the model likes.
    assert all(case["first_row_text"].startswith('{"items"') for case in steps["cases"][1:])


@pytest.mark.slow
def test_structured_quick_without_xgrammar_measures_llguidance_alone(tmp_path):
    # An xgrammar module that fails to import stands in for a machine without it.
    (tmp_path / "xgrammar.py").write_text("raise ImportError('xgrammar hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    run, result = run_quick(tmp_path, env)
    assert sorted(result["libraries"]) == ["llguidance"]
    assert result["xgrammar_skipped"] == "xgrammar hidden by the test" and result["ratios"] == []
    assert "xgrammar not measured: xgrammar hidden by the test" in run.stdout
    assert [case["constrained_rows"] for case in result["steps"]["cases"]] == [0, 1, result["steps"]["batch"]]

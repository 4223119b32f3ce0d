"""benchmarks/safety_eval.py scores the shipped rules on the labelled set: few benign texts
flagged, most violations found, in both splits.

The floors sit a little below what the shipped rules measured when written (labels found: 95.5%
dev, 92.9% test; benign texts flagged: 2 of 107 dev, 0 of 106 test; lowest recall of a category:
78.9%, self-harm/intent), so the test fails when a change to the rules or the engine loses real
ground, not when one text moves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
                  "self-harm", "self-harm/intent", "self-harm/instructions", "sexual", "sexual/minors",
                  "violence", "violence/graphic", "pii/email", "pii/phone", "pii/card")


def run_eval(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The script run from the repository root with `flags`; its output and its JSON."""
    path = tmp_path / "safety.json"
    run = subprocess.run([sys.executable, "benchmarks/safety_eval.py", *flags, "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(path.read_text())


def test_the_shipped_rules_flag_few_benign_texts_and_find_most_violations(tmp_path):
    run, result = run_eval(tmp_path)

    assert result["num_texts"] >= 300 and result["num_benign"] >= 180
    assert result["benign_false_positive_rate"] < 0.02
    assert sorted(result["per_category"]) == sorted(ALL_CATEGORIES)
    assert all(row["positives"] >= 8 for row in result["per_category"].values())
    assert all(row["recall"] >= 0.7 for row in result["per_category"].values()), result["per_category"]
    dev, test = result["by_split"]["dev"], result["by_split"]["test"]
    assert dev["benign_false_positive_rate"] < 0.03 and test["benign_false_positive_rate"] < 0.03
    assert dev["micro_recall"] >= 0.9 and test["micro_recall"] >= 0.85
    assert dev["violating_flagged_rate"] >= 0.9 and test["violating_flagged_rate"] >= 0.9
    assert dev["num_texts"] + test["num_texts"] == result["num_texts"]
    assert result["microseconds_per_text"] > 0
    assert "benign false-positive rate, test" in run.stdout


def test_one_split_and_a_rules_file_of_ones_own(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[illicit]\nwords = ["heroin"]\n')
    _, result = run_eval(tmp_path, "--split", "dev", "--rules", str(rules))

    assert list(result["by_split"]) == ["dev"]
    illicit = result["per_category"]["illicit"]
    assert illicit["tp"] >= 1 and illicit["fp"] == 0
    assert result["per_category"]["hate"]["tp"] == 0  # no hate rules in that file
    assert result["per_category"]["pii/card"]["recall"] >= 0.8  # the built-in detectors still run

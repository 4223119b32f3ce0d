"""How well the safety pipeline's rules stage (chatd/safety/rules.py) sorts a labelled set of
prompts: precision and recall per category, and how often it flags a benign text.

benchmarks/safety/prompts.jsonl holds one labelled text a line: {"text", "categories", "split"}.
`categories` lists every category of chatd.safety.rules.ALL_CATEGORIES the text truly falls in
(empty: benign). Labelling: a subcategory's label comes with its parent's ("sexual/minors" texts
are "sexual" too), as OpenAI's subcategories are subsets and the rules report a subcategory's
match under its parent; a threat aimed at the reader is harassment/threatening, violence urged
against someone else is violence, one aimed at a group for who they are is hate/threatening.
About half of each group of texts is the "dev" split, which the shipped rules were written
against; the other half, "test", was not looked at while writing them, so it shows how the
rules generalise. Most benign texts are chosen to use the rules' trigger words harmlessly
("kill the process", "breast cancer screening", order numbers that look like card numbers).

A text counts as flagged for category C when any match has category C; precision and recall are
per text. The benign false-positive rate is the share of benign texts with any match at all.

    python benchmarks/safety_eval.py                       # both splits, the shipped rules
    python benchmarks/safety_eval.py --split dev --rules my_rules.toml --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from chatd.safety.rules import ALL_CATEGORIES, RuleSet  # noqa: E402

PROMPTS_PATH = Path(__file__).resolve().parent / "safety" / "prompts.jsonl"
SPLITS = ("dev", "test")


@dataclass(frozen=True)
class Judged:
    """One labelled text and the categories the rules flagged it for."""

    text: str
    labels: frozenset[str]
    flagged: frozenset[str]
    split: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=("dev", "test", "all"), default="all", help="which texts (default all)")
    parser.add_argument("--rules", type=Path, help="a rules TOML file (default: chatd's shipped default_rules.toml)")
    parser.add_argument("--prompts", type=Path, default=PROMPTS_PATH, help="the labelled set (default %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--show-errors", action="store_true", help="list every missed and wrongly flagged text")
    return parser.parse_args(argv)


def read_prompts(path: Path, split: str) -> list[dict]:
    """The labelled texts of one split ("all": both); ValueError on a label that is no category."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for number, row in enumerate(rows, 1):
        unknown = set(row["categories"]) - set(ALL_CATEGORIES)
        if unknown or row["split"] not in SPLITS:
            raise ValueError(f"{path}:{number}: unknown label {sorted(unknown)} or split {row['split']!r}")
    return [row for row in rows if split == "all" or row["split"] == split]


def judge(rules: RuleSet, rows: list[dict]) -> tuple[list[Judged], float]:
    """Every text scanned; and the seconds the scans took, all together."""
    judged, seconds = [], 0.0
    for row in rows:
        started = time.perf_counter()
        matches = rules.scan(row["text"])
        seconds += time.perf_counter() - started
        judged.append(Judged(row["text"], frozenset(row["categories"]), frozenset(m.category for m in matches), row["split"]))
    return judged, seconds


def ratio(numerator: int, denominator: int) -> float | None:
    """numerator / denominator, or None (JSON null, printed "-") when there is nothing to divide."""
    return numerator / denominator if denominator else None


def summarize(judged: list[Judged]) -> dict:
    """Per-category counts, precision and recall, and the benign false-positive rate, of some texts."""
    per_category = {}
    for category in ALL_CATEGORIES:
        positives = sum(category in j.labels for j in judged)
        tp = sum(category in j.labels and category in j.flagged for j in judged)
        fp = sum(category not in j.labels and category in j.flagged for j in judged)
        per_category[category] = {"positives": positives, "tp": tp, "fp": fp,
                                  "precision": ratio(tp, tp + fp), "recall": ratio(tp, positives)}
    benign = [j for j in judged if not j.labels]
    violating = [j for j in judged if j.labels]
    num_labels = sum(len(j.labels) for j in violating)
    return {
        "per_category": per_category,
        "benign_false_positive_rate": ratio(sum(bool(j.flagged) for j in benign), len(benign)),
        # every (text, label) pair: the share the rules found
        "micro_recall": ratio(sum(len(j.labels & j.flagged) for j in violating), num_labels),
        # violating texts flagged for at least one of their own categories (what a block needs)
        "violating_flagged_rate": ratio(sum(bool(j.labels & j.flagged) for j in violating), len(violating)),
        "num_texts": len(judged),
        "num_benign": len(benign),
    }


def percent(value: float | None) -> str:
    """A ratio as printed: "94.1%", or "-" when undefined."""
    return "-" if value is None else f"{value:.1%}"


def print_summary(title: str, summary: dict) -> None:
    """One split's table: per category, then the benign false-positive rate and overall recall."""
    print(f"\n{title}: {summary['num_texts']} texts, {summary['num_benign']} benign")
    print(f"{'category':24s} {'positives':>9s} {'tp':>4s} {'fp':>4s} {'precision':>10s} {'recall':>7s}")
    for category, row in summary["per_category"].items():
        print(f"{category:24s} {row['positives']:9d} {row['tp']:4d} {row['fp']:4d} "
              f"{percent(row['precision']):>10s} {percent(row['recall']):>7s}")
    print(f"benign false-positive rate {percent(summary['benign_false_positive_rate'])}, "
          f"recall over all labels {percent(summary['micro_recall'])}, "
          f"violating texts flagged {percent(summary['violating_flagged_rate'])}")


def print_errors(judged: list[Judged]) -> None:
    """Each text whose flags differ from its labels: what was missed, what was flagged wrongly."""
    for j in judged:
        missed, extra = sorted(j.labels - j.flagged), sorted(j.flagged - j.labels)
        if missed or extra:
            print(f"  [{j.split}] missed {missed} extra {extra}: {j.text}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rules = RuleSet.load(args.rules)
    judged, seconds = judge(rules, read_prompts(args.prompts, args.split))
    print(f"rules {args.rules or 'default_rules.toml'}, prompts {args.prompts}, split {args.split}")
    by_split = {split: summarize([j for j in judged if j.split == split])
                for split in SPLITS if any(j.split == split for j in judged)}
    for split, summary in by_split.items():
        print_summary(split, summary)
    result = summarize(judged)
    if len(by_split) > 1:
        print_summary("all", result)
    result["by_split"] = by_split
    result["microseconds_per_text"] = seconds / len(judged) * 1e6 if judged else None
    print()
    for split, summary in by_split.items():
        print(f"benign false-positive rate, {split}: {percent(summary['benign_false_positive_rate'])}")
    print(f"benign false-positive rate, all: {percent(result['benign_false_positive_rate'])}")
    print(f"scan time per text: {result['microseconds_per_text']:.0f} us")
    if args.show_errors:
        print("\nerrors:")
        print_errors(judged)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

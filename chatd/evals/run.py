"""`chatd eval FILE`: a golden set run against a served model, scored, and gated.

Each item is sent as a chat completion (temperature 0, its max_tokens) to `--base-url` and
`--model` (a model, or a version of an alias named directly), a few at a time; its reply is
scored (scoring.py). The result is the share of items passed with a 95% Wilson interval; it
fails the gate when the share is under `--min-score`, or under a saved baseline's (`--baseline`,
a previous run's `--json`) by more than this run's interval, and the command then exits 1.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from chatd.evals.golden import GoldenItem, load_golden
from chatd.evals.scoring import Judge, score

Z_95 = 1.959964  # the normal quantile of a two-sided 95% interval


@dataclass
class ItemResult:
    id: str
    passed: bool
    reply: str
    why: str  # for a failure: what was wrong


def wilson_interval(passed: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The 95% Wilson score interval of a share passed: sound at 0%, 100% and small sets, where
    the normal approximation's is not."""
    if total == 0:
        return 0.0, 1.0
    p = passed / total
    center = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, center - half), min(1.0, center + half)


async def run_items(items: list[GoldenItem], base_url: str, model: str, api_key: str | None, judge_url: str | None,
                    judge_model: str | None, judge_key: str | None, concurrency: int) -> list[ItemResult]:
    """Every item's reply from the model, scored; a request that fails counts as a failed item."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/chat/completions"
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        judge = Judge(session, judge_url, judge_model, judge_key) if judge_url and judge_model else None

        async def one(item: GoldenItem) -> ItemResult:
            async with gate:
                body = {"model": model, "messages": list(item.messages), "max_tokens": item.max_tokens, "temperature": 0}
                try:
                    async with session.post(url, json=body, headers=headers) as response:
                        answer = await response.json(content_type=None)
                        if response.status != 200:
                            message = answer.get("error", {}).get("message") if isinstance(answer, dict) else answer
                            return ItemResult(item.id, False, "", f"the server answered {response.status}: {message}")
                    reply = answer["choices"][0]["message"]["content"] or ""
                    if item.scoring == "rubric":
                        if judge is None:
                            raise ValueError("a rubric item needs --judge-base-url and --judge-model")
                        passed, why = await judge.grade(item, reply)
                    else:
                        passed, why = score(item, reply)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError) as exc:
                    return ItemResult(item.id, False, "", f"{type(exc).__name__}: {exc}")
                return ItemResult(item.id, passed, reply, "" if passed else why)

        return list(await asyncio.gather(*(one(item) for item in items)))


def summary(results: list[ItemResult], model: str, baseline: dict | None, min_score: float | None) -> dict:
    """The run's score, interval, gate and what changed from the baseline."""
    passed = sum(r.passed for r in results)
    low, high = wilson_interval(passed, len(results))
    score_ = passed / len(results)
    failures = []
    if min_score is not None and score_ < min_score:
        failures.append(f"score {score_:.3f} is under --min-score {min_score:g}")
    regressed = []
    if baseline is not None:
        margin = (high - low) / 2
        if score_ < baseline["score"] - margin:
            failures.append(f"score {score_:.3f} is under the baseline's {baseline['score']:.3f} by more than this "
                            f"run's interval (±{margin:.3f})")
        was = {item["id"]: item["passed"] for item in baseline.get("items", [])}
        regressed = [r.id for r in results if was.get(r.id) and not r.passed]
    return {"model": model, "items": [asdict(r) for r in results], "passed": passed, "total": len(results),
            "score": score_, "interval_95": [low, high], "baseline_score": baseline["score"] if baseline else None,
            "regressed": regressed, "gate_failures": failures, "finished_at": time.time()}


def print_report(result: dict) -> None:
    for item in result["items"]:
        mark = "pass" if item["passed"] else "FAIL"
        print(f"{mark}  {item['id']}" + (f"  {item['why']}" if item["why"] else ""))
    low, high = result["interval_95"]
    print(f"\n{result['model']}: {result['passed']}/{result['total']} passed, score {result['score']:.3f} "
          f"(95% interval {low:.3f}-{high:.3f})")
    if result["baseline_score"] is not None:
        print(f"baseline {result['baseline_score']:.3f}; regressed: {', '.join(result['regressed']) or 'none'}")
    for failure in result["gate_failures"]:
        print(f"gate failed: {failure}")


def main(args) -> int:
    items = load_golden(Path(args.target))
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    if any(item.scoring == "rubric" for item in items) and not (args.judge_base_url and args.judge_model):
        raise ValueError("the golden set has rubric items: give --judge-base-url and --judge-model")
    results = asyncio.run(run_items(items, args.base_url, args.model, args.api_key, args.judge_base_url,
                                    args.judge_model, args.judge_api_key or args.api_key, args.concurrency))
    result = summary(results, args.model, baseline, args.min_score)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 1 if result["gate_failures"] else 0

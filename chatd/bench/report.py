"""What a `chatd bench` run leaves and how it reads: request records, per-level summaries, the report.

Per level: time to first token (TTFT), inter-token latency (ITL), end-to-end latency and
throughput; per turn of a multi-turn run, TTFT and, from `usage`, how many prompt tokens the
server took from its prefix cache and how many it had to compute. It knows nothing of HTTP:
load.py fills the records, this file only reads them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import orjson

from chatd.bench.options import BenchOptions


@dataclass
class RequestRecord:
    """One streamed request as the client saw it; times are seconds from sending it."""

    session: int
    turn: int  # 1-based turn within the session's conversation
    max_tokens: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # first content delta; None when the reply was empty
    itls: list[float] = field(default_factory=list)  # between content *chunks*, not tokens
    e2e: float | None = None
    num_output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    num_prompt_tokens: int | None = None  # usage.prompt_tokens when the server sent usage
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: from the prefix cache
    num_prefill_tokens: int | None = None  # prompt tokens the server computed: prompt - cached, when both are known
    response_id: str | None = None  # the Responses API's id of this turn's response (the next turn continues it)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 with linear interpolation between the nearest ranks (as numpy does)."""
    ordered = sorted(values)
    result: dict[str, float | None] = {}
    for q in (50, 95, 99):
        if not ordered:
            result[f"p{q}"] = None
            continue
        rank = (len(ordered) - 1) * q / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        result[f"p{q}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return result


@dataclass
class LevelResult:
    """Every request of one concurrency level, and the numbers a reader compares across levels."""

    concurrency: int
    wall_time: float
    requests: list[RequestRecord]

    def summary(self) -> dict:
        """Counts, latency percentiles (seconds) and throughput; per turn when multi-turn."""
        ok = [r for r in self.requests if r.ok]
        num_output_tokens = sum(r.num_output_tokens for r in ok)
        wall_time = max(self.wall_time, 1e-9)
        turns = []
        for turn in sorted({r.turn for r in ok}):
            in_turn = [r for r in ok if r.turn == turn]
            turns.append({
                "turn": turn,
                "num_ok": len(in_turn),
                "ttft_p50": percentiles([r.ttft for r in in_turn if r.ttft is not None])["p50"],
                # Means over the requests whose server reported the number; None when none did.
                "prompt_tokens_mean": _mean([r.num_prompt_tokens for r in in_turn]),
                "cached_tokens_mean": _mean([r.num_cached_tokens for r in in_turn]),
                "prefill_tokens_mean": _mean([r.num_prefill_tokens for r in in_turn]),
            })
        return {
            "concurrency": self.concurrency,
            "num_ok": len(ok),
            "num_failed": len(self.requests) - len(ok),
            "wall_time": self.wall_time,
            "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
            "itl_per_chunk": percentiles([itl for r in ok for itl in r.itls]),
            "e2e_p50": percentiles([r.e2e for r in ok])["p50"],
            "num_output_tokens": num_output_tokens,
            "output_tokens_per_s": num_output_tokens / wall_time,
            "requests_per_s": len(ok) / wall_time,
            "errors": Counter(r.error for r in self.requests if not r.ok).most_common(),
            "turns": turns,
        }


@dataclass
class BenchResult:
    """The options a run used and one result per concurrency level, in the order they ran."""

    options: BenchOptions
    levels: list[LevelResult]

    def to_json(self) -> bytes:
        """Options, per-level summaries and every request record, as indented JSON."""
        levels = [
            {"summary": level.summary(), "requests": [asdict(record) for record in level.requests]}
            for level in self.levels
        ]
        return orjson.dumps({"options": asdict(self.options), "levels": levels}, option=orjson.OPT_INDENT_2)


def _mean(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _tokens(mean: float | None) -> str:
    return "-" if mean is None else f"{mean:.0f}"


def format_level(level: LevelResult) -> str:
    """A short human report of one level, as printed by `chatd bench`."""
    s = level.summary()
    ttft, itl = s["ttft"], s["itl_per_chunk"]
    lines = [
        f"concurrency {s['concurrency']}: {s['num_ok']} ok, {s['num_failed']} failed in {s['wall_time']:.2f} s",
        f"  TTFT  p50 {_ms(ttft['p50'])}  p95 {_ms(ttft['p95'])}  p99 {_ms(ttft['p99'])}",
        f"  ITL   p50 {_ms(itl['p50'])}  p95 {_ms(itl['p95'])}  p99 {_ms(itl['p99'])}  (per streamed chunk)",
        f"  E2E   p50 {_ms(s['e2e_p50'])}",
        f"  {s['output_tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s",
    ]
    if max((r.turn for r in level.requests), default=1) > 1:  # a multi-turn run
        lines.append("  per turn (token counts are means; prefill = prompt - cached, what the server computed):")
        for turn in s["turns"]:
            lines.append(
                f"  turn {turn['turn']}: TTFT p50 {_ms(turn['ttft_p50'])}, {turn['num_ok']} ok, "
                f"prompt {_tokens(turn['prompt_tokens_mean'])}, cached {_tokens(turn['cached_tokens_mean'])}, "
                f"prefill {_tokens(turn['prefill_tokens_mean'])} tokens"
            )
    lines += [f"  failed x{count}: {error}" for error, count in s["errors"]]
    return "\n".join(lines)

"""What tracing costs: `chatd serve` with [tracing] off and on (sample_ratio 1.0: every span of
every request exported over OTLP/HTTP), side by side in one run, at 64 streams.

One run builds a random-weight model folder as `serve.py` does (its helpers, imported), starts a
trace collector on a loopback port (an OTLP/HTTP endpoint that takes each batch and answers 200,
counting bytes: it decodes nothing, so its CPU, on the same two cores, stays small; a real
collector runs elsewhere), then, for each of `--runs` rounds, starts chatd with tracing off and
with tracing on (the order alternates round by round, so a drifting machine favours neither),
drives each with chatd's load generator (streamed chat completions, prompts 100-200 words, 64
tokens out, EOS ignored) and stops it. From the traced server's /metrics: spans exported and
dropped. It prints each round's output tok/s and ends with:

    tracing on / off, output tok/s at 64 streams: median R (rounds: ...); N spans per request exported, D dropped

    python benchmarks/tracing.py                      # 3 rounds, ~6 minutes on the 2-core machine
    python benchmarks/tracing.py --runs 1 --streams 8 --num-requests 16 --output-tokens 16 16   # a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))  # run from a checkout, installed or not
sys.path.insert(0, str(BENCHMARKS))  # serve.py's helpers

from serve import (HOST, Server, add_common_arguments, bench_options, build_bench_model, free_port,  # noqa: E402
                   started_and_warm)

from chatd.bench.load import run_bench  # noqa: E402


class Collector:
    """An OTLP/HTTP endpoint that takes every batch (200) and counts what it was sent."""

    def __init__(self) -> None:
        self.batches = self.bytes = 0
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                collector.bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                collector.batches += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def trace_spans(base: str) -> dict[str, float]:
    """chatd:trace_spans_total by outcome, from the server's /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("chatd:trace_spans_total{"):
            found[line.split('outcome="')[1].split('"')[0]] = float(line.split()[-1])
    return found


def run_once(args, model_dir: Path, work: Path, traced: bool, collector: Collector) -> dict:
    config = work / ("traced.toml" if traced else "plain.toml")
    text = f'[model]\ndevice = "cpu"\ndtype = "float32"\n[scheduler]\nmax_num_batched_tokens = {args.max_num_batched_tokens}\n'
    if traced:
        text += f'[tracing]\notlp_endpoint = "{collector.url}"\nsample_ratio = 1.0\n'
    config.write_text(text)
    port = free_port()
    name = "traced" if traced else "plain"
    server = Server(name, [sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--config", str(config),
                           "--host", HOST, "--port", str(port)], work / f"{name}.log",
                    env={"OTEL_BSP_SCHEDULE_DELAY": "1000"})
    try:
        base = started_and_warm(server, port, args.start_timeout).removesuffix("/v1")
        options = bench_options(args, base + "/v1", None, True, args.num_requests)
        result = asyncio.run(run_bench(options))
        summary = result.levels[0].summary()
        if traced:
            time.sleep(2.0)  # the last batch leaves (OTEL_BSP_SCHEDULE_DELAY: 1 s)
        spans = trace_spans(base) if traced else {}
        print(f"[{name}] {summary['num_ok']} ok / {summary['num_failed']} failed, "
              f"{summary['output_tokens_per_s']:.1f} tok/s" + (f", spans {spans}" if traced else ""), flush=True)
        return {"tok_s": summary["output_tokens_per_s"], "ok": summary["num_ok"], "spans": spans}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--runs", type=int, default=3, help="rounds of off and on (default 3)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--num-requests", type=int, help="requests per server run (default: 2x the streams)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(100, 200), metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--json", metavar="PATH", help="also write every number to this file")
    args = parser.parse_args(argv)
    args.concurrency = (args.streams,)
    collector = Collector()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="chatd-tracing-bench-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        build_bench_model(args, model_dir)
        for i in range(args.runs):
            order = (False, True) if i % 2 == 0 else (True, False)
            runs = {traced: run_once(args, model_dir, work, traced, collector) for traced in order}
            rounds.append({"off": runs[False], "on": runs[True], "ratio": runs[True]["tok_s"] / runs[False]["tok_s"]})
    ratios = [r["ratio"] for r in rounds]
    requests = sum(r["on"]["ok"] + 1 for r in rounds)  # each run's warm-up too
    exported = sum(r["on"]["spans"].get("exported", 0) for r in rounds)
    dropped = sum(v for r in rounds for k, v in r["on"]["spans"].items() if k.startswith("dropped"))
    print(f"\ntracing on / off, output tok/s at {args.streams} streams: median {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)}); {exported / requests:.1f} spans per request exported, "
          f"{dropped:.0f} dropped; the collector got {collector.batches} batches, {collector.bytes / 1e6:.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

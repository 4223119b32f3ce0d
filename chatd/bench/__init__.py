"""`chatd bench`: an async load generator for any OpenAI-compatible server.

It streams chat or text completions at one or more concurrency levels and reports time to
first token (TTFT), inter-token latency (ITL), end-to-end latency and throughput. Multi-turn
sessions either resend their growing history to /chat/completions (stateless, as OpenAI) or
keep it on the server, the client posting only each new user message: with `conversations`
through chatd's conversations API, with `responses` through OpenAI's Responses API chained by
`previous_response_id`. Per turn it reports TTFT and, from `usage`, how
many prompt tokens the server took from its prefix cache and how many it had to compute.

    options.py   BenchOptions: what to send, how hard, for how long; the flags that fill it
    load.py      the load generator over HTTP (aiohttp): sessions, streamed requests, SSE; run_bench
    report.py    what a run leaves (RequestRecord, LevelResult, BenchResult): percentiles, format_level

Import a name from the file that owns it (`from chatd.bench.load import run_bench`). This file
declares the subcommand and loads only options.py, so `chatd keys list` never loads aiohttp's
client; the load generator is imported when `chatd bench` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from chatd.bench.options import add_arguments, options_from_args


def add_parser(subparsers) -> None:
    """Register `chatd bench` on the CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server (chatd, vLLM, ...)")
    add_arguments(bench)
    bench.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Run `chatd bench`: print each level as it ends, write --json; 1 when any request failed."""
    from chatd.bench.load import run_bench
    from chatd.bench.report import format_level

    options = options_from_args(args)
    mode = "conversations" if options.conversations else "responses" if options.responses else options.endpoint
    print(f"bench {options.url} ({mode}), concurrency {','.join(map(str, options.concurrency))}")
    result = asyncio.run(run_bench(options, on_level=lambda level: print(format_level(level), flush=True)))
    if args.json:
        with open(args.json, "wb") as file:
            file.write(result.to_json())
        print(f"wrote {args.json}")
    num_failed = sum(not r.ok for level in result.levels for r in level.requests)
    if num_failed:
        print(f"{num_failed} request(s) failed", file=sys.stderr)
    return 1 if num_failed else 0

"""Tiers under a flood: a paid trickle's time to first token while free tenants flood the server.

One run builds a random-weight model folder as `serve.py` does (its helpers, imported; by default
the offline benchmark's shape, heavy enough that the engine, not the HTTP front end, is what the
clients wait for), then starts `chatd serve` on it three times, one after the other, with the
key database on (keys made before each start), and drives it with streamed chat completions:

1. `paid_alone`: only the paid trickle (4 streams from one paid tenant, each a loop of requests);
2. `tiers`: the same trickle beside a free flood (64 streams from 8 free tenants), with tiers as
   a public service would set them: free below paid, 4 requests at once per free tenant, a
   queue bound and a TTFT objective that sheds free requests, paid unlimited;
3. `fcfs`: the same workload with tiers switched off: both tiers at one priority, no limits, so
   requests are served first come, first served.

Every request asks for the same length (EOS ignored) with a prompt of 100-300 words from a
seeded RNG. A refused free request (429 or 503) waits its Retry-After (at most 2 s) and goes on;
no request waits longer than --timeout (default 120 s) in all. The batch is kept small
(`[scheduler] max_num_seqs`, default 16) so that it, not the CPU's arithmetic, is what the tiers
share. It prints the config of each mode, then per mode the paid TTFT p50/p95, and what happened
to the free requests (served, 429, 503, timed out, failed otherwise), then paid p95 under `tiers`
and under `fcfs` as ratios of `paid_alone` (the goal: within 1.5x with tiers). With --repeats N
the modes run N times in turn and each figure is the median of its N per-run values. The client
runs on the same machine as the server: on 2 cores it takes its share of the CPU in every mode alike.

    python benchmarks/tiers.py --json tiers.json           # ~3 minutes on 2 cores
    python benchmarks/tiers.py --repeats 3                  # medians of three runs, ~10 minutes
    python benchmarks/tiers.py --quick                      # smoke test (a tiny model, 5 s a mode), ~40 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))  # run from a checkout, installed or not
sys.path.insert(0, str(BENCHMARKS))  # serve.py's helpers

import aiohttp  # noqa: E402
from serve import HOST, Server, add_common_arguments, build_bench_model, free_port  # noqa: E402

MODES = ("paid_alone", "tiers", "fcfs")
WORDS = ("the scheduler admits requests in order of their class and shares each class fairly between tenants "
         "so that a flood from one side never starves the other while the engine keeps every slot busy").split()
MAX_RETRY_WAIT = 2.0  # a refused free client waits its Retry-After, at most this long


def tier_config(args, mode: str) -> str:
    """The [tiers] part of the mode's config.toml."""
    unlimited = ("requests_per_minute = 0\ntokens_per_minute = 0\nmax_concurrent_requests = 0\n"
                 "max_queued_requests = 0\nmax_tokens = 0\nttft_p95_seconds = 0\n")
    if mode == "fcfs":  # tiers off: one class, no limits
        return f"[tiers.free]\n{unlimited}priority = 10\n\n[tiers.paid]\n{unlimited}priority = 10\n"
    return (f"[tiers.free]\nrequests_per_minute = {args.free_rpm}\ntokens_per_minute = {args.free_tpm}\n"
            f"max_concurrent_requests = {args.free_concurrency}\nmax_queued_requests = {args.free_queue}\n"
            f"max_tokens = 256\nttft_p95_seconds = {args.free_ttft}\npriority = 20\n\n"
            f"[tiers.paid]\n{unlimited}priority = 10\n")


def serving_config(args, mode: str) -> str:
    """What the mode is about, as config.toml: the model, the batch and the tiers."""
    return (f'[model]\ndevice = "cpu"\ndtype = "float32"\n\n[scheduler]\nmax_num_seqs = {args.max_num_seqs}\n'
            f"max_num_batched_tokens = {args.max_num_batched_tokens}\n\n{tier_config(args, mode)}")


def write_config(path: Path, args, mode: str) -> str:
    """The mode's whole config.toml: the serving config, with keys required and a fresh key database beside it."""
    text = (f'[store]\ndb_path = "{path.parent / (mode + ".db")}"\n\n[auth]\nenabled = true\n\n'
            f"{serving_config(args, mode)}")
    path.write_text(text)
    return text


def create_key(config: Path, name: str, tier: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "chatd", "keys", "create", "--name", name, "--tier", tier,
                           "--config", str(config)], capture_output=True, text=True, check=True, env=env)
    return re.search(r"chatd_[0-9a-f]{12}_\S+", done.stdout).group(0)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 300)))


class Tally:
    """What happened to one tier's requests: TTFTs of those served, and a count per outcome."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.counts = {"served": 0, "429": 0, "503": 0, "timeout": 0, "failed": 0}
        self.errors: dict[str, int] = {}  # why requests failed, the first words of each kind

    def fail(self, why: str) -> None:
        self.counts["failed"] += 1
        self.errors[why] = self.errors.get(why, 0) + 1

    def summary(self) -> dict:
        ttfts = sorted(self.ttfts)
        pick = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None  # noqa: E731
        errors = sorted(self.errors.items(), key=lambda item: -item[1])[:5]
        return {**self.counts, "sent": sum(self.counts.values()), "ttft_p50": pick(0.5), "ttft_p95": pick(0.95),
                "errors": errors}


async def one_request(session: aiohttp.ClientSession, url: str, key: str, text: str, args, tally: Tally) -> float:
    """Send one streamed chat request; returns how long to wait before the next (Retry-After when refused)."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": args.output_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status in (429, 503):
                tally.counts[str(response.status)] += 1
                await response.read()
                return min(MAX_RETRY_WAIT, float(response.headers.get("Retry-After", "1")))
            if response.status != 200:
                tally.fail(f"{response.status}: {(await response.text())[:200]}")
                return 0.1
            first = None
            async for line in response.content:
                # The first chunk says the role with empty content; the first token's chunk has text.
                if first is None and line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                    first = time.perf_counter() - started
            tally.ttfts.append(first if first is not None else time.perf_counter() - started)
            tally.counts["served"] += 1
    except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
        tally.counts["timeout"] += 1
        return 0.1
    except aiohttp.ClientError as exc:
        tally.fail(repr(exc))
        return 0.1
    return 0.0


async def client_loop(url: str, key: str, args, tally: Tally, seed: int, end: float) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.perf_counter() < end:
            wait = await one_request(session, url, key, prompt(rng), args, tally)
            if wait:
                await asyncio.sleep(wait)


async def drive(url: str, keys: dict, args, flood: bool) -> dict:
    paid, free = Tally(), Tally()
    end = time.perf_counter() + args.duration
    loops = [client_loop(url, keys["paid"], args, paid, 1000 + i, end) for i in range(args.paid_streams)]
    if flood:
        tenants = [name for name in keys if name.startswith("free")]
        loops += [client_loop(url, keys[tenants[i % len(tenants)]], args, free, i, end) for i in range(args.free_streams)]
    await asyncio.gather(*loops)
    return {"paid": paid.summary(), "free": free.summary() if flood else None}


def run_mode(args, mode: str, model_dir: Path, work: Path) -> dict:
    """One fresh server in this mode, its keys made before it starts, driven for --duration seconds."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / f"{mode}.toml"
    text = write_config(config, args, mode)
    env = {**os.environ, "CHATD_HOME": str(work / f"{mode}-home")}
    keys = {"paid": create_key(config, "paid", "paid", env)}
    keys |= {f"free{i}": create_key(config, f"free{i}", "free", env) for i in range(args.free_tenants)}
    port = free_port()
    server = Server(mode, [sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--config", str(config),
                           "--host", HOST, "--port", str(port)], work / f"{mode}.log", env=env)
    try:
        server.wait_until(lambda: "start timeline:" in server.log_path.read_text(errors="replace"), args.start_timeout)
        url = f"http://{HOST}:{port}/v1/chat/completions"
        result = asyncio.run(drive(url, keys, args, flood=mode != "paid_alone"))
        result["server"] = server_view(f"http://{HOST}:{port}/metrics")
        result["config"] = text
        print(f"[{mode}] {json.dumps({k: v for k, v in result.items() if k != 'config'})}", flush=True)
        return result
    finally:
        server.stop()


def server_view(metrics_url: str) -> dict:
    """The server's own per-tier means from /metrics: time to first token, time in the engine's queue."""
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    sums: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = re.match(r'chatd:tier_(time_to_first_token|request_queue_time)_seconds_(sum|count)\{.*tier="(\w+)"\} (\S+)', line)
        if match:
            what, kind, tier, value = match.groups()
            sums[(f"{tier} {what}", kind)] = float(value)
    return {name: sums[(name, "sum")] / count for (name, kind), count in sums.items() if kind == "count" and count}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def merge_runs(runs: list[dict]) -> dict:
    """One mode over its runs: each figure (p50, p95, each count, the server's means) the median of the runs'."""
    def merge(tallies: list[dict | None]) -> dict | None:
        if tallies[0] is None:
            return None
        merged = {key: median([t[key] for t in tallies]) for key in tallies[0] if key != "errors"}
        errors: dict[str, int] = {}
        for tally in tallies:
            for why, count in tally["errors"]:
                errors[why] = errors.get(why, 0) + count
        return {**merged, "errors": sorted(errors.items(), key=lambda item: -item[1])}

    server_keys = {key for run in runs for key in run["server"]}
    return {"paid": merge([run["paid"] for run in runs]), "free": merge([run["free"] for run in runs]),
            "server": {key: median([run["server"].get(key) for run in runs]) for key in sorted(server_keys)},
            "config": runs[0]["config"], "runs": runs}


def paid_p95_ratios(alone: dict, tiers: dict, fcfs: dict) -> dict:
    p95 = lambda mode: mode.get("paid", {}).get("ttft_p95")  # noqa: E731
    return {"paid p95 with tiers / alone (goal <= 1.5)": ratio(p95(tiers), p95(alone)),
            "paid p95 without tiers (fcfs) / alone": ratio(p95(fcfs), p95(alone))}


def print_table(report: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    repeats = report["args"]["repeats"]
    if repeats > 1:
        print(f"\nmedians of {repeats} runs (each figure on its own)", end="")
    print(f"\n{'mode':<11} {'paid p50 ms':>11} {'paid p95 ms':>11} {'paid done':>9}   {'free served':>11} "
          f"{'429':>5} {'503':>5} {'timeout':>7} {'failed':>6} {'free p50 ms':>11} {'free p95 ms':>11}")
    for mode in MODES:
        row = report.get(mode)
        if not row or "paid" not in row:
            print(f"{mode:<11} failed: {row.get('error') if row else 'not run'}")
            continue
        paid, free = row["paid"], row["free"] or {}
        count = lambda key: "-" if free.get(key) is None else f"{free[key]:g}"  # noqa: E731
        print(f"{mode:<11} {ms(paid['ttft_p50']):>11} {ms(paid['ttft_p95']):>11} {paid['served']:>9g}   "
              f"{count('served'):>11} {count('429'):>5} {count('503'):>5} {count('timeout'):>7} {count('failed'):>6} "
              f"{ms(free.get('ttft_p50')):>11} {ms(free.get('ttft_p95')):>11}")
        for tier in ("paid", "free"):
            for why, times in (row[tier] or {}).get("errors", []):
                print(f"  {mode} {tier} failed x{times}: {why}")
    for name, value in report["ratios"].items():
        per_run = report["ratios_per_run"][name]
        runs = f" (runs: {', '.join('-' if v is None else f'{v:.2f}' for v in per_run)})" if len(per_run) > 1 else ""
        print(f"{name}: {'-' if value is None else f'{value:.2f}x'}{runs}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds each mode's clients send (default 30)")
    parser.add_argument("--paid-streams", type=int, default=4)
    parser.add_argument("--free-streams", type=int, default=64)
    parser.add_argument("--free-tenants", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request, EOS ignored")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="the batch the tiers share (default 16)")
    parser.add_argument("--free-concurrency", type=int, default=4, help="free tier max_concurrent_requests per tenant")
    parser.add_argument("--free-rpm", type=int, default=600, help="free tier requests_per_minute per tenant")
    parser.add_argument("--free-tpm", type=int, default=200_000, help="free tier tokens_per_minute per tenant")
    parser.add_argument("--free-queue", type=int, default=16, help="free tier max_queued_requests")
    parser.add_argument("--free-ttft", type=float, default=2.0, help="free tier ttft_p95_seconds")
    parser.add_argument("--repeats", type=int, default=1, help="run the modes this many times, in turn (default 1)")
    add_common_arguments(parser)
    parser.set_defaults(timeout=120.0)  # a request that takes longer is counted as timed out
    parser.add_argument("--quick", action="store_true", help="smoke test: 5 s per mode, fewer streams")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.free_streams, args.free_tenants, args.paid_streams, args.output_tokens = 5.0, 8, 2, 2, 16
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 128
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # the finally blocks stop the servers

    import torch

    report: dict = {"args": vars(args), "command": " ".join([sys.executable, *sys.argv]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "load_before": os.getloadavg()}
    for mode in ("tiers", "fcfs"):  # paid_alone runs with the tiers config
        print(f"[{mode}] config ([auth] enabled, a fresh key database each run):\n"
              f"{serving_config(args, mode).strip()}\n", flush=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    failures: dict[str, list[str]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="chatd-tiers-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        build_bench_model(args, model_dir)  # replies of ordinary tokens only, as serve.py's
        for repeat in range(args.repeats):  # modes in turn, so a drift in the machine touches each alike
            for mode in MODES:
                try:
                    runs[mode].append(run_mode(args, mode, model_dir, Path(tmp) / f"run{repeat}"))
                except Exception as exc:  # keep going: the other modes still say something
                    print(f"[{mode}] FAILED: {exc}", flush=True)
                    failures[mode].append(str(exc))
                    runs[mode].append({"error": str(exc)})
    for mode in MODES:
        done = [run for run in runs[mode] if "paid" in run]
        report[mode] = merge_runs(done) if done else {"error": "; ".join(failures[mode]), "runs": runs[mode]}
        report[mode]["failures"] = failures[mode]
    report["ratios"] = paid_p95_ratios(report["paid_alone"], report["tiers"], report["fcfs"])
    report["ratios_per_run"] = {name: [] for name in report["ratios"]}
    for alone, tiers, fcfs in zip(runs["paid_alone"], runs["tiers"], runs["fcfs"]):
        for name, value in paid_p95_ratios(alone, tiers, fcfs).items():
            report["ratios_per_run"][name].append(value)
    report["load_after"] = os.getloadavg()
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if not any(failures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

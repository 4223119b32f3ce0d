"""Hostile grammars beside a normal client: does one client's costly grammar slow anyone else?

One run starts `chatd serve` (the default model unless --model names another; --quick: the demo
model) and measures a normal client's streamed reply, its inter-token latency (ITL) per token,
while `/health` is polled every 50 ms, in two modes, one after the other:

1. `alone`: the normal client by itself;
2. `plain`: the same request beside a request of the hostile one's shape without its grammar
   (`n: 16`, free text): what sharing the batch with 16 more rows costs, grammar or not;
3. `hostile`: the same request while one hostile request runs beside it: by default the worst
   grammar chatd allows, `{"guided_regex": "a{10000}", "n": 16}` (counted repetitions are capped
   at 10,000; each of its masks takes ~3 ms on the 2-core machine, 16 rows share one lexer), and
   every --refused grammar is sent too, whose answers (a 400 naming the limit) are timed.

It prints each mode's ITL p50 / mean / max, the worst /health latency, the hostile request's status
and time, then the ratios hostile / alone (issue 36's goal: ITL within 1.5x, /health under 100 ms)
and hostile / plain (what the grammar itself costs the other client).
With --repeats N the modes run N times in turn and each figure is the median of its N values.

    python benchmarks/hostile_grammars.py --repeats 3          # the default model, ~3 minutes on 2 cores
    python benchmarks/hostile_grammars.py --quick               # the demo model, smoke test, ~30 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))  # run from a checkout, installed or not
sys.path.insert(0, str(BENCHMARKS))  # serve.py's helpers

import aiohttp  # noqa: E402
from serve import HOST, Server, free_port  # noqa: E402

WORST_ALLOWED = {"guided_regex": "a{10000}", "n": 16}
REFUSED = ['{"guided_regex": "a{100000}", "n": 16}', '{"guided_regex": "(a{1000}){1000}"}',
           '{"guided_json": {"type": "string", "pattern": "^a{1000000}$"}}']
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def stream_itl(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    """One streamed chat reply of `tokens` tokens (EOS ignored); the seconds between its chunks."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    gaps, last = [], None
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps[1:] or [0.0]  # from the second token on (the first gap includes the role chunk)


async def poll_health(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    seconds = []
    while not stop.is_set():
        started = time.perf_counter()
        async with session.get(f"{url}/health") as response:
            await response.read()
        seconds.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)
    return seconds


async def hostile(session: aiohttp.ClientSession, url: str, body: dict, tokens: int) -> tuple[int, float]:
    started = time.perf_counter()
    request = {"messages": [{"role": "user", "content": "Say a."}], "max_tokens": tokens, "temperature": 1.0, **body}
    async with session.post(f"{url}/v1/chat/completions", json=request) as response:
        await response.read()
        return response.status, time.perf_counter() - started


async def one_mode(url: str, mode: str, args) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        stop = asyncio.Event()
        health = asyncio.ensure_future(poll_health(session, url, stop))
        attacks = []
        if mode == "plain":
            attacks = [asyncio.ensure_future(hostile(session, url, {"n": WORST_ALLOWED["n"], "ignore_eos": True}, args.tokens))]
            await asyncio.sleep(0.5)
        if mode == "hostile":
            attacks = [asyncio.ensure_future(hostile(session, url, WORST_ALLOWED, args.tokens))]
            attacks += [asyncio.ensure_future(hostile(session, url, json.loads(body), args.tokens)) for body in args.refused]
            await asyncio.sleep(0.5)  # the hostile request is compiled and running
        gaps = await stream_itl(session, url, args.tokens)
        stop.set()
        health_seconds = await health
        answers = [await attack for attack in attacks]
    result = {"itl_p50": statistics.median(gaps), "itl_mean": statistics.fmean(gaps), "itl_max": max(gaps),
              "health_max": max(health_seconds)}
    if answers:
        result["hostile"] = {"status": answers[0][0], "seconds": answers[0][1]}
        result["refused"] = [{"status": status, "seconds": seconds} for status, seconds in answers[1:]]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the model to serve (default: chatd's default model)")
    parser.add_argument("--quick", action="store_true", help="the demo model, fewer tokens")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per reply (default 64)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--refused", nargs="*", default=REFUSED, help="JSON bodies of grammars sent to be refused")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.tokens = args.model or "demo", min(args.tokens, 24)
    work = Path(tempfile.mkdtemp(prefix="chatd-hostile-"))
    port = free_port()
    command = [sys.executable, "-m", "chatd", "serve", "--host", HOST, "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    server = Server("chatd", command, work / "chatd.log", env={"CHATD_HOME": str(work / "home")})
    runs: dict[str, list[dict]] = {"alone": [], "plain": [], "hostile": []}
    try:
        server.wait_until(lambda: "start timeline:" in server.log_path.read_text(errors="replace"), 600)
        url = f"http://{HOST}:{port}"
        asyncio.run(stream_itl_once(url))  # warm-up, untimed
        for _ in range(args.repeats):
            for mode in runs:
                result = asyncio.run(one_mode(url, mode, args))
                runs[mode].append(result)
                print(f"{mode:8s} {json.dumps(result)}", flush=True)
    finally:
        server.stop()
    summary = {mode: {key: statistics.median(r[key] for r in results)
                      for key in ("itl_p50", "itl_mean", "itl_max", "health_max")} for mode, results in runs.items()}
    for mode, figures in summary.items():
        print(f"{mode:8s} ITL p50 {figures['itl_p50'] * 1000:7.1f} ms  mean {figures['itl_mean'] * 1000:7.1f} ms  "
              f"max {figures['itl_max'] * 1000:7.1f} ms  /health max {figures['health_max'] * 1000:6.1f} ms")
    ratios = {f"{key} vs {base}": summary["hostile"][key] / max(summary[base][key], 1e-9)
              for base in ("alone", "plain") for key in ("itl_p50", "itl_mean", "itl_max")}
    print("hostile / alone, plain: " + "  ".join(f"{key} {value:.2f}x" for key, value in ratios.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "ratios": ratios}, indent=2))
    return 0


async def stream_itl_once(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await stream_itl(session, url, 4)


if __name__ == "__main__":
    sys.exit(main())

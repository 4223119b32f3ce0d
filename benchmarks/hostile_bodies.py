"""Hostile request bodies beside a prober: does walking one client's body stall the server for others?

A request body is read by orjson (C, bounded by max_body_bytes and 1,024 levels), then checked in
Python: its schemas measured and closed, its messages and token ids walked. One run starts
`chatd serve` on the demo model (no compile thread competing: its steps run eagerly) and, for each
body below, sends `--concurrency` copies at once while `/health` is polled every 5 ms; it prints
the worst `/health` latency during each burst beside the worst while idle, and each burst's answers.

  nested-*     JSON schemas nested 100 to 5,000 levels (chat response_format, structured_outputs,
               Responses text.format, tool parameters, a schema sent as JSON text): refused (400)
  enum-10000   an enum of 10,000 integers (49 KB): accepted, one token generated
  anyof-16000  an anyOf of 16,000 empty schemas (48 KB, under the 64 KB limit): accepted; its
               walk (closing the schema) is ~25 ms of Python, the worst body found

    python benchmarks/hostile_bodies.py --repeats 3          # ~1 minute on 2 cores
    python benchmarks/hostile_bodies.py --quick              # one repeat, fewer bodies (a smoke test)

Issue 52's goal: /health under 100 ms whatever a body holds.
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

ASK = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> str:
    """A JSON schema nested `depth` objects deep, as text (Python's json cannot write it that deep)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def bodies(quick: bool) -> dict[str, tuple[str, str]]:
    """Name -> (path, body text)."""
    def chat(extra: dict) -> str:
        return json.dumps({"messages": ASK, "max_tokens": 1, **extra})

    # "@" stands for the schema: spliced in as text, since Python's json cannot write it that deep.
    shapes = {
        "response_format": ("/v1/chat/completions",
                            chat({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "@"}}})),
        "structured_outputs": ("/v1/chat/completions", chat({"structured_outputs": {"json": "@"}})),
        "tool": ("/v1/chat/completions", chat({"tools": [{"type": "function", "function": {"name": "f", "parameters": "@"}}]})),
        "text.format": ("/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 1, "text": {
            "format": {"type": "json_schema", "name": "x", "schema": "@"}}})),
    }
    made = {}
    for depth in (200,) if quick else (100, 300, 1000, 5000):
        for shape, (path, text) in shapes.items():
            made[f"nested-{depth}-{shape}"] = (path, text.replace('"@"', nested(depth)))
        made[f"nested-{depth}-as-text"] = ("/v1/chat/completions", chat({"guided_json": nested(depth)}))
    made["enum-10000"] = ("/v1/chat/completions", chat({"structured_outputs": {"json": {"enum": list(range(10_000))}}}))
    made["anyof-16000"] = ("/v1/chat/completions", chat({"structured_outputs": {"json": {"anyOf": [{}] * 16_000}}}))
    return made


async def worst_health(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        async with session.get(f"{url}/health") as response:
            await response.read()
        worst = max(worst, time.perf_counter() - start)
        await asyncio.sleep(0.005)
    return worst


async def burst(url: str, path: str, text: str | None, concurrency: int) -> dict:
    """`concurrency` copies of a body at once (None: nothing, for the idle figure) under the prober."""
    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()
        prober = asyncio.create_task(worst_health(session, url, stop))
        await asyncio.sleep(0.2)

        async def one() -> int:
            async with session.post(url + path, data=text, headers={"Content-Type": "application/json"}) as response:
                await response.read()
                return response.status

        start = time.perf_counter()
        statuses = await asyncio.gather(*(one() for _ in range(concurrency))) if text is not None else []
        if text is None:
            await asyncio.sleep(0.5)
        seconds = time.perf_counter() - start
        await asyncio.sleep(0.1)
        stop.set()
        return {"health_max": await prober, "seconds": seconds, "statuses": sorted(set(statuses))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8, help="copies of each body sent at once (default 8)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one depth of nesting, one repeat")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="chatd-bodies-"))
    port = free_port()
    command = [sys.executable, "-m", "chatd", "serve", "--model", "demo", "--no-compile", "--host", HOST,
               "--port", str(port)]
    server = Server("chatd", command, work / "chatd.log", env={"CHATD_HOME": str(work / "home")})
    cases = {"idle": ("/health", None), **bodies(args.quick)}
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    try:
        server.wait_until(lambda: "start timeline:" in server.log_path.read_text(errors="replace"), 600)
        url = f"http://{HOST}:{port}"
        for _ in range(args.repeats):
            for name, (path, text) in cases.items():
                runs[name].append(asyncio.run(burst(url, path, text, args.concurrency)))
    finally:
        server.stop()
    summary = {name: {"health_max": statistics.median(r["health_max"] for r in results),
                      "seconds": statistics.median(r["seconds"] for r in results),
                      "statuses": results[-1]["statuses"]} for name, results in runs.items()}
    idle = summary["idle"]["health_max"]
    for name, figures in summary.items():
        print(f"{name:34s} /health max {figures['health_max'] * 1000:7.1f} ms ({figures['health_max'] / idle:5.1f}x idle)"
              f"  burst {figures['seconds'] * 1000:7.1f} ms  {figures['statuses']}")
    print(f"worst /health beside a hostile body: {max(f['health_max'] for f in summary.values()) * 1000:.1f} ms "
          "(goal: under 100 ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

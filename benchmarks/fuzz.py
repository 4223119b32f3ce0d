"""Fuzz a chatd server with malformed requests, many more than CI sends: the generators of
tests/http/fuzzing.py, `--concurrency` at a time. First every body field set to each wrong
JSON type in turn (~800 requests), then `--requests` generated ones (every route; wrong JSON
types, numbers no encoder writes, bytes that are not UTF-8, deep nesting, odd framing, queries,
ids and headers).

It prints how many answers had each status, the fields chatd named in its 400s, and every
problem with the request that caused it: a 5xx, an error from chatd's code that is not in
OpenAI's shape, a non-4xx from aiohttp's parser, a request left unanswered. Exit status 1 if
there was any. Afterwards it checks that the engine holds no stream and no KV block.

    python benchmarks/fuzz.py --requests 3000                    # starts its own demo server (auth on)
    python benchmarks/fuzz.py --requests 3000 --url http://127.0.0.1:8000 --key chatd_...   # a running one

Against a running server the key's tenant gets conversations and usage; its limits decide what
is too large or too slow (the test's own server uses small ones so that those answers are cheap:
with the defaults, each request whose body never ends waits body_timeout_seconds, 60 s, for its 408).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.http.fuzzing import FUZZ_CONFIG, Tally, field_sweep, first_turn, raw_requests, send_all  # noqa: E402
from tests.http.test_isolation import engine_is_empty  # noqa: E402


def fuzz(url: str, key: str, requests: int, concurrency: int, random_seed: int) -> dict:
    """The field sweep, then `requests` generated requests, `concurrency` at a time."""
    targets = asyncio.run(first_turn(url, key))
    tally = Tally()
    started = time.perf_counter()
    asyncio.run(send_all(targets, [request for request, _, _ in field_sweep()], concurrency, tally))

    @seed(random_seed)
    @settings(max_examples=max(1, requests // concurrency), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(raw_requests(), min_size=concurrency, max_size=concurrency))
    def run(batch):
        asyncio.run(send_all(targets, batch, concurrency, tally))

    run()
    return {"tally": tally, "seconds": time.perf_counter() - started, "gauges_after": asyncio.run(engine_is_empty(url))}


def print_report(report: dict, show: int) -> None:
    tally = report["tally"]
    print(f"{sum(tally.statuses.values())} answers in {report['seconds']:.1f} s")
    print("status counts:")
    for status, count in sorted(tally.statuses.items(), key=lambda item: str(item[0])):
        print(f"  {status}: {count}")
    print("fields named by chatd's 400s: " + ", ".join(f"{param!r}: {n}" for param, n in tally.params.most_common()))
    print("slowest: " + "".join(f"\n  {seconds:.2f} s {request}" for seconds, request in tally.slowest))
    print(f"engine afterwards (streams, running, waiting, KV usage): {report['gauges_after']}")
    print(f"{len(tally.problems)} problems")
    for problem in tally.problems[:show]:
        print(f"- {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="how many requests to send (default 3000)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="the generators' seed: the same seed sends the same requests")
    parser.add_argument("--url", help="a running chatd serve with auth on (default: start a demo server)")
    parser.add_argument("--key", help="an API key of that server (with --url)")
    parser.add_argument("--show", type=int, default=20, help="print at most this many problems (default 20)")
    args = parser.parse_args()
    if bool(args.url) != bool(args.key):
        parser.error("--url and --key go together")
    if args.url:
        report = fuzz(args.url, args.key, args.requests, args.concurrency, args.seed)
    else:
        from chatd.engine.models.demo import build_demo_model
        from tests.http.serving import create_key, start_server

        with tempfile.TemporaryDirectory(prefix="chatd-fuzz-") as directory:
            root = Path(directory)
            config = f'[store]\ndb_path = "{root / "chatd.db"}"\n' + FUZZ_CONFIG
            (root / "config.toml").write_text(config)
            key = create_key(root / "config.toml", "fuzzer")
            proc, url, log_path = start_server(root, build_demo_model(root / "demo"), config)
            try:
                report = fuzz(url, key, args.requests, args.concurrency, args.seed)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            log = log_path.read_text()
            # aiohttp logs each request head it refuses as an ERROR with a traceback; chatd's own errors are the ones that matter.
            print(f"server log: {log.count(' ERROR chatd')} errors from chatd, {log.count(' ERROR aiohttp')} from aiohttp")
    print_report(report, args.show)
    return 1 if report["tally"].problems or report["gauges_after"] != (0, 0, 0, 0) else 0


if __name__ == "__main__":
    sys.exit(main())

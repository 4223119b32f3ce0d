"""Several models in one `chatd serve`: what sharing costs, what a cold model costs, what escalation sends up.

One server ([[models]]) serves the demo model ("small", a random Llama) and the default SmolLM2
("smol", and a second engine of it, "smol-b"), the first two also with keep_alive 0
("small-cold", "smol-cold"), beside an escalating alias ("auto": small, or smol when a rule
holds). Three parts, in one run:

1. Sharing. Streamed chat completions at `--concurrency` on "smol" while "smol-b" is idle, and
   the other way round ("alone"), then the same load on both at once ("shared"): each one's
   output tok/s and ITL p50, and the shared / alone ratios, medians of `--rounds` rounds. Two
   engines of one model cost the same, so their loads overlap from start to end; they share the
   machine's cores (or GPU). The steps are compiled and one untimed run of the load goes first.
2. Cold start. A request to a model with keep_alive 0 after it has unloaded: its time to the
   first token (load included) against the same model's warm TTFT, `--cold-runs` times each
   (medians), for the demo model and SmolLM2.
3. Escalation. `--mixed-requests` requests to "auto" drawn from a mix (short chats, long
   prompts, tools, a JSON response format, long conversations; `MIX`), max_tokens 1: the share
   sent to the large model, by rule, as /metrics counts them and as the replies' `model` says.
4. Escalation by confidence. `--probe-requests` chats of five kinds (`PROBED`: questions with one
   answer, arithmetic, poems, stories, nonsense) to "sure" (SmolLM2, or its second engine when
   its 8-token greedy probe's confidence is under 0.5): the share sent up by kind, and the time to
   the first token of those that stayed against the same kind of request naming "smol" directly
   (what the probe adds), medians.

    python benchmarks/fleet.py                       # about 4 minutes on 2 cores
    python benchmarks/fleet.py --quick --json f.json # a smoke test (tests/test_bench_fleet.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from benchmarks.serve import HOST, Server, free_port  # noqa: E402
from chatd.bench.load import run_level  # noqa: E402
from chatd.bench.options import BenchOptions  # noqa: E402

CONFIG = """
[model]
device = "{device}"
[[models]]
name = "small"
path = "{demo}"
[[models]]
name = "smol"
path = ""
preload = true
[[models]]
name = "smol-b"
path = ""
preload = true
[[models]]
name = "small-cold"
path = "{demo}"
keep_alive = 0
[[models]]
name = "smol-cold"
path = ""
keep_alive = 0
[aliases.auto]
small = "small"
large = "smol"
escalate_when = {{ prompt_chars = 2000, messages = 12, tools = true, response_format = true }}
[aliases.sure]
small = "smol"
large = "smol-b"
escalate_when = {{ min_confidence = 0.5, confidence_tokens = 8 }}
"""
# The mixed workload's share of each kind of request (part 3).
MIX = {"short chat": 0.60, "long prompt": 0.15, "tools": 0.10, "json format": 0.05, "long conversation": 0.10}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


# Part 4's kinds of chat, each filled in with a random word or number.
PROBED = {"fact": "What is the capital of {country}?", "sum": "What is {a} plus {b}?",
          "poem": "Write a poem about {thing}.", "story": "Tell me a story about {thing}.", "nonsense": "{letters}?"}
COUNTRIES = ("France", "Japan", "Kenya", "Peru", "Norway", "Egypt", "Canada", "India", "Chile", "Spain")
THINGS = ("a lamp", "the sea", "a fox", "winter", "a clock", "bread", "a bridge", "rain", "a violin", "salt")


def probed_request(kind: str, rng: random.Random, model: str) -> dict:
    """A streamed chat completions body of one of part 4's kinds."""
    letters = " ".join("".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(2, 6)))
                       for _ in range(rng.randint(2, 5)))
    text = PROBED[kind].format(country=rng.choice(COUNTRIES), a=rng.randint(1, 999), b=rng.randint(1, 999),
                               thing=rng.choice(THINGS), letters=letters)
    return {"model": model, "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": text}]}


async def confidence_escalation(url: str, num_requests: int, seed: int) -> dict:
    """Part 4: each kind through "sure" and straight to "smol", one request at a time (so each
    time to the first token is the request's own)."""
    rng = random.Random(seed + 1)
    kinds = [kind for _ in range(num_requests // len(PROBED)) for kind in PROBED]
    sent_up = {kind: 0 for kind in PROBED}
    stayed_ttft: dict[str, list[float]] = {kind: [] for kind in PROBED}
    direct_ttft: dict[str, list[float]] = {kind: [] for kind in PROBED}
    async with aiohttp.ClientSession() as session:
        for kind in kinds:
            model, ttft = await streamed_first_token(session, url, probed_request(kind, rng, "sure"))
            if model == "smol":
                stayed_ttft[kind].append(ttft)
            else:
                sent_up[kind] += 1
            direct_ttft[kind].append((await streamed_first_token(session, url, probed_request(kind, rng, "smol")))[1])
    per_kind = len(kinds) // len(PROBED)
    stayed = [t for times in stayed_ttft.values() for t in times]
    direct = [t for times in direct_ttft.values() for t in times]
    return {"requests": len(kinds), "sent_up_share": sum(sent_up.values()) / len(kinds),
            "sent_up_by_kind": {kind: count / per_kind for kind, count in sent_up.items()},
            "stayed_ttft_s": statistics.median(stayed) if stayed else None,
            "direct_ttft_s": statistics.median(direct)}


async def streamed_first_token(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, float]:
    """The model that served a streamed chat, and the seconds to its first event with content."""
    started = time.perf_counter()
    first, model = None, ""
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {") and first is None:
                chunk = json.loads(line[6:])
                model = chunk["model"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - started
    return model, first if first is not None else time.perf_counter() - started


def mixed_request(kind: str, rng: random.Random) -> dict:
    """A chat completions body of one kind of the mix."""
    question = {"role": "user", "content": f"What is {rng.randint(1, 1000)} plus {rng.randint(1, 1000)}?"}
    body: dict = {"model": "auto", "max_tokens": 1, "messages": [question]}
    if kind == "long prompt":
        body["messages"] = [{"role": "user", "content": "Summarise this: " + "the river runs under the bridge " * 80}]
    elif kind == "tools":
        body["tools"] = [TOOL]
    elif kind == "json format":
        body["response_format"] = {"type": "json_object"}
    elif kind == "long conversation":
        turns = [{"role": role, "content": f"turn {i}"} for i in range(14) for role in ("user", "assistant")][:-1]
        body["messages"] = turns
    return body


async def escalation(url: str, num_requests: int, seed: int) -> dict:
    """Part 3: the mix sent to "auto", and where each request went."""
    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=num_requests)
    served: dict[str, dict[str, int]] = {kind: {} for kind in MIX}
    async with aiohttp.ClientSession() as session:
        before = await alias_counts(session, url)
        for start in range(0, num_requests, 8):
            bodies = [(kind, mixed_request(kind, rng)) for kind in kinds[start:start + 8]]
            replies = await asyncio.gather(*(post(session, url + "/v1/chat/completions", body) for _, body in bodies))
            for (kind, _), reply in zip(bodies, replies):
                served[kind][reply["model"]] = served[kind].get(reply["model"], 0) + 1
        after = await alias_counts(session, url)
    by_rule = {why: after.get(why, 0) - before.get(why, 0) for why in after}
    escalated = sum(count for why, count in by_rule.items() if why not in ("none", "thread", "weight"))
    return {"requests": num_requests, "mix": MIX, "served_by_kind": served, "by_rule": by_rule,
            "escalated_share": escalated / num_requests}


async def alias_counts(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """chatd:alias_requests_total for "auto", by why."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("chatd:alias_requests_total{") and 'alias="auto"' in line:
            why = line.split('why="', 1)[1].split('"', 1)[0]
            counts[why] = counts.get(why, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as response:
        reply = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {reply}")
        return reply


async def first_token_seconds(session: aiohttp.ClientSession, url: str, model: str) -> float:
    """Seconds from sending a streamed chat request to its first token."""
    body = {"model": model, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hello there"}]}
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{model} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                return time.perf_counter() - started
    raise RuntimeError(f"{model}: no token came")


async def model_cards(session: aiohttp.ClientSession, url: str) -> list[dict]:
    async with session.get(url + "/v1/models") as response:
        return (await response.json())["data"]


async def status(session: aiohttp.ClientSession, url: str, model: str) -> str:
    return next(card["status"] for card in await model_cards(session, url) if card["id"] == model)


async def cold_start(url: str, runs: int) -> dict:
    """Part 2: each model's first token when unloaded (keep_alive 0) against when loaded."""
    results = {}
    async with aiohttp.ClientSession() as session:
        for warm, cold in (("small", "small-cold"), ("smol", "smol-cold")):
            cold_times, warm_times = [], []
            for _ in range(runs):
                deadline = time.monotonic() + 60
                while await status(session, url, cold) != "unloaded":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{cold} never unloaded")
                    await asyncio.sleep(0.2)
                cold_times.append(await first_token_seconds(session, url, cold))
                warm_times.append(await first_token_seconds(session, url, warm))
            results[warm] = {"cold_ttft_s": statistics.median(cold_times), "warm_ttft_s": statistics.median(warm_times),
                             "cold_runs": cold_times, "warm_runs": warm_times}
    return results


async def sharing(url: str, args) -> dict:
    """Part 1: each engine's streamed load alone, then both at once, `args.rounds` times."""
    pair = ("smol", "smol-b")

    def options(model: str) -> BenchOptions:
        return BenchOptions(url=url + "/v1", model=model, concurrency=(args.concurrency,),
                            num_requests=args.num_requests, prompt_tokens=(100, 200),
                            output_tokens=(args.output_tokens, args.output_tokens), ignore_eos=True, seed=args.seed)

    async def load(model: str) -> dict:
        return (await run_level(options(model), args.concurrency, time.perf_counter)).summary()

    async with aiohttp.ClientSession() as session:  # steps compiling on a thread would slow the first runs
        for model in pair:
            await first_token_seconds(session, url, model)
        deadline = time.monotonic() + 600
        while any(card["chatd"].get("compiled_steps") == "compiling" for card in await model_cards(session, url)
                  if card["id"] in pair):
            if time.monotonic() > deadline:
                raise RuntimeError("the steps were still compiling after 10 minutes")
            await asyncio.sleep(1.0)
    for model in pair:  # untimed: the compiled steps' first calls, the prompts' first prefills
        await load(model)
    rounds = {model: [] for model in pair}
    for _ in range(args.rounds):
        alone = {model: await load(model) for model in pair}
        shared = dict(zip(pair, await asyncio.gather(*(load(model) for model in pair))))
        for model in pair:
            rounds[model].append({"alone": alone[model], "shared": shared[model],
                                  "tok_s_ratio": shared[model]["output_tokens_per_s"] / alone[model]["output_tokens_per_s"],
                                  "itl_ratio": shared[model]["itl_per_chunk"]["p50"] / alone[model]["itl_per_chunk"]["p50"]})
    result = {}
    for model, runs in rounds.items():
        median = lambda pick: statistics.median(pick(run) for run in runs)  # noqa: E731
        result[model] = {"alone_tok_s": median(lambda r: r["alone"]["output_tokens_per_s"]),
                         "shared_tok_s": median(lambda r: r["shared"]["output_tokens_per_s"]),
                         "alone_itl_s": median(lambda r: r["alone"]["itl_per_chunk"]["p50"]),
                         "shared_itl_s": median(lambda r: r["shared"]["itl_per_chunk"]["p50"]),
                         "tok_s_ratio": median(lambda r: r["tok_s_ratio"]), "itl_ratio": median(lambda r: r["itl_ratio"]),
                         "rounds": runs}
    return result


def report(result: dict) -> None:
    print(f"\n1. Sharing, {result['args']['concurrency']} streams on each engine (medians of {result['args']['rounds']} rounds)")
    print(f"{'model':>6} {'alone tok/s':>12} {'shared tok/s':>13} {'ratio':>6} {'alone ITL ms':>13} "
          f"{'shared ITL ms':>14} {'ratio':>6}")
    for model, row in result["sharing"].items():
        print(f"{model:>6} {row['alone_tok_s']:>12.1f} {row['shared_tok_s']:>13.1f} {row['tok_s_ratio']:>6.2f} "
              f"{row['alone_itl_s'] * 1e3:>13.1f} {row['shared_itl_s'] * 1e3:>14.1f} {row['itl_ratio']:>6.2f}")
    print(f"\n2. Cold start (median of {result['args']['cold_runs']}): time to the first token")
    for model, row in result["cold_start"].items():
        print(f"{model:>6}: unloaded {row['cold_ttft_s']:.2f} s, loaded {row['warm_ttft_s'] * 1e3:.0f} ms")
    mixed = result["escalation"]
    print(f"\n3. Escalation: {mixed['requests']} requests to \"auto\", {mixed['escalated_share']:.1%} sent to the "
          f"large model; by rule: {mixed['by_rule']}")
    for kind, served in mixed["served_by_kind"].items():
        print(f"   {kind:>18}: {served}")
    probed = result["confidence"]
    stayed = f"{probed['stayed_ttft_s'] * 1e3:.0f} ms" if probed["stayed_ttft_s"] is not None else "none stayed"
    print(f"\n4. Escalation by confidence: {probed['requests']} chats to \"sure\", {probed['sent_up_share']:.1%} sent up;"
          f" by kind: {probed['sent_up_by_kind']}")
    print(f"   TTFT p50 of those that stayed (probe included) {stayed}, naming smol directly "
          f"{probed['direct_ttft_s'] * 1e3:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8, help="streams on each model in part 1 (8)")
    p.add_argument("--num-requests", type=int, default=24, help="requests per model in part 1 (24)")
    p.add_argument("--output-tokens", type=int, default=48, help="tokens each reply of part 1 generates (48)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of part 1, alone and shared in turn (3)")
    p.add_argument("--cold-runs", type=int, default=3, help="cold starts per model in part 2 (3)")
    p.add_argument("--mixed-requests", type=int, default=400, help="requests of the mix in part 3 (400)")
    p.add_argument("--probe-requests", type=int, default=100, help="chats of part 4, of five kinds (100)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke test: 2 streams, 4 requests, 1 round, 1 cold run, "
                   "40 mixed, 10 probed")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if args.quick:
        (args.concurrency, args.num_requests, args.output_tokens, args.rounds, args.cold_runs, args.mixed_requests,
         args.probe_requests) = (2, 4, 8, 1, 1, 40, 10)
    from chatd.engine.models.demo import build_demo_model
    from chatd.engine.models.sources import default_model_path

    if default_model_path() is None:
        raise SystemExit("the default model's package is not installed (make install)")
    with tempfile.TemporaryDirectory(prefix="chatd-fleet-") as tmp:
        work = Path(tmp)
        demo = build_demo_model(work / "demo")
        config = work / "config.toml"
        config.write_text(CONFIG.format(device=args.device, demo=demo) + f'[store]\ndb_path = "{work / "chatd.db"}"\n')
        port = free_port()
        server = Server("chatd", [sys.executable, "-m", "chatd", "serve", "--config", str(config), "--host", HOST,
                                  "--port", str(port)], work / "chatd.log")
        try:
            server.wait_until(lambda: "ready: model" in server.log_path.read_text(errors="replace"), 300)
            url = f"http://{HOST}:{port}"
            result = {"args": vars(args)}
            result["sharing"] = asyncio.run(sharing(url, args))
            result["cold_start"] = asyncio.run(cold_start(url, args.cold_runs))
            result["escalation"] = asyncio.run(escalation(url, args.mixed_requests, args.seed))
            result["confidence"] = asyncio.run(confidence_escalation(url, args.probe_requests, args.seed))
        finally:
            server.stop()
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

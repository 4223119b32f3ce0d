"""Multi-turn chat: chatd's conversations API and OpenAI's Responses API (prefix cache on) next to
stateless chat (cache off).

One run builds one random-weight model folder as `serve.py` does (its helpers, imported), then
runs the same planned sessions in each mode, one `chatd serve` at a time on a free 127.0.0.1 port:

1. prefix cache on, `chatd.bench` in conversations mode: per session one conversation, each turn
   posting only the new user message; the server renders its stored history, and the prefix
   cache should serve the earlier turns, so a turn computes little more than its new message;
2. prefix cache on, `chatd.bench` in responses mode: each turn a `POST /v1/responses` with only
   the new user message and the previous turn's `previous_response_id`;
3. the server restarted with `[cache] enable_prefix_caching = false`, the same sessions sent
   statelessly to /v1/chat/completions, each turn carrying the whole history, all of it computed.

All runs send the same user messages with the same max_tokens, greedy and EOS ignored. It
prints, per turn, the prompt tokens the server computed (`usage`: prompt - cached) and TTFT p50
in each mode, and the ratios turn-N TTFT / turn-1 TTFT per mode and stateless / conversations
(and / responses) at the last turn. It knows nothing of chatd's internals; it reads what the server reports.

    python benchmarks/conversations.py --json conversations.json       # ~1.5 min on 2 cores
    python benchmarks/conversations.py --sessions 2 --concurrency 2 --turns 3 \
        --hidden 128 --layers 2 --heads 4 --kv-heads 2 --intermediate 256     # smoke test, ~1 min
    python benchmarks/conversations.py --modes stateless_cached         # diagnostic: the cache without the API
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS.parent))  # run from a checkout, installed or not
sys.path.insert(0, str(BENCHMARKS))  # serve.py's helpers

from serve import HOST, Server, add_common_arguments, build_bench_model, free_port, http_json  # noqa: E402

from chatd.bench.load import run_bench  # noqa: E402
from chatd.bench.options import BenchOptions  # noqa: E402
from chatd.bench.report import format_level  # noqa: E402

# name -> (prefix caching on the server, the API the client drives: "conversations", "responses" or
# "chat"). The first three are the comparison; the others (only with --modes) tell the API's share
# from the cache's.
MODES = {
    "conversations": (True, "conversations"),
    "responses": (True, "responses"),
    "stateless": (False, "chat"),
    "stateless_cached": (True, "chat"),
    "conversations_uncached": (False, "conversations"),
}
DEFAULT_MODES = ("conversations", "responses", "stateless")


def write_config(path: Path, args, prefix_caching: bool) -> None:
    path.write_text(
        f'[model]\ndevice = "cpu"\ndtype = "float32"\n\n'
        f"[cache]\nenable_prefix_caching = {str(prefix_caching).lower()}\n\n"
        f"[scheduler]\nmax_num_batched_tokens = {args.max_num_batched_tokens}\n"
    )


def warm_up(url: str, api: str) -> None:
    """One short untimed turn through the path the mode uses (the server-side ones write to SQLite)."""
    body = {"max_tokens": 4, "temperature": 0}
    if api == "responses":
        status, text = http_json(url + "/responses", {"input": "hello", "max_output_tokens": 4, "temperature": 0})
        if status != 200:
            raise RuntimeError(f"warm-up response answered {status}: {text[:300]}")
        return
    if api == "chat":
        messages = [{"role": "user", "content": "hello"}]
        status, text = http_json(url + "/chat/completions", {**body, "messages": messages})
        if status != 200:
            raise RuntimeError(f"warm-up chat completion answered {status}: {text[:300]}")
        return
    status, text = http_json(url + "/conversations", {"title": "warm-up"})
    if status != 200:
        raise RuntimeError(f"warm-up POST /conversations answered {status}: {text[:300]}")
    conversation_id = json.loads(text)["id"]
    status, text = http_json(f"{url}/conversations/{conversation_id}/messages", {**body, "content": "hello"})
    if status != 200:
        raise RuntimeError(f"warm-up message answered {status}: {text[:300]}")


def run_mode(args, name: str, model_dir: Path, work: Path) -> dict:
    prefix_caching, api = MODES[name]
    config_path = work / f"{name}.toml"
    write_config(config_path, args, prefix_caching)
    port = free_port()
    server = Server(
        name, [sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--config", str(config_path),
               "--host", HOST, "--port", str(port), "--device", "cpu"],
        work / f"{name}.log",
        env={"CHATD_HOME": str(work / f"{name}-home")},  # a fresh SQLite store, not the user's
    )
    try:
        server.wait_until(lambda: "start timeline:" in server.log_path.read_text(errors="replace"), args.start_timeout)
        url = f"http://{HOST}:{port}/v1"
        warm_up(url, api)
        options = BenchOptions(
            url=url, concurrency=(args.concurrency,), num_requests=args.sessions,
            prompt_tokens=tuple(args.prompt_tokens), output_tokens=tuple(args.output_tokens), multi_turn=args.turns,
            temperature=0.0, ignore_eos=True, seed=args.seed, timeout=args.timeout,
            conversations=api == "conversations", responses=api == "responses",
        )
        what = {"conversations": "conversations API", "responses": "Responses API, previous_response_id chains",
                "chat": "stateless /chat/completions"}[api]
        print(f"[{name}] prefix cache {'on' if prefix_caching else 'off'}, {what}", flush=True)
        level = asyncio.run(run_bench(options)).levels[0]
        print("\n".join(f"[{name}] {line}" for line in format_level(level).splitlines()), flush=True)
        return {"prefix_caching": prefix_caching, "api": api, "summary": level.summary(),
                "requests": [asdict(record) for record in level.requests]}
    finally:
        server.stop()


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(report: dict) -> dict:
    """Turn-N / turn-1 TTFT per mode and stateless / conversations at the last turn (None where unmeasured)."""
    ttft = {name: {t["turn"]: t["ttft_p50"] for t in report[name]["summary"]["turns"]}
            for name in MODES if "summary" in report.get(name, {})}
    last = report["args"]["turns"]
    ratios = {f"{name}_ttft_turn{last}_over_turn1": _ratio(by_turn.get(last), by_turn.get(1))
              for name, by_turn in ttft.items()}
    for kept in ("conversations", "responses"):
        if "stateless" in ttft and kept in ttft:
            ratios[f"stateless_over_{kept}_ttft_turn{last}"] = _ratio(ttft["stateless"].get(last), ttft[kept].get(last))
    return ratios


def print_table(report: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    tokens = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    runs = {name: report[name]["summary"] for name in MODES if "summary" in report.get(name, {})}
    if not runs:
        return
    print("\nper turn (token counts: means over sessions; prefill = prompt - cached, what the server computed)")
    by_turn = {name: {t["turn"]: t for t in s["turns"]} for name, s in runs.items()}
    if runs.keys() & set(DEFAULT_MODES):
        print("| turn | conv. prompt | conv. cached | conv. prefill | conv. TTFT p50 ms | resp. cached | resp. prefill "
              "| resp. TTFT p50 ms | stateless prompt | stateless prefill | stateless TTFT p50 ms |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for turn in range(1, report["args"]["turns"] + 1):
            conv = by_turn.get("conversations", {}).get(turn, {})
            resp = by_turn.get("responses", {}).get(turn, {})
            stateless = by_turn.get("stateless", {}).get(turn, {})
            print(f"| {turn} | {tokens(conv.get('prompt_tokens_mean'))} | {tokens(conv.get('cached_tokens_mean'))} | "
                  f"{tokens(conv.get('prefill_tokens_mean'))} | {ms(conv.get('ttft_p50'))} | "
                  f"{tokens(resp.get('cached_tokens_mean'))} | {tokens(resp.get('prefill_tokens_mean'))} | "
                  f"{ms(resp.get('ttft_p50'))} | "
                  f"{tokens(stateless.get('prompt_tokens_mean'))} | {tokens(stateless.get('prefill_tokens_mean'))} | "
                  f"{ms(stateless.get('ttft_p50'))} |")
    for name in runs.keys() - set(DEFAULT_MODES):  # diagnostics, one line each
        print(f"{name}, turn: TTFT p50 ms / prefill tokens: " + ", ".join(
            f"{t}: {ms(t_['ttft_p50'])} / {tokens(t_['prefill_tokens_mean'])}" for t, t_ in by_turn[name].items()))
    for name, s in runs.items():
        print(f"{name}: {s['num_ok']} ok, {s['num_failed']} failed, {s['wall_time']:.1f} s, "
              f"{s['output_tokens_per_s']:.1f} output tok/s")
        for error, count in s["errors"]:
            print(f"  {name} failed x{count}: {error}")
    for key, value in report["ratios"].items():
        print(f"{key}: {'-' if value is None else f'{value:.2f}x'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8, help="sessions, each a conversation of --turns turns")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions at once (default 4)")
    parser.add_argument("--turns", type=int, default=6, help="user messages per session (default 6)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(40, 80), metavar=("MIN", "MAX"),
                        help="words per user message, uniform (default 40 80)")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                        help="max_tokens per reply, uniform, EOS ignored (default 32 64)")
    add_common_arguments(parser)
    parser.add_argument("--modes", type=lambda text: tuple(text.split(",")), default=DEFAULT_MODES,
                        help=f"comma-separated, run in this order, from {', '.join(MODES)} "
                             f"(default {','.join(DEFAULT_MODES)}); the last two are diagnostics")
    parser.add_argument("--json", metavar="PATH", help="also write every number and request to this file")
    args = parser.parse_args(argv)
    unknown = [name for name in args.modes if name not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    # SIGTERM as Ctrl-C, so the finally blocks stop the server subprocesses.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    import torch

    report: dict = {"args": vars(args), "torch_threads": torch.get_num_threads(), "load_before": os.getloadavg()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="chatd-conversations-bench-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        # As in serve.py: replies of ordinary tokens only, so both modes store and resend the same text.
        report["silenced_token_ids"] = len(build_bench_model(args, model_dir))
        for name in args.modes:
            try:
                report[name] = run_mode(args, name, model_dir, work)
            except Exception as exc:  # keep going: the other mode still says something
                print(f"[{name}] FAILED: {exc}", flush=True)
                report[name] = {"error": str(exc)}
    report["load_after"] = os.getloadavg()
    report["ratios"] = compare(report)
    print_table(report)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if all("summary" in report[name] for name in args.modes) else 1


if __name__ == "__main__":
    sys.exit(main())

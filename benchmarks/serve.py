"""Serving throughput and latency: `chatd serve` next to `transformers serve --continuous-batching`.

One run builds one random-weight model folder (the demo tokenizer, a Llama of the offline
benchmark's shape), then, one server at a time (never both at once: the CPU machine has two
cores), starts the server as a subprocess on a free 127.0.0.1 port, drives it with chatd's load
generator (`chatd.bench.load.run_bench`: streamed chat completions at each concurrency level) and
stops it (SIGTERM, then SIGKILL after a timeout, also on errors). Then chatd's offline engine
(`LLM.generate`) runs the highest level's workload, the same chat prompts as token ids through
the same chat template, the same output lengths, EOS ignored, at most that level's number of sequences at once, so the server's tok/s can be read
as a share of what the engine does without any front end.

It prints, per server and level, TTFT p50/p95, ITL p50 (per streamed chunk), output tok/s
(output tokens as the servers' `usage` reports them) and the ratio chatd / transformers, and
the server / offline ratio at the highest level.

    python benchmarks/serve.py                                   # levels 1,16,64
    python benchmarks/serve.py --concurrency 1,4 --num-requests 8 --output-tokens 16   # smoke test
    python benchmarks/serve.py --skip-transformers --json serve.json
    python benchmarks/serve.py --device cuda --skip-transformers --concurrency 1,16,64,256 \
        --hidden 1024 --layers 28 --heads 16 --kv-heads 8 --intermediate 3072 --max-num-batched-tokens 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from chatd.bench.load import make_sessions, run_bench  # noqa: E402
from chatd.bench.options import BenchOptions  # noqa: E402
from chatd.bench.report import LevelResult  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, str]:
    """GET (body None) or POST JSON; returns (status, text) and never raises on an HTTP status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class Server:
    """A server subprocess with its output in a log file; `stop` is safe to call any time."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict | None = None) -> None:
        self.name, self.command, self.log_path = name, command, log_path
        self.log = open(log_path, "wb")
        print(f"[{name}] $ {' '.join(command)}", flush=True)
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: signals reach its workers, not us
        )

    def wait_until(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log:\n{self.tail()}")
            try:
                if ready():
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; log:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] no exit {timeout:.0f} s after SIGTERM: killing", flush=True)
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait()
        self.log.close()
        print(f"[{self.name}] stopped (exit {self.process.returncode})", flush=True)


def bench_options(args, url: str, model: str | None, ignore_eos: bool, num_requests: int | None) -> BenchOptions:
    return BenchOptions(
        url=url, model=model, concurrency=args.concurrency, num_requests=num_requests,
        prompt_tokens=tuple(args.prompt_tokens), output_tokens=tuple(args.output_tokens),
        temperature=getattr(args, "temperature", 0.0), top_p=getattr(args, "top_p", 1.0), ignore_eos=ignore_eos, seed=args.seed, timeout=args.timeout,
    )


def print_level(name: str, level: LevelResult) -> None:
    s = level.summary()
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    print(
        f"[{name}] c={s['concurrency']}: {s['num_ok']} ok / {s['num_failed']} failed, {s['wall_time']:.1f} s, "
        f"TTFT p50 {ms(s['ttft']['p50'])} ms p95 {ms(s['ttft']['p95'])} ms, ITL p50 {ms(s['itl_per_chunk']['p50'])} ms, "
        f"{s['num_output_tokens']} output tokens, {s['output_tokens_per_s']:.1f} tok/s",
        flush=True,
    )
    for error, count in s["errors"]:
        print(f"[{name}]   failed x{count}: {error}", flush=True)


def silence_special_and_byte_tokens(model_dir: Path) -> list[int]:
    """Zero the lm_head rows of the tokenizer's byte-fallback (<0xNN>) and special tokens.

    With random weights every other token's logit is a random number, so the greedy argmax over
    ~740 of them is positive and a zeroed row (logit exactly 0) is never picked. This keeps two
    things out of greedy outputs, for both servers alike: EOS (transformers serve rejects
    `ignore_eos`, so without this its outputs would end early) and byte-fallback tokens (its
    streams die on them: "Invalid prefix encountered while decoding stream").
    """
    import re

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = sorted({i for tok, i in tokenizer.get_vocab().items() if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok)}
                 | set(tokenizer.all_special_ids))
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["lm_head.weight"][ids] = 0.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return ids


def started_and_warm(server: Server, port: int, timeout: float) -> str:
    """Wait for a `chatd serve` to be ready, send it one untimed request through the whole path,
    and return its /v1 URL."""
    server.wait_until(lambda: "start timeline:" in server.log_path.read_text(errors="replace"), timeout)
    url = f"http://{HOST}:{port}/v1"
    status, text = http_json(url + "/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
    if status != 200:
        raise RuntimeError(f"{server.name} warm-up answered {status}: {text[:300]}")
    return url


def run_chatd(args, model_dir: Path, config_path: Path, work: Path) -> dict:
    port = free_port()
    server = Server(
        "chatd", [sys.executable, "-m", "chatd", "serve", "--model", str(model_dir), "--config", str(config_path),
                  "--host", HOST, "--port", str(port), "--device", args.device]
        + ["--engine-process", args.engine_process],
        work / "chatd.log",
    )
    try:
        url = started_and_warm(server, port, args.start_timeout)
        options = bench_options(args, url, None, True, args.num_requests)
        result = asyncio.run(run_bench(options, on_level=lambda level: print_level("chatd", level)))
        return {"ignore_eos": True, "levels": [level.summary() for level in result.levels]}
    finally:
        server.stop()


def transformers_cli() -> str:
    """The `transformers` command beside this Python (a venv's bin/ need not be on PATH), else PATH's."""
    beside = Path(sys.executable).parent / "transformers"
    return str(beside) if beside.exists() else "transformers"


def run_transformers(args, model_dir: Path, work: Path) -> dict:
    port = free_port()
    server = Server(
        "transformers", [transformers_cli(), "serve", str(model_dir), "--continuous-batching", "--attn-implementation",
                         "sdpa", "--device", args.device, "--dtype", args.dtype, "--host", HOST, "--port", str(port)],
        work / "transformers.log", env={"HF_HUB_OFFLINE": "1"},
    )
    try:
        base = f"http://{HOST}:{port}"
        server.wait_until(lambda: http_json(base + "/health", timeout=5)[0] == 200, args.start_timeout)
        url = base + "/v1"
        # Does it reject a field it does not know? Probe with ignore_eos (this also pays its ~8 s
        # lazy start before any clock runs). If it accepts it, both servers get it.
        status, text = http_json(url + "/chat/completions", {
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}, timeout=args.start_timeout)
        ignore_eos = status == 200
        print(f"[transformers] probe with ignore_eos: HTTP {status}: {text[:200]!r}", flush=True)
        if not ignore_eos:
            status, text = http_json(url + "/chat/completions", {
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0},
                timeout=args.start_timeout)
            if status != 200:
                raise RuntimeError(f"transformers warm-up answered {status}: {text[:300]}")
        options = bench_options(args, url, None, ignore_eos, args.hf_num_requests or args.num_requests)
        result = asyncio.run(run_bench(options, on_level=lambda level: print_level("transformers", level)))
        return {"ignore_eos_accepted": ignore_eos, "probe_status": status,
                "levels": [level.summary() for level in result.levels]}
    finally:
        server.stop()


def run_offline(args, model_dir: Path, engine_options: dict) -> dict:
    """chatd's LLM on the highest level's workload: the same chat prompts, as token ids."""
    from chatd import LLM, SamplingParams

    concurrency = max(args.concurrency)
    options = bench_options(args, "unused", None, True, args.num_requests)
    num_sessions = options.num_requests or 2 * concurrency
    # The very prompts run_level sends at this level: same options, same per-level seed.
    sessions = make_sessions(options, num_sessions, random.Random(f"{options.seed}:{concurrency}"))
    # At most `concurrency` sequences at once, as the server sees at most that many requests.
    engine_options = {**engine_options, "max_num_seqs": concurrency}
    llm = LLM(str(model_dir), **engine_options)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": turns[0][0]}]) for turns in sessions]
    params = [SamplingParams(max_tokens=turns[0][1], temperature=0.0, ignore_eos=True) for turns in sessions]
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    del llm
    # A fresh engine, so the warm-up leaves nothing in the prefix cache.
    llm = LLM(str(model_dir), **engine_options)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    num_output = sum(len(out.outputs[0].token_ids) for out in outputs)
    result = {"concurrency_workload": concurrency, "num_requests": len(prompts),
              "num_prompt_tokens": sum(map(len, prompts)), "num_output_tokens": num_output,
              "wall_time": wall, "output_tokens_per_s": num_output / wall}
    print(f"[offline] {len(prompts)} requests, {result['num_prompt_tokens']} prompt tokens, {num_output} output "
          f"tokens in {wall:.1f} s: {result['output_tokens_per_s']:.1f} tok/s", flush=True)
    return result


def print_tables(report: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    for name in ("chatd", "transformers"):
        run = report.get(name)
        if not run or "levels" not in run:
            continue
        print(f"\n{name}")
        print("| concurrency | requests ok/failed | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | output tokens | wall s | output tok/s |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for s in run["levels"]:
            print(f"| {s['concurrency']} | {s['num_ok']}/{s['num_failed']} | {ms(s['ttft']['p50'])} | "
                  f"{ms(s['ttft']['p95'])} | {ms(s['itl_per_chunk']['p50'])} | {s['num_output_tokens']} | "
                  f"{s['wall_time']:.1f} | {s['output_tokens_per_s']:.1f} |")
    chatd, hf = report.get("chatd"), report.get("transformers")
    if chatd and hf and "levels" in chatd and "levels" in hf:
        print("\nchatd / transformers, output tok/s (target at 64 streams: >= 2x)")
        for a, b in zip(chatd["levels"], hf["levels"]):
            ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else float("nan")
            print(f"  concurrency {a['concurrency']}: {a['output_tokens_per_s']:.1f} / {b['output_tokens_per_s']:.1f} = {ratio:.2f}x")
    offline = report.get("offline")
    if chatd and offline and "levels" in chatd:
        top = chatd["levels"][-1]
        share = top["output_tokens_per_s"] / offline["output_tokens_per_s"]
        report["server_over_offline"] = share
        print(f"\nchatd serve at {top['concurrency']} streams / offline LLM on the same workload: "
              f"{top['output_tokens_per_s']:.1f} / {offline['output_tokens_per_s']:.1f} = {share:.1%} (target >= 85%)")


def build_bench_model(args, model_dir: Path) -> list[int]:
    """The random-weight Llama of the shape in `args`, with byte and special tokens silenced; returns those ids."""
    from chatd.engine.models.demo import build_model_dir

    build_model_dir(
        model_dir, "llama", seed=args.seed, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        tie_word_embeddings=False,
    )
    return silence_special_and_byte_tokens(model_dir)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape, chatd's step budget, the seed and the timeouts (shared with conversations.py)."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="chatd's step budget (default 1024, as offline.py on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to come up")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda t: tuple(int(p) for p in t.split(",") if p.strip()),
                        default=(1, 16, 64), help="levels, comma-separated (default 1,16,64)")
    parser.add_argument("--num-requests", type=int, help="requests per level (default: 2x the level)")
    parser.add_argument("--hf-num-requests", type=int,
                        help="requests per level for transformers serve only (default: --num-requests)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(100, 200), metavar=("MIN", "MAX"),
                        help="prompt words per request, uniform (default 100 200)")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(64, 64), metavar=("MIN", "MAX"),
                        help="max_tokens per request, uniform (default 64 64)")
    parser.add_argument("--skip-transformers", action="store_true", help="run chatd (server and offline) only")
    parser.add_argument("--skip-offline", action="store_true", help="do not run chatd's offline engine")
    parser.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto",
                        help="chatd's engine in a process of its own: on, off, or auto (chatd's rule: on a GPU with 4+ CPUs)")
    add_common_arguments(parser)
    parser.add_argument("--device", default="cpu", help="where both servers and the offline engine run: cpu or cuda (default cpu)")
    parser.add_argument("--dtype", help="the model's dtype (default float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this file")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    # SIGTERM as Ctrl-C, so the try/finally blocks stop the server subprocesses.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    import torch

    report: dict = {"args": {k: v for k, v in vars(args).items()}, "torch_threads": torch.get_num_threads(),
                    "load_before": os.getloadavg()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="chatd-serve-bench-") as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        silenced = build_bench_model(args, model_dir)
        report["silenced_token_ids"] = len(silenced)
        print(f"zeroed {len(silenced)} lm_head rows (byte-fallback and special tokens)", flush=True)
        engine_options = dict(device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
        config_path = work / "chatd.toml"
        config_path.write_text(
            f'[model]\ndevice = "{args.device}"\ndtype = "{args.dtype}"\n\n'
            f'[scheduler]\nmax_num_batched_tokens = {args.max_num_batched_tokens}\n'
        )
        print(f"model folder {model_dir}", flush=True)
        try:
            report["chatd"] = run_chatd(args, model_dir, config_path, work)
        except Exception as exc:  # keep going: the other runs still say something
            print(f"[chatd] FAILED: {exc}", flush=True)
            report["chatd"] = {"error": str(exc)}
        if not args.skip_transformers:
            try:
                report["transformers"] = run_transformers(args, model_dir, work)
            except Exception as exc:
                print(f"[transformers] FAILED: {exc}", flush=True)
                report["transformers"] = {"error": str(exc)}
        if not args.skip_offline:
            report["offline"] = run_offline(args, model_dir, engine_options)
    report["load_after"] = os.getloadavg()
    print_tables(report)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    write_report(report, args.json)
    return 0


def write_report(report: dict, path: str | None) -> None:
    """Write the run's figures as JSON where --json asked (nothing when it did not)."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

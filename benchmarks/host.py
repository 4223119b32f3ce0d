"""The host's work per engine step, with the device's time taken away: no GPU needed.

chatd's engine (and server) run here on a *timed model*: a forward that costs next to nothing on
the CPU, while a device clock charges each step a fixed time (`--step-ms`, 10 ms by default) the
way a GPU would: a step launched while another runs starts when that one ends, and the host's
wait for a step's draws sleeps, so the GIL is free meanwhile, as in a CUDA synchronize. What the
clock cannot hide is the host's own Python: scheduling, building inputs, launching the forward
and the sampler, folding the tokens back, detokenizing, and handing the deltas to the streams.
The tokenizer is the demo model's (real text, a 1,000-token vocabulary, so the draws cost
little; greedy, as a GPU samples on the device).

1. Engine: at 1, 64, 256 and 512 running sequences, the decode steps of one batch (prefill done,
   nothing finished yet), with async scheduling off and on: wall time per step, how much of it
   the device was busy, and the host's milliseconds per step in each stage (core/stage_times.py).
2. Server: a real `chatd serve` (this file's `--serve-child`: the server as `chatd serve` builds
   it, with the timed engine) driven by chatd's load generator from this process at 256 and 512
   streams (chat completions, prompts 100-200 words, 64 tokens out, EOS ignored), and chatd's
   offline engine on the very same requests, at most that many at once: served / offline tok/s.
   From the server's /metrics and /proc: its engine thread's CPU seconds and the rest of the
   process's (the event loop's, mostly), per step. Both ways: the engine on a thread of the
   server (as `chatd serve` runs it) and in a process of its own (`--engine-process`; the child's
   CPU is not in these columns).

It ends with one line:
    served/offline: NN% at 256 streams, MM% at 512; host overhead per step at 256: X ms; loop per
    streamed token: A µs at 256, B µs at 512; engine per sequence: C µs at 256, D µs at 512
(X: how much longer a step with async scheduling on takes than the device's step, at 256. A, B:
CPU of the server's event-loop thread per token streamed; the table also has the whole process's
but the engine thread, tokenizing and store threads included. C, D: the engine thread's CPU per
sequence a step decodes. The load generator's own CPU, in this process on the same cores, is in the
table apart.)

    python benchmarks/host.py                       # ~8 minutes on the 2-core machine
    python benchmarks/host.py --quick               # a smoke test, seconds
    python benchmarks/host.py --step-ms 5 --repeats 5 --json host.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

import torch  # noqa: E402

from chatd.config import CacheConfig, Config, ModelConfig, SchedulerConfig, ServerConfig, StoreConfig  # noqa: E402
from chatd.engine import LLMEngine, SamplingParams, Tokenizer  # noqa: E402
from chatd.engine.gc_freeze import freeze_startup_objects  # noqa: E402
from chatd.engine.attention.sdpa import SdpaBackend  # noqa: E402
from chatd.engine.models.demo import ensure_demo_model  # noqa: E402
from chatd.engine.worker.runner import ModelRunner  # noqa: E402

STAGES = ("schedule", "inputs", "forward", "sample", "wait", "postprocess", "detokenize", "dispatch")
HOST_STAGES = ("schedule", "inputs", "forward", "sample", "postprocess", "detokenize")
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 8192


class DeviceClock:
    """A device that runs one step at a time, each for `step_seconds`, queued as CUDA queues
    kernels. Waiting for a step sleeps until it ends (the GIL is free meanwhile)."""

    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.busy_until = 0.0
        self.busy_seconds = 0.0  # time the device has been given to run, in all

    def launch(self) -> float:
        """Queue one step; when it will be done (a perf_counter reading)."""
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + self.step_seconds
        self.busy_seconds += self.step_seconds
        return self.busy_until

    @staticmethod
    def wait(until: float) -> None:
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class TimedModel(torch.nn.Module):
    """A model whose forward is two small lookups and one small matmul: next to nothing on the
    host. Its greedy tokens depend on the token and its position, so replies are varied text."""

    num_layers, num_kv_heads, head_dim = 1, 1, 1  # a KV pool of one float a slot: the runner allocates one
    quantization = "none"

    def __init__(self, vocab_size: int, width: int = 16) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab_size, width, generator=generator)
        self.position_table = torch.randn(97, width, generator=generator)
        self.head = torch.randn(width, vocab_size, generator=generator)

    def forward(self, input_ids, positions, kv_caches, meta, backend) -> torch.Tensor:
        return self.table[input_ids] + self.position_table[positions % 97]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head


class TimedHandle:
    """A launched step (the runner's StepHandle) whose draws are back once the device clock's time
    for it has passed."""

    def __init__(self, handle, wait) -> None:
        self.handle, self.wait = handle, wait

    def __getattr__(self, name: str):
        return getattr(self.handle, name)

    def result(self):
        self.wait()
        return self.handle.result()


class TimedRunner(ModelRunner):
    """The real ModelRunner (inputs, launch, sampler) over the timed model; each launched step
    takes the device clock's time, and its result waits for it."""

    def __init__(self, model: TimedModel, clock: DeviceClock, num_blocks: int, max_model_len: int) -> None:
        super().__init__(model, SdpaBackend(), num_blocks, BLOCK_SIZE, torch.device("cpu"), torch.float32,
                         max_model_len=max_model_len)
        self.clock = clock

    def launch(self, scheduled, previous=None):
        return TimedHandle(super().launch(scheduled, previous), functools.partial(self.clock.wait, self.clock.launch()))

    def execute(self, scheduled):
        """What an engine from before steps were launched calls (a checkout measured as it was): run, then wait."""
        out = super().execute(scheduled)
        self.clock.wait(self.clock.launch())
        return out


def timed_engine(config: Config, step_seconds: float, clock: DeviceClock | None = None) -> LLMEngine:
    """chatd's engine around the timed model, with the demo model's tokenizer; built from `config`
    as `LLMEngine.from_config` would be (the scheduler, cache and context settings)."""
    path = Path(config.model.path)
    tokenizer = Tokenizer.from_pretrained(path)
    max_model_len = config.model.max_model_len or 2048
    num_blocks = config.cache.num_blocks or 1 + config.scheduler.max_num_seqs * -(-max_model_len // BLOCK_SIZE) // 4
    runner = TimedRunner(TimedModel(tokenizer.vocab_size), clock or DeviceClock(step_seconds), num_blocks, max_model_len)
    engine = LLMEngine(runner, config.scheduler, config.cache, num_blocks=num_blocks, max_model_len=max_model_len,
                       vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids,
                       model_path=str(path), is_demo=True)
    freeze_startup_objects()  # as chatd does once its engine is built
    return engine


def engine_config(demo: Path, max_num_seqs: int, async_scheduling: str, **server) -> Config:
    scheduler = dict(max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=max_num_seqs)
    if "async_scheduling" in SchedulerConfig.__dataclass_fields__:  # (older checkouts: always off)
        scheduler["async_scheduling"] = async_scheduling
    return Config(model=ModelConfig(path=str(demo), device="cpu", max_model_len=2048),
                  cache=CacheConfig(block_size=BLOCK_SIZE), scheduler=SchedulerConfig(**scheduler), **server)


# -- 1. the engine's steps --------------------------------------------------------------------


def measure_steps(demo: Path, step_seconds: float, batch: int, async_scheduling: str, output_tokens: int) -> dict:
    """One batch of `batch` sequences decoding together: per decode step, wall ms, device busy
    share and the host's ms per stage."""
    clock = DeviceClock(step_seconds)
    engine = timed_engine(engine_config(demo, max(batch, 1), async_scheduling), step_seconds, clock)
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(10, engine.vocab_size) for _ in range(128)], params)
    while engine.scheduler.num_waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # into the steady state (with async scheduling, a step in flight)
        engine.step()
    stage_times = getattr(engine, "stage_times", lambda: dict.fromkeys(STAGES, 0.0))  # (older checkouts: none)
    before, busy, started = stage_times(), clock.busy_seconds, time.perf_counter()
    steps = 0
    while steps < output_tokens - 8 and not any(out.finished for out in engine.step()):
        steps += 1
    wall = time.perf_counter() - started
    after = stage_times()
    engine.close()
    per_step = {stage: (after[stage] - before[stage]) / steps * 1000 for stage in HOST_STAGES}
    return {
        "batch": batch, "async_scheduling": async_scheduling, "steps": steps,
        "step_ms": wall / steps * 1000, "device_busy": (clock.busy_seconds - busy) / wall,
        "host_ms": sum(per_step.values()), "stages_ms": per_step,
        "wait_ms": (after["wait"] - before["wait"]) / steps * 1000,
    }


# -- 2. the server against the offline engine --------------------------------------------------


def serve_child(args) -> None:
    """`chatd serve` as the CLI runs it, with the timed engine in place of a loaded model."""
    from chatd.http.serve import serve
    from chatd.logs import setup_logging

    setup_logging()
    demo = Path(args.demo)
    server = dict(host="127.0.0.1", port=args.port)
    server["engine_process"] = "on" if args.engine_process else "off"
    if args.stream_interval != 1:
        server["stream_interval"] = args.stream_interval
    config = engine_config(demo, args.max_num_seqs, args.async_scheduling, server=ServerConfig(**server),
                           store=StoreConfig(db_path=args.db))
    build = functools.partial(timed_engine, step_seconds=args.step_ms / 1000)
    if "build_engine" in inspect.signature(serve).parameters:
        asyncio.run(serve(config, build_engine=build))
    else:  # a checkout from before serve() took one (to measure it as it was)
        import chatd.http.serve

        chatd.http.serve.LLMEngine.from_config = build
        asyncio.run(serve(config))


def offline_tokens_per_s(demo: Path, step_seconds: float, streams: int, async_scheduling: str, options) -> float:
    """chatd's offline engine on the requests the load generator sends at `streams`, at most that many at once."""
    from chatd.bench.load import make_sessions

    engine = timed_engine(engine_config(demo, streams, async_scheduling), step_seconds)
    sessions = make_sessions(options, options.num_requests or 2 * streams, random.Random(f"{options.seed}:{streams}"))
    for i, turns in enumerate(sessions):
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": turns[0][0]}])
        engine.add_request(f"o{i}", prompt, SamplingParams(temperature=0.0, max_tokens=turns[0][1], ignore_eos=True))
    started, num_output = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        num_output += sum(len(o.token_ids) for out in engine.step() for o in out.outputs)
    wall = time.perf_counter() - started
    engine.close()
    return num_output / wall


def scrape(url: str) -> dict[str, float]:
    """The engine's step counters from the server's /metrics."""
    import urllib.request

    values: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("chatd:engine_stage_seconds_total"):
                stage = line.split('stage="')[1].split('"')[0]
                values[stage] = float(line.rsplit(" ", 1)[1])
            elif line.startswith(("chatd:engine_steps_total", "chatd:engine_thread_cpu_seconds_total",
                                  "chatd:generation_tokens_total")):
                values[line.split("_total")[0].removeprefix("chatd:")] = float(line.rsplit(" ", 1)[1])
    return {"engine_steps": 0.0, "engine_thread_cpu_seconds": 0.0, "dispatch": 0.0, **values}  # (older checkouts: none)


def process_cpu_seconds(pid: int, thread: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads (the main thread: its pid)."""
    stat = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def measure_server(demo: Path, args, streams_levels: list[int], work: Path, async_scheduling: str,
                   engine_process: bool = False) -> list[dict]:
    """`chatd serve` on the timed engine at each level, and the offline engine on the same requests."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve import Server, free_port, http_json

    from chatd.bench.load import run_bench
    from chatd.bench.options import BenchOptions

    results = []
    port = free_port()
    server = Server("chatd", [sys.executable, __file__, "--serve-child", "--port", str(port), "--demo", str(demo),
                              "--step-ms", str(args.step_ms), "--max-num-seqs", str(max(streams_levels)),
                              "--async-scheduling", async_scheduling, "--db", str(work / f"host-{async_scheduling}.db")]
                    + (["--engine-process"] if engine_process else [])
                    + (["--stream-interval", str(args.stream_interval)] if args.stream_interval != 1 else []),
                    work / f"server-{async_scheduling}.log")
    try:
        server.wait_until(lambda: _serving(server.log_path.read_text(errors="replace")), 300)
        base = f"http://127.0.0.1:{port}"
        status, text = http_json(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 4, "temperature": 0})
        if status != 200:
            raise RuntimeError(f"warm-up answered {status}: {text[:300]}")
        for streams in streams_levels:
            options = BenchOptions(url=base + "/v1", concurrency=(streams,), num_requests=2 * streams,
                                   prompt_tokens=(100, 200), output_tokens=(args.output_tokens, args.output_tokens),
                                   ignore_eos=True, seed=args.seed, timeout=600)
            pid = server.process.pid
            before, cpu_before, loop_before = scrape(base), process_cpu_seconds(pid), process_cpu_seconds(pid, pid)
            generator_before = time.process_time()
            level = asyncio.run(run_bench(options)).levels[0].summary()
            generator_cpu = time.process_time() - generator_before  # the load generator's own (it shares the machine)
            after, cpu_after, loop_after = scrape(base), process_cpu_seconds(pid), process_cpu_seconds(pid, pid)
            steps = after["engine_steps"] - before["engine_steps"] or float("nan")  # (older checkouts count none)
            tokens = after["generation_tokens"] - before["generation_tokens"]
            engine_cpu = after["engine_thread_cpu_seconds"] - before["engine_thread_cpu_seconds"]
            served = level["output_tokens_per_s"]
            offline = offline_tokens_per_s(demo, args.step_ms / 1000, streams, async_scheduling, options)
            results.append({
                "streams": streams, "async_scheduling": async_scheduling, "num_failed": level["num_failed"],
                "engine": "process" if engine_process else "thread",
                "served_tok_s": served, "offline_tok_s": offline, "served_over_offline": served / offline,
                "itl_p50_ms": (level["itl_per_chunk"]["p50"] or 0) * 1000,
                "tokens_per_step": tokens / steps,
                "engine_thread_cpu_ms_per_step": engine_cpu / steps * 1000,
                # A decode step's sequences are its tokens: the engine's CPU per sequence it stepped.
                "engine_us_per_sequence": engine_cpu / tokens * 1e6,
                "rest_of_process_cpu_ms_per_step": (cpu_after - cpu_before - engine_cpu) / steps * 1000,
                "loop_us_per_token": (loop_after - loop_before) / tokens * 1e6,  # the event loop's thread
                "rest_of_process_us_per_token": (cpu_after - cpu_before - engine_cpu) / tokens * 1e6,
                "generator_cpu_ms_per_step": generator_cpu / steps * 1000,
                "dispatch_ms_per_step": (after["dispatch"] - before["dispatch"]) / steps * 1000,
            })
            print(f"[serve, engine {results[-1]['engine']}, async {async_scheduling}] {streams} streams: served {served:.0f} tok/s, offline "
                  f"{offline:.0f} tok/s ({served / offline:.0%}), {level['num_failed']} failed", flush=True)
    finally:
        server.stop()
    return results


# -- report ------------------------------------------------------------------------------------


def median_runs(runs: list[dict], keys: tuple[str, ...]) -> dict:
    out = dict(runs[0])
    for key in keys:
        out[key] = statistics.median(r[key] for r in runs)
    if "stages_ms" in out:
        out["stages_ms"] = {s: statistics.median(r["stages_ms"][s] for r in runs) for s in HOST_STAGES}
    return out


def print_report(steps: list[dict], served: list[dict], step_ms: float) -> None:
    print(f"\nengine, decode steps of a {step_ms:g} ms device step (medians): host ms per step by stage")
    print("| sequences | async | step ms | device busy | host ms | " + " | ".join(HOST_STAGES) + " |")
    print("| ---: | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in HOST_STAGES) + " |")
    for r in steps:
        stages = " | ".join(f"{r['stages_ms'][s]:.2f}" for s in HOST_STAGES)
        print(f"| {r['batch']} | {r['async_scheduling']} | {r['step_ms']:.2f} | {r['device_busy']:.0%} | "
              f"{r['host_ms']:.2f} | {stages} |")
    if served:
        print("\nserver vs offline engine, same requests (medians)")
        print("| streams | engine | async | served tok/s | offline tok/s | served/offline | ITL p50 ms | tokens a step | "
              "engine thread CPU ms/step | engine µs/sequence | rest of process CPU ms/step | loop µs/token | "
              "rest of process µs/token | dispatch ms/step | load generator CPU ms/step |")
        print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in served:
            print(f"| {r['streams']} | {r['engine']} | {r['async_scheduling']} | {r['served_tok_s']:.0f} | {r['offline_tok_s']:.0f} | "
                  f"{r['served_over_offline']:.0%} | {r['itl_p50_ms']:.1f} | {r['tokens_per_step']:.0f} | "
                  f"{r['engine_thread_cpu_ms_per_step']:.2f} | {r.get('engine_us_per_sequence', 0):.1f} | "
                  f"{r['rest_of_process_cpu_ms_per_step']:.2f} | {r.get('loop_us_per_token', 0):.1f} | "
                  f"{r.get('rest_of_process_us_per_token', 0):.1f} | {r['dispatch_ms_per_step']:.2f} | "
                  f"{r.get('generator_cpu_ms_per_step', 0):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=10.0, help="the device's time per step (default 10)")
    parser.add_argument("--batches", default="1,64,256,512", help="running sequences in the engine table")
    parser.add_argument("--streams", default="256,512", help="server streams to compare with the offline engine")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement; medians are shown")
    parser.add_argument("--modes", default="off,on", help="async scheduling settings to run (engine table)")
    parser.add_argument("--server-mode", default="on", help="async scheduling of the served run")
    parser.add_argument("--server-engines", default="thread,process",
                        help="where the served engine runs: thread (the default) and/or process (--engine-process)")
    parser.add_argument("--server-repeats", type=int, default=2, help="runs of each served measurement")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--stream-interval", type=int, default=1, help="the served runs' [server] stream_interval")
    parser.add_argument("--quick", action="store_true", help="a smoke test: small batches, one run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure here")
    # The server child (started by this script).
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--demo", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--async-scheduling", default="on", help=argparse.SUPPRESS)
    parser.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child:
        serve_child(args)
        return
    if args.quick:
        args.batches, args.streams, args.repeats, args.server_repeats, args.output_tokens = "1,16", "16", 1, 1, 24
    torch.set_num_threads(1)  # the timed model's few ops: threads would only add wake-ups
    demo = ensure_demo_model()
    batches = [int(b) for b in args.batches.split(",")]
    streams_levels = [int(s) for s in args.streams.split(",") if s]
    steps = []
    for batch in batches:
        for mode in args.modes.split(","):
            runs = [measure_steps(demo, args.step_ms / 1000, batch, mode, args.output_tokens) for _ in range(args.repeats)]
            steps.append(median_runs(runs, ("step_ms", "device_busy", "host_ms", "wait_ms")))
            r = steps[-1]
            print(f"[engine] {batch} sequences, async {mode}: {r['step_ms']:.2f} ms a step, host {r['host_ms']:.2f} ms, "
                  f"device busy {r['device_busy']:.0%}", flush=True)
    served = []
    keys = ("served_tok_s", "offline_tok_s", "served_over_offline", "itl_p50_ms", "tokens_per_step",
            "engine_thread_cpu_ms_per_step", "rest_of_process_cpu_ms_per_step", "dispatch_ms_per_step",
            "engine_us_per_sequence", "loop_us_per_token", "rest_of_process_us_per_token", "generator_cpu_ms_per_step")
    for where in args.server_engines.split(",") if not args.skip_server and streams_levels else []:
        with tempfile.TemporaryDirectory(prefix="chatd-host-") as tmp:
            runs = [measure_server(demo, args, streams_levels, Path(tmp), args.server_mode, where == "process")
                    for _ in range(args.server_repeats)]
        served += [median_runs([run[i] for run in runs], keys) for i in range(len(streams_levels))]
    print_report(steps, served, args.step_ms)
    if args.json:
        Path(args.json).write_text(json.dumps({"step_ms": args.step_ms, "engine": steps, "server": served}, indent=1))
    default = [r for r in served if r["engine"] == "thread"] or served  # the line is about `chatd serve` as it ships
    for r in served:
        if r not in default:
            print(f"(engine in its own process: served/offline {r['served_over_offline']:.0%} at {r['streams']} streams)")
    ratio = {r["streams"]: r["served_over_offline"] for r in default}
    overlapped = [r for r in steps if r["async_scheduling"] == "on"]
    at = next((r for r in overlapped if r["batch"] == 256), overlapped[-1] if overlapped else steps[-1])
    by_streams = {r["streams"]: r for r in default}
    share = lambda n: f"{ratio[n]:.0%}" if n in ratio else "-"  # noqa: E731
    figure = lambda n, key: f"{by_streams[n][key]:.1f}" if n in by_streams else "-"  # noqa: E731
    print(f"served/offline: {share(256)} at 256 streams, {share(512)} at 512; host overhead per step at "
          f"{at['batch']}: {max(at['step_ms'] - args.step_ms, 0.0):.2f} ms; loop per streamed token: "
          f"{figure(256, 'loop_us_per_token')} µs at 256, {figure(512, 'loop_us_per_token')} µs at 512; engine per "
          f"sequence: {figure(256, 'engine_us_per_sequence')} µs at 256, {figure(512, 'engine_us_per_sequence')} µs at 512")


def _serving(log: str) -> bool:
    """The server runs as it will: its start timeline is in (or, in a checkout older than it, it is ready)."""
    return "start timeline:" in log or ("ready:" in log and "start: listening" not in log)


if __name__ == "__main__":
    main()

"""Decode step time against its rooflines, and time to first token with and without a cached prefix.

One run, one device, one random-weight model (Llama-3.1-8B's shape in bfloat16 by default):

1. The machine's two ceilings, measured in this run: copy bandwidth (a large device-to-device
   tensor copy; bytes moved = 2 x its size, as it reads and writes them) and the matmul rate (a
   large square matmul in the model's dtype). Both are medians, measured at the start and again
   at the end (the median of the two is used).
2. Decode step time at each batch size: B prompts of `--context` random tokens are prefilled,
   then `--warmup-steps` decode steps run untimed and `--decode-steps` are timed, each checked to
   be a pure decode step (B sequences, one token each, no prompt token computed, no preemption).
   The median step time is set against the step's rooflines:

     memory roofline  = bytes / copy bandwidth
       bytes = weights + KV read + KV written
       weights    = dtype bytes x (every linear incl. lm_head + norms, read once + B embedding rows)
       KV read    = dtype bytes x sum over sequences of context x layers x 2 x kv_heads x head_dim
       KV written = dtype bytes x B x layers x 2 x kv_heads x head_dim
     compute roofline = FLOPs / matmul rate
       FLOPs = 2 x (non-embedding params + lm_head) x B + 4 x layers x heads x head_dim x sum(context)
     roofline = max(memory, compute); fraction = roofline / measured step time

   A sequence's context is every token its fed token attends to, itself included; the sums use
   each timed step's actual contexts. Activations, logits and the sampler are not counted, and a
   kernel that only reads can beat a copy's rate, so a fraction slightly above 100% is possible.
3. Time to first token of a `--ttft-prompt`-token prompt (max_tokens=1), from add_request to the
   step that returns the token: fresh random prompts (nothing cached), then, prefix cache on,
   prompts whose first `--ttft-cached` tokens a previous request has just computed. The floor is
   the same roofline for the tokens actually computed (FLOPs of the prefill, with causal attention).

This script knows nothing of chatd's internals; it only calls the engine's public API.

    python benchmarks/steps.py --device cuda --json steps.json
    python benchmarks/steps.py --quick                  # tiny model on CPU: a smoke test, seconds
    python benchmarks/steps.py --device cuda --quantization none,fp8,int4 --batches 1,64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # weight-loading progress bars would bury the tables

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from benchmarks.roofline import (  # noqa: E402
    DTYPES,
    build_checkpoint,
    measure_ceilings,
    prefill_cost,
    rooflines,
    step_cost,
    sync,
)

# Llama-3.1-8B's shape (transformers config names); the weights are random.
LLAMA_8B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)
TINY = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=256, vocab_size=2048, tie_word_embeddings=False, max_position_embeddings=4096,
)
# SmolLM2-135M's shape (chatd's default model): what a CPU serves.
SMOLLM2_135M = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
    rope_parameters=dict(rope_type="default", rope_theta=100000.0),
)
SHAPES = {"Llama-3.1-8B": LLAMA_8B, "SmolLM2-135M": SMOLLM2_135M, "tiny Llama": TINY}
# The workload; --quick swaps in the tiny model and a small workload.
DEFAULTS = dict(batches=(1, 8, 64, 256), context=1024, decode_steps=30, warmup_steps=5, ttft_prompt=2000,
                ttft_cached=1900, ttft_repeats=5, max_num_batched_tokens=8192, copy_mib=2048, gemm_size=8192)
QUICK = dict(batches=(1, 4), context=64, decode_steps=10, warmup_steps=3, ttft_prompt=200, ttft_cached=150,
             ttft_repeats=3, max_num_batched_tokens=1024, copy_mib=64, gemm_size=512)
BLOCK_SIZE = 16

FORMULAS = """\
memory roofline  = (weights + KV read + KV written) / copy bandwidth
  weights    = dtype bytes x (every linear incl. lm_head + norms, read once + batch embedding rows)
               (quantized: the linears and norms at 1 byte a weight for fp8 and int8, 0.625 for int4)
  KV read    = dtype bytes x sum(context) x layers x 2 x kv_heads x head_dim
  KV written = dtype bytes x batch x layers x 2 x kv_heads x head_dim
compute roofline = FLOPs / matmul rate
  FLOPs = 2 x (non-embedding params + lm_head) x batch + 4 x layers x heads x head_dim x sum(context)
roofline = max(memory, compute); fraction = roofline / measured step time
sum(context) = tokens each sequence's fed token attends to, summed over the batch (per timed step)"""


# -- the measurements -----------------------------------------------------------------------------


def check(outputs: list) -> list:
    """A step's outputs, or the first failed request's error raised."""
    failed = [o for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
    return outputs


def time_decode(engine, batch: int, args: argparse.Namespace, rng: random.Random) -> dict:
    """Prefill `batch` random prompts, then time pure decode steps; per-step contexts for the rooflines."""
    from chatd.engine import SamplingParams

    # Early sequences decode while later ones still prefill, so leave room for those tokens too.
    prefill_steps = -(-batch * args.context // max(args.max_num_batched_tokens - batch, 1)) + 2
    profiled = args.profile if batch == args.batches[0] else 0
    params = SamplingParams(max_tokens=prefill_steps + args.warmup_steps + args.decode_steps + profiled + 2,
                            temperature=0.0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    prompts = [[rng.randrange(args.vocab) for _ in range(args.context)] for _ in ids]
    try:
        return _time_decode(engine, batch, ids, prompts, params, args)
    finally:  # the next batch size starts from an empty engine, whatever happened here
        for rid in ids:
            engine.abort(rid)


def _time_decode(engine, batch: int, ids: list[str], prompts: list[list[int]], params, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    num_outputs = dict.fromkeys(ids, 0)

    def step() -> list:
        outs = check(engine.step())
        for out in outs:
            num_outputs[out.request_id] += sum(len(o.token_ids) for o in out.outputs)
        return outs

    while min(num_outputs.values()) == 0:  # until every sequence has its first token
        step()
    for _ in range(args.warmup_steps):
        step()
    before = engine.stats()
    times, contexts = [], []
    for _ in range(args.decode_steps):
        # The fed token attends to the prompt and every generated token, itself included.
        contexts.append([args.context + n for n in num_outputs.values()])
        sync(device)
        start = time.perf_counter()
        outs = step()
        sync(device)
        times.append(time.perf_counter() - start)
        if len(outs) != batch or any(len(o.outputs[0].token_ids) != 1 or o.finished for o in outs):
            raise RuntimeError(f"batch {batch}: a timed step was not {batch} one-token decodes")
    after = engine.stats()
    if after.num_prompt_tokens != before.num_prompt_tokens or after.num_preemptions != before.num_preemptions:
        raise RuntimeError(f"batch {batch}: prompt tokens computed or sequences preempted during the timed steps")
    if after.num_running != batch or after.num_waiting:
        raise RuntimeError(f"batch {batch}: {after.num_running} running, {after.num_waiting} waiting")
    if args.profile and batch == args.batches[0]:
        profile_steps(step, batch, args)
    return dict(batch=batch, step_seconds=times, contexts=contexts)


def profile_steps(step, batch: int, args: argparse.Namespace) -> None:
    """Run `args.profile` more decode steps under torch's profiler and print where their time went:
    the device's busy time against the wall time (the rest is the host's, or idle), and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.profile):
            step()
        sync(device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    on_device = sum(e.self_device_time_total for e in averages) / 1e6 if device.type == "cuda" else 0.0
    busy = (f"; device busy {on_device / args.profile * 1e3:.3f} ms a step ({on_device / wall:.0%} of the wall time)"
            if device.type == "cuda" else "")
    print(f"\nprofile of {args.profile} decode steps at batch {batch}: {wall / args.profile * 1e3:.3f} ms a step "
          f"(under the profiler){busy}")
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=20, max_name_column_width=60), flush=True)


def first_token(engine, request_id: str, prompt: list[int], device: torch.device):
    """Seconds from add_request to the step that returns the request's first token, and that output."""
    from chatd.engine import SamplingParams

    sync(device)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in check(engine.step()):
            if out.request_id == request_id and out.outputs and out.outputs[0].token_ids:
                seconds = time.perf_counter() - start
                while engine.has_unfinished_requests():
                    engine.step()
                return seconds, out
    raise RuntimeError(f"request {request_id} finished without a token")


def time_ttft(engine, args: argparse.Namespace, rng: random.Random) -> list[dict]:
    """TTFT of fresh prompts, then of prompts sharing their first ttft_cached tokens with the previous request."""
    device = torch.device(args.device)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    cases = []
    for case, cached in (("no cache", 0), (f"{args.ttft_cached} cached", args.ttft_cached)):
        seconds, num_cached = [], []
        for repeat in range(args.ttft_repeats + 1):  # the first run warms up this step shape, untimed
            prompt = fresh(args.ttft_prompt)
            if cached:
                first_token(engine, f"ttft-base-{cached}-{repeat}", prompt, device)
                prompt = prompt[:cached] + fresh(args.ttft_prompt - cached)
            took, out = first_token(engine, f"ttft-{cached}-{repeat}", prompt, device)
            if repeat:
                seconds.append(took)
                num_cached.append(out.num_cached_tokens)
        cases.append(dict(case=case, prompt_tokens=args.ttft_prompt, shared_prefix=cached,
                          num_cached_tokens=num_cached, seconds=seconds))
    return cases


# -- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    """Measure ceilings, build the model, time decode steps and TTFT of each quantization, print the
    tables; return every number."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    args.shape = "tiny Llama" if args.quick else args.shape or "Llama-3.1-8B"
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    args.vocab = shape["vocab_size"]
    print(f"torch {torch.__version__}, device {device}, dtype {args.dtype}, seed {args.seed}", flush=True)
    start_ceilings = measure_ceilings(args)
    print(f"copy bandwidth {start_ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s ({args.copy_mib} MiB copied, read + write "
          f"counted), {args.dtype} matmul {start_ceilings['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s "
          f"({args.gemm_size}^3); medians of 10", flush=True)

    max_model_len = -(-max(args.ttft_prompt + 16, 2 * args.context + 256) // BLOCK_SIZE) * BLOCK_SIZE
    with tempfile.TemporaryDirectory(prefix="chatd-steps-", dir=args.tmp_dir) as tmp:
        started = time.perf_counter()
        params = build_checkpoint(Path(tmp), shape, dtype, device, args.seed)
        build_seconds = time.perf_counter() - started
        print(f"model: {args.shape} shape, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
              f"{params['total_params'] / 1e6:.1f}M parameters ({params['non_embedding_params'] / 1e6:.1f}M non-embedding), "
              f"{params['checkpoint_bytes'] / 1e9:.3f} GB in {params['num_files']} files, written in {build_seconds:.1f} s",
              flush=True)
        runs = [measure(tmp, quantization, args, max_model_len) for quantization in args.quantization]

    try:
        end_ceilings = measure_ceilings(args)
    except torch.OutOfMemoryError:  # the engine's memory was not all given back; keep the start's
        end_ceilings = start_ceilings
    ceilings = {k: statistics.median([start_ceilings[k], end_ceilings[k]]) for k in start_ceilings}
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    for run_ in runs:
        weight_bytes = WEIGHT_BYTES.get(run_["quantization"], dtype_bytes)
        run_["decode"] = [decode_row(r, shape, params, dtype_bytes, ceilings, weight_bytes) for r in run_.pop("decode_times")]
        run_["ttft"] = [ttft_row(r, shape, params, dtype_bytes, ceilings, weight_bytes) for r in run_.pop("ttft_times")]
        first = run_["decode"][0]
        run_["batch1_meets_target"] = (first["step_seconds"] <= 1.25 * first["roofline_seconds"]
                                       if first["batch"] == 1 and "error" not in first else None)
        report(args, shape, ceilings, start_ceilings, end_ceilings, run_)
    if len(runs) > 1:
        report_ratios(runs)
    print(FORMULAS)
    first = runs[0]
    return dict(
        args=dict(vars(args)), torch=torch.__version__, shape=shape, params=params,
        engine=first["engine"], max_model_len=max_model_len, build_seconds=build_seconds, load_seconds=first["load_seconds"],
        ceilings=ceilings, ceilings_start=start_ceilings, ceilings_end=end_ceilings, decode=first["decode"],
        ttft=first["ttft"], batch1_meets_target=first["batch1_meets_target"], formulas=FORMULAS, runs=runs,
        errors=[f"{r['quantization']}: {row['error']}" if len(runs) > 1 else row["error"]
                for r in runs for row in r["decode"] + r["ttft"] if "error" in row],
    )


def measure(folder: str, quantization: str, args: argparse.Namespace, max_model_len: int) -> dict:
    """Build chatd's engine on the checkpoint with weights quantized as `quantization`, time its decode
    steps and TTFT (the same prompts for each quantization), and give its memory back."""
    from chatd import LLM, SamplingParams

    device, rng = torch.device(args.device), random.Random(args.seed)
    started = time.perf_counter()
    options = dict(device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE, max_num_seqs=max(args.batches),
                   max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                   enable_prefix_caching=True, compile=not args.no_compile, quantization=quantization)
    if args.gpu_memory_utilization:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    try:
        llm = LLM(folder, **options)
    except Exception as exc:  # a quantization this device cannot run: its rows say so, the others still run
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
        return dict(quantization=quantization, engine=None, load_seconds=None,
                    decode_times=[dict(batch=b, error=error) for b in args.batches], ttft_times=[dict(case="all", error=error)])
    load_seconds = time.perf_counter() - started
    engine = llm.engine
    describe = engine.model_info().details()
    print(f"engine built in {load_seconds:.1f} s (weights, KV pool, CUDA graphs): {describe}", flush=True)
    llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    # A failure is reported in its row and the rest still run: a GPU run is too dear to lose whole.
    decode = []
    for batch in args.batches:
        try:
            decode.append(time_decode(engine, batch, args, rng))
            print(f"{quantization} batch {batch}: median step {statistics.median(decode[-1]['step_seconds']) * 1e3:.2f} ms", flush=True)
        except Exception as exc:
            traceback.print_exc()
            decode.append(dict(batch=batch, error=f"{type(exc).__name__}: {exc}"))
    try:
        ttft = time_ttft(engine, args, rng)
    except Exception as exc:
        traceback.print_exc()
        ttft = [dict(case="all", error=f"{type(exc).__name__}: {exc}")]
    del llm, engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(quantization=quantization, engine=describe, load_seconds=load_seconds, decode_times=decode, ttft_times=ttft)


def decode_row(result: dict, shape: dict, params: dict, dtype_bytes: int, ceilings: dict, weight_bytes: float) -> dict:
    """One batch size's median step time set against the rooflines of its timed steps' mean cost."""
    if "error" in result:
        return result
    costs = [step_cost(shape, params, dtype_bytes, contexts, weight_bytes) for contexts in result["contexts"]]
    mean = {k: statistics.fmean(c[k] for c in costs) for k in costs[0]}
    memory, compute = rooflines(mean, ceilings)
    measured = statistics.median(result["step_seconds"])
    return dict(
        batch=result["batch"], step_seconds=measured, runs=result["step_seconds"],
        mean_context=statistics.fmean(sum(c) / len(c) for c in result["contexts"]),
        memory_roofline_seconds=memory, compute_roofline_seconds=compute,
        roofline_seconds=max(memory, compute), roofline_fraction=max(memory, compute) / measured, **mean,
    )


def ttft_row(case: dict, shape: dict, params: dict, dtype_bytes: int, ceilings: dict, weight_bytes: float) -> dict:
    """One TTFT case's median set against the roofline of the prefill it computed."""
    if "error" in case:
        return case
    cost = prefill_cost(shape, params, dtype_bytes, case["prompt_tokens"], min(case["num_cached_tokens"]), weight_bytes)
    memory, compute = rooflines(cost, ceilings)
    return dict(case, ttft_seconds=statistics.median(case["seconds"]), floor_seconds=max(memory, compute),
                memory_floor_seconds=memory, compute_floor_seconds=compute)


def report(args, shape, ceilings, start, end, run_: dict) -> None:
    """Print one engine's decode and TTFT tables and the ceilings they were set against."""
    decode_rows, ttft_rows, target = run_["decode"], run_["ttft"], run_["batch1_meets_target"]
    weights = "" if run_["quantization"] == "none" else f", weights {run_['quantization']}"
    print(f"\nDecode step time, {args.shape} shape ({shape['num_hidden_layers']} layers, {args.dtype}{weights}), prompts of "
          f"{args.context} tokens, median of {args.decode_steps} timed steps after {args.warmup_steps} untimed")
    print(f"{'batch':>5} {'context':>8} {'step ms':>9} {'memory ms':>10} {'compute ms':>11} {'roofline ms':>12} "
          f"{'fraction':>9} {'x roofline':>11}  {'GB read+written':>15} {'GFLOP':>9}  steps ms (min-max)")
    for row in decode_rows:
        if "error" in row:
            print(f"{row['batch']:>5} failed: {row['error']}")
            continue
        num_bytes = row["weight_bytes"] + row["kv_read_bytes"] + row["kv_write_bytes"]
        print(f"{row['batch']:>5} {row['mean_context']:>8.0f} {row['step_seconds'] * 1e3:>9.3f} "
              f"{row['memory_roofline_seconds'] * 1e3:>10.3f} {row['compute_roofline_seconds'] * 1e3:>11.3f} "
              f"{row['roofline_seconds'] * 1e3:>12.3f} {row['roofline_fraction']:>9.1%} "
              f"{1 / row['roofline_fraction']:>10.2f}x  {num_bytes / 1e9:>15.3f} {row['flops'] / 1e9:>9.1f}  "
              f"{min(row['runs']) * 1e3:.3f}-{max(row['runs']) * 1e3:.3f}")
    if target is not None:
        row = decode_rows[0]
        print(f"batch 1: {row['step_seconds'] * 1e3:.3f} ms = {1 / row['roofline_fraction']:.2f}x its roofline "
              f"(target <= 1.25x: {'met' if target else 'NOT met'})")
    print(f"\nTime to first token, {args.ttft_prompt}-token random prompt, max_tokens=1, prefix cache on, "
          f"max_num_batched_tokens {args.max_num_batched_tokens} (the prompt is one step); "
          f"median of {args.ttft_repeats} after 1 untimed")
    print(f"{'case':<12} {'prompt':>7} {'cached':>7} {'computed':>9} {'TTFT ms':>9} {'floor ms':>9} {'x floor':>8}  runs (ms)")
    for row in ttft_rows:
        if "error" in row:
            print(f"{row['case']:<12} failed: {row['error']}")
            continue
        cached = min(row["num_cached_tokens"])
        runs = ", ".join(f"{s * 1e3:.1f}" for s in row["seconds"])
        print(f"{row['case']:<12} {row['prompt_tokens']:>7} {cached:>7} {row['prompt_tokens'] - cached:>9} "
              f"{row['ttft_seconds'] * 1e3:>9.2f} {row['floor_seconds'] * 1e3:>9.2f} "
              f"{row['ttft_seconds'] / row['floor_seconds']:>7.2f}x  {runs}")
    print("cached = RequestOutput.num_cached_tokens (whole blocks of 16 of the shared prefix); floor = the roofline "
          "of the computed tokens' prefill (causal attention) and one token's logits")
    print(f"\nCeilings (median of start and end): copy bandwidth {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s "
          f"(start {start['copy_bytes_per_s'] / 1e9:.1f}, end {end['copy_bytes_per_s'] / 1e9:.1f}); {args.dtype} matmul "
          f"{ceilings['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s (start {start['matmul_flops_per_s'] / 1e9:.1f}, "
          f"end {end['matmul_flops_per_s'] / 1e9:.1f})")


def report_ratios(runs: list[dict]) -> None:
    """Each quantization's median decode step and TTFT over the first's (the same checkpoint, this run)."""
    base = runs[0]
    print(f"\nStep time over {base['quantization']}'s (same checkpoint and device, this run)")
    for run_ in runs[1:]:
        cells = [f"batch {a['batch']} {b['step_seconds'] / a['step_seconds']:.2f}x"
                 for a, b in zip(base["decode"], run_["decode"]) if "error" not in a and "error" not in b]
        cells += [f"TTFT {a['case']} {b['ttft_seconds'] / a['ttft_seconds']:.2f}x"
                  for a, b in zip(base["ttft"], run_["ttft"]) if "error" not in a and "error" not in b]
        print(f"  {run_['quantization']}: {', '.join(cells) or 'no rows to compare'}")


# Bytes a quantized weight takes, scales included (chatd's formats): fp8 and int8 one byte and a
# scale per row (~0.1%, not counted); int4 half a byte and a bfloat16 scale and zero per 32. A
# `gguf` file's mix of types is counted at the model's dtype.
WEIGHT_BYTES = {"fp8": 1.0, "int8": 1.0, "int4": 0.5 + 4 / 32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of this benchmark (offline.py passes its --device and --quick through)."""
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", choices=DTYPES, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the first batch size's timed steps, N more under torch's profiler: device busy "
                        "time against wall time, and the top ops (default 0: none)")
    p.add_argument("--quantization", type=lambda s: s.split(","), default=["none"],
                   help="chatd's model.quantization, or several comma-separated: one engine each on the same "
                        "checkpoint, ratios to the first printed (default none; on CUDA fp8 and int4)")
    p.add_argument("--quick", action="store_true", help="tiny model, batches 1 and 4, 200-token TTFT prompt: a smoke test")
    p.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")), help="decode batch sizes (1,8,64,256)")
    p.add_argument("--context", type=int, help="prompt tokens per decode sequence (1024)")
    p.add_argument("--decode-steps", dest="decode_steps", type=int, help="timed decode steps per batch size (30)")
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, help="untimed decode steps before them (5)")
    p.add_argument("--ttft-prompt", dest="ttft_prompt", type=int, help="TTFT prompt tokens (2000)")
    p.add_argument("--ttft-cached", dest="ttft_cached", type=int, help="of those, shared with the previous prompt (1900)")
    p.add_argument("--ttft-repeats", dest="ttft_repeats", type=int, help="timed TTFT runs per case (5)")
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, help="chatd's step budget (8192)")
    p.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float, help="chatd's (default its own)")
    p.add_argument("--shape", choices=[name for name in SHAPES if name != "tiny Llama"],
                   help="the random model's shape (default Llama-3.1-8B)")
    p.add_argument("--no-compile", dest="no_compile", action="store_true",
                   help="on CPU, decode steps eagerly (chatd's --no-compile)")
    p.add_argument("--layers", type=int, help="fewer decoder layers than the shape's (a quicker look on a GPU)")
    p.add_argument("--copy-mib", dest="copy_mib", type=int, help="size of the copy that measures bandwidth (2048)")
    p.add_argument("--gemm-size", dest="gemm_size", type=int, help="size of the matmul that measures the rate (8192)")
    p.add_argument("--tmp-dir", dest="tmp_dir", help="where the random checkpoint is written (default the system's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")


def finish_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what was not given from the defaults (or QUICK's) and the device."""
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "float32" if torch.device(args.device).type == "cpu" else "bfloat16"
    from chatd.config import QUANTIZATIONS

    unknown = [q for q in args.quantization if q not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"--quantization takes {', '.join(QUANTIZATIONS)}, got {', '.join(unknown)}")
    if not 0 < args.ttft_cached < args.ttft_prompt:
        raise ValueError(f"--ttft-cached must be between 0 and --ttft-prompt ({args.ttft_prompt}), got {args.ttft_cached}")
    if args.ttft_prompt > args.max_num_batched_tokens:
        raise ValueError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must hold the TTFT prompt "
                         f"({args.ttft_prompt}) so it is one step")
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    try:
        finish_arguments(args)
    except ValueError as exc:
        p.error(str(exc))
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

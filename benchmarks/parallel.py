"""Tensor parallelism's cost: the same steps with the model on one rank and split over N, side by side.

On the 2-core CPU machine this shows what the split costs, not a speedup: both ranks share the
two cores (each gets one thread), so the arithmetic is the same and what TP adds is two gloo
all-reduces per layer, the vocabulary gather, and sending each step's inputs to the workers.
Configurations run in turn, `--repeats` times; each figure is the median of its step times over
all runs, and the ratio is TP=N's median over TP=1's.

Measured per configuration (chatd's offline engine, `LLM(...).engine.step()` timed):
  decode step at batch 1 and at `--batch` (prompts of `--prompt-len`, then decode-only steps),
  prefill step of one `--prefill-len`-token prompt.

Then, on paper, what an all-reduce costs a large model on a GPU node (`--paper`): per step,
2 x layers + 1 all-reduces of tokens x hidden values (o_proj, down_proj, the embedding), and a
ring all-reduce moves 2 (N-1)/N of the data through each GPU's links.

    python benchmarks/parallel.py                       # TP=1 vs TP=2 on CPU, a 58M-parameter Llama
    python benchmarks/parallel.py --quick               # seconds
    python benchmarks/parallel.py --device cuda --tp 2  # on a node with 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from chatd.engine import LLM, SamplingParams  # noqa: E402
from chatd.engine.models.demo import build_model_dir  # noqa: E402

# A Llama of hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1536, vocabulary 32000 (offline.py's cpu preset).
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1536, vocab_size=32000)
QUICK_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=2000)

# Llama-3.1-70B on 8 GPUs joined by NVLink 4 (H100 SXM: 900 GB/s per GPU, both directions together).
PAPER = dict(model="Llama-3.1-70B", hidden=8192, layers=80, dtype_bytes=2, ranks=8, link_gb_s=450.0,
             weights_gb=141.0, hbm_tb_s=3.35, flops_tflops=989.0, latency_us=10.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=2, help="ranks to compare against one")
    parser.add_argument("--batch", type=int, default=16, help="sequences in the larger decode batch")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=24, help="decode steps timed per batch")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="runs of every configuration, in turn")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.prompt_len, args.decode_steps, args.prefill_len, args.repeats = 4, 32, 6, 64, 1
    return args


def decode_step_times(llm: LLM, batch: int, args: argparse.Namespace, offset: int,
                      tokens: dict[str, list[int]]) -> list[float]:
    """Seconds of each decode-only step of `batch` sequences (their prompts computed first, untimed);
    the greedy tokens each sequence got go into `tokens`."""
    engine = llm.engine
    params = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [(offset + 31 * i + j) % 1900 + 5 for j in range(args.prompt_len)]  # no shared prefix
        engine.add_request(f"decode-{offset}-{batch}-{i}", prompt, params)

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)

    while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.live_sequences()):
        step()  # prefill (and the first token)
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times[:-1]  # the last step also ends the requests


def prefill_step_time(llm: LLM, args: argparse.Namespace, offset: int) -> float:
    engine = llm.engine
    prompt = [(offset + 7 * j) % 1900 + 5 for j in range(args.prefill_len)]
    engine.add_request(f"prefill-{offset}", prompt, SamplingParams(max_tokens=1, temperature=0))
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def run(model: Path, tp: int, args: argparse.Namespace, repeat: int) -> dict[str, list[float]]:
    options = dict(device=args.device, dtype=args.dtype, block_size=16, num_blocks=1024,
                   max_num_batched_tokens=max(args.prefill_len, args.batch * args.prompt_len), tensor_parallel_size=tp,
                   enable_prefix_caching=False)
    tokens: dict[str, list[int]] = {}
    with LLM(str(model), **options) as llm:
        decode_step_times(llm, 1, args, 10_000 * repeat, {})  # warm-up
        times = {
            "decode_1": decode_step_times(llm, 1, args, 10_000 * repeat + 1, tokens),
            f"decode_{args.batch}": decode_step_times(llm, args.batch, args, 10_000 * repeat + 2, tokens),
            "prefill": [prefill_step_time(llm, args, 10_000 * repeat + 3 + i) for i in range(3)],
        }
    return times, tokens


def on_paper(p: dict) -> list[str]:
    """Per-step all-reduce volume and time for a large model at TP=ranks, against its compute."""
    lines = [f"On paper: {p['model']} (hidden {p['hidden']}, {p['layers']} layers, {8 * p['dtype_bytes']}-bit) over "
             f"{p['ranks']} GPUs, NVLink {p['link_gb_s']:g} GB/s each way per GPU, {p['latency_us']:g} us per small all-reduce"]
    num_reduces = 2 * p["layers"] + 1
    for tokens, what in ((1, "decode, batch 1"), (64, "decode, batch 64"), (8192, "prefill, 8192 tokens")):
        size = tokens * p["hidden"] * p["dtype_bytes"]  # one all-reduce's tensor
        through_each = 2 * (p["ranks"] - 1) / p["ranks"] * size * num_reduces  # ring all-reduce
        comm_ms = through_each / (p["link_gb_s"] * 1e9) * 1e3 + num_reduces * p["latency_us"] / 1e3
        # A step reads every weight once (memory bound) or does 2 FLOPs a weight a token (compute bound).
        read_ms = p["weights_gb"] / p["ranks"] / (p["hbm_tb_s"] * 1e3) * 1e3
        math_ms = 2 * p["weights_gb"] / p["dtype_bytes"] * 1e9 * tokens / p["ranks"] / (p["flops_tflops"] * 1e12) * 1e3
        compute_ms = max(read_ms, math_ms)
        lines.append(f"  {what:<22} {num_reduces} all-reduces of {size / 2**20:8.3f} MiB: {through_each / 2**20:9.1f} MiB "
                     f"through each GPU, ~{comm_ms:6.2f} ms; the step's own work ~{compute_ms:6.2f} ms "
                     f"(communication {comm_ms / compute_ms:.0%} of it unless overlapped)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = QUICK_SHAPE if args.quick else SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(Path(tmp) / "model", "llama", seed=0, **shape)
        print(f"model: Llama hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
              f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, MLP {shape['intermediate_size']}, "
              f"vocabulary {shape['vocab_size']}, {args.dtype} on {args.device} ({os.cpu_count()} cores)")
        results: dict[int, dict[str, list[float]]] = {1: {}, args.tp: {}}
        same_tokens = True
        for repeat in range(args.repeats):
            tokens = {}
            for tp in (1, args.tp):
                times, tokens[tp] = run(model, tp, args, repeat)
                for key, values in times.items():
                    results[tp].setdefault(key, []).extend(values)
            same_tokens &= tokens[1] == tokens[args.tp]
    print(f"greedy tokens of TP={args.tp} equal TP=1's: {'yes' if same_tokens else 'NO'}")
    print(f"\n{'step':<14} {'TP=1 ms':>9} {f'TP={args.tp} ms':>9} {'ratio':>7}   (medians of {args.repeats} runs)")
    table = {}
    for key in results[1]:
        one, many = statistics.median(results[1][key]), statistics.median(results[args.tp][key])
        table[key] = {"tp1_ms": one * 1e3, f"tp{args.tp}_ms": many * 1e3, "ratio": many / one}
        print(f"{key:<14} {one * 1e3:9.2f} {many * 1e3:9.2f} {many / one:6.2f}x")
    paper = on_paper(PAPER)
    print("\n" + "\n".join(paper))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "steps": table, "same_tokens": same_tokens,
                                               "paper": paper}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

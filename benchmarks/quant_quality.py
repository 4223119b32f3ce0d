"""What weight quantization costs and buys on one model: perplexity, greedy agreement, one stream's speed.

For each `model.quantization` (none, int8, int4, and gguf for a GGUF file) it loads the model
with chatd's engine and measures:

  perplexity   of benchmarks/quant/text.txt (a short story written for this benchmark and given
               to the public domain), teacher-forced through chatd's own forward, in windows of
               `--window` tokens
  agreement    the share of greedy tokens equal to the `none` run's before the first divergence,
               over 16 chat prompts of `--max-tokens` tokens
  first token  the share of prompts whose first greedy token equals the `none` run's
  decode step  the median time of one decode step at batch 1 (64 steps after a warm-up), and
               its ratio to `none`'s
  prefill      the median time of the layers' forward over one perplexity window (`--window`
               tokens, as a prompt's prefill runs them)

    python benchmarks/quant_quality.py                        # SmolLM2-135M (the default model), CPU
    python benchmarks/quant_quality.py --model PATH --modes none,int8,int4 --json q.json
    python benchmarks/quant_quality.py --modes gguf --kv-cache-dtypes auto,float16,bfloat16   # the KV cache's dtype

Each mode runs once per `--kv-cache-dtypes` setting (default auto: the model's float32); the first
pair is the reference for agreement and speed. A perplexity window is one prefill with no earlier
context, whose keys and values are rounded as the cache stores them, so it measures the cache's dtype too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

import torch  # noqa: E402

from chatd.engine import LLM, SamplingParams  # noqa: E402
from chatd.engine.attention import build_step  # noqa: E402
from chatd.engine.models.demo import ensure_demo_model  # noqa: E402
from chatd.engine.models.sources import default_model_path  # noqa: E402

TEXT = Path(__file__).resolve().parent / "quant" / "text.txt"
PROMPTS = [
    "What is the capital of France?", "Name three colours.", "Write a haiku about the sea.", "What is 12 times 12?",
    "Explain what a lighthouse does.", "Give me a synonym for happy.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?", "Describe a cat in one sentence.", "List two planets.",
    "How many days are in a week?", "What language is spoken in Spain?", "Tell me a fact about the moon.",
    "What do bees make?", "Suggest a name for a dog.", "What is the opposite of cold?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder or GGUF file (default: SmolLM2-135M if installed, else the demo model)")
    parser.add_argument("--modes", help="comma-separated model.quantization values (default: none,int8,int4 and gguf for a GGUF)")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated cache.kv_cache_dtype values, each run with every mode (default auto)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


@torch.inference_mode()
def perplexity(llm: LLM, window: int) -> tuple[float, int, float]:
    """exp(mean negative log-likelihood) of the text's tokens, each window a fresh prefill; also the
    median milliseconds of the layers' forward over a whole window (the last, shorter one aside)."""
    runner = llm.engine.runner
    ids = llm.tokenizer.encode(TEXT.read_text())
    total, count, prefill_ms = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        blocks = list(range(-(-len(chunk) // runner.block_size)))
        step = build_step(chunk, [0], [len(chunk)], [blocks], runner.block_size, runner.device)
        started = time.perf_counter()
        # As a served prompt's prefill runs: compiled for a window of 192 tokens or more.
        hidden = runner.fast.hidden(step, runner.kv_caches, runner.backend)
        if hidden is None:
            hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta, runner.backend)
        if len(chunk) == window + 1:
            prefill_ms.append((time.perf_counter() - started) * 1e3)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden[:-1]), dim=-1)
        targets = torch.tensor(chunk[1:])
        total -= logprobs[torch.arange(len(targets)), targets].sum().item()
        count += len(targets)
    return math.exp(total / count), count, statistics.median(prefill_ms) if prefill_ms else float("nan")


def decode_step_ms(llm: LLM) -> float:
    engine = llm.engine
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}])
    times = []
    for run in range(2):  # the first run warms up
        engine.add_request(f"speed-{run}", prompt, SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
        engine.step()
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            if run:
                times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    same = sum(next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(reference, tokens))
    return same / sum(len(r) for r in reference)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or default_model_path() or ensure_demo_model()
    is_gguf = str(model).lower().endswith(".gguf")
    modes = args.modes.split(",") if args.modes else ["none", "int8", "int4"] + (["gguf"] if is_gguf else [])
    kv_dtypes = args.kv_cache_dtypes.split(",")
    print(f"model {Path(model).name}, CPU, {torch.get_num_threads()} threads, modes {', '.join(modes)}, "
          f"KV caches {', '.join(kv_dtypes)}")
    results, reference = [], None
    for mode, kv_dtype in ((mode, kv_dtype) for mode in modes for kv_dtype in kv_dtypes):
        with LLM(str(model), device="cpu", dtype="float32", max_model_len=1024, num_blocks=256, quantization=mode,
                 kv_cache_dtype=kv_dtype) as llm:
            ppl, num_tokens, prefill_ms = perplexity(llm, args.window)
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            step_ms = decode_step_ms(llm)
        reference = reference or tokens
        result = {"mode": mode, "kv_cache_dtype": kv_dtype, "perplexity": ppl, "text_tokens": num_tokens, "agreement": agreement(reference, tokens),
                  "first_token": sum(r[0] == t[0] for r, t in zip(reference, tokens)) / len(tokens),
                  "decode_step_ms": step_ms, "prefill_ms": prefill_ms, "sample": outputs[0].outputs[0].text[:60]}
        results.append(result)
    base = results[0]["decode_step_ms"]
    print(f"\n{'mode':<6} {'KV cache':<9} {'perplexity':>10} {'agreement':>10} {'first token':>12} {'decode step':>12} "
          f"{'vs first':>8} {'prefill ' + str(args.window):>12}")
    for r in results:
        print(f"{r['mode']:<6} {r['kv_cache_dtype']:<9} {r['perplexity']:10.3f} {r['agreement']:10.1%} {r['first_token']:12.1%} "
              f"{r['decode_step_ms']:9.2f} ms {r['decode_step_ms'] / base:7.2f}x {r['prefill_ms']:9.0f} ms   {r['sample']!r}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

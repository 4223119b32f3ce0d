"""How much a narrower KV cache changes what a model says: greedy tokens and their log-probabilities
with the cache in a 16-bit float or fp8 against the cache in the model's own dtype.

For 16 fixed prompts (chat-templated when the model has a template) it runs chatd's offline
engine (`chatd.engine.LLM`, the real scheduler, runner and attention backend) once per
`cache.kv_cache_dtype`: "auto" (the reference) and each of --settings (default bfloat16, float16,
fp8_e4m3, fp8_e5m2), greedy, EOS ignored so every answer has --max-tokens tokens. Per setting it prints:

- agreement before divergence: the share of all generated positions that come before a prompt's
  first token that differs from the reference (once one token differs, the contexts differ);
- agreement overall: the share of positions whose token equals the reference's at that position;
- |dlogprob|: mean and max absolute difference of the chosen token's log-probability, over the
  positions before divergence (where both runs saw the same context);
- identical: prompts whose whole answer equals the reference's.

    python benchmarks/kv_accuracy.py                       # SmolLM2-135M-Instruct if installed, else the demo model
    python benchmarks/kv_accuracy.py --model PATH --device cuda --max-tokens 64
    python benchmarks/kv_accuracy.py --quantization gguf --settings float16,bfloat16   # SmolLM2's Q4_1 blocks kept

The model's KV scales are 1.0 (chatd reads no calibrated scales), as in serving.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from chatd.engine import LLM, SamplingParams  # noqa: E402
from chatd.engine.models.demo import ensure_demo_model  # noqa: E402
from chatd.engine.models.sources import default_model_path  # noqa: E402

PROMPTS = [
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain photosynthesis to a ten-year-old.",
    "Translate into French: The library opens at nine in the morning.",
    "List five tips for sleeping better.",
    "What is 17 times 23? Show your steps.",
    "Write a haiku about a rainy afternoon in the city.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the differences between TCP and UDP?",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "Write a short, polite email declining a meeting invitation.",
    "Explain what a hash table is and when to use one.",
    "Who was Ada Lovelace?",
    "Tell me a story about a robot who learns to paint.",
    "What should I pack for a three-day hiking trip?",
]
SETTINGS = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


@dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float]  # the chosen token's, per position


@dataclass
class Agreement:
    """One run against the reference."""

    before_divergence: float  # share of positions before each prompt's first differing token
    overall: float  # share of positions with the reference's token
    mean_logprob_difference: float  # over positions before divergence
    max_logprob_difference: float
    num_identical: int  # prompts whose answer is the reference's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder or GGUF file (default: SmolLM2-135M-Instruct if installed, else the demo model)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (default: chatd's choice for the device)")
    parser.add_argument("--quantization", default="none", help="model.quantization (default none)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated cache.kv_cache_dtype values against auto (default {','.join(SETTINGS)})")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="context, keeps the KV pool small (default 1024)")
    return parser.parse_args(argv)


def model_path(option: str | None) -> str:
    if option:
        return option
    default = default_model_path()
    return str(default if default is not None else ensure_demo_model())


def prompt_ids(llm: LLM) -> list[list[int]] | list[str]:
    """The prompts as the model's chat template renders them (plain text when it has none)."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise SystemExit("the model has no tokenizer: kv_accuracy.py needs text prompts")
    try:
        return [tokenizer.encode_chat([{"role": "user", "content": prompt}]) for prompt in PROMPTS]
    except ValueError:  # no chat template
        return PROMPTS


def generate(path: str, args: argparse.Namespace, kv_cache_dtype: str) -> tuple[list[Answer], str]:
    """Greedy answers with the KV cache in `kv_cache_dtype`, and a line describing the run."""
    llm = LLM(path, device=args.device, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype,
              max_model_len=args.max_model_len, quantization=args.quantization)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompt_ids(llm), params)
    seconds = time.perf_counter() - started
    runner = llm.engine.runner
    about = (f"{kv_cache_dtype:9s} KV {str(runner.kv_dtype).removeprefix('torch.'):14s} model "
             f"{str(runner.dtype).removeprefix('torch.')}, {runner.backend.name}, {runner.num_blocks} blocks, {seconds:.1f} s")
    answers = [Answer(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs]
    return answers, about


def compare(reference: list[Answer], answers: list[Answer]) -> Agreement:
    num_positions = num_same = num_before = num_identical = 0
    differences: list[float] = []
    for want, got in zip(reference, answers, strict=True):
        pairs = list(zip(want.token_ids, got.token_ids))
        first_difference = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        num_positions += len(want.token_ids)
        num_same += sum(a == b for a, b in pairs)
        num_before += first_difference
        num_identical += want.token_ids == got.token_ids
        differences += [abs(a - b) for a, b in zip(want.logprobs[:first_difference], got.logprobs[:first_difference])]
    return Agreement(
        before_divergence=num_before / num_positions,
        overall=num_same / num_positions,
        mean_logprob_difference=sum(differences) / len(differences) if differences else float("nan"),
        max_logprob_difference=max(differences, default=float("nan")),
        num_identical=num_identical,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = model_path(args.model)
    print(f"model {path}, device {args.device}, quantization {args.quantization}, "
          f"{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens (EOS ignored)")
    reference, about = generate(path, args, "auto")
    print(about)
    rows = []
    for setting in args.settings.split(","):
        answers, about = generate(path, args, setting)
        print(about)
        rows.append((setting, compare(reference, answers)))
    print()
    print(f"{'kv_cache_dtype':14s} {'agree before divergence':>24s} {'agree overall':>14s} "
          f"{'mean |dlogprob|':>16s} {'max |dlogprob|':>15s} {'identical':>10s}")
    for setting, agreement in rows:
        print(f"{setting:14s} {agreement.before_divergence:24.1%} {agreement.overall:14.1%} "
              f"{agreement.mean_logprob_difference:16.4f} {agreement.max_logprob_difference:15.4f} "
              f"{agreement.num_identical:>5d} / {len(PROMPTS)}")


if __name__ == "__main__":
    main()

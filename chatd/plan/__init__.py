"""`chatd plan`: how many GPUs a number of users needs, at what cost, and which limit binds.

From a model's config, a GPU kind and a traffic estimate it works out sessions per GPU under
three constraints at a latency objective (KV memory, time per output token from measured decode
step times, time to first token from a stated queueing model), replicas for the peak, tokens/s
per GPU and $ per million tokens, and prints every input beside the result so the arithmetic can
be redone by hand. It loads no weights unless `--measure` times this machine's device.

    model_shape.py  KV bytes per token and weight bytes, from the model's config
    measured.py     the GPU step times benchmarks/README.md holds, with their provenance
    curves.py       StepCurve: decode step time by batch and context, prefill rate; --curve files
    measure.py      --measure: chatd's engine timed on this machine
    capacity.py     the arithmetic: constraints, replicas, tokens/s, cost (plain numbers)
    planner.py      flags to one plan document: inputs resolved and labelled, the curve chosen
    report.py       the document as text

This file declares the subcommand and imports nothing heavy; the rest loads when `chatd plan` runs.
"""

from __future__ import annotations

import argparse
import sys

from chatd.cli_args import non_negative_float, positive_number
from chatd.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

GPU_CHOICES = ("h100", "h200", "cpu")


def add_parser(subparsers) -> None:
    """Register `chatd plan` on the CLI's subparsers."""
    plan = subparsers.add_parser(
        "plan", help="capacity plan: GPUs, sessions per GPU and $/M tokens for a number of users",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(plan)
    plan.set_defaults(func=main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`chatd plan`'s flags. Those whose default depends on others (or on the GPU kind) default to None here."""
    p.add_argument("--model", help="model folder, GGUF file or hub id (its config only), or 'demo' (default: chatd's "
                                   "default model, SmolLM2-135M-Instruct)")
    p.add_argument("--gpu", choices=GPU_CHOICES, help="the device each replica has (required unless --measure)")
    p.add_argument("--users", type=positive_number(int), required=True, help="users of the service")
    p.add_argument("--turns-per-day", type=positive_number(float), required=True, help="turns (request and reply) per user per day")
    traffic = p.add_argument_group("traffic")
    traffic.add_argument("--prompt-tokens", type=positive_number(int), help="prompt tokens computed per turn (default 1000)")
    traffic.add_argument("--output-tokens", type=positive_number(int), help="tokens generated per turn (default 250)")
    traffic.add_argument("--context-tokens", type=positive_number(int),
                         help="KV tokens a session holds (default prompt + output)")
    traffic.add_argument("--peak-factor", type=_at_least_one, help="peak turn rate over the day's average (default 3)")
    traffic.add_argument("--turn-seconds", type=positive_number(float),
                         help="how long a turn holds its stream (default ttft-p95 + output-tokens x tpot)")
    slo = p.add_argument_group("latency objective")
    slo.add_argument("--ttft-p95", type=positive_number(float), help="95th percentile time to first token, seconds (default 1.0)")
    slo.add_argument("--tpot", type=positive_number(float), help="time per output token, seconds (default 0.060)")
    device = p.add_argument_group("device and serving")
    device.add_argument("--gpu-memory-gib", type=positive_number(float), help="the GPU's memory (default: the kind's)")
    device.add_argument("--gpu-memory-utilization", type=_fraction, help="chatd's share of it (default 0.90)")
    device.add_argument("--activation-headroom-gib", type=non_negative_float, help="memory kept from the KV pool (default 2)")
    device.add_argument("--cpu-kv-cache-gb", type=positive_number(float), help="with --gpu cpu: chatd's KV pool (default 1.0)")
    device.add_argument("--gpu-hour-usd", type=non_negative_float, help="price of one GPU an hour (default: h100 2.5, h200 3.5)")
    device.add_argument("--dtype", choices=DTYPES, help="the weights' dtype (default auto: bfloat16 on a GPU, float32 on CPU)")
    device.add_argument("--quantization", choices=QUANTIZATIONS, help="weights in fewer bits (default auto: a GGUF file's own blocks on a CPU, else none)")
    device.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="how the KV cache stores values (default auto)")
    device.add_argument("--max-num-seqs", type=positive_number(int), help="chatd's scheduler.max_num_seqs (default 256)")
    curve = p.add_argument_group("step times")
    curve.add_argument("--curve", metavar="FILE", help="step times from a JSON file (what --save-curve writes)")
    curve.add_argument("--measure", action="store_true", help="time chatd's engine on this machine's device, and plan with that")
    curve.add_argument("--measure-batches", type=_positive_list, metavar="B,B,...", help="batch sizes (default 1,4,16,64)")
    curve.add_argument("--measure-contexts", type=_positive_list, metavar="C,C,...",
                       help="context lengths (default a quarter of context-tokens, and context-tokens)")
    curve.add_argument("--measure-steps", type=positive_number(int), default=10, help="timed decode steps per point (default 10)")
    curve.add_argument("--no-compile", action="store_true", help="with --measure on a CPU, run steps eagerly")
    curve.add_argument("--save-curve", metavar="FILE", help="with --measure, write the curve as JSON for --curve")
    curve.add_argument("--allow-other-model-curve", action="store_true",
                       help="plan with a curve measured on a model of another shape (its step times are not this model's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(args: argparse.Namespace) -> int:
    """Run `chatd plan`: 0 with a plan, 1 when not one session meets the objective, 2 for a bad input (named)."""
    import json

    from chatd.plan.planner import build_plan
    from chatd.plan.report import format_plan

    log = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        document = build_plan(args, log=log)
    except ValueError as exc:
        print(f"chatd plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(document, indent=2) if args.json else format_plan(document))
    return 0 if document["result"]["replicas"] is not None else 1


def _at_least_one(text: str) -> float:
    value = positive_number(float)(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (a peak is no lower than the average), got {text}")
    return value


def _fraction(text: str) -> float:
    value = positive_number(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {text}")
    return value


def _positive_list(text: str) -> list[int]:
    parse = positive_number(int)
    return sorted({parse(part) for part in text.split(",") if part.strip()})

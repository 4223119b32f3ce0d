"""From `chatd plan`'s flags to one plan document: every input with where it came from, and the results.

It resolves what the flags leave out (the GPU kind's memory and price, the serving dtype, the KV
dtype, the turn's duration), chooses the step-time curve (measured.py's, a `--curve` file or
`--measure`), refuses a curve that describes another model or device, and hands plain numbers to
capacity.py. report.py prints the document; `--json` writes it as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from chatd.config import CacheConfig, SchedulerConfig
from chatd.plan import capacity
from chatd.plan.curves import StepCurve, measured_curve, measured_kinds, read_curve
from chatd.plan.model_shape import DTYPE_BYTES, ModelShape, read_model_shape


@dataclass(frozen=True)
class GpuKind:
    """A `--gpu` kind's defaults; each is an assumption the plan prints as one."""

    name: str
    memory_gib: float | None  # None: not a GPU (the KV pool is cpu_kv_cache_gb)
    memory_note: str
    gpu_hour_usd: float | None
    price_note: str


GPU_KINDS = {
    "h100": GpuKind("NVIDIA H100 80GB HBM3", 81_559 / 1024, "memory.total nvidia-smi gives for the card (81,559 MiB); "
                    "not measured by chatd", 2.5, "a typical on-demand cloud price; not a quote"),
    "h200": GpuKind("NVIDIA H200 141GB HBM3e", 143_771 / 1024, "memory.total nvidia-smi gives for the card "
                    "(143,771 MiB); not measured by chatd", 3.5, "a typical on-demand cloud price; not a quote"),
    "cpu": GpuKind("CPU", None, "on a CPU chatd's KV pool is cache.cpu_kv_cache_gb; weights are apart", None,
                   "no default for a CPU"),
}
DEFAULT_ACTIVATION_HEADROOM_GIB = 2.0  # CUDA context and one full step's activations and logits (assumption)
CPU_QUANTIZATIONS = ("none", "int8", "int4", "gguf")
GPU_QUANTIZATIONS = ("none", "fp8", "int4")


class Inputs:
    """Every input of the plan, with its value and where it came from (given, default, assumption, ...)."""

    def __init__(self) -> None:
        self.values: dict[str, dict] = {}

    def set(self, name: str, value, source: str, note: str = ""):
        self.values[name] = dict(value=value, source=source, **({"note": note} if note else {}))
        return value

    def flag(self, args: argparse.Namespace, name: str, default, source: str = "default", note: str = ""):
        """The flag's value if given, else `default` recorded as `source`."""
        given = getattr(args, name.lstrip("-").replace("-", "_"))
        return self.set(name, given, "given") if given is not None else self.set(name, default, source, note)


def build_plan(args: argparse.Namespace, log=print) -> dict:
    """The plan document for parsed `chatd plan` flags; a ValueError naming the flag for a bad input."""
    inputs = Inputs()
    shape = read_model_shape(args.model)
    inputs.set("--model", shape.source, "given" if args.model else "default")
    kind_name = _gpu_kind(args)
    kind = GPU_KINDS[kind_name]
    inputs.set("--gpu", kind_name, "given" if args.gpu else "this machine (--measure)")
    on_gpu = kind.memory_gib is not None
    quantization = inputs.flag(args, "--quantization", "auto")
    if quantization == "auto":  # as chatd serve resolves it (models/quantized/quantize_model.py resolve_quantization)
        quantization = inputs.set("--quantization", "gguf" if shape.file_blocks and not on_gpu else "none",
                                  inputs.values["--quantization"]["source"],
                                  "auto: a GGUF file's own blocks on a CPU, else the float weights")
    allowed = GPU_QUANTIZATIONS if on_gpu else CPU_QUANTIZATIONS
    if quantization not in allowed:
        raise ValueError(f"--quantization {quantization} does not run on {kind_name} (there: {', '.join(allowed)})")
    dtype = inputs.flag(args, "--dtype", _auto_dtype(shape, on_gpu), "default", "auto: what chatd serve picks there")
    if dtype == "auto":
        dtype = inputs.set("--dtype", _auto_dtype(shape, on_gpu), "given", "auto: what chatd serve picks there")
    kv_dtype = inputs.flag(args, "--kv-cache-dtype", "auto")
    if kv_dtype == "auto":  # as chatd serve resolves it (attention/common.py resolve_kv_dtype)
        kv_dtype = "float16" if not on_gpu and quantization != "none" and dtype == "float32" else dtype
        inputs.set("--kv-cache-dtype", kv_dtype, inputs.values["--kv-cache-dtype"]["source"],
                   "auto: the weights' dtype (float16 beside quantized weights on a CPU)")
    kv_bytes = shape.kv_bytes_per_token(kv_dtype)
    weights_bytes = shape.weights_bytes(dtype, quantization)

    ttft_target = inputs.flag(args, "--ttft-p95", 1.0)
    tpot_target = inputs.flag(args, "--tpot", 0.060)
    users = inputs.set("--users", args.users, "given")
    turns = inputs.set("--turns-per-day", args.turns_per_day, "given")
    prompt = inputs.flag(args, "--prompt-tokens", 1000)
    output = inputs.flag(args, "--output-tokens", 250)
    context = inputs.flag(args, "--context-tokens", prompt + output, "default", "prompt + output: a session's KV at its turn's end")
    if context > shape.max_model_len:
        raise ValueError(f"--context-tokens {context} is more than the model's context window ({shape.max_model_len})")
    peak_factor = inputs.flag(args, "--peak-factor", 3.0, "assumption", "the busiest hour's turn rate over the day's average")
    turn_seconds = inputs.flag(args, "--turn-seconds", ttft_target + output * tpot_target, "default",
                               "ttft-p95 + output-tokens x tpot: a turn held for its SLO's worst case")
    max_num_seqs = inputs.flag(args, "--max-num-seqs", SchedulerConfig().max_num_seqs, "default", "chatd's scheduler.max_num_seqs")
    block_size = inputs.set("block_size", CacheConfig().block_size, "default", "chatd's cache.block_size: KV is held in whole blocks")

    curve, curve_source = _choose_curve(args, inputs, shape, kind_name, dtype, quantization, kv_dtype, prompt, context, log)
    warnings = _curve_warnings(args, curve, shape, quantization, kv_dtype)

    device_doc = dict(kind=kind_name, name=kind.name if on_gpu or curve_source != "measure" else curve.device)
    if on_gpu:
        memory_gib = inputs.flag(args, "--gpu-memory-gib", kind.memory_gib, "assumption", kind.memory_note)
        utilization = inputs.flag(args, "--gpu-memory-utilization", CacheConfig().gpu_memory_utilization, "default",
                                  "chatd's cache.gpu_memory_utilization")
        headroom_gib = inputs.flag(args, "--activation-headroom-gib", DEFAULT_ACTIVATION_HEADROOM_GIB, "assumption",
                                   "CUDA context and one full step's activations and logits; chatd serve measures "
                                   "it at start (its log's 'GPU memory on ...' line)")
        kv_budget = memory_gib * 2**30 * utilization - weights_bytes - headroom_gib * 2**30
        device_doc.update(memory_bytes=memory_gib * 2**30, kv_budget_formula=
                          "GPU memory x gpu-memory-utilization - weights - activation headroom")
        if kv_budget <= 0:
            raise ValueError(f"the weights ({weights_bytes / 2**30:.1f} GiB) and headroom ({headroom_gib} GiB) leave no KV "
                             f"memory in {utilization:.0%} of {memory_gib:.1f} GiB (--gpu {kind_name}); chatd plan "
                             "covers one GPU a replica (tensor parallelism is not planned)")
    else:
        kv_gb = inputs.flag(args, "--cpu-kv-cache-gb", CacheConfig().cpu_kv_cache_gb, "default", "chatd's cache.cpu_kv_cache_gb")
        kv_budget = kv_gb * 2**30
        device_doc.update(kv_budget_formula="cpu-kv-cache-gb (chatd's CPU KV pool; the weights live beside it)")
    device_doc["kv_budget_bytes"] = kv_budget
    price = inputs.flag(args, "--gpu-hour-usd", kind.gpu_hour_usd, "assumption", kind.price_note)

    traffic = capacity.Traffic(users, turns, prompt, output, context, peak_factor, turn_seconds)
    device = capacity.Device(
        kv_budget_bytes=kv_budget, kv_bytes_per_token=kv_bytes, block_size=block_size,
        step_seconds=lambda n: curve.step_seconds(n, context, kv_bytes), max_batch=curve.max_batch,
        prefill_tokens_per_s=curve.prefill_tokens_per_s, max_num_seqs=max_num_seqs, gpu_hour_usd=price,
    )
    result = capacity.plan(traffic, device, ttft_target, tpot_target)
    if curve.max_batch < max_num_seqs:
        warnings.append(f"sessions per GPU are capped at the curve's largest measured batch ({curve.max_batch}): no step "
                        "time past it is read (measure larger batches to plan past it)")
    if result.replicas is None:
        warnings.append(f"not one session meets the SLO on this device: at batch 1 a token takes "
                        f"{capacity.tpot_seconds(1, traffic, device) * 1e3:.1f} ms and p95 TTFT is "
                        f"{capacity.ttft_p95_seconds(1, traffic, device):.3f} s")
    return dict(
        inputs=inputs.values,
        model=dict(source=shape.source, architecture=shape.architecture, **shape.dims(), max_model_len=shape.max_model_len,
                   num_params=shape.num_params, dtype=dtype, quantization=quantization, weights_bytes=weights_bytes,
                   kv_cache_dtype=kv_dtype, kv_bytes_per_token=kv_bytes,
                   kv_formula=f"{shape.num_layers} layers x {shape.num_kv_heads} kv heads x {shape.head_dim} head_dim x 2 "
                              f"(K and V) x {DTYPE_BYTES[kv_dtype]} bytes ({kv_dtype}) = {kv_bytes:,} bytes"),
        device=device_doc,
        curve=_curve_doc(curve, curve_source, context, kv_bytes),
        traffic=dict(average_turns_per_s=traffic.average_turns_per_s, peak_turns_per_s=traffic.peak_turns_per_s,
                     peak_sessions=traffic.peak_sessions, tokens_per_day=traffic.tokens_per_day,
                     session_kv_bytes=-(-context // block_size) * block_size * kv_bytes),
        result=_result_doc(result),
        models=MODELS,
        warnings=warnings,
    )


# The plan's stated models, printed with every plan.
MODELS = dict(
    session="a stream generating one turn's reply; idle conversations hold no KV (their blocks are the prefix cache's)",
    kv_memory="sessions = floor(KV budget / (ceil(context-tokens / block_size) x block_size x KV bytes/token))",
    tpot="a token's time = decode step(n) + n x prompt-tokens / output-tokens / prefill rate (the prefill of the turns "
         "that replace those ending, in the same steps); TPOT sessions = the largest n it keeps <= --tpot",
    ttft="turns arrive as Poisson at n / turn-seconds per GPU, prefills served one at a time in prompt-tokens / prefill "
         "rate each: an M/D/1 queue, its wait's p95 from Erlang's exact formula; TTFT = wait + prefill + one decode step",
    curve="linear in the batch between measured batches, never past the largest; contexts as the curve section says",
    peak="peak sessions = users x turns-per-day / 86,400 x peak-factor x turn-seconds (Little's law); replicas = "
         "ceil(peak sessions / sessions per GPU), sized for the peak and running all day",
    cost="$/M tokens = gpu-hour-usd / (tokens/s x 3600) x 1e6 at the operating point (a GPU full); over a day: "
         "replicas x 24 x gpu-hour-usd / the day's tokens",
)


def _gpu_kind(args: argparse.Namespace) -> str:
    if args.measure:
        import torch

        local = "cuda" if torch.cuda.is_available() else "cpu"
        if args.gpu is None:
            return "cpu" if local == "cpu" else _named_gpu(torch.cuda.get_device_name())
        if (args.gpu == "cpu") != (local == "cpu"):
            raise ValueError(f"--measure times this machine's device ({local}), not --gpu {args.gpu}; leave --gpu out "
                             f"or run it on {'a machine with that GPU' if args.gpu != 'cpu' else 'a CPU machine'}")
        return args.gpu
    if args.gpu is None:
        raise ValueError(f"--gpu is required ({', '.join(GPU_KINDS)}) unless --measure times this machine")
    return args.gpu


def _named_gpu(device_name: str) -> str:
    for kind in ("h100", "h200"):
        if kind in device_name.lower():
            return kind
    raise ValueError(f"--measure found a {device_name}, which is none of {', '.join(GPU_KINDS)}: name --gpu and "
                     "--gpu-memory-gib and --gpu-hour-usd for it")


def _auto_dtype(shape: ModelShape, on_gpu: bool) -> str:
    """What chatd serve's dtype `auto` picks: float32 on CPU, bfloat16 on a GPU (float16 for a float16 checkpoint)."""
    if not on_gpu:
        return "float32"
    return "float16" if shape.config_dtype == "float16" else "bfloat16"


def _choose_curve(args, inputs: Inputs, shape: ModelShape, kind: str, dtype: str, quantization: str, kv_dtype: str,
                  prompt: int, context: int, log) -> tuple[StepCurve, str]:
    """The step-time curve and how it was found: `measure`, `file` or `benchmarks/README.md`."""
    if args.measure and args.curve:
        raise ValueError("--measure and --curve both give the step times; choose one")
    if args.measure:
        from chatd.plan.measure import measure_curve

        batches = inputs.flag(args, "--measure-batches", [1, 4, 16, 64])
        contexts = inputs.flag(args, "--measure-contexts", sorted({max(16, context // 4), context}), "default",
                               "a quarter of context-tokens and context-tokens")
        inputs.set("--measure-steps", args.measure_steps, "given" if args.measure_steps != 10 else "default",
                   "timed decode steps per point, after 3 untimed")
        inputs.set("--no-compile", args.no_compile, "given" if args.no_compile else "default")
        curve = measure_curve(args.model, shape.dims(), batches, contexts, prompt, device="cpu" if kind == "cpu" else "cuda",
                              dtype=dtype, quantization=quantization, kv_cache_dtype=kv_dtype,
                              compile_steps=not args.no_compile, kv_bytes_per_token=shape.kv_bytes_per_token(kv_dtype),
                              decode_steps=args.measure_steps, log=log)
        curve = dataclasses.replace(curve, gpu=kind)
        if args.save_curve:
            import json
            from pathlib import Path

            Path(args.save_curve).write_text(json.dumps(curve.to_dict(), indent=2) + "\n")
            log(f"wrote {args.save_curve}")
        return curve, "measure"
    if args.curve:
        inputs.set("--curve", args.curve, "given")
        curve = read_curve(args.curve)
        if curve.gpu and curve.gpu != kind:
            raise ValueError(f"--curve {args.curve!r} was measured on {curve.gpu} ({curve.device}), not --gpu {kind}")
        return curve, "file"
    curve = measured_curve(kind, quantization)
    if curve is not None:
        inputs.set("--curve", curve.name, "default", "benchmarks/README.md's figures for this GPU and weight format")
    else:
        have = "; ".join(f"{gpu}: {', '.join(q)} weights" for gpu, q in measured_kinds().items())
        raise ValueError(f"benchmarks/README.md has no per-batch step times for --gpu {kind} with --quantization "
                         f"{quantization} (it has {have}); measure them there with --measure, or give --curve FILE")
    return curve, "benchmarks/README.md"


def _curve_warnings(args, curve: StepCurve, shape: ModelShape, quantization: str, kv_dtype: str) -> list[str]:
    """What differs between the curve's measurement and the plan: another model is refused unless allowed."""
    warnings = []
    differences = curve.shape_differences(shape.dims())
    if differences:
        message = (f"the curve ({curve.name}) was measured on {curve.model.get('name', 'another model')}, whose shape "
                   f"differs from {shape.source}'s ({'; '.join(differences)}): its step times are not this model's")
        if not args.allow_other_model_curve:
            raise ValueError(f"{message}. Measure this model on that GPU (--measure there, then --curve FILE from its "
                             "--save-curve), or pass --allow-other-model-curve to plan with them anyway")
        warnings.append(message + " (--allow-other-model-curve)")
    if curve.quantization != quantization:
        warnings.append(f"the curve was measured with {curve.quantization} weights, the plan is for {quantization}")
    if curve.kv_cache_dtype != kv_dtype:
        warnings.append(f"the curve was measured with a {curve.kv_cache_dtype} KV cache, the plan is for {kv_dtype}")
    return warnings


def _curve_doc(curve: StepCurve, how: str, context: int, kv_bytes: int) -> dict:
    doc = curve.to_dict()
    doc.update(
        found_by=how, max_batch=curve.max_batch, prefill_tokens_per_s=curve.prefill_tokens_per_s,
        interpolation="linear in the batch between measured batches; never past the largest measured batch",
        context_method=curve.context_method(context),
        steps_at_plan_context_ms={p.batch: round(curve.step_seconds(p.batch, context, kv_bytes) * 1e3, 4)
                                  for p in curve.decode if p.batch <= curve.max_batch},
    )
    return doc


def _result_doc(result: capacity.Capacity) -> dict:
    doc = dataclasses.asdict(result)
    doc["constraints"] = [dataclasses.asdict(c) for c in result.constraints]
    return doc

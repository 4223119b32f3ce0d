"""`chatd plan --measure`: time chatd's own engine on this machine's device and return a StepCurve.

For each context length and batch size: that many random token-id prompts of that length are
prefilled, a few decode steps run untimed, then timed steps are checked to be pure decodes (every
sequence one token, no prompt token computed) and their median kept. Then the time to first token
of a fresh prompt of the plan's prompt length, alone, gives the prefill rate (median of a few,
after one untimed). It is benchmarks/steps.py's method, in small; it knows nothing of the plan.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from datetime import datetime, timezone

from chatd.plan.curves import DecodePoint, StepCurve

BLOCK_SIZE = 16  # chatd's default cache.block_size
PREFILL_REPEATS = 3
STEP_TOKENS = 2048  # chatd's default scheduler.max_num_batched_tokens


def measure_curve(model: str | None, dims: dict, batches: list[int], contexts: list[int], prefill_tokens: int, *,
                  device: str = "auto", dtype: str = "auto", quantization: str = "none", kv_cache_dtype: str = "auto",
                  compile_steps: bool = True, kv_bytes_per_token: int = 4096, decode_steps: int = 10,
                  warmup_steps: int = 3, log=print) -> StepCurve:
    """Load the model in chatd's engine and time decode steps and prefill (the module docstring says how).
    `dims`: the model's dimensions, recorded with the curve; `kv_bytes_per_token` sizes a CPU pool."""
    import torch

    from chatd import LLM

    longest = max(max(contexts) + warmup_steps + decode_steps + 64, prefill_tokens + 16)
    max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    options = dict(device=device, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                   compile=compile_steps, block_size=BLOCK_SIZE, max_num_seqs=max(batches), max_model_len=max_model_len,
                   max_num_batched_tokens=max(STEP_TOKENS, prefill_tokens), enable_prefix_caching=False,
                   # on a CPU, a pool that holds the largest batch at the longest context
                   cpu_kv_cache_gb=max(1.0, 1.25 * max(batches) * max_model_len * kv_bytes_per_token / 2**30))
    started = time.perf_counter()
    llm = LLM(model, **options)
    engine = llm.engine
    info = engine.model_info()
    log(f"measuring on {info.device} ({info.dtype}, KV cache {info.kv_cache_dtype}, compiled steps "
        f"{'on' if info.compiled_decode else 'off'}); loaded in {time.perf_counter() - started:.1f} s")
    cuda = info.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = random.Random(0)
    vocab = min(info.vocab_size, 32000)
    try:
        points = []
        for context in contexts:
            for batch in batches:
                seconds = _decode_step(engine, batch, context, vocab, rng, decode_steps, warmup_steps, sync)
                points.append(DecodePoint(batch, context, seconds))
                log(f"  batch {batch:>4}, context {context:>6}: {seconds * 1e3:8.3f} ms a step")
        times = [_first_token(engine, f"prefill-{i}", [rng.randrange(vocab) for _ in range(prefill_tokens)], sync)
                 for i in range(PREFILL_REPEATS + 1)]
        ttft = statistics.median(times[1:])  # the first warms this step's shape up
        log(f"  prefill of {prefill_tokens} tokens: {ttft * 1e3:.1f} ms to the first token")
    finally:
        llm.close()
    name = torch.cuda.get_device_name(info.device) if cuda else _cpu_name()
    return StepCurve(
        name=f"measured on {name}", device=name, source="chatd plan --measure (this machine)",
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=f"chatd plan --measure --measure-batches {','.join(map(str, batches))} "
                f"--measure-contexts {','.join(map(str, contexts))} --prompt-tokens {prefill_tokens}",
        model=dict(name=str(info.path), **dims), dtype=info.dtype, quantization=info.quantization,
        kv_cache_dtype=info.kv_cache_dtype, decode=tuple(points), prefill_tokens=prefill_tokens, prefill_seconds=ttft,
        notes=(f"median of {decode_steps} timed decode steps after {warmup_steps} untimed; prefill the median of "
               f"{PREFILL_REPEATS} after one untimed",
               f"compiled steps {'on' if info.compiled_decode else 'off'}, attention {info.attention_backend}"),
    )


def _decode_step(engine, batch: int, context: int, vocab: int, rng: random.Random, steps: int, warmup: int, sync) -> float:
    """Median seconds of a pure decode step of `batch` sequences of about `context` tokens."""
    from chatd.engine import SamplingParams

    ids = [f"decode-{batch}-{context}-{i}" for i in range(batch)]
    # Early sequences decode while later ones still prefill: leave room for those tokens too.
    prefill_steps = -(-batch * context // max(STEP_TOKENS - batch, 1)) + 2
    params = SamplingParams(max_tokens=prefill_steps + warmup + steps + 2, temperature=0.0, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(context)], params)
    try:
        started = set()
        while len(started) < batch:  # until every sequence has its first token
            started.update(out.request_id for out in _checked(engine.step()) if _tokens(out))
        for _ in range(warmup):
            _checked(engine.step())
        before = engine.stats().num_prompt_tokens
        times = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            outs = _checked(engine.step())
            sync()
            times.append(time.perf_counter() - start)
            if len(outs) != batch or any(_tokens(o) != 1 for o in outs):
                raise RuntimeError(f"batch {batch}: a timed step was not {batch} one-token decodes")
        if engine.stats().num_prompt_tokens != before:
            raise RuntimeError(f"batch {batch}: prompt tokens were computed during the timed steps")
        return statistics.median(times)
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()


def _first_token(engine, request_id: str, prompt: list[int], sync) -> float:
    """Seconds from add_request to the step that returns the prompt's first token."""
    from chatd.engine import SamplingParams

    sync()
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    seconds = None
    while engine.has_unfinished_requests():
        for out in _checked(engine.step()):
            if seconds is None and out.request_id == request_id and _tokens(out):
                sync()
                seconds = time.perf_counter() - start
    if seconds is None:
        raise RuntimeError(f"request {request_id} finished without a token")
    return seconds


def _tokens(output) -> int:
    """Tokens a step's output carries for its request."""
    return sum(len(o.token_ids) for o in output.outputs)


def _checked(outputs: list) -> list:
    failed = [o for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
    return outputs


def _cpu_name() -> str:
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"

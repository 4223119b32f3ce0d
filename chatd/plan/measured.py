"""The GPU step times chatd has measured, transcribed from benchmarks/README.md with where they came from.

`chatd plan --gpu KIND` plans with these when no `--curve` or `--measure` is given. Only figures
printed in benchmarks/README.md belong here, each with its section, date, device and command; a
GPU kind with no per-batch step times there (the H200, so far) has no entry, and the plan asks for
`--measure` or `--curve` instead. Each figure is the median of the timed steps of one run (the
GPU session allowed no repeats). This module knows nothing of how the figures are used.
"""

from __future__ import annotations

# Llama-3.1-8B's shape, as benchmarks/steps.py builds it (random weights); transformers' names.
LLAMA_8B_SHAPE = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256,
)

_SESSION = dict(
    gpu="h100",
    device="NVIDIA H100 80GB HBM3 (the lent nvidia-h100-x1; driver 580.159.04, 132 SMs)",
    date="2026-11-27, 02:58-03:24 UTC",
    software="torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, Python 3.12",
    model=dict(name="Llama-3.1-8B shape, random weights (benchmarks/steps.py)", **LLAMA_8B_SHAPE),
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    # Measured in the same run (a 2 GiB device-to-device copy, reads and writes counted).
    copy_bytes_per_s=2978e9,
)

_README = "benchmarks/README.md, \"First GPU figures (2026-11-27, 02:58-03:24 UTC, one H100 80GB HBM3, issue 19's session)\""
# The run that measured the fp8 and int4 rows, as benchmarks/README.md gives it.
_QUANTIZED_COMMAND = ("bash benchmarks/gpu_session.sh steps --quantization none,fp8,int4 --batches 1,64 --decode-steps 20 "
                      "--ttft-repeats 3")

# Decode points: batch, each sequence's context when timed (prompts of 1024 tokens), median step ms.
# Prefill: the time to first token of a fresh 2000-token prompt alone (one step, max_tokens=1).
MEASURED_CURVES: tuple[dict, ...] = (
    dict(
        _SESSION,
        name="h100-bfloat16-llama-3.1-8b",
        quantization="none",
        source=f"{_README}, table \"Decode steps and TTFT\"",
        command="bash benchmarks/gpu_session.sh steps --decode-steps 20 --ttft-repeats 3",
        decode=[dict(batch=1, context=1024, step_ms=8.677), dict(batch=8, context=1024, step_ms=9.874),
                dict(batch=64, context=1024, step_ms=15.346), dict(batch=256, context=1024, step_ms=31.288)],
        prefill=dict(prompt_tokens=2000, ttft_ms=62.2),
    ),
    dict(
        _SESSION,
        name="h100-fp8-llama-3.1-8b",
        quantization="fp8",
        source=f"{_README}, table \"Quantized weights\", row fp8",
        command=_QUANTIZED_COMMAND,
        decode=[dict(batch=1, context=1024, step_ms=9.264), dict(batch=64, context=1024, step_ms=15.970)],
        prefill=dict(prompt_tokens=2000, ttft_ms=77.0),
    ),
    dict(
        _SESSION,
        name="h100-int4-llama-3.1-8b",
        quantization="int4",
        source=f"{_README}, table \"Quantized weights\", row int4",
        command=_QUANTIZED_COMMAND,
        decode=[dict(batch=1, context=1024, step_ms=5.722), dict(batch=64, context=1024, step_ms=42.163)],
        prefill=dict(prompt_tokens=2000, ttft_ms=969.0),
    ),
)

#!/usr/bin/env bash
# Issue 5's GPU checks in the shape of one `device` call each (10 minutes a call at most):
#
#   bash benchmarks/gpu_session.sh tests        # the gpu-marked tests (kernels, graphs, memory, greedy)
#   bash benchmarks/gpu_session.sh throughput   # offline.py: Qwen3-0.6B shape vs transformers' peers
#   bash benchmarks/gpu_session.sh steps        # steps.py: 8B decode rooflines and TTFT
#   bash benchmarks/gpu_session.sh kv           # kv_sessions.py (host tier, fp8 KV) and kv_accuracy.py
#   bash benchmarks/gpu_session.sh serve        # serve.py: `chatd serve` on CUDA, streamed, 1-256 at once
#   bash benchmarks/gpu_session.sh linears      # linears.py: bf16, int4, unpacked int4, fp8 per layer, 1-8192 rows
#   bash benchmarks/gpu_session.sh start        # startup.py: `chatd serve` from this checkout on CUDA, its start
#                                               # timeline (a Llama of Qwen3-0.6B's size: the default model's
#                                               # 98 MB wheel is over what a device call carries)
#   bash benchmarks/gpu_session.sh busy         # issue 37 in one call (<= 8 min): steps --profile, nano-vllm's
#                                               # workload, serve vs offline at 256 and 512, 8B batch-1 decode,
#                                               # host.py's fixed-time proxy; one JSON ($OUT/busy.json)
#
# The GPU machine lacks some of chatd's and the tests' packages and has no network: first, here,
#
#   bash benchmarks/gpu_session.sh wheels       # downloads them into .whl/ (git-ignored), for Python 3.12
#
# and have the device call carry .whl. Arguments after the first go to the script it runs
# (pytest, offline.py, steps.py or kv_sessions.py), e.g. `throughput --repeats 1 --peers chatd,hf-cb`
# or `steps --quantization none,fp8,int4 --batches 1,64`, or `steps --profile 10` (where a step's
# time goes: device busy against wall, top kernels).
#
# It runs from a checkout without installing chatd (PYTHONPATH), installs wheels carried in
# .whl/ first if there are any (the GPU machine has no network), and leaves logs and JSON in
# $OUT (the device tool's output folder; /tmp/chatd-gpu elsewhere).
set -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# What the GPU image (torch 2.11+cu130, transformers 5.17, aiohttp, pytest) lacks, by version tested here.
WHEELS="orjson==3.13.0 aiosqlite==0.22.1 gguf==0.19.0 llguidance==1.9.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
        pytest-asyncio==1.5.0 jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1"
if [ "${1:-}" = wheels ]; then
    mkdir -p .whl && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    # shellcheck disable=SC2086
    exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
fi
OUT=${OUT:-/tmp/chatd-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
"$PYTHON" -c "
from importlib.metadata import version
print(' '.join(f'{name} {version(name)}' for name in ('torch', 'triton', 'transformers', 'aiohttp', 'prometheus-client',
      'safetensors', 'huggingface-hub', 'llguidance', 'gguf')))" | tee -a "$OUT/gpu.txt"
what=${1:-}
shift
case "$what" in
    tests)
        "$PYTHON" -m pytest -q -m gpu -rs -p no:cacheprovider tests/engine "$@" 2>&1 | tee "$OUT/gpu-tests.log" ;;
    throughput)
        "$PYTHON" benchmarks/offline.py --device cuda --skip-steps --json "$OUT/throughput.json" "$@" 2>&1 | tee "$OUT/throughput.log" ;;
    steps)
        "$PYTHON" benchmarks/steps.py --device cuda --tmp-dir /tmp --json "$OUT/steps.json" "$@" 2>&1 | tee "$OUT/steps.log" ;;
    kv)
        "$PYTHON" benchmarks/kv_sessions.py --device cuda --repeats 3 --json "$OUT/kv_sessions.json" "$@" 2>&1 | tee "$OUT/kv.log"
        "$PYTHON" benchmarks/kv_accuracy.py --device cuda 2>&1 | tee -a "$OUT/kv.log" ;;
    serve)  # a Llama of Qwen3-0.6B's size; transformers serve needs packages the image lacks
        "$PYTHON" benchmarks/serve.py --device cuda --skip-transformers --concurrency 1,16,64,256 --hidden 1024 \
            --layers 28 --heads 16 --kv-heads 8 --intermediate 3072 --max-num-batched-tokens 8192 \
            --json "$OUT/serve.json" "$@" 2>&1 | tee "$OUT/serve.log" ;;
    busy)  # each stage capped, so one stuck stage leaves time for the rest and the JSON
        timeout 70 "$PYTHON" benchmarks/steps.py --device cuda --tmp-dir /tmp --profile 10 --batches 1,256 \
            --decode-steps 10 --ttft-repeats 1 --json "$OUT/busy-profile.json" 2>&1 | tee "$OUT/busy.log"
        timeout 120 "$PYTHON" benchmarks/offline.py --device cuda --skip-steps --peers chatd --repeats 1 \
            --json "$OUT/busy-offline.json" 2>&1 | tee -a "$OUT/busy.log"
        for where in thread process; do  # the engine on a thread of the server, then in its own process
            timeout 70 "$PYTHON" benchmarks/serve.py --device cuda --skip-transformers --concurrency 256,512 \
                --hidden 1024 --layers 28 --heads 16 --kv-heads 8 --intermediate 3072 --max-num-batched-tokens 8192 \
                --output-tokens 64 64 --engine-process $([ $where = process ] && echo on || echo off) \
                --json "$OUT/busy-serve-$where.json" 2>&1 | tee -a "$OUT/busy.log"
        done
        timeout 50 "$PYTHON" benchmarks/steps.py --device cuda --tmp-dir /tmp --batches 1 --decode-steps 30 \
            --ttft-repeats 1 --json "$OUT/busy-8b.json" 2>&1 | tee -a "$OUT/busy.log"
        timeout 80 "$PYTHON" benchmarks/host.py --batches 256,512 --repeats 1 --server-repeats 1 --json "$OUT/busy-host.json" 2>&1 | tee -a "$OUT/busy.log"
        "$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = {name: out / f"busy-{name}.json" for name in ("profile", "offline", "serve-thread", "serve-process", "8b", "host")}
merged = {name: json.loads(path.read_text()) if path.exists() else None for name, path in parts.items()}
(out / "busy.json").write_text(json.dumps(merged, indent=1))
print("wrote", out / "busy.json", {name: value is not None for name, value in merged.items()})
PY
        ;;
    start)
        "$PYTHON" -c "from chatd.engine.models.demo import build_model_dir; build_model_dir('/tmp/start-model', 'llama', \
            hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, \
            intermediate_size=3072, tie_word_embeddings=False)" || exit
        "$PYTHON" benchmarks/startup.py --model /tmp/start-model --json "$OUT/startup.json" --log-dir "$OUT" "$@" 2>&1 | tee "$OUT/startup.log" ;;
    linears)
        "$PYTHON" benchmarks/linears.py --device cuda --json "$OUT/linears.json" "$@" 2>&1 | tee "$OUT/linears.log" ;;
    *)
        echo "usage: bash benchmarks/gpu_session.sh wheels|tests|throughput|steps|kv|serve|start|linears" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 5's GPU checks in the shape of one `device` call each (10 minutes a call at most):
#
#   bash benchmarks/gpu_session.sh tests        # the gpu-marked tests (kernels, graphs, memory, greedy)
#   bash benchmarks/gpu_session.sh throughput   # offline.py: Qwen3-0.6B shape vs transformers' peers
#   bash benchmarks/gpu_session.sh steps        # steps.py: 8B decode rooflines and TTFT
#   bash benchmarks/gpu_session.sh kv           # kv_sessions.py (host tier, fp8 KV) and kv_accuracy.py
#
# It runs from a checkout without installing chatd (PYTHONPATH), installs wheels carried in
# .whl/ first if there are any (the GPU machine has no network), and leaves logs and JSON in
# $OUT (the device tool's output folder; /tmp/chatd-gpu elsewhere).
set -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/chatd-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
"$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
case "${1:-}" in
    tests)
        "$PYTHON" -m pytest -q -m gpu -rs -p no:cacheprovider tests/engine 2>&1 | tee "$OUT/gpu-tests.log" ;;
    throughput)
        "$PYTHON" benchmarks/offline.py --device cuda --skip-steps --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" ;;
    steps)
        "$PYTHON" benchmarks/steps.py --device cuda --tmp-dir /tmp --json "$OUT/steps.json" 2>&1 | tee "$OUT/steps.log" ;;
    kv)
        "$PYTHON" benchmarks/kv_sessions.py --device cuda --repeats 3 --json "$OUT/kv_sessions.json" 2>&1 | tee "$OUT/kv.log"
        "$PYTHON" benchmarks/kv_accuracy.py --device cuda 2>&1 | tee -a "$OUT/kv.log" ;;
    *)
        echo "usage: bash benchmarks/gpu_session.sh tests|throughput|steps|kv" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The first GPU session's one command: the CUDA tests, then the GPU benchmark, into one JSON.
#
#     ops/gpu_check.sh [OUT_DIR]        (or `make gpu-check`; OUT_DIR defaults to gpu-check/)
#
# 1. the CUDA paths' tests, compiled and captured on the device (STREAMBATCH_TEST_DEVICE=cuda):
#    the Triton kernels and the split-KV decode against the CPU paths, greedy tokens against HF
#    generate through the engine, CUDA graphs captured and replayed, one host sync per step;
# 2. python -m ops.bench_gpu on random:llama3-8b in bf16: memory bandwidth and matmul rate, decode at
#    1-256 sequences of 512 and 2,048 tokens (each row's share of its roofline bound, the host's
#    work per step and its share, syncs per step), prefill's share of the matmul bound, the
#    targets met or not, offline throughput, greedy parity.
# Everything lands in OUT_DIR/gpu.json (the benchmark's sections, plus "cuda_tests": the tests'
# counts and the failures' names); the log beside it. Under 8 minutes on an H200: each phase has a
# time limit, and a failed phase does not stop the next.
#
# Needs the project's Python dependencies and a CUDA build of torch: `make setup` on a machine
# where nvidia-smi answers installs both; PYTHON picks another interpreter (default: .venv's, else
# python3), e.g. a GPU image's own torch with the other packages put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-gpu-check}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu-check.log") 2>&1

"$PYTHON" -c 'import sys, torch
sys.exit(None if torch.version.cuda and torch.cuda.is_available() else
         f"torch {torch.__version__}: CUDA build {torch.version.cuda}, device visible {torch.cuda.is_available()}: "
         "a GPU check needs both (make setup on the GPU machine)")' || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== CUDA tests"
STREAMBATCH_TEST_DEVICE=cuda timeout 210 "$PYTHON" -m pytest -q -p no:cacheprovider \
    --junitxml "$OUT_DIR/cuda-tests.xml" \
    tests/engine/test_triton_attention.py tests/engine/test_cuda_graphs.py tests/engine/test_syncs.py
tests_status=$?

echo "== GPU benchmark"
timeout 270 "$PYTHON" -m ops.bench_gpu --requests 500 --json "$OUT_DIR/gpu.json"
bench_status=$?

"$PYTHON" -m ops.gpu_check "$OUT_DIR"
exit $(( tests_status || bench_status ))

#!/usr/bin/env bash
# The GPU path in one command, at most 8 minutes: the CUDA tests (one worker per GPU, two
# workers on one GPU, NCCL, fp16 and bf16 training, inference on CUDA against the CPU, a Spark
# local fit placed on the GPU), then `paraloom bench training --device cuda` (paraloom and DDP
# on 1..N GPUs). Writes JSON under benchmarks/results/gpu/ (GPU_CHECK_OUT overrides) and prints
# one table. Without CUDA it says so in one line and exits 0.
#
# Python: PARALOOM_PYTHON, else .venv/bin/python, else python3 (a GPU machine's own torch);
# paraloom is imported from src/ when it is not installed there.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PARALOOM_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo none)
if [ "$gpus" = "none" ]; then
  echo "gpu-check: $PY cannot import torch; nothing checked (set PARALOOM_PYTHON)"
  exit 0
fi
if [ "$gpus" = "0" ]; then
  echo "gpu-check: no CUDA device (torch.cuda.is_available() is False in $PY); nothing to check"
  exit 0
fi

"$PY" -c "import paraloom" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
out="${GPU_CHECK_OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
status=0

echo "gpu-check: $gpus GPU(s); CUDA tests (at most 5 minutes)"
timeout 300 "$PY" -m pytest -m cuda tests/test_cuda.py -q -rs -p no:cacheprovider \
  -o junit_logging=system-err --junitxml="$out/cuda-tests.xml" || status=1

echo "gpu-check: paraloom bench training --device cuda (at most 3 minutes)"
timeout 180 "$PY" -m paraloom bench training --device cuda --model lenet --epochs 2 \
  --out "$out/training.json" || status=1

"$PY" -m paraloom.bench.gpu_report "$out" || status=1
exit $status

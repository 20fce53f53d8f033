#!/usr/bin/env bash
# Install what the demo needs, train LeNet on scikit-learn's digits with 2 workers, then evaluate it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh ""
mkdir -p out
"${PARALOOM_VENV:-.venv}/bin/paraloom" train --model lenet --dataset digits --workers 2 --mode averaging \
    --epochs 5 --out out/lenet-digits.safetensors
"${PARALOOM_VENV:-.venv}/bin/paraloom" evaluate out/lenet-digits.safetensors --dataset digits

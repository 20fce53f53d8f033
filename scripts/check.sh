#!/usr/bin/env bash
# Install the development tools and run the static checks: ruff, then mypy --strict over
# src/paraloom (settings in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "test,serve,spark,dev"
.venv/bin/ruff check src tests examples
.venv/bin/mypy --strict

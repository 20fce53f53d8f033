#!/usr/bin/env bash
# Install what the tests need and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "test,serve,spark,dev"
exec "${PARALOOM_VENV:-.venv}/bin/python" -m pytest "$@"

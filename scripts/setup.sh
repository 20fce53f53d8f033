#!/usr/bin/env bash
# Create .venv (once) and install paraloom with the given extras; safe to run again.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test,serve
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
venv="${PARALOOM_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# Re-install only when the package definition or the extras changed.
stamp="$venv/.paraloom-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) [$extras]"
if [ -f "$stamp" ] && grep -qxF "$want" "$stamp"; then
    exit 0
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch is pinned here: 2.13.0 is the CPU build this project is developed and tested with.
"$venv/bin/python" -m pip install --quiet "torch==2.13.0"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
"$venv/bin/python" -m pip install --quiet -e "$spec"
echo "$want" >> "$stamp"

#!/usr/bin/env bash
# The documentation site (MkDocs Material + mkdocstrings), after installing what it needs.
# Usage: scripts/docs.sh build   strict build into site/ (a broken link or reference fails)
#        scripts/docs.sh serve   serve it on http://127.0.0.1:8000 while you edit
set -euo pipefail
cd "$(dirname "$0")/.."
# The API reference imports every public module, Spark and serving included.
scripts/setup.sh "docs,serve,spark"
mkdocs="${PARALOOM_VENV:-.venv}/bin/mkdocs"
case "${1:-build}" in
  build) exec "$mkdocs" build --strict --site-dir site ;;
  serve) exec "$mkdocs" serve --dev-addr 127.0.0.1:8000 ;;
  *) echo "usage: scripts/docs.sh build|serve" >&2; exit 2 ;;
esac

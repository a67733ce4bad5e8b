#!/usr/bin/env bash
# Install the project with its dev extra into ./.venv and run the test suite.
# The nuScenes devkit pins numpy<2, so it is installed without its dependencies
# together with the two it needs at import time (requirements/devkit.txt) — see docs/KPIS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q -e ".[dev]"
if [ -f requirements/devkit.txt ]; then
  .venv/bin/pip install -q --no-deps -r requirements/devkit.txt
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Install the project with its dev extra into ./.venv and run the test suite (docs/TESTING.md).
#   bash scripts/test.sh            the default tier (what CI runs), under its wall-time budget
#   bash scripts/test.sh --full     everything: also the tests marked `full` (the heavy tier)
#   bash scripts/test.sh tests/kernels -k scatter    any pytest arguments (no budget)
# The install (torch through pip, the rest through uv, pip alone as the fallback): scripts/install_dev.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_dev.sh
.venv/bin/ruff check .
if [ "$#" -eq 0 ]; then
  # The default tier's budget: clean clones on 2-core AMD EPYC Zen 4, 2026-12-03 (benchmarks/RESULTS.md, "Test suite"): 577 s of
  # tests quiet, 704 s at load ~2. 1500 s leaves 2.1x over 704 s for a slower machine or hour (this box's
  # speed varied 25-35 % within a day), and with the install still stays far under CI's 5400 s.
  export PFACTORY_TEST_BUDGET_S=${PFACTORY_TEST_BUDGET_S:-1500}
fi
# One pytest-xdist worker per core (at most 4: each test may use 2 threads and ~2 GB); a test module, or the
# modules sharing an expensive session fixture (tests/conftest.py: XDIST_GROUPS), go to one worker, so module
# and those session fixtures are built once; PFACTORY_TEST_WORKERS=0 runs in-process.
WORKERS=${PFACTORY_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')}
if [ "$WORKERS" -gt 0 ]; then
  exec .venv/bin/python -m pytest -n "$WORKERS" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"

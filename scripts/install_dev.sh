#!/usr/bin/env bash
# Install the project (editable) with its dev extra into ./.venv, and the nuScenes devkit (see below).
# Used by scripts/test.sh; safe to rerun (satisfied requirements are kept).
#
# pip chooses the torch file, so pip's own configuration picks its build (find-links, constraints, index: on
# a machine with a local CPU wheel, that one; `pip install --dry-run --report`, a JSON report). uv installs
# that file and everything else: the same requirements and the same versions, with parallel downloads and
# byte-compilation (a fresh venv on a 2-core AMD EPYC Zen 3, 2026-12-03: 98 s with torch through pip, vs
# pip's 354 s for the same 270 packages; docs/TESTING.md). uv reads neither pip.conf nor PIP_* settings:
# when it cannot install (no uv for this platform, an index only pip knows), the script says so and pip
# installs everything, as before. PFACTORY_INSTALL_WITH=pip forces pip.
# uv's cache lives in .venv/uv-cache (hard links into the venv: no second copy on disk).
#
# The nuScenes devkit pins numpy<2, so it is installed without its dependencies together with the two it
# needs at import time (requirements/devkit.txt) — see docs/KPIS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv

with_uv() {
  [ "${PFACTORY_INSTALL_WITH:-}" != pip ] || return 1
  .venv/bin/pip install -q uv || return 1
  local torch
  torch=$(.venv/bin/python - <<'PYEOF'
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print(next(d for d in deps if d.split(";")[0].strip().startswith("torch")))
PYEOF
  ) || return 1
  # The torch file pip's configuration picks (its JSON install report, nothing installed), for uv to install
  # with the rest: one parallel install and byte-compilation instead of pip's serial one (~20 s less).
  local torch_url
  torch_url=$(.venv/bin/pip install -q --dry-run --no-deps --ignore-installed --report - "$torch" \
    | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])') \
    || return 1
  export UV_CACHE_DIR="$PWD/.venv/uv-cache"
  if [ -n "${PIP_CERT:-}" ] && [ -z "${SSL_CERT_FILE:-}" ]; then export SSL_CERT_FILE="$PIP_CERT"; fi
  local uv=(.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode)
  "${uv[@]}" "torch @ $torch_url" -e ".[dev]" || return 1
  if [ -f requirements/devkit.txt ]; then "${uv[@]}" --no-deps -r requirements/devkit.txt || return 1; fi
}

if ! with_uv; then
  [ "${PFACTORY_INSTALL_WITH:-}" = pip ] || echo "install: uv could not install the project; using pip" >&2
  .venv/bin/pip install -q -e ".[dev]"
  if [ -f requirements/devkit.txt ]; then
    .venv/bin/pip install -q --no-deps -r requirements/devkit.txt
  fi
fi

#!/usr/bin/env bash
# Kernel checks for a lent CUDA GPU (written for the H200: PyTorch, Triton, ONNX Runtime, pytest,
# no network, no pip install). Runs the CUDA tests of tests/kernels (`-m gpu`: Triton vs reference
# at realistic sizes, odd shapes with real Triton, opcheck, torch.compile on CUDA) and the kernel
# benchmark, writing $OUT/kernels.json (+ the two logs). Exit status: non-zero if either failed.
#
#   bash scripts/gpu_check.sh                 # OUT defaults to ./artifacts/bench
#   OUT=/tmp/out PYTHON=python3 bash scripts/gpu_check.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."  # repo root: works without installing the package
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:${PYTHONPATH}}"
unset TRITON_INTERPRET PFK_FORCE_TRITON  # real Triton on the GPU, never the CPU interpreter
OUT="${OUT:-./artifacts/bench}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
"$PY" - <<'PY'
import torch, triton
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
assert torch.cuda.is_available(), "no CUDA device visible"
PY

echo "== pytest -m gpu tests/kernels"
test_rc=0
timeout 420 "$PY" -m pytest -m gpu tests/kernels -q -p no:cacheprovider --durations=5 \
    2>&1 | tee "$OUT/kernels_pytest.txt" || test_rc=$?

echo "== benchmark (--device cuda)"
bench_rc=0
timeout 420 "$PY" benchmarks/bench_kernels.py --device cuda --json "$OUT/kernels.json" \
    2>&1 | tee "$OUT/kernels_bench.txt" || bench_rc=$?

echo "== summary"
echo "pytest -m gpu: exit ${test_rc}   benchmark: exit ${bench_rc}   outputs in ${OUT}"
if [[ -f "$OUT/kernels.json" ]]; then
    "$PY" - "$OUT/kernels.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for t in report["targets"]:
    print(f"  {t['target']:<36} {t['value']!s:>8}  need >= {t['need']:<4} {'PASS' if t['pass'] else 'FAIL'}")
PY
fi
exit $(( test_rc != 0 ? test_rc : bench_rc ))

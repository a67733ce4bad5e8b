#!/usr/bin/env bash
# The one command a GPU owner runs (docs/GPU.md): every `gpu`-marked test of the suite (the Triton kernels
# vs their references, DALI's GPU decode and loader, the self-checks of every fast path including a CUDA
# bf16 training step), then `factory doctor` (each fast path verified on this GPU, or failed with its
# figures, or skipped and why), then the kernel benchmark; one summary at the end. Needs PyTorch with CUDA,
# Triton, pytest; no network. Exit status: non-zero if any part failed.
#
#   bash scripts/gpu_check.sh              # OUT defaults to ./artifacts/bench
#   bash scripts/gpu_check.sh --dry-run    # print what it would run (the test files found), run nothing
#   OUT=/tmp/out PYTHON=python3 bash scripts/gpu_check.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."  # repo root: works without installing the package
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:${PYTHONPATH}}"
unset TRITON_INTERPRET PFK_FORCE_TRITON  # real Triton on the GPU, never the CPU interpreter
OUT="${OUT:-./artifacts/bench}"
PY="${PYTHON:-python3}"

# every test file with a gpu-marked test (`pytest.mark.gpu`, or the "cuda" param of triton_device_params)
mapfile -t GPU_TESTS < <(grep -rlE 'mark\.gpu|triton_device_params\(' tests --include='*.py' | sort)
PYTEST=(timeout 540 "$PY" -m pytest -m gpu "${GPU_TESTS[@]}" -q -p no:cacheprovider -p no:xdist --durations=5)
DOCTOR=(timeout 300 "$PY" -c "from factory.cli import main; main()" doctor)
BENCH=(timeout 420 "$PY" benchmarks/bench_kernels.py --device cuda --json "$OUT/kernels.json")

if (( DRY )); then
    echo "gpu-marked test files (${#GPU_TESTS[@]}):"
    printf '  %s\n' "${GPU_TESTS[@]}"
    echo "would run:"
    echo "  ${PYTEST[*]}"
    echo "  ${DOCTOR[*]}            (table; JSON in \$OUT/doctor.json)"
    echo "  ${BENCH[*]}"
    exit 0
fi
mkdir -p "$OUT"

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
"$PY" - <<'PY'
import torch, triton
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
assert torch.cuda.is_available(), "no CUDA device visible"
PY

echo "== pytest -m gpu (${#GPU_TESTS[@]} files)"
test_rc=0
"${PYTEST[@]}" 2>&1 | tee "$OUT/gpu_pytest.txt" || test_rc=$?

echo "== factory doctor"
doctor_rc=0
"${DOCTOR[@]}" 2>&1 | tee "$OUT/doctor.txt" || doctor_rc=$?
"${DOCTOR[@]}" --json > "$OUT/doctor.json" 2>/dev/null || true

echo "== benchmark (--device cuda)"
bench_rc=0
"${BENCH[@]}" 2>&1 | tee "$OUT/kernels_bench.txt" || bench_rc=$?

echo "== summary"
echo "pytest -m gpu: exit ${test_rc}   factory doctor: exit ${doctor_rc}   benchmark: exit ${bench_rc}   outputs in ${OUT}"
grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/gpu_pytest.txt" | tail -n 20 || true
grep -E ' (failed|verified|skipped) ' "$OUT/doctor.txt" | awk '{print "  " $0}' || true
if [[ -f "$OUT/kernels.json" ]]; then
    "$PY" - "$OUT/kernels.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for t in report["targets"]:
    print(f"  {t['target']:<36} {t['value']!s:>8}  need >= {t['need']:<4} {'PASS' if t['pass'] else 'FAIL'}")
PY
fi
for rc in "$test_rc" "$doctor_rc" "$bench_rc"; do (( rc != 0 )) && exit "$rc"; done
exit 0

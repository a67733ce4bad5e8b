"""Does the default test tier still catch real bugs? Plant one deliberate bug per stage, run that stage's
default-tier tests on it, and report which tests failed (docs/TESTING.md, "Regression power").

    .venv/bin/python scripts/mutation_check.py            # all mutations
    .venv/bin/python scripts/mutation_check.py --only prepare

Each mutation is a text edit of one source file in a throw-away copy of the checkout (`git worktree`-free:
a plain copy of the tracked files, so the checkout is never touched). The edit must match exactly once:
a refactor that moves the code makes this script fail loudly, never pass silently. A mutation is
"caught" when at least one of its tests fails; the script exits 1 if any mutation survives.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    stage: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    pytest_args: tuple[str, ...] = ()  # e.g. ("--full",): a mutation only the heavy tier can catch


MUTATIONS = (
    Mutation(
        "sensors", "flip the sign of the yaw in the KITTI reader (camera -> lidar heading)",
        "pfactory/sensors/kitti.py",
        "heading_rect = np.array([np.cos(o.rotation_y), 0.0, -np.sin(o.rotation_y)])",
        "heading_rect = np.array([np.cos(o.rotation_y), 0.0, np.sin(o.rotation_y)])",
        ("tests/sensors",),
    ),
    Mutation(
        "prepare", "drop the last frame of every shard in the shard writer",
        "pfactory/prepare/shards.py",
        '    """Prepared frames -> one Arrow table with `schema` (column order and types fixed)."""\n',
        '    """Prepared frames -> one Arrow table with `schema` (column order and types fixed)."""\n'
        "    frames = frames[:-1] if len(frames) > 1 else frames\n",
        ("tests/prepare", "tests/tasks/test_prepare.py"),
    ),
    Mutation(
        "train", "break the pillar scatter-max backward (half the gradient)",
        "kernels/pillar_scatter.py",
        "    return grad_features, None, None, None, None\n",
        "    return grad_features * 0.5, None, None, None, None\n",
        ("tests/kernels/test_pillar_scatter.py", "tests/archs/painted_pillars"),
    ),
    Mutation(
        "promote", "swap the thresholds of two gates (min_map and p99 latency)",
        "pfactory/promote/gates.py",
        '_lower("min_map", candidate.kpis["mAP"], params.min_map, "mAP")',
        '_lower("min_map", candidate.kpis["mAP"], params.max_p99_latency_ms, "mAP")',
        ("tests/promote", "tests/tasks/test_promote.py"),
    ),
    Mutation(
        "latency-gate", "latency gate disabled: the candidate-vs-champion latency gates are never applied",
        "pfactory/promote/gates.py",
        "        gates += _latency_gates(params, champion_latency)\n",
        "        pass  # latency gate disabled\n",
        ("tests/promote/test_latency_gate.py",),
    ),
    Mutation(
        "evaluate", "skip the last work unit of the distributed evaluation",
        "pfactory/evaluate/distributed.py",
        "infer_unit, (spec, data, u)) for u in units]",
        "infer_unit, (spec, data, u)) for u in units[:-1]]",
        ("tests/evaluate", "tests/tasks/test_evaluate.py"),
    ),
    Mutation(
        "quality", "drop the box regression term from the default architecture's training loss (it still "
        "trains and its loss still falls; of the default tier only the DDP-equality test fails on it, by "
        "accident: the zeroed term leaves the regression conv without gradient)",
        "pfactory/archs/painted_pillars/loss.py",
        "    total = heatmap_weight * focal + reg_weight * l1  # []\n",
        "    total = heatmap_weight * focal + 0.0 * reg_weight * l1  # []\n",
        ("tests/quality/test_quality.py",),
        ("--full", "-k", "painted_pillars"),
    ),
)


def copy_checkout(dst: Path) -> None:
    """The tracked and untracked-not-ignored files of the checkout, as they are now."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def apply(root: Path, m: Mutation) -> None:
    path = root / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.path}: the text to mutate for {m.stage!r} is found {text.count(m.old)} times, "
                         "expected once (the code moved: update scripts/mutation_check.py)")
    path.write_text(text.replace(m.old, m.new))


def run_tests(root: Path, m: Mutation) -> tuple[int, list[str], float]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *m.pytest_args, *m.tests],
        cwd=root, env=env, capture_output=True, text=True,
    )
    failed = sorted(set(re.findall(r"^FAILED (\S+)", r.stdout, flags=re.M)))
    errors = sorted(set(re.findall(r"^ERROR (\S+)", r.stdout, flags=re.M)))
    return r.returncode, failed + errors, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="a stage name (repeatable)")
    args = ap.parse_args()
    survived = []
    for m in MUTATIONS:
        if args.only and m.stage not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"pf-mutant-{m.stage}-") as tmp:
            root = Path(tmp)
            copy_checkout(root)
            apply(root, m)
            code, failed, seconds = run_tests(root, m)
        caught = code != 0 and bool(failed)
        print(f"[{m.stage}] {m.what}: {'CAUGHT' if caught else 'SURVIVED'} by {len(failed)} test(s) "
              f"in {seconds:.0f} s ({' '.join(m.tests)})")
        for name in failed[:8]:
            print(f"    {name}")
        if len(failed) > 8:
            print(f"    ... and {len(failed) - 8} more")
        if not caught:
            survived.append(m.stage)
    if survived:
        print(f"mutations not caught by the default tier: {', '.join(survived)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

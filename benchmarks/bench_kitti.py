"""KITTI's official metric: `factory kpi --metrics kitti` vs the widely used Python reference evaluator, as
whole processes on the same files (what their users wait for: start-up, imports, numba compile included).

In:  a KITTI-val-sized set of generated scenes (`tests/metrics/kitti_scenes.make_scenes`: 3,769 frames, ~6 GT
     boxes and ~7 detections a frame of every type, DontCare regions, all difficulty edges), written as
     `label_2/` and `results/` files; `--frames N` for another size.
Out: printed wall times (median of `--repeats` for ours, of `--ref-repeats` for the reference), the ratio,
     and the largest difference of any AP (R40 / R11, strict / loose, 3 classes x bbox/bev/3d/aos x 3
     difficulties); `--json FILE` writes them.

The reference (kitti-object-eval-python as OpenPCDet ships it) is not part of this repository: pass a folder
holding its package as `kitti_ref/` (`--ref-path`) and a Python with numba (`--ref-python`); its numba.cuda
rotated IoU needs a GPU, so on a CPU machine use a numba.njit copy of its device functions (docs/KPIS.md,
"KITTI metric: how the reference was established"). Without `--ref-path` only ours is timed.

Run: python benchmarks/bench_kitti.py [--frames 3769] [--repeats 3] [--ref-path DIR --ref-python PY]
     (or `factory bench kitti ...`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `tests.metrics` (the scene generator and the reference driver)

TARGET_RATIO = 10.0  # issue 33: the KITTI metric as a whole `factory kpi` process >= 10x the reference's


def _timed(cmd: list[str], cwd: Path | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return wall, res.stdout


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=3769, help="frames (KITTI val: 3,769)")
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="runs of ours (median)")
    ap.add_argument("--ref-path", type=Path, help="folder holding the reference's kitti_ref/ package")
    ap.add_argument("--ref-python", default=sys.executable, help="Python (with numba) for the reference")
    ap.add_argument("--ref-repeats", type=int, default=1, help="runs of the reference (median)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    from tests.metrics.kitti_scenes import make_scenes, write_scenes
    from tests.metrics.make_kitti_golden import DRIVER

    with tempfile.TemporaryDirectory(prefix="bench-kitti-") as tmp:
        gt, dt = make_scenes(args.seed, args.frames, max_gt=12)
        labels, results = write_scenes(Path(tmp), gt, dt)
        n_gt, n_dt = sum(map(len, gt.values())), sum(map(len, dt.values()))
        out = Path(tmp) / "kpis.json"
        ours_cmd = [sys.executable, "-m", "factory.cli", "kpi", "--gt", str(labels), "--pred", str(results)]
        ours_cmd += ["--metrics", "kitti", "--out", str(out)]
        ours = [_timed(ours_cmd, cwd=ROOT)[0] for _ in range(args.repeats)]
        doc = json.loads(out.read_text())
        result = {
            "frames": args.frames, "gt_boxes": n_gt, "detections": n_dt,
            "ours_s": ours, "ours_median_s": statistics.median(ours),
        }  # fmt: skip
        print(f"{args.frames} frames, {n_gt} ground-truth lines, {n_dt} detections")
        print(f"factory kpi --metrics kitti : median {result['ours_median_s']:.3f} s wall of {args.repeats}")
        if args.ref_path is not None:
            ref_cmd = [args.ref_python, "-c", DRIVER, str(labels), str(results), str(args.frames)]
            runs = [_timed(ref_cmd, cwd=args.ref_path) for _ in range(args.ref_repeats)]
            ref = json.loads(runs[-1][1].splitlines()[-1])["percent"]
            worst = 0.0
            keys = {
                "R40": {"strict": "kitti", "loose": "kitti_loose"},
                "R11": {"strict": "kitti_R11", "loose": "kitti_loose_R11"},
            }
            for rec, by_ov in ref.items():
                for ov, by_c in by_ov.items():
                    for c, by_m in by_c.items():
                        for m, by_d in by_m.items():
                            for d, v in by_d.items():
                                mine = doc[keys[rec][ov]][c][m][d]
                                if v is not None and mine is not None:
                                    worst = max(worst, abs(mine - v / 100))
            ref_s = [w for w, _ in runs]
            result.update(ref_s=ref_s, ref_median_s=statistics.median(ref_s), max_abs_diff=worst)
            result["ratio"] = result["ref_median_s"] / result["ours_median_s"]
            ok = "ok" if result["ratio"] >= TARGET_RATIO else "BELOW TARGET"
            print(
                f"reference evaluator        : median {result['ref_median_s']:.3f} s wall of {args.ref_repeats}"
            )
            print(
                f"ratio {result['ratio']:.1f}x (target >= {TARGET_RATIO:g}x: {ok}); largest AP difference {worst:.2g}"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

"""Detection KPIs: ours (vectorised NumPy) vs nuscenes-devkit's algorithm, on the same boxes.

In:  a synthetic nuScenes-val-sized set (`pfactory.metrics.synthetic.random_detections`: 6,019
     frames, ~40 GT and ~100 predictions per frame, 3 classes) or `--frames N` for a quick run.
Out: printed table (and `--json FILE`): both times, the speed ratio, peak memory, and the largest
     difference between the two sets of numbers (AP per class and threshold, ATE/ASE/AOE).

The devkit side is `devkit_kpis` from tests/metrics/test_devkit_agreement.py (its `accumulate`,
`calc_ap`, `calc_tp` for every class and threshold, as `DetectionEval.evaluate` calls them), so
test and benchmark check the same thing. Its time excludes building the `EvalBoxes`, reported
apart. Ours is timed on the same work (no range buckets) and on the full report (3 range
buckets + per-frame counts). Memory: growth of the resident set's high-water mark during each
evaluation (Linux `/proc/self/clear_refs` reset), plus the tracemalloc peak for ours.

Run: `python benchmarks/bench_kpi.py [--frames 6019] [--json out.json]`
(needs the devkit: `pip install --no-deps -r requirements/devkit.txt`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `tests.metrics` (the devkit reference lives with its test)

from pfactory.metrics.detection import KpiParams, evaluate_detections  # noqa: E402
from pfactory.metrics.synthetic import random_detections  # noqa: E402

TARGET_RATIO = 10.0  # the requirement: at least 10x the devkit


def _rss_kib(field: str) -> int | None:
    """VmRSS / VmHWM of this process in KiB (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_growth_mib(fn):
    """Run fn(); return (result, seconds, growth of peak RSS over the RSS at start in MiB or None)."""
    reset = _reset_peak_rss()
    start = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = _rss_kib("VmHWM")
    grow = (peak - start) / 1024 if (reset and start is not None and peak is not None) else None
    return out, dt, grow


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} MiB"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=6019, help="frames (nuScenes val: 6019)")
    ap.add_argument("--gt-per-frame", type=float, default=40.0)
    ap.add_argument("--pred-per-frame", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of ours (best is reported)")
    ap.add_argument("--skip-devkit", action="store_true", help="time ours only")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    gts, preds = random_detections(args.frames, args.gt_per_frame, args.pred_per_frame, seed=args.seed)
    n_gt, n_pred = sum(len(f.boxes) for f in gts), sum(len(f.boxes) for f in preds)
    same_work = KpiParams(range_buckets_m=())  # what the devkit loop computes: classes x thresholds
    full = KpiParams()
    report: dict = {
        "machine": f"{_cpu_name()}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}",
        "frames": args.frames,
        "gt_boxes": n_gt,
        "pred_boxes": n_pred,
    }
    print(f"{args.frames} frames, {n_gt} GT boxes, {n_pred} predictions, classes {same_work.classes}")
    print(f"machine: {report['machine']}")

    times = []
    for _ in range(args.repeats):
        kpis, dt, grow = _peak_growth_mib(lambda: evaluate_detections(gts, preds, same_work))
        times.append(dt)
    ours = kpis.metrics
    _, full_dt, full_grow = _peak_growth_mib(lambda: evaluate_detections(gts, preds, full))
    tracemalloc.start()
    evaluate_detections(gts, preds, same_work)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    report["ours"] = {
        "seconds": min(times),
        "seconds_all_runs": times,
        "seconds_full_report": full_dt,
        "peak_rss_growth_mib": grow,
        "peak_rss_growth_full_report_mib": full_grow,
        "tracemalloc_peak_mib": traced_peak / 2**20,
    }
    print(
        f"ours    : {min(times):8.3f} s (best of {args.repeats}; full report with range buckets {full_dt:.3f} s)"
    )
    print(f"          peak RSS growth {_mib(grow)}, tracemalloc peak {traced_peak / 2**20:.1f} MiB")

    if not args.skip_devkit:
        from tests.metrics.test_devkit_agreement import _SKIP_REASON, devkit_kpis, to_eval_boxes

        if _SKIP_REASON:
            print(f"devkit  : skipped: {_SKIP_REASON}")
        else:
            (gt_eb, pred_eb), build_dt, build_grow = _peak_growth_mib(
                lambda: (to_eval_boxes(gts, same_work), to_eval_boxes(preds, same_work))
            )
            ref, dk_dt, dk_grow = _peak_growth_mib(lambda: devkit_kpis(gt_eb, pred_eb, same_work))
            worst = 0.0
            for c in same_work.classes:
                for th in same_work.dist_ths_m:
                    worst = max(worst, abs(ours["classes"][c]["ap"][str(th)] - ref[c]["ap"][th]))
                for m in ("ate", "ase", "aoe"):
                    worst = max(worst, abs(ours["classes"][c][m] - ref[c][m]))
            ratio = dk_dt / min(times)
            report["devkit"] = {
                "seconds": dk_dt,
                "seconds_build_evalboxes": build_dt,
                "peak_rss_growth_mib": dk_grow,
                "evalboxes_rss_growth_mib": build_grow,
            }
            report["speed_ratio"] = ratio
            report["max_abs_diff"] = worst
            print(f"devkit  : {dk_dt:8.3f} s (+ {build_dt:.1f} s to build EvalBoxes, {_mib(build_grow)})")
            print(f"          peak RSS growth {_mib(dk_grow)}")
            print(f"ratio   : {ratio:8.1f} x  (target >= {TARGET_RATIO:g} x)")
            print(f"max |ours - devkit| over AP and TP errors: {worst:.3g}")
            for c in same_work.classes:
                aps = " ".join(f"{ours['classes'][c]['ap'][str(t)]:.4f}" for t in same_work.dist_ths_m)
                print(f"  {c:<11} AP {aps}  ATE {ours['classes'][c]['ate']:.4f}")
            print(f"  mAP {ours['mAP']:.4f}  NDS* {ours['NDS']:.4f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if "max_abs_diff" in report and report["max_abs_diff"] > 1e-6:
        print("FAIL: numbers differ from the devkit")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

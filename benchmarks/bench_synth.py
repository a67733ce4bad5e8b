"""Synthetic dataset generation speed (target, issue 50: the default 250 KITTI frames in <= 15 s on 2 cores).

Times `generate_dataset` (files written, fsync'd, renamed into place) for `--frames` frames at
each `--workers` count and prints frames/s, then a per-stage breakdown of single frames in
this process (scene sampling, lidar, camera render, image encoding) in CPU milliseconds.

Run: python benchmarks/bench_synth.py [--frames 200] [--workers 1 2] [--cameras 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pfactory.synth.dataset import (
    camera_rig,
    encode_jpeg,
    encode_png,
    generate_dataset,
    in_view,
    kitti_camera,
)
from pfactory.synth.scene import sample_scene
from pfactory.synth.sensors import hdl64, render_camera, simulate_lidar


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its finished children (pool workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def stage_breakdown(frames: int, cameras: int, seed: int) -> dict[str, float]:
    """Median CPU ms per stage over `frames` frames (same code path as `generate_frame`)."""
    times: dict[str, list[float]] = {"scene": [], "lidar": [], "camera": [], "encode": []}
    for i in range(frames):
        scene_rng, lidar_rng, camera_rng = np.random.default_rng([seed, i]).spawn(3)
        t0 = time.process_time()
        if cameras == 1:
            cams = [kitti_camera()]
            scene = sample_scene(scene_rng, "front", in_view(cams[0]))
        else:
            cams = camera_rig(cameras)
            scene = sample_scene(scene_rng, "around")
        t1 = time.process_time()
        simulate_lidar(scene, lidar_rng, hdl64())
        t2 = time.process_time()
        images = [render_camera(scene, c, camera_rng, track_objects=cameras == 1).rgb for c in cams]
        t3 = time.process_time()
        for img in images:
            encode_png(img) if cameras == 1 else encode_jpeg(img)
        t4 = time.process_time()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(1000 * dt)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cameras", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--breakdown-frames", type=int, default=10)
    args = ap.parse_args(argv)
    result: dict = {"frames": args.frames, "cameras": args.cameras, "cpus": os.cpu_count(), "runs": []}
    tmp = Path(tempfile.mkdtemp(prefix="bench_synth_"))
    try:
        for w in args.workers:
            out = tmp / f"w{w}"
            cpu0 = _cpu_s()
            t0 = time.perf_counter()
            summary = generate_dataset(
                out, frames=args.frames, seed=args.seed, cameras=args.cameras, workers=w
            )
            dt = time.perf_counter() - t0
            cpu = _cpu_s() - cpu0
            size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6
            run = {
                "workers": w,
                "time_s": round(dt, 2),
                "frames_per_s": round(args.frames / dt, 2),
                "cpu_s_per_frame": round(cpu / args.frames, 3),
                "size_mb": round(size_mb, 1),
            }
            result["runs"].append(run)
            # The CPU seconds (this process + its workers, user + system) say what idle cores would
            # give, when other jobs share the machine and stretch the wall time.
            print(
                f"synth {args.frames} frames, {args.cameras} camera(s), workers={w}: {dt:.1f} s wall, "
                f"{args.frames / dt:.2f} frames/s, {cpu / args.frames:.3f} CPU s/frame, {size_mb:.0f} MB "
                f"(points/frame {summary['points_per_frame']['mean']:.0f}, objects {summary['objects']}), "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["stage_cpu_ms"] = stage_breakdown(args.breakdown_frames, args.cameras, args.seed)
    print(
        f"per-frame CPU ms by stage (median of {args.breakdown_frames}): {json.dumps(result['stage_cpu_ms'])}"
    )
    return result


if __name__ == "__main__":
    main()

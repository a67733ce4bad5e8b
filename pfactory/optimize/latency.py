"""Latency of several runners measured in one run: warm-up, interleaved timing, percentiles, ratios.

In:  `{name: runner}` (callables `runner(points, num_points, images, proj) -> outputs`), a list of
     feeds per batch size (dicts of numpy inputs, end-to-end inputs: padded points, not pillars).
Out: `measure_latency(...) -> dict` = `latency.json`:
    {"batch_1": {"<name>": {"p50_ms", "p95_ms", "p99_ms", "mean_ms", "min_ms", "throughput_fps",
                            "iterations"}, ...}, ...,
     "speedup_vs_eager": {"batch_1": {"<name>": p50(eager) / p50(name)}, ...}, "config": {...}}

Interleaving: iteration i runs every runner once on the same feed (feeds cycle), in a rotating order,
so a burst of load from another process on a shared 2-core machine lands on all runners alike instead
of on whichever ran during the burst. Percentiles use linear interpolation (numpy); with 20 iterations
p99 is close to the maximum, documented in latency.json's config.

`compare_directories(candidate_dir, champion_dir, feeds, ...)`: the promotion's latency gate against the
champion -- the artifact each optimized directory serves (`runtime.auto_backend`, sha256-checked), timed
side by side in this process, interleaved the same way -> {"candidate", "champion": {"artifact", p50/p99...},
"ratio_p50", "ratio_p99", "config"}.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pfactory.optimize.feed import Feed

Runner = Callable[..., Any]
EAGER = "pytorch/eager"


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not available on every platform
        return None


def summarize(times_s: Sequence[float], batch_size: int) -> dict[str, float]:
    """p50/p95/p99/mean/min in ms and throughput (frames/s at the median latency)."""
    t = np.asarray(times_s, dtype=np.float64) * 1000.0
    p50, p95, p99 = (float(v) for v in np.percentile(t, [50, 95, 99]))
    return {
        "p50_ms": round(p50, 3),
        "p95_ms": round(p95, 3),
        "p99_ms": round(p99, 3),
        "mean_ms": round(float(t.mean()), 3),
        "min_ms": round(float(t.min()), 3),
        "throughput_fps": round(batch_size * 1000.0 / p50, 3) if p50 > 0 else float("inf"),
        "iterations": len(t),
    }


def time_interleaved(
    runners: Mapping[str, Runner], feeds: Sequence[Feed], warmup: int, iterations: int
) -> dict[str, list[float]]:
    """Seconds per call of each runner; every iteration runs all runners on the same feed."""
    if not feeds:
        raise ValueError("no feeds to time")
    names = list(runners)
    for i in range(warmup):
        for name in names:
            runners[name](**feeds[i % len(feeds)])
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(iterations):
        feed = feeds[i % len(feeds)]
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotate who runs first (cache/thermal order effects)
            t0 = time.perf_counter()
            runners[name](**feed)
            times[name].append(time.perf_counter() - t0)
    return times


def measure_latency(
    runners: Mapping[str, Runner],
    feeds_by_batch: Mapping[int, Sequence[Feed]],
    warmup: int,
    iterations: int,
    reference: str = EAGER,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`latency.json` (module docstring) for every runner at every batch size of `feeds_by_batch`."""
    load_before = _loadavg()
    out: dict[str, Any] = {}
    speedups: dict[str, Any] = {}
    for b, feeds in sorted(feeds_by_batch.items()):
        times = time_interleaved(runners, feeds, warmup, iterations)
        key = f"batch_{b}"
        out[key] = {name: summarize(t, b) for name, t in times.items()}
        if reference in out[key]:
            ref = out[key][reference]["p50_ms"]
            speedups[key] = {
                name: round(ref / s["p50_ms"], 3)
                for name, s in out[key].items()
                if name != reference and s["p50_ms"] > 0
            }
    points = [int(f["num_points"].max()) for feeds in feeds_by_batch.values() for f in feeds]
    return {
        **out,
        "speedup_vs_eager": speedups,
        "config": {
            "warmup": warmup,
            "iterations": iterations,
            "interleaved": True,
            "percentiles": "numpy linear interpolation over `iterations` calls",
            "reference": reference,
            "points_per_frame_median": int(np.median(points)) if points else 0,
            # Other processes on the machine skew every runner; the 1-min load average says how busy it was.
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": _loadavg(),
            **(config or {}),
        },
    }


def compare_directories(
    candidate_dir: Path,
    champion_dir: Path,
    feeds: Sequence[Feed],
    warmup: int,
    iterations: int,
    device: str = "cpu",
    threads: int | None = None,
) -> dict[str, Any]:
    """Candidate vs champion latency, measured side by side (module docstring).

    In: two optimized directories (each checked against its backend.json), the feeds (one batch size),
    warm-up and timed calls per runner. Out: {"candidate": {"artifact", "dir", **summarize(...)}, "champion":
    {...}, "ratio_p50": candidate p50 / champion p50, "ratio_p99": the same for p99, "config": {"warmup",
    "iterations", "batch", "interleaved", "loadavg_1min_before", "loadavg_1min_after"}}.
    """
    from pfactory.optimize.manifest import find_artifact, read_manifest, verify_directory
    from pfactory.optimize.runtime import auto_backend, open_runner

    runners: dict[str, Runner] = {}
    served: dict[str, str] = {}
    for role, d in (("candidate", Path(candidate_dir)), ("champion", Path(champion_dir))):
        manifest = verify_directory(d, read_manifest(d))
        backend = auto_backend(manifest, device)
        art = find_artifact(manifest, backend, None)
        # No spinning: ORT's idle threads would otherwise busy-wait into the other runner's turn.
        runners[role] = open_runner(d / art["file"], backend, art["precision"], device, threads, spin=False)
        served[role] = f"{backend}/{art['precision']}"
    batch = int(feeds[0]["num_points"].shape[0]) if feeds else 0
    load_before = _loadavg()
    times = time_interleaved(runners, feeds, warmup, iterations)
    out: dict[str, Any] = {
        role: {"artifact": served[role], "dir": str(d), **summarize(times[role], batch)}
        for role, d in (("candidate", candidate_dir), ("champion", champion_dir))
    }
    for q in ("p50", "p99"):
        champ = out["champion"][f"{q}_ms"]
        out[f"ratio_{q}"] = round(out["candidate"][f"{q}_ms"] / champ, 4) if champ > 0 else float("inf")
    out["config"] = {
        "warmup": warmup, "iterations": iterations, "batch": batch, "interleaved": True,
        "loadavg_1min_before": load_before, "loadavg_1min_after": _loadavg(),
    }  # fmt: skip
    return out

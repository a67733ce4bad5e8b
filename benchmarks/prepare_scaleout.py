"""Prepare-stage scale-out (`factory bench prepare --dask`): frames/s with 1 vs N Dask workers, same frames.

In:  the real KITTI frames of ../shared/data/real (PNG 1242x375, ~120k points each) replicated by symlinks
     to `--frames` frames (synthetic frames of the same sizes when the real ones are absent); default
     params (416x128 model input), `--unit-frames` frames per work unit, 1 thread per worker.
Out: a printed table (and `--json FILE`): per worker count, the median over `--repeats` runs (interleaved,
     each on a warm LocalCluster) of the stage wall time (listing + units + shards + merge + publish) and
     frames/s; the ratio to 1 worker (target >= 1.6x for 2 workers on 2 cores); the scheduling overhead per
     task = (task-loop wall x worker threads - sum of task compute) / tasks (submission, result transfer,
     idle slots at the tail), next to a no-op Dask task's round trip; peak RSS per worker (VmHWM: the
     worker's largest resident set, warm-up included); worker CPU seconds (frames per CPU second equal
     for 1 and N = the scale-out adds no work); the serial parts (listing, merge, publish). The same frames
     in this process (today's default path, `prepare.num_threads` 2) for reference. Every run's shards and
     rejected.jsonl are hashed (sha256): all runs must be byte-identical. The 1-minute load average before
     and after is printed: on a shared machine the ratio only means something next to it.

Run: `factory bench prepare --dask [--frames 192] [--workers 1 2] [--repeats 3] [--unit-frames 16] [--json F]`
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 1.6  # 2 workers vs 1 on 2 cores (the acceptance)


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _noop() -> None:
    return None


def output_hashes(out: Path) -> dict[str, str]:
    """sha256 of every shard file and rejected.jsonl (what must not depend on the scheduling)."""
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and (p.suffix == ".parquet" or p.name == "rejected.jsonl")
    }


def build_raw(work: Path, frames: int) -> Path:
    from raw_datasets import build_datasets

    return build_datasets(work, frames)["png"]


def timed_run(client: Any, address: str, raw: Path, out: Path, params: Any) -> dict[str, Any]:
    from pfactory.prepare.scaleout import prepare_scaled

    cpu0 = client.run(_cpu_s)
    t0 = time.perf_counter()
    res = prepare_scaled(raw, out, params, address)
    wall = time.perf_counter() - t0
    cpu1 = client.run(_cpu_s)
    m = res.metrics
    cpu = sum(cpu1[w] - cpu0[w] for w in cpu1 if w in cpu0)
    return {
        "wall_s": wall,
        "frames": m["frames_total"],
        "frames_per_s": m["frames_total"] / wall,
        "overhead_per_task_ms": m["overhead_per_task_ms"],
        "tasks": m["units"] + m["shard_tasks"],
        "peak_rss_worker_mb": m["peak_rss_worker_mb"],
        "worker_cpu_s": cpu,
        "serial_s": {k: m[f"seconds_{k}"] for k in ("list", "merge", "publish")},
        "hashes": output_hashes(out),
    }


def noop_round_trip_ms(client: Any, n: int = 200) -> float:
    from distributed import wait

    t0 = time.perf_counter()
    wait([client.submit(_noop, key=f"noop-{i}-{os.urandom(3).hex()}", pure=False) for i in range(n)])
    return 1000 * (time.perf_counter() - t0) / n


@contextlib.contextmanager
def local_cluster(workers: int) -> Iterator[tuple[Any, str]]:
    """`(Client, scheduler address)` of a LocalCluster started exactly as the stage starts one."""
    from pfactory.prepare.scaleout import WORKER_ENV
    from pfactory.runtime import cluster

    with cluster.dask_client(f"local:{workers}", workers, 1, "bench", WORKER_ENV) as (client, _):
        yield client, client.scheduler.address


def rss_vs_frames(work: Path, sizes: list[int], params: Any) -> dict[str, float]:
    """Peak RSS (MiB) of a fresh 1-worker cluster preparing each frame count: flat = bounded by the unit."""
    from pfactory.prepare.scaleout import prepare_scaled

    out = {}
    for n in sizes:
        raw = build_raw(work / f"rss-{n}", n)
        with local_cluster(1) as (_, address):
            res = prepare_scaled(raw, work / f"rss-out-{n}", params, address)
        out[str(n)] = round(res.metrics["peak_rss_worker_mb"], 1)
        shutil.rmtree(work / f"rss-out-{n}", ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="bench_prepare --dask", description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=192, help="frames per run (160+; a multiple of 2 units)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--unit-frames", type=int, default=16)
    ap.add_argument("--no-inprocess", action="store_true", help="skip the single-process reference runs")
    ap.add_argument(
        "--rss-sizes", type=int, nargs="*", default=[],
        help="also: peak RSS of one fresh worker preparing each of these frame counts (memory vs dataset size)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument(
        "--stage", type=int, nargs="+", default=None, metavar="FRAMES",
        help="instead: the stage end to end at these frame counts, 1 process vs --workers' last count, interleaved",
    )  # fmt: skip
    args = ap.parse_args(argv)
    logging.getLogger("distributed").setLevel(logging.WARNING)  # cluster start/stop chatter
    if args.stage:
        work = args.work or Path(tempfile.mkdtemp(prefix="bench_prepare_stage_"))
        try:
            report = stage_main(args.stage, args.workers[-1], args.repeats, args.unit_frames, work)
        finally:
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return report

    from pfactory.prepare.params import PrepareParams
    from pfactory.prepare.scaleout import prepare_scaled
    from pfactory.prepare.stage import prepare_dataset

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_prepare_dask_"))
    work.mkdir(parents=True, exist_ok=True)
    params = PrepareParams(device="cpu", unit_frames=args.unit_frames, threads_per_worker=1)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "frames": args.frames,
        "unit_frames": args.unit_frames,
        "threads_per_worker": 1,
        "load_before": round(os.getloadavg()[0], 2),
    }
    clusters: dict[int, tuple[Any, str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {str(w): [] for w in args.workers}
    stack = contextlib.ExitStack()
    try:
        raw = build_raw(work, args.frames)
        warm = build_raw(work / "warm", 2 * args.unit_frames * max(args.workers))
        t0 = time.perf_counter()
        os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(work / "dask"))
        for w in args.workers:
            clusters[w] = stack.enter_context(local_cluster(w))
            prepare_scaled(warm, work / f"warm-{w}", params, clusters[w][1])  # imports, DALI build
        report["cluster_start_and_warmup_s"] = round(time.perf_counter() - t0, 2)
        report["noop_task_ms"] = {str(w): round(noop_round_trip_ms(c), 3) for w, (c, _) in clusters.items()}
        inproc: list[dict[str, Any]] = []
        for r in range(args.repeats):
            for w in args.workers:
                out = work / f"out-{w}-{r}"
                runs[str(w)].append(timed_run(*clusters[w], raw, out, params))
                shutil.rmtree(out, ignore_errors=True)
            if not args.no_inprocess:
                out = work / f"inproc-{r}"
                t1 = time.perf_counter()
                prepare_dataset(raw, out, params)
                inproc.append({"wall_s": time.perf_counter() - t1, "hashes": output_hashes(out)})
                shutil.rmtree(out, ignore_errors=True)
        report["load_after"] = round(os.getloadavg()[0], 2)
        if args.rss_sizes:
            report["rss_vs_frames"] = rss_vs_frames(work, args.rss_sizes, params)
    finally:
        stack.close()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    table = {}
    for w, rows in runs.items():
        table[w] = {
            "wall_s_median": round(med(rows, "wall_s"), 3),
            "wall_s_all": [round(r["wall_s"], 3) for r in rows],
            "frames_per_s_median": round(med(rows, "frames_per_s"), 2),
            "overhead_per_task_ms_median": round(med(rows, "overhead_per_task_ms"), 2),
            "tasks": rows[0]["tasks"],
            "peak_rss_worker_mb": round(max(r["peak_rss_worker_mb"] for r in rows), 1),
            "frames_per_worker_cpu_s": round(args.frames / med(rows, "worker_cpu_s"), 2),
            "serial_s_median": {
                k: round(statistics.median(r["serial_s"][k] for r in rows), 3)
                for k in ("list", "merge", "publish")
            },
        }
    base = table[str(args.workers[0])]["frames_per_s_median"]
    for w in table:
        table[w]["ratio_vs_first"] = round(table[w]["frames_per_s_median"] / base, 3)
    report["workers"] = table
    all_hashes = [r["hashes"] for rows in runs.values() for r in rows] + [r["hashes"] for r in inproc]
    report["identical_outputs"] = all(h == all_hashes[0] for h in all_hashes)
    report["files_hashed"] = len(all_hashes[0])
    if inproc:
        report["in_process"] = {
            "threads": params.num_threads,
            "wall_s_median": round(med(inproc, "wall_s"), 3),
            "frames_per_s_median": round(args.frames / med(inproc, "wall_s"), 2),
        }
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _print(report: dict[str, Any]) -> None:
    print(f"\n== prepare on Dask: {report['frames']} KITTI frames, units of {report['unit_frames']}, "
          f"1 thread per worker ({report['machine']}, load {report['load_before']} -> {report.get('load_after')}) ==")  # fmt: skip
    print(f"  cluster start + warm-up: {report.get('cluster_start_and_warmup_s')} s; "
          f"no-op task round trip (ms): {report.get('noop_task_ms')}")  # fmt: skip
    print(f"  {'workers':>7} {'wall s':>8} {'frames/s':>9} {'ratio':>6} {'ovh/task ms':>11} {'tasks':>5} "
          f"{'peak RSS/worker MiB':>19} {'frames/cpu-s':>12}  serial s (list, merge, publish)")  # fmt: skip
    for w, r in report["workers"].items():
        s = r["serial_s_median"]
        print(f"  {w:>7} {r['wall_s_median']:>8.2f} {r['frames_per_s_median']:>9.2f} {r['ratio_vs_first']:>5.2f}x "
              f"{r['overhead_per_task_ms_median']:>11.2f} {r['tasks']:>5} {r['peak_rss_worker_mb']:>19.1f} "
              f"{r['frames_per_worker_cpu_s']:>12.2f}  {s['list']:.3f}, {s['merge']:.3f}, {s['publish']:.3f}")  # fmt: skip
    if "2" in report["workers"]:
        ratio = report["workers"]["2"]["ratio_vs_first"]
        print(f"  2 workers vs 1: {ratio:.2f}x (target >= {TARGET_RATIO}x on 2 cores, quiet machine)")
    if "in_process" in report:
        ip = report["in_process"]
        print(
            f"  in one process ({ip['threads']} threads, today's default): {ip['frames_per_s_median']:.2f} frames/s"
        )
    if "rss_vs_frames" in report:
        print(f"  peak RSS of one worker vs frames prepared (MiB): {report['rss_vs_frames']}")
    print(f"  shards + rejected.jsonl byte-identical across every run: {report['identical_outputs']} "
          f"({report['files_hashed']} files)")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# `--stage`: the stage as `factory prepare` runs it, one process vs a LocalCluster it starts itself


def _cpu_all() -> float:
    """CPU seconds of this process and of its waited-for children (a LocalCluster's spawned workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def stage_run(raw: Path, out: Path, params: Any) -> dict[str, Any]:
    """One `prepare_data` call, timed end to end (cluster start, imports, DALI build and close included)."""
    from pfactory.prepare.scaleout import prepare_data

    load = os.getloadavg()[0]
    c0, t0 = _cpu_all(), time.perf_counter()
    res = prepare_data(raw, out, params)
    wall, cpu = time.perf_counter() - t0, _cpu_all() - c0
    hashes = output_hashes(out)
    shutil.rmtree(out, ignore_errors=True)
    m = res.metrics
    return {"wall_s": wall, "cpu_s": cpu, "cores": cpu / wall, "load": load, "hashes": hashes,
            "cluster_s": m.get("seconds_cluster", 0.0), "tasks_s": m.get("seconds_tasks", wall)}  # fmt: skip


def stage_main(sizes: list[int], workers: int, repeats: int, unit_frames: int, work: Path) -> dict[str, Any]:
    """Per frame count: A = the stage with `prepare.workers` 1 (this process, `prepare.num_threads` 2: the
    default), B = `prepare.workers` N (a LocalCluster of N single-threaded worker processes started and
    closed by the stage), run A B A B ... (`repeats` each) back to back; medians, CPU seconds (this process
    + its children), and a linear fit of CPU-s against frames per arm: the slope is the per-frame work,
    the intercept the fixed cost (processes, imports, DALI builds). Raises if any run's bytes differ."""
    from pfactory.prepare.params import PrepareParams

    one = PrepareParams(device="cpu")
    many = PrepareParams(device="cpu", workers=workers, threads_per_worker=1, unit_frames=unit_frames)
    os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(work / "dask"))
    rows = []
    for n in sizes:
        raw = build_raw(work / f"raw-{n}", n)
        runs: dict[str, list[dict[str, Any]]] = {"one": [], "many": []}
        for r in range(repeats):
            runs["one"].append(stage_run(raw, work / f"one-{n}-{r}", one))
            runs["many"].append(stage_run(raw, work / f"many-{n}-{r}", many))
        hashes = [x["hashes"] for v in runs.values() for x in v]
        if any(h != hashes[0] for h in hashes):
            raise AssertionError(f"{n} frames: outputs differ between runs (1 process vs {workers} workers)")
        row: dict[str, Any] = {"frames": n, "files_identical": len(hashes[0])}
        for arm, v in runs.items():
            for k in ("wall_s", "cpu_s", "cores", "cluster_s", "tasks_s"):
                row[f"{arm}_{k}"] = round(statistics.median(x[k] for x in v), 3)
            row[f"{arm}_walls"] = [round(x["wall_s"], 2) for x in v]
        row["ratio"] = round(row["one_wall_s"] / row["many_wall_s"], 3)
        row["load"] = f"{min(x['load'] for v in runs.values() for x in v):.2f}-{max(x['load'] for v in runs.values() for x in v):.2f}"  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    report: dict[str, Any] = {"machine": f"{platform.machine()} x{os.cpu_count()}", "workers": workers,
                              "unit_frames": unit_frames, "one_process_threads": one.num_threads, "rows": rows}  # fmt: skip
    if len(rows) >= 2:
        for arm in ("one", "many"):
            a, b = rows[0], rows[-1]
            slope = (b[f"{arm}_cpu_s"] - a[f"{arm}_cpu_s"]) / (b["frames"] - a["frames"])
            report[f"{arm}_cpu_ms_per_frame"] = round(1000 * slope, 2)
            report[f"{arm}_fixed_cpu_s"] = round(a[f"{arm}_cpu_s"] - slope * a["frames"], 2)
    _print_stage(report)
    return report


def _print_stage(report: dict[str, Any]) -> None:
    w = report["workers"]
    print(f"\n== the prepare stage end to end: 1 process ({report['one_process_threads']} threads) vs a LocalCluster "
          f"of {w} single-threaded workers (units of {report['unit_frames']}), {report['machine']} ==")  # fmt: skip
    print(f"  {'frames':>6} {'1-proc s':>9} {f'{w}-worker s':>11} {'ratio':>6} {'cores 1/N':>10} "
          f"{'CPU-s 1/N':>12} {'cluster s':>9}  load")  # fmt: skip
    for r in report["rows"]:
        print(f"  {r['frames']:>6} {r['one_wall_s']:>9.2f} {r['many_wall_s']:>11.2f} {r['ratio']:>5.2f}x "
              f"{r['one_cores']:>4.2f}/{r['many_cores']:<4.2f} {r['one_cpu_s']:>5.1f}/{r['many_cpu_s']:<6.1f} "
              f"{r['many_cluster_s']:>9.2f}  {r['load']}")  # fmt: skip
    if "one_cpu_ms_per_frame" in report:
        print(f"  CPU per frame: 1 process {report['one_cpu_ms_per_frame']} ms, {w} workers "
              f"{report['many_cpu_ms_per_frame']} ms; fixed CPU: {report['one_fixed_cpu_s']} s vs "
              f"{report['many_fixed_cpu_s']} s")  # fmt: skip
        bound = os.cpu_count() / max(r["one_cores"] for r in report["rows"])
        print(
            f"  bound on {os.cpu_count()} cores with equal work per frame: cores / cores the one process "
            f"already uses = {bound:.2f}x (target {TARGET_RATIO}x)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])

"""Prepare stage: DALI camera path vs a PIL + NumPy baseline, time per part, memory vs dataset size.

In:  the real KITTI frames (PNG, 1242x375) and the real nuScenes demo sample (6 JPEGs, 1600x900)
     of ../shared/data/real, replicated by symlinks to `--frames` frames each
     (`pfactory.prepare.replicate`; synthetic frames from `pfactory.synth` when the real
     files are absent). Default params (416x128 model input).
Out: printed tables (and `--json FILE`):
  1. camera path on the same images, same threads (`--threads`, default 2), side by side:
     DALI (decode, resize, pad, normalize, CHW float16), the PIL + NumPy baseline doing
     identical work in a thread pool (`pfactory.prepare.camera.pil_reference`), and the decode-only
     ceiling of the same images (DALI and PIL, the faster counts); img/s, frames/s, the ratios
     DALI / baseline and DALI / ceiling. PNG (KITTI) and JPEG (nuScenes) separately. Also
     where the time goes beyond decoding, in CPU ms per image: DALI decode-only, decode +
     resize (`dali_decode_resize`) and the full pipeline, so resize and normalize+pad+CHW+fp16
     are differences; PIL + NumPy per part (decode, resize, normalize+pad+fp16) in one
     thread (`pil_parts`). Each
     measurement is repeated `--repeats` times, interleaved, and the median is reported (the
     machine is shared: `load` is the 1-minute load average around the run);
  2. the whole stage (`prepare_dataset`) on the same frames: frames/s and seconds per part --
     read (validate + read), decode and resize (+pad/normalize) (the camera time split by the
     decode-only / full ratio of table 1), lidar, write, hash;
  3. the lidar transform, NumPy (used) vs DALI `fn.coord_transform` vs torch, per frame;
  4. with `--rss`, peak RSS of `prepare_dataset` on 200 vs 2000 KITTI frames, each in a fresh
     subprocess (VmHWM), and the growth (target < 20 %);
  5. on a CUDA machine, the DALI GPU path (mixed decode) next to the CPU paths.
Targets (2 cores): DALI >= 1.25x the 2-thread baseline, >= 80 % of the decode-only ceiling.

Run: `python benchmarks/bench_prepare.py [--frames 200] [--formats png,jpeg] [--rss] [--json out.json]`
(also `factory bench prepare`, via `main(argv)`). `--dask`: the scale-out benchmark instead, 1 vs N Dask
workers on the same frames (benchmarks/prepare_scaleout.py, its own options).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests.conftest` builds the nuScenes tables around the real files

from raw_datasets import build_datasets  # noqa: E402  (this folder: the benchmarks share it)

from pfactory.prepare.camera import CameraPipeline, ResizeGeometry, pil_reference, resize_geometry  # noqa: E402
from pfactory.prepare.params import PrepareParams  # noqa: E402

TARGET_VS_BASELINE = 1.25
TARGET_VS_CEILING = 0.80
TARGET_RSS_GROWTH = 0.20


def camera_inputs(raw: Path, params: PrepareParams) -> tuple[list[bytes], list[ResizeGeometry], int]:
    """Encoded images of every (frame, camera) pair of `raw`, their geometry, and frames."""
    from pfactory.sensors.datasets import open_dataset

    ds = open_dataset(raw)
    datas, geos = [], []
    ids = ds.frame_ids()
    for fid in ids:
        for cam in ds.read(fid, with_labels=False).cameras:
            datas.append(Path(cam.image_path).read_bytes())
            geos.append(resize_geometry(cam.image_size, tuple(params.image_size)))
    return datas, geos, len(ids)


# ----------------------------------------------------------------------------------------------
# Camera path measurements


def run_dali(
    datas: list[bytes],
    geos: list[ResizeGeometry],
    params: PrepareParams,
    threads: int,
    decode_only: bool,
    device: str = "cpu",
    resize_only: bool = False,
) -> tuple[float, float]:
    """(wall, CPU) seconds for all images through a DALI pipeline (built and warmed up first)."""
    cam = CameraPipeline(
        tuple(params.image_size),
        params.image_mean,
        params.image_std,
        params.batch_size,
        threads,
        device,
        decode_only,
        resize_only,
    )
    B = cam.batch_size
    sizes = [(g.out_h, g.out_w) for g in geos]
    cam.run(datas[:B], sizes[:B])  # build + warm-up
    c0, t0 = _cpu_seconds(), time.perf_counter()
    for i in range(0, len(datas), B):
        cam.run(datas[i : i + B], sizes[i : i + B])
    return time.perf_counter() - t0, _cpu_seconds() - c0


def run_pil(
    datas: list[bytes], geos: list[ResizeGeometry], params: PrepareParams, threads: int, decode_only: bool
) -> tuple[float, float]:
    """(wall, CPU) seconds for all images through PIL + NumPy in a `threads`-thread pool."""
    from PIL import Image

    W, H = params.image_size

    def full(i: int) -> np.ndarray:
        # float16 CHW like DALI's output, so both sides produce the same thing
        return pil_reference(datas[i], geos[i], (W, H), params.image_mean, params.image_std).astype(
            np.float16
        )

    def decode(i: int) -> None:
        with Image.open(io.BytesIO(datas[i])) as im:
            im.load()

    fn = decode if decode_only else full
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(min(8, len(datas)))))  # warm-up
        c0, t0 = _cpu_seconds(), time.perf_counter()
        list(pool.map(fn, range(len(datas))))
        return time.perf_counter() - t0, _cpu_seconds() - c0


def pil_parts(datas: list[bytes], geos: list[ResizeGeometry], params: PrepareParams, n: int = 48) -> dict:
    """CPU ms per image of each part of `pil_reference` (+ its fp16 cast), in one thread.

    The same steps as `pil_reference`, timed apart on the first `n` images (thread CPU time,
    so the load of a shared machine does not count).
    """
    from PIL import Image

    W, H = params.image_size
    m = np.asarray(params.image_mean, dtype=np.float32) * 255.0
    inv = 1.0 / (np.asarray(params.image_std, dtype=np.float32) * 255.0)
    t = {"decode": 0.0, "resize": 0.0, "normalize+pad+fp16": 0.0}
    k = min(n, len(datas))
    for d, g in zip(datas[:k], geos[:k]):
        c0 = time.thread_time()
        with Image.open(io.BytesIO(d)) as im:
            rgb = im.convert("RGB")
        c1 = time.thread_time()
        small = rgb.resize((g.out_w, g.out_h), Image.BILINEAR)
        c2 = time.thread_time()
        a = np.asarray(small, dtype=np.float32)
        out = np.zeros((3, H, W), dtype=np.float32)
        out[:, : g.out_h, : g.out_w] = ((a - m) * inv).transpose(2, 0, 1)
        out.astype(np.float16)
        c3 = time.thread_time()
        t["decode"] += c1 - c0
        t["resize"] += c2 - c1
        t["normalize+pad+fp16"] += c3 - c2
    return {key: round(v / k * 1e3, 2) for key, v in t.items()}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (robust to a shared machine)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def camera_table(datas, geos, n_frames, params, threads, repeats, gpu) -> dict:
    """Median seconds of each path (interleaved repeats) -> rates and ratios."""
    paths = {
        "dali": lambda: run_dali(datas, geos, params, threads, False),
        "pil_numpy": lambda: run_pil(datas, geos, params, threads, False),
        "dali_decode_only": lambda: run_dali(datas, geos, params, threads, True),
        "pil_decode_only": lambda: run_pil(datas, geos, params, threads, True),
        "dali_decode_resize": lambda: run_dali(datas, geos, params, threads, False, resize_only=True),
    }
    if gpu:
        paths["dali_gpu"] = lambda: run_dali(datas, geos, params, threads, False, "gpu")
        paths["dali_gpu_decode_only"] = lambda: run_dali(datas, geos, params, threads, True, "gpu")
    secs: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(repeats):
        for k, f in paths.items():
            wall, cpu_s = f()  # the timed loop only (pipeline build and warm-up excluded)
            secs[k].append(wall)
            cpu[k].append(cpu_s)
    med = {k: statistics.median(v) for k, v in secs.items()}
    n = len(datas)
    out = {
        k: {
            "seconds": round(s, 3),
            "img_per_s": round(n / s, 1),
            "frames_per_s": round(n_frames / s, 1),
            "cpu_ms_per_img": round(statistics.median(cpu[k]) / n * 1e3, 2),
            "runs_s": [round(x, 3) for x in secs[k]],
        }
        for k, s in med.items()
    }
    ceiling = min(med["dali_decode_only"], med["pil_decode_only"])
    out["ratio_dali_vs_pil"] = round(med["pil_numpy"] / med["dali"], 3)
    out["ratio_dali_vs_decode_ceiling"] = round(ceiling / med["dali"], 3)
    # The same ratios in CPU time per image: what the throughput ratio is on cores no one else
    # uses (the wall-clock ratios above move with the load of a shared machine).
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    out["cpu_ratio_dali_vs_pil"] = round(cmed["pil_numpy"] / cmed["dali"], 3)
    out["cpu_ratio_dali_vs_decode_ceiling"] = round(
        min(cmed["dali_decode_only"], cmed["pil_decode_only"]) / cmed["dali"], 3
    )
    # Where DALI's time goes beyond decoding (CPU ms per image, differences of the medians).
    per = {k: cmed[k] / n * 1e3 for k in ("dali_decode_only", "dali_decode_resize", "dali")}
    out["dali_parts_cpu_ms"] = {
        "decode": round(per["dali_decode_only"], 2),
        "resize": round(per["dali_decode_resize"] - per["dali_decode_only"], 2),
        "normalize+pad+CHW+fp16": round(per["dali"] - per["dali_decode_resize"], 2),
    }
    out["pil_parts_cpu_ms"] = pil_parts(datas, geos, params)
    out["images"] = n
    out["frames"] = n_frames
    if gpu:
        out["ratio_gpu_vs_dali_cpu"] = round(med["dali"] / med["dali_gpu"], 2)
        out["ratio_gpu_vs_pil"] = round(med["pil_numpy"] / med["dali_gpu"], 2)
    return out


# ----------------------------------------------------------------------------------------------
# Whole stage, lidar transform, memory


def stage_table(raw: Path, params: PrepareParams, cam: dict, work: Path) -> dict:
    from pfactory.prepare.stage import prepare_dataset

    res = prepare_dataset(raw, work / f"prepared_{raw.name}", params)
    m = res.metrics
    # Per part, in thread-seconds of the stage's own timers (the read workers and the main
    # thread), and for the camera the CPU-seconds of DALI on these images from table 1, split
    # into decode and resize+pad+normalize by the decode-only pipeline. The parts overlap in
    # time (workers, main thread and DALI run concurrently), so they add up to more than the wall.
    n_img = cam["images"]
    dp = cam["dali_parts_cpu_ms"]
    parts = {
        "read (validate + read, workers)": m["seconds_read"],
        "decode (DALI CPU)": dp["decode"] * n_img / 1e3,
        "resize (DALI CPU)": max(dp["resize"], 0.0) * n_img / 1e3,
        "normalize+pad+CHW+fp16 (DALI CPU)": max(dp["normalize+pad+CHW+fp16"], 0.0) * n_img / 1e3,
        "lidar (workers)": m["seconds_lidar"],
        "write (main)": m["seconds_write"],
        "hash inputs + shards": m["seconds_hash"],
        "main thread waiting for reads": m["seconds_read_wait"],
        "main thread waiting for DALI": m["seconds_camera_wait"],
    }
    shard_bytes = sum(s["bytes"] for sp in res.manifest["splits"].values() for s in sp["shards"])
    shutil.rmtree(work / f"prepared_{raw.name}", ignore_errors=True)
    return {
        "frames": m["frames_total"],
        "rejected": m["frames_rejected"],
        "seconds_total": round(m["seconds_total"], 2),
        "frames_per_s": round(m["frames_per_s"], 1),
        "parts_s": {k: round(v, 3) for k, v in parts.items()},
        "shard_mib": round(shard_bytes / 2**20, 1),
    }


def lidar_transform_table(raw: Path, repeats: int = 5) -> dict:
    """ms/frame of the sensor -> reference transform of the real sweeps, three ways."""
    import torch
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    from pfactory.prepare.lidar import transform_xyz
    from pfactory.sensors.datasets import open_dataset

    ds = open_dataset(raw)
    sweeps = [ds.read(f, with_labels=False).points for f in ds.frame_ids()[:16]]
    th = 0.3
    T = np.eye(4)
    T[:3, :3] = [[np.cos(th), -np.sin(th), 0], [np.sin(th), np.cos(th), 0], [0, 0, 1]]
    R32 = T[:3, :3].astype(np.float32)
    pipe = Pipeline(
        batch_size=len(sweeps), num_threads=2, device_id=None, exec_async=False, exec_pipelined=False
    )
    with pipe:
        p = fn.external_source(name="p", dtype=types.FLOAT, ndim=2)
        M = fn.external_source(name="M", dtype=types.FLOAT, ndim=2)
        pipe.set_outputs(fn.cat(fn.coord_transform(p[:, 0:3], M=M), p[:, 3:4], axis=1))
    pipe.build()

    def dali() -> None:
        pipe.feed_input("p", sweeps)
        pipe.feed_input("M", [R32] * len(sweeps))
        (o,) = pipe.run()
        [np.array(o[i]) for i in range(len(sweeps))]

    def numpy_cols() -> None:
        for q in sweeps:
            transform_xyz(q, T)

    def torch_mm() -> None:
        Rt = torch.from_numpy(R32.T.copy())
        for q in sweeps:
            tq = torch.from_numpy(q)
            torch.cat([tq[:, :3] @ Rt, tq[:, 3:]], 1)

    out = {}
    for name, f in (
        ("numpy_columns (used)", numpy_cols),
        ("dali_coord_transform", dali),
        ("torch_matmul", torch_mm),
    ):
        f()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            times.append((time.perf_counter() - t0) / len(sweeps) * 1e3)
        out[name] = round(statistics.median(times), 2)
    out["points_per_sweep"] = int(np.mean([len(s) for s in sweeps]))
    return out


def _rss_child(raw: str, out: str) -> None:
    """Subprocess body: prepare `raw` and print the peak RSS (VmHWM, KiB) as JSON."""
    from pfactory.prepare.stage import prepare_dataset

    res = prepare_dataset(raw, out, PrepareParams())
    hwm = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    print(
        json.dumps(
            {"vmhwm_kib": hwm, "frames": res.metrics["frames_total"], "seconds": res.metrics["seconds_total"]}
        )
    )


def rss_table(work: Path, sizes: tuple[int, ...] = (200, 2000)) -> dict:
    from pfactory.prepare.replicate import replicate_kitti

    real = Path(os.environ.get("PFACTORY_REAL_DATA", ROOT.parent / "shared/data/real")) / "kitti"
    src = real if real.is_dir() else work / "synth_kitti"
    out = {}
    for n in sizes:
        raw = replicate_kitti(src, work / f"rss_kitti_{n}", n)
        proc = subprocess.run(
            [sys.executable, __file__, "--rss-child", str(raw), str(work / f"rss_out_{n}")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        out[n] = {"peak_rss_mib": round(r["vmhwm_kib"] / 1024, 1), "seconds": round(r["seconds"], 1)}
        shutil.rmtree(work / f"rss_out_{n}", ignore_errors=True)
        shutil.rmtree(work / f"rss_kitti_{n}", ignore_errors=True)
    a, b = out[sizes[0]]["peak_rss_mib"], out[sizes[-1]]["peak_rss_mib"]
    out["growth"] = round(b / a - 1, 3)
    return out


# ----------------------------------------------------------------------------------------------


def _print(report: dict) -> None:
    print(
        f"\n== camera path ({report['threads']} threads, load {report['load_before']} -> {report['load_after']}) =="
    )
    for fmt, t in report["camera"].items():
        print(f"{fmt.upper()}: {t['images']} images of {t['frames']} frames")
        for k in (
            "dali",
            "pil_numpy",
            "dali_decode_only",
            "dali_decode_resize",
            "pil_decode_only",
            "dali_gpu",
            "dali_gpu_decode_only",
        ):
            if k in t:
                print(
                    f"  {k:22s} {t[k]['img_per_s']:8.1f} img/s {t[k]['frames_per_s']:8.1f} frames/s "
                    f"{t[k]['cpu_ms_per_img']:6.2f} CPU ms/img  runs {t[k]['runs_s']}"
                )
        ok1 = "ok" if t["ratio_dali_vs_pil"] >= TARGET_VS_BASELINE else "BELOW TARGET"
        ok2 = "ok" if t["ratio_dali_vs_decode_ceiling"] >= TARGET_VS_CEILING else "BELOW TARGET"
        print(
            f"  DALI / PIL+NumPy       {t['ratio_dali_vs_pil']:.2f}x wall (target {TARGET_VS_BASELINE}x: {ok1}), "
            f"{t['cpu_ratio_dali_vs_pil']:.2f}x CPU"
        )
        print(
            f"  DALI / decode ceiling  {t['ratio_dali_vs_decode_ceiling']:.0%} wall (target {TARGET_VS_CEILING:.0%}: {ok2}), "
            f"{t['cpu_ratio_dali_vs_decode_ceiling']:.0%} CPU"
        )
        print(
            "  CPU ms/img by part     DALI "
            + ", ".join(f"{k} {v}" for k, v in t["dali_parts_cpu_ms"].items())
        )
        print(
            "                         PIL  " + ", ".join(f"{k} {v}" for k, v in t["pil_parts_cpu_ms"].items())
        )
    print("\n== whole stage (prepare_dataset, default params) ==")
    for fmt, s in report["stage"].items():
        print(
            f"{fmt.upper()}: {s['frames']} frames in {s['seconds_total']} s = {s['frames_per_s']} frames/s, shards {s['shard_mib']} MiB"
        )
        for k, v in s["parts_s"].items():
            print(f"  {k:38s} {v:8.3f} s")
    if "lidar_transform" in report:
        print("\n== lidar transform, ms/frame ==")
        print("  " + ", ".join(f"{k}: {v}" for k, v in report["lidar_transform"].items()))
    if "rss" in report:
        r = report["rss"]
        print("\n== peak RSS, prepare in a fresh process (KITTI) ==")
        for k, v in r.items():
            if k != "growth":
                print(f"  {k} frames: {v['peak_rss_mib']} MiB ({v['seconds']} s)")
        print(f"  growth {r['growth']:.1%} (target < {TARGET_RSS_GROWTH:.0%})")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--dask" in argv:  # the scale-out benchmark (benchmarks/prepare_scaleout.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import prepare_scaleout

        return prepare_scaleout.main([a for a in argv if a != "--dask"])
    ap = argparse.ArgumentParser(prog="bench_prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=200, help="frames per format (>= 200 for the targets)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rss", action="store_true", help="also peak RSS on 200 vs 2000 frames (~2 min)")
    ap.add_argument(
        "--parts",
        default="camera,stage,lidar",
        help="comma-separated subset of camera,stage,lidar (rss: --rss)",
    )
    ap.add_argument(
        "--formats",
        default="png,jpeg",
        help="comma-separated subset of png (KITTI), jpeg (nuScenes): one per run keeps runs short",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--rss-child", nargs=2, metavar=("RAW", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child:
        _rss_child(*args.rss_child)
        return {}
    from pfactory.prepare.camera import cuda_device_count

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    work.mkdir(parents=True, exist_ok=True)
    params = PrepareParams(num_threads=args.threads, device="cpu")
    gpu = cuda_device_count() > 0
    report: dict = {
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "threads": args.threads,
        "load_before": round(os.getloadavg()[0], 2),
        "gpu": gpu,
        "camera": {},
        "stage": {},
    }
    parts = set(args.parts.split(","))
    try:
        raws = build_datasets(work, args.frames) if parts & {"camera", "stage", "lidar"} else {}
        formats = set(args.formats.split(","))
        for fmt, raw in raws.items():
            if fmt not in formats:
                continue
            if parts & {"camera", "stage"}:
                datas, geos, n = camera_inputs(raw, params)
                report["camera"][fmt] = camera_table(datas, geos, n, params, args.threads, args.repeats, gpu)
            if "stage" in parts:
                report["stage"][fmt] = stage_table(raw, params, report["camera"][fmt], work)
        if "lidar" in parts:
            report["lidar_transform"] = lidar_transform_table(raws["png"])
        if args.rss:
            report["rss"] = rss_table(work)
        report["load_after"] = round(os.getloadavg()[0], 2)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])

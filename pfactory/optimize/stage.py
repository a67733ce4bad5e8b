"""Optimize: a trained detector -> production artifacts + evidence of parity and speed (the work of the
optimize stage, `tasks/optimize.py`, which lists the files).

`optimize(opt, model_dir, data, out, backend, precision, active)`: 1. export one ONNX graph (points +
images -> boxes); 2. ONNX Runtime FP32 and (precision int8) static INT8 from the rewritten graph, and
(`optimize.aoti.enabled`) the AOTInductor package; 3. a TensorRT engine (backend tensorrt), self-checked
on this GPU against ONNX Runtime FP32 of the export on two held-out frames: a failed engine is refused and
deleted before parity (`refuse_failed_engine`); 4. parity
of every artifact vs PyTorch on held-out frames: an artifact outside its gate is refused and removed while
the FP32 artifact passes (`_fallback`: the stage ships what passed, primary the first artifact that passed
(ONNX Runtime FP32) when the asked one was refused, and says so in backend.json "selection", parity.json
"refused"/"fallback", on stderr and as MLflow tags `optimize.shipped` / `optimize.fallback`);
`ParityError` only when the FP32 artifact fails too
(the export itself is wrong: nothing is written to `out`, the report is kept as
`<out>.parity-failed.json`); 5. latency, PyTorch eager interleaved, and
the primary (backend auto on CPU with AOTInductor enabled: the fastest artifact, `_choose_primary`); 6. backend.json with the
sha256 of every file and the stage's time split (`timings_s`, also printed). `out` is built in a
temporary sibling and renamed into place on success.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from pfactory.optimize.errors import BackendUnavailable, ParityError
from pfactory.optimize.params import OptimizeParams
from pfactory.runtime.progress import emit as emit_progress
from pfactory.storage.fsutil import atomic_directory, atomic_write_json, sha256_file

ORT_PRECISIONS = ("fp32", "int8")


def check_combination(backend: str, precision: str) -> None:
    if backend == "aoti" and precision != "fp32":
        raise BackendUnavailable(
            f"precision {precision!r} is not built for AOTInductor (fp32 only): use --precision fp32, or backend "
            "auto with optimize.aoti.enabled to weigh it against the ONNX Runtime INT8 artifact"
        )
    if backend == "onnxruntime" and precision not in ORT_PRECISIONS:
        raise BackendUnavailable(
            f"precision {precision!r} is not built for ONNX Runtime (fp32 | int8): its CPU kernels have no fast "
            "FP16 path; use --backend tensorrt on a GPU machine, or --precision fp32 / int8"
        )


def _threads(opt: OptimizeParams) -> int:
    return opt.intra_op_threads or os.cpu_count() or 1


def _flat_metrics(
    parity: dict[str, Any], latency: dict[str, Any] | None, timings: dict[str, float]
) -> dict[str, float]:
    """MLflow scalars, named like the train stage's: parity/<artifact>/<metric>, latency/batch_<b>/<runner>/<stat>,
    speedup/batch_<b>/<runner> (p50 of eager / p50 of runner), time/<step>_s."""
    out: dict[str, float] = {f"time/{k}": round(v, 3) for k, v in timings.items()}
    for name, a in {**parity["artifacts"], **parity.get("refused", {})}.items():
        key = name.replace("/", "_")
        if "metrics" not in a:  # refused before parity (an engine that failed its self-check)
            out[f"parity/{key}/passed"] = 0.0
            continue
        m = a["metrics"]
        vals = {
            "match_rate": m["match_rate"],
            "boxes_max_abs_diff": m["boxes"]["max_abs_diff"],
            "boxes_max_rel_diff": m["boxes"]["max_rel_diff"],
            "boxes_cosine": m["boxes"]["cosine"],
            "yaw_max_abs_diff": m["yaw"]["max_abs_diff"],
            "yaw_p99_abs_diff": m["yaw"].get("p99_abs_diff"),
            "boxes_tolerance_ratio": m["boxes"]["tolerance_ratio"],
            "yaw_tolerance_ratio": m["yaw"]["tolerance_ratio"],
            "scores_tolerance_ratio": m["scores"]["tolerance_ratio"],
            "scores_max_abs_diff": m["scores"]["max_abs_diff"],
            "scores_max_rel_diff": m["scores"]["max_rel_diff"],
            "scores_cosine": m["scores"]["cosine"],
            "repeat_max_abs_diff": (
                max(m["repeatability"]["boxes_max_abs_diff"], m["repeatability"]["scores_max_abs_diff"])
                if m.get("repeatability")
                else None
            ),
            "passed": float(a["passed"]),
        }
        out.update({f"parity/{key}/{k}": float(v) for k, v in vals.items() if v is not None})
    if latency is not None:
        for batch, runners in latency.items():
            if not batch.startswith("batch_"):
                continue
            for name, s in runners.items():
                key = name.replace("/", "_")
                for stat in ("p50_ms", "p95_ms", "p99_ms", "throughput_fps"):
                    out[f"latency/{batch}/{key}/{stat}"] = float(s[stat])
        for batch, ratios in latency.get("speedup_vs_eager", {}).items():
            for name, r in ratios.items():
                out[f"speedup/{batch}/{name.replace('/', '_')}"] = float(r)
    return out


def log_mlflow(out_dir: Path, metrics: dict[str, float], hashes: dict[str, str]) -> None:
    import mlflow

    mlflow.log_metrics(metrics)
    mlflow.log_dict(hashes, "optimized/sha256.json")
    mlflow.log_artifacts(str(out_dir), artifact_path="optimized")


def optimize(
    opt: OptimizeParams,
    model_dir: Path,
    data: Path,
    out: Path,
    backend: str,
    precision: str | None,
    active: Any,
) -> dict[str, Any]:
    """Build `out` from `model_dir` (module docstring); the metrics. `backend`/`precision` override
    `opt.backend`/`opt.precision` (None/"auto" = from params); `active`: the MLflow run to log to, or None."""
    import torch

    from pfactory.detectors.io import WEIGHTS, load_model
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.calibration import load_feeds
    from pfactory.optimize.export import OUTPUT_NAMES, export_onnx
    from pfactory.optimize.export_cache import cache_dir as export_cache_dir
    from pfactory.optimize.latency import EAGER, measure_latency
    from pfactory.optimize.ort_backend import save_optimized_fp32, write_rewritten
    from pfactory.optimize.parity import compare_outputs, parity_report, report_failures
    from pfactory.optimize.runtime import TorchRunner, open_runner, resolve_backend
    from pfactory.optimize.sensitivity import REPORT as SENSITIVITY
    from pfactory.optimize.sensitivity import build_int8, format_report
    from pfactory.runtime.lineage import package_versions

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    device = opt.device
    requested = backend if backend not in (None, "auto") else opt.backend
    backend = resolve_backend(requested, device)
    precision = precision or opt.precision
    check_combination(backend, precision)
    # auto on a CPU machine with a second CPU backend built (optimize.aoti.enabled): the fastest artifact
    # passing parity is primary. Without one the asked precision stays primary: a choice by timing alone
    # would make the stage's output depend on the machine's load (ORT FP32 vs INT8 within noise on a tiny
    # model: seen flipping under a parallel test run).
    choose_fastest = requested == "auto" and backend == "onnxruntime" and opt.aoti.enabled
    build_aoti = backend == "aoti" or (choose_fastest and opt.aoti.enabled)
    threads = _threads(opt)
    torch_device = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    ort_device = "cpu" if device == "cpu" else "auto"

    model, model_config = load_model(model_dir, map_location="cpu")
    held = load_feeds(data, opt.parity.split, opt.parity.batch_size, opt.parity.frames, opt.num_threads)
    cameras = int(held.feeds[0]["images"].shape[1])
    if model_config.get("cameras") and len(model_config["cameras"]) != cameras:
        raise ValueError(
            f"{data}: frames have {cameras} cameras, the model was trained with {len(model_config['cameras'])}"
        )
    previous_timing_cache = out / mf.TRT_DIR / "timing.cache"
    previous_timing = previous_timing_cache.read_bytes() if previous_timing_cache.is_file() else None

    with atomic_directory(out, stage="optimize", inputs=(model_dir, data)) as tmp:
        # 1. export + checks
        emit_progress("optimize", phase="exporting ONNX")
        meta = {
            "pfactory.classes": model_config.get("classes", list(model.spec.classes)),
            "pfactory.image_size": list(model.spec.image_size),
            "pfactory.max_detections": model.max_detections,
            "pfactory.arch": model_config["arch"],
            "pfactory.outputs": mf.OUTPUT_CONTRACT,
        }
        exported = export_onnx(
            model, tmp / mf.ONNX_FILE, cameras=cameras, opset=opt.opset, dynamic_batch=opt.dynamic_batch,
            export_points=opt.export_points, metadata=meta, cache=export_cache_dir(),
        )  # fmt: skip
        timings["export_s"] = exported.export_s
        artifacts: list[dict[str, Any]] = []

        # 2. ONNX Runtime FP32 (always: the baseline of the export itself) and INT8, both from the
        #    exactly-rewritten graph (ScatterND rows, no size-1 sums: pfactory.optimize.graph_rewrite)
        emit_progress("optimize", phase="ONNX Runtime FP32 graph")
        t0 = time.perf_counter()
        ort_src = tmp / ".model.ort-rewritten.onnx"  # intermediate, removed below
        rewrites = write_rewritten(tmp / mf.ONNX_FILE, ort_src)
        fp32_src, fp32_rewrites = ort_src, rewrites
        if opt.ort.affine_conv:  # FP32 only: INT8 would profile each new depthwise conv as a candidate
            fp32_src = tmp / ".model.ort-affine.onnx"
            fp32_rewrites = write_rewritten(tmp / mf.ONNX_FILE, fp32_src, affine_conv=True)
        fp32_path = save_optimized_fp32(fp32_src, tmp / mf.ORT_DIR / "model.fp32.onnx")
        if fp32_src != ort_src:
            fp32_src.unlink()
        timings["ort_optimize_s"] = time.perf_counter() - t0
        artifacts.append({"backend": "onnxruntime", "precision": "fp32", "file": f"{mf.ORT_DIR}/{fp32_path.name}",
                          "graph_rewrites": fp32_rewrites,
                          "graph_optimization": "ORT_ENABLE_EXTENDED (saved); ORT_ENABLE_ALL at load"})  # fmt: skip
        calib = None
        sensitivity = None
        if precision == "int8":
            t0 = time.perf_counter()
            calib = load_feeds(
                data, opt.int8.calibration_split, 1, opt.int8.calibration_frames, opt.num_threads
            )
            timings["calibration_data_s"] = time.perf_counter() - t0
            # Calibration method, per-layer sensitivity and the layers kept float, measured on the
            # calibration frames (pfactory.optimize.sensitivity); TensorRT's INT8 reuses the choice.
            emit_progress("optimize", phase=f"INT8 quantization, {opt.int8.calibration_frames} frames")
            q, sensitivity = build_int8(
                ort_src, tmp / mf.ORT_DIR / "model.int8.onnx", calib.feeds, opt.int8,
                score_threshold=opt.parity.agreement_score_threshold,
                match_distance_m=opt.parity.match_distance_m, threads=threads,
                cache_dir=tmp / mf.ORT_DIR, work_dir=tmp, previous_cache_dir=out / mf.ORT_DIR,
            )  # fmt: skip
            sensitivity["calibration_frame_ids"] = calib.all_frame_ids()
            atomic_write_json(tmp / mf.ORT_DIR / SENSITIVITY, sensitivity)
            print(format_report(sensitivity), file=sys.stderr)
            timings["quantize_s"] = q.quantize_s
            timings.update({f"int8_{k}_s": v for k, v in sensitivity.get("timings_s", {}).items()})
            if backend == "onnxruntime":
                artifacts.append({"backend": "onnxruntime", "precision": "int8", "file": f"{mf.ORT_DIR}/model.int8.onnx",
                                  "graph_rewrites": rewrites, "quantization": q.to_json(),
                                  "sensitivity": f"{mf.ORT_DIR}/{SENSITIVITY}",
                                  "calibration_frame_ids": calib.all_frame_ids()})  # fmt: skip
            else:  # the engine is the INT8 artifact; the ORT model was only the profile's by-product
                (tmp / mf.ORT_DIR / "model.int8.onnx").unlink()
        ort_src.unlink()  # not an artifact: model.fp32.onnx / model.int8.onnx are built from it

        # 2b. AOTInductor package (CPU): the same export path traced by torch.export, compiled ahead of time
        if build_aoti:
            from pfactory.optimize.aoti_backend import AOTI_DIR, BACKEND, build_aoti

            emit_progress("optimize", phase="AOTInductor FP32 package")
            aoti_file = f"{AOTI_DIR}/model.fp32.pt2"
            info = build_aoti(
                model, tmp / aoti_file, cameras=cameras, export_points=opt.export_points,
                dynamic_batch=exported.dynamic_batch, threads=threads,
                cache_dir=out.parent / ".cache" / "inductor",
            )  # fmt: skip
            timings["aoti_export_s"], timings["aoti_compile_s"] = info["export_s"], info["compile_s"]
            artifacts.append({"backend": BACKEND, "precision": "fp32", "file": aoti_file, "aoti": info})

        # 3. TensorRT engine (GPU machines)
        trt_meta = None
        refused_early: dict[str, Any] = {}  # parity.json "refused" entries of artifacts refused before parity
        if backend == "tensorrt":
            emit_progress("optimize", phase=f"building the TensorRT {precision} engine")
            entry = _build_tensorrt(
                opt, precision, tmp, exported, calib, previous_timing, sensitivity, held.feeds[:2]
            )
            timings["tensorrt_build_s"] = entry["build_s"]
            trt_meta = {**entry["metadata"], "selfcheck": entry["selfcheck"]}
            refused_early = refuse_failed_engine(entry, tmp)
            if not refused_early:
                artifacts.append(entry)

        # 4. parity vs PyTorch on held-out frames
        emit_progress("optimize", phase=f"parity vs PyTorch on {opt.parity.frames} held-out frames")
        t0 = time.perf_counter()
        eager = TorchRunner(model, torch_device, threads)
        reference = [eager.run(f) for f in held.feeds]
        # One session per artifact, for parity and then latency (the timed session is the gated one). No
        # spinning: ORT's idle threads would otherwise busy-wait into the next runner's turn when timed.
        runners = {
            a["backend"] + "/" + a["precision"]: open_runner(
                tmp / a["file"], a["backend"], a["precision"], ort_device, threads, spin=False
            )
            for a in artifacts
        }
        results = {}
        for name, r in runners.items():
            prec = name.split("/")[1]
            first = [r.run(f) for f in held.feeds]
            second = [r.run(f) for f in held.feeds]  # repeatability: a racing kernel differs run to run
            results[name] = {
                "precision": prec,
                "metrics": compare_outputs(
                    reference, first, opt.parity, getattr(opt.parity, prec), repeat=second
                ),
            }
        report = parity_report(
            results, opt.parity, held.all_frame_ids(), reference=f"pytorch eager ({torch_device})"
        )
        timings["parity_s"] = time.perf_counter() - t0
        fallback = None
        if not report["passed"] or refused_early:
            fallback = _fallback(report, f"{backend}/{precision}", refused_early)
            if fallback is None:  # the FP32 artifact (the export itself) failed: nothing ships
                if refused_early:
                    report["refused"] = {**report.get("refused", {}), **refused_early}
                kept = atomic_write_json(out.parent / f"{out.name}.parity-failed.json", report)
                if active is not None:
                    import mlflow

                    mlflow.log_dict(report, "optimized/parity-failed.json")
                    mlflow.log_metrics(_flat_metrics(report, None, timings))
                raise ParityError(report_failures(report), str(kept))
            for a in [a for a in artifacts if f"{a['backend']}/{a['precision']}" in report["refused"]]:
                (tmp / a["file"]).unlink()  # what was not gated through is not shipped
                artifacts.remove(a)
                runners.pop(f"{a['backend']}/{a['precision']}")
            print(f"optimize: {fallback['why']}", file=sys.stderr)
        atomic_write_json(tmp / mf.PARITY, report)

        # 5. latency, PyTorch eager in the same run, interleaved
        emit_progress("optimize", phase=f"latency at batch {', '.join(map(str, opt.latency.batch_sizes))}")
        t0 = time.perf_counter()
        timed = {EAGER: eager} if opt.latency.eager else {}
        timed.update(runners)  # what parity gated (minus what it refused), already loaded
        feeds_by_batch = {b: _latency_feeds(held, data, opt, b) for b in opt.latency.batch_sizes}
        latency = measure_latency(
            timed, feeds_by_batch,
            opt.latency.warmup, opt.latency.iterations,
            config={"threads": threads, "device": torch_device, "end_to_end": "padded points in, decoded boxes out"},
        )  # fmt: skip
        timings["latency_s"] = time.perf_counter() - t0
        atomic_write_json(tmp / mf.LATENCY, latency)

        # 5b. the primary artifact: the one asked for, or (auto on a CPU machine) the fastest that passed parity
        primary, selection = _choose_primary(backend, precision, artifacts, latency, choose_fastest)
        if fallback is not None:
            primary, selection = _fallback_primary(primary, selection, fallback, choose_fastest)

        # 6. manifest with the sha256 of every file
        hashes = mf.file_hashes(tmp)
        for a in artifacts:
            a["sha256"] = hashes[a["file"]]
            a["bytes"] = (tmp / a["file"]).stat().st_size
        timings["total_s"] = time.perf_counter() - t_start
        manifest = {
            "format": mf.FORMAT,
            "primary": primary,
            "selection": selection,
            "artifacts": artifacts,
            "onnx": {**exported.to_json(), "file": mf.ONNX_FILE, "sha256": hashes[mf.ONNX_FILE]},
            "model": {
                "dir": str(model_dir),
                "weights_sha256": sha256_file(model_dir / WEIGHTS),
                "arch": model_config["arch"],
                "plugin": model_config.get("plugin"),
                "classes": list(model.spec.classes),
                "image_size": list(model.spec.image_size),
                "cameras": cameras,
                "max_detections": model.max_detections,
                "inputs": list(model.deploy_inputs),
            },
            "outputs": {"names": list(OUTPUT_NAMES), "contract": mf.OUTPUT_CONTRACT},
            "files": hashes,
            "versions": package_versions(("torch", "onnx", "onnxruntime", "onnxscript", "tensorrt", "numpy")),
            "tensorrt": trt_meta,
            "timings_s": {k: round(v, 3) for k, v in timings.items()},
        }
        atomic_write_json(tmp / mf.MANIFEST, manifest)

    split = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in timings.items() if k != "total_s")
    split = split.replace("export ", f"export [traced graph: {exported.cache}] ", 1)
    print(f"optimize: {timings['total_s']:.1f} s ({split}); primary {primary['backend']}/{primary['precision']}"
          + (f": {selection['why']}" if "why" in selection else ""), file=sys.stderr)  # fmt: skip
    metrics: dict[str, Any] = _flat_metrics(report, latency, timings)
    if active is not None:
        log_mlflow(out, metrics, {**hashes, mf.MANIFEST: sha256_file(out / mf.MANIFEST)})
        import mlflow

        shipped = f"{primary['backend']}/{primary['precision']}"
        why = selection["why"] if fallback else "none"
        mlflow.set_tags({"optimize.shipped": shipped, "optimize.fallback": why[:5000]})
        metrics["mlflow_run_id"] = active.info.run_id
    if fallback is not None:
        metrics["parity/fallback"] = 1.0
    return metrics


def _latency_feeds(held: Any, data: Path, opt: OptimizeParams, batch: int) -> list[Any]:
    """The latency frames at `batch`: the first `batch * 4` frames of `opt.parity.split` in feeds of `batch`
    frames, rebatched from the parity frames `held` (a `FrameFeeds`) when it holds them, else read anew."""
    from pfactory.optimize.calibration import load_feeds, rebatch

    again = rebatch(held, batch, batch * 4)
    if again is not None:
        return again.feeds
    return load_feeds(data, opt.parity.split, batch, batch * 4, opt.num_threads).feeds


def refuse_failed_engine(entry: dict[str, Any], root: Path) -> dict[str, Any]:
    """A TensorRT engine whose self-check failed on this GPU (`entry`: `build_engine`'s manifest entry, its
    "file" relative to the optimized directory `root`) is not an artifact: its plan file is deleted and its
    parity.json "refused" entry returned, {"tensorrt/<precision>": {"precision", "failures": [why],
    "passed": False, "selfcheck"}}, for `_fallback`. {} (the file kept) when the engine verified or its
    check was skipped."""
    from pfactory.optimize.tensorrt_backend import selfcheck_failure

    why = selfcheck_failure(entry)
    if why is None:
        return {}
    (root / entry["file"]).unlink(missing_ok=True)
    name = f"{entry['backend']}/{entry['precision']}"
    refused = {
        "precision": entry["precision"],
        "failures": [why],
        "passed": False,
        "selfcheck": entry["selfcheck"],
    }
    return {name: refused}


def _fallback(
    report: dict[str, Any], asked: str, refused_early: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Ship what passed (module docstring): moves each failed artifact of `report` (parity.json) from
    "artifacts" to "refused", adds `refused_early` (artifacts refused before parity: `refuse_failed_engine`)
    there, sets "passed" (every shipped artifact passed) and "fallback"; returns the fallback record
    {"asked", "refused": {name: failures}, "shipped": [names], "why"}. None (report unchanged) when the ONNX
    Runtime FP32 artifact failed too: it is the export's own parity evidence, and an export that does not
    compute what PyTorch computes ships nothing."""
    arts = report["artifacts"]
    early = {n: a["failures"] for n, a in (refused_early or {}).items()}
    failed = {n: a["failures"] for n, a in arts.items() if not a["passed"]}
    if not (failed or early) or not arts.get("onnxruntime/fp32", {}).get("passed"):
        return None
    shipped = [n for n in arts if n not in failed]

    def first(items: dict[str, list[str]]) -> str:
        return "; ".join(
            f"{n}: {f[0]}" + (f" (+{len(f) - 1} more)" if len(f) > 1 else "") for n, f in items.items()
        )

    parts = [f"{', '.join(early)} refused before parity ({first(early)})"] if early else []
    parts += [f"{', '.join(failed)} failed parity ({first(failed)})"] if failed else []
    why = "; ".join(parts) + f"; shipping what passed: {', '.join(shipped)}"
    report["refused"] = {**(refused_early or {}), **{n: arts.pop(n) for n in failed}}
    report["passed"] = True
    report["fallback"] = {"asked": asked, "refused": {**early, **failed}, "shipped": shipped, "why": why}
    return report["fallback"]


def _fallback_primary(
    primary: dict[str, str], selection: dict[str, Any], fallback: dict[str, Any], choose_fastest: bool
) -> tuple[dict[str, str], dict[str, Any]]:
    """The primary and backend.json "selection" after `_fallback`: the asked primary when it was shipped (or
    `choose_fastest` already chose among what shipped), else the first shipped artifact (build order: ONNX
    Runtime FP32); "selection" gains "fallback" (with its "primary") and "why"; `fallback` gains "primary"."""
    selection = {**selection, "fallback": fallback}
    asked = f"{primary['backend']}/{primary['precision']}"
    if asked in fallback["refused"] and not choose_fastest:
        b, p = fallback["shipped"][0].split("/")
        primary = {"backend": b, "precision": p}
        how = "its self-check" if fallback["refused"][asked][0].startswith("self-check") else "parity"
        selection["rule"] = f"asked: {asked}, refused by {how}: {b}/{p}"
    shipped = f"{primary['backend']}/{primary['precision']}"
    fallback["primary"] = shipped
    selection["why"] = f"primary {shipped} because " + fallback["why"]
    return primary, selection


def _choose_primary(
    backend: str,
    precision: str,
    artifacts: list[dict[str, Any]],
    latency: dict[str, Any],
    choose_fastest: bool,
) -> tuple[dict[str, str], dict[str, Any]]:
    """The primary {backend, precision} and why (`backend.json` "selection").

    `choose_fastest` (backend auto on a CPU machine): every artifact built passed parity (else the stage
    stopped before), so the primary is the one with the lowest p50 at the smallest batch timed; ties keep
    build order (ONNX Runtime FP32, INT8, AOTInductor). Otherwise the asked backend and precision."""
    if not choose_fastest:
        return {"backend": backend, "precision": precision}, {"rule": f"asked: {backend}/{precision}"}
    batches = sorted(int(k.removeprefix("batch_")) for k in latency if k.startswith("batch_"))
    key = f"batch_{batches[0]}"
    p50 = {f"{a['backend']}/{a['precision']}": latency[key][f"{a['backend']}/{a['precision']}"]["p50_ms"]
           for a in artifacts}  # fmt: skip
    chosen = min(p50, key=lambda n: (p50[n], list(p50).index(n)))
    b, p = chosen.split("/")
    eager = latency[key].get("pytorch/eager", {}).get("p50_ms")
    why = (
        f"fastest p50 at batch {batches[0]} of the artifacts that passed parity: {chosen} {p50[chosen]:.2f} ms"
        + (f" ({eager / p50[chosen]:.2f}x eager)" if eager else "")
    )
    return {"backend": b, "precision": p}, {
        "rule": "auto: fastest p50 at the smallest batch timed, among the artifacts that passed parity",
        "batch": batches[0],
        "p50_ms": p50,
        "chosen": chosen,
        "why": why,
    }


def _build_tensorrt(
    opt: OptimizeParams, precision: str, tmp: Path, exported: Any, calib: Any, previous_timing: bytes | None,
    sensitivity: dict[str, Any] | None = None, check_feeds: list[Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The TensorRT engine of `precision` (tensorrt_backend's module docstring has the version split), its
    manifest entry with the self-check verdict on `check_feeds` against ONNX Runtime FP32 of the export
    (`tmp/model.onnx`).

    INT8 keeps the layers the sensitivity profile kept float (`sensitivity`, computed with ONNX Runtime
    on the calibration frames) out of INT8, in FP16, on both TensorRT generations."""
    import onnx

    from pfactory.optimize import manifest as mf
    from pfactory.optimize.ort_backend import quantize_int8
    from pfactory.optimize.tensorrt_backend import (
        TIMING_CACHE,
        OnnxSource,
        build_engine,
        cast_onnx_fp16,
        engine_spec,
        import_tensorrt,
        sensitivity_fp16_layers,
    )

    trt = import_tensorrt()
    trt_dir = tmp / mf.TRT_DIR
    trt_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = tmp / mf.ONNX_FILE
    fp16_layers = sensitivity_fp16_layers(onnx.load(str(onnx_path)), sensitivity, opt.int8.exclude_nodes)
    spec = engine_spec(
        opt, precision, trt.__version__, exported.inputs, max(opt.latency.batch_sizes), fp16_layers
    )
    source = onnx_path
    if spec.onnx_source == OnnxSource.FP16_CAST.value:
        source = cast_onnx_fp16(onnx_path, trt_dir / "model.fp16.onnx", opt.tensorrt.fp16_keep_fp32_op_types)
    elif spec.onnx_source == OnnxSource.INT8_QDQ.value:
        # TensorRT >= 11: explicit quantization; the calibrator choice becomes the QDQ calibration method,
        # the sensitivity choice the unquantized layers, and the float part runs in FP16.
        int8 = opt.int8.model_copy(update={"ort_method": opt.int8.calibrator, "exclude_op_types": []})
        qdq = trt_dir / "model.int8.qdq.fp32.onnx"
        kept = [layer["weight"] for layer in (sensitivity or {}).get("layers", [])
                if layer["name"] in set((sensitivity or {}).get("kept_float", []))]  # fmt: skip
        quantize_int8(
            onnx_path, qdq, calib.feeds, int8, for_tensorrt=True, cache_path=trt_dir / "calibration.json",
            work_dir=tmp, keep_float=kept,
        )  # fmt: skip
        keep32 = [*opt.tensorrt.fp16_keep_fp32_op_types, "QuantizeLinear", "DequantizeLinear"]
        source = cast_onnx_fp16(qdq, trt_dir / "model.int8.qdq.onnx", keep32)
        qdq.unlink()
    prev = None
    if previous_timing is not None:
        prev = tmp / ".previous-timing.cache"
        prev.write_bytes(previous_timing)
    entry = build_engine(
        source, spec, trt_dir, calib.feeds if calib is not None else None, prev,
        reference_onnx=onnx_path, check_feeds=check_feeds,
    )  # fmt: skip
    if prev is not None:
        prev.unlink()
    entry["file"] = f"{mf.TRT_DIR}/{entry['file']}"
    entry.update(
        {"backend": "tensorrt", "precision": precision, "timing_cache": f"{mf.TRT_DIR}/{TIMING_CACHE}"}
    )
    return entry

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
temporary sibling and renamed into place on success. Each backend's build (steps 2-3) is one function
behind one interface: `pfactory.optimize.backends`.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from pfactory.metrics.cut import DEFAULT_SCORE_THRESHOLD
from pfactory.optimize.backends import Build, build_artifacts, open_runners, refuse_failed_engine
from pfactory.optimize.errors import BackendUnavailable, ParityError
from pfactory.optimize.params import OptimizeParams
from pfactory.runtime.progress import emit as emit_progress
from pfactory.storage.fsutil import atomic_directory, atomic_write_json, sha256_file

ORT_PRECISIONS = ("fp32", "int8")
__all__ = ["ORT_PRECISIONS", "check_combination", "log_mlflow", "optimize", "refuse_failed_engine"]


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


# Imported up front, as one step: a missing dependency fails the stage before any work.
_STAGE_MODULES = (
    "torch", "pfactory.detectors.io", "pfactory.optimize.manifest", "pfactory.optimize.calibration",
    "pfactory.optimize.export", "pfactory.optimize.export_cache", "pfactory.optimize.latency",
    "pfactory.optimize.ort_backend", "pfactory.optimize.parity", "pfactory.optimize.runtime",
    "pfactory.optimize.sensitivity", "pfactory.runtime.lineage",
)  # fmt: skip


def optimize(
    opt: OptimizeParams,
    model_dir: Path,
    data: Path,
    out: Path,
    backend: str,
    precision: str | None,
    active: Any,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
) -> dict[str, Any]:
    """Build `out` from `model_dir` (module docstring); the metrics. `backend`/`precision` override
    `opt.backend`/`opt.precision` (None/"auto" = from params); `active`: the MLflow run to log to, or None;
    `score_threshold`: the parity comparison's detection cut (`evaluate.score_threshold`)."""
    for module in _STAGE_MODULES:
        importlib.import_module(module)
    b = _plan(opt, model_dir, data, out, backend, precision, active, score_threshold)
    _load(b)
    with atomic_directory(out, stage="optimize", inputs=(model_dir, data)) as tmp:
        b.tmp = tmp
        _export(b)  # 1. export + checks
        build_artifacts(b)  # 2. ONNX Runtime FP32 (+ INT8), 2b. AOTInductor, 3. TensorRT (backends.py)
        report, fallback, eager, runners = _gate(b)  # 4. parity vs PyTorch on held-out frames
        latency = _time(b, eager, runners)  # 5. latency, PyTorch eager in the same run, interleaved
        # 5b. the primary artifact: the one asked for, or (auto on a CPU machine) the fastest that passed parity
        primary, selection = _choose_primary(b.backend, b.precision, b.artifacts, latency, b.choose_fastest)
        if fallback is not None:
            primary, selection = _fallback_primary(primary, selection, fallback, b.choose_fastest)
        hashes = _write_manifest(b, primary, selection)  # 6. manifest with the sha256 of every file
    return _finish(b, report, latency, fallback, primary, selection, hashes)


def _plan(
    opt: OptimizeParams,
    model_dir: Path,
    data: Path,
    out: Path,
    backend: str,
    precision: str | None,
    active: Any,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
) -> Build:
    """The run `optimize` was asked for: backend and precision resolved and checked, what to build, where;
    `score_threshold` the parity comparison's detection cut."""
    import torch

    from pfactory.optimize.runtime import resolve_backend

    t_start = time.perf_counter()
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
    return Build(
        opt=opt, model_dir=model_dir, data=data, out=out, active=active, backend=backend,
        precision=precision, choose_fastest=choose_fastest,
        build_aoti=backend == "aoti" or (choose_fastest and opt.aoti.enabled), threads=_threads(opt),
        torch_device="cuda" if device != "cpu" and torch.cuda.is_available() else "cpu",
        ort_device="cpu" if device == "cpu" else "auto", t_start=t_start, cut=score_threshold,
    )  # fmt: skip


def with_float_modules(opt: OptimizeParams, model: Any) -> OptimizeParams:
    """`opt` with the detector's `int8_float_modules` (the contract's hook) added to `int8.exclude_nodes`
    after the user's own patterns (every INT8 build, ORT and TensorRT, reads `opt.int8`); `opt` itself as it
    is when the detector names none."""
    from pfactory.detectors.contract import int8_float_modules

    keep = [m for m in int8_float_modules(model) if m not in opt.int8.exclude_nodes]
    if not keep:
        return opt
    int8 = opt.int8.model_copy(update={"exclude_nodes": [*opt.int8.exclude_nodes, *keep]})
    return opt.model_copy(update={"int8": int8})


def _load(b: Build) -> None:
    """The trained model, the held-out (parity) frames, their camera count checked against the model's, and
    the previous output's TensorRT timing cache (if any) into `b`; the detector's `int8_float_modules`
    joined to `b.opt.int8.exclude_nodes` (the detector contract's hook)."""
    from pfactory.detectors.io import load_model
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.calibration import load_feeds

    opt = b.opt
    b.model, b.model_config = load_model(b.model_dir, map_location="cpu")
    b.opt = opt = with_float_modules(opt, b.model)
    b.held = load_feeds(b.data, opt.parity.split, opt.parity.batch_size, opt.parity.frames, opt.num_threads)
    b.cameras = int(b.held.feeds[0]["images"].shape[1])
    if b.model_config.get("cameras") and len(b.model_config["cameras"]) != b.cameras:
        raise ValueError(
            f"{b.data}: frames have {b.cameras} cameras, the model was trained with "
            f"{len(b.model_config['cameras'])}"
        )
    previous_timing_cache = b.out / mf.TRT_DIR / "timing.cache"
    b.previous_timing = previous_timing_cache.read_bytes() if previous_timing_cache.is_file() else None


def _export(b: Build) -> None:
    """One ONNX graph of the whole detector into `b.tmp` (`export.export_onnx`, checks included)."""
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.export import export_onnx
    from pfactory.optimize.export_cache import cache_dir as export_cache_dir

    opt, model = b.opt, b.model
    emit_progress("optimize", phase="exporting ONNX")
    meta = {
        "pfactory.classes": b.model_config.get("classes", list(model.spec.classes)),
        "pfactory.image_size": list(model.spec.image_size),
        "pfactory.max_detections": model.max_detections,
        "pfactory.arch": b.model_config["arch"],
        "pfactory.outputs": mf.OUTPUT_CONTRACT,
    }
    b.exported = export_onnx(
        model, b.tmp / mf.ONNX_FILE, cameras=b.cameras, opset=opt.opset, dynamic_batch=opt.dynamic_batch,
        export_points=opt.export_points, metadata=meta, cache=export_cache_dir(),
    )  # fmt: skip
    b.timings["export_s"] = b.exported.export_s


def _gate(b: Build) -> tuple[dict[str, Any], dict[str, Any] | None, Any, dict[str, Any]]:
    """Parity of every artifact vs PyTorch eager on the held-out frames, each run twice (repeatability);
    what failed is refused (`_ship_what_passed`); parity.json written. (report, fallback record or None,
    the eager runner, the runners of the artifacts shipped)."""
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.parity import compare_outputs, parity_report
    from pfactory.optimize.runtime import TorchRunner

    opt, held = b.opt, b.held
    emit_progress("optimize", phase=f"parity vs PyTorch on {opt.parity.frames} held-out frames")
    t0 = time.perf_counter()
    eager = TorchRunner(b.model, b.torch_device, b.threads)
    reference = [eager.run(f) for f in held.feeds]
    runners = open_runners(b)  # one session per artifact, for parity and then latency
    results = {}
    for name, r in runners.items():
        prec = name.split("/")[1]
        first = [r.run(f) for f in held.feeds]
        second = [r.run(f) for f in held.feeds]  # repeatability: a racing kernel differs run to run
        results[name] = {
            "precision": prec,
            "metrics": compare_outputs(
                reference, first, opt.parity, getattr(opt.parity, prec), repeat=second, score_threshold=b.cut
            ),
        }
    report = parity_report(
        results, opt.parity, held.all_frame_ids(), reference=f"pytorch eager ({b.torch_device})", score_threshold=b.cut
    )
    b.timings["parity_s"] = time.perf_counter() - t0
    fallback = None
    if not report["passed"] or b.refused_early:
        fallback = _ship_what_passed(b, report, runners)
    atomic_write_json(b.tmp / mf.PARITY, report)
    return report, fallback, eager, runners


def _ship_what_passed(b: Build, report: dict[str, Any], runners: dict[str, Any]) -> dict[str, Any]:
    """`_fallback` on a failed `report`: the refused artifacts' files, entries and runners removed, the why
    printed; the fallback record. `ParityError` (the report kept beside `b.out`, logged to the MLflow run)
    when the FP32 artifact, the export itself, failed too: nothing ships."""
    from pfactory.optimize.parity import report_failures

    fallback = _fallback(report, f"{b.backend}/{b.precision}", b.refused_early)
    if fallback is None:  # the FP32 artifact (the export itself) failed: nothing ships
        if b.refused_early:
            report["refused"] = {**report.get("refused", {}), **b.refused_early}
        kept = atomic_write_json(b.out.parent / f"{b.out.name}.parity-failed.json", report)
        if b.active is not None:
            import mlflow

            mlflow.log_dict(report, "optimized/parity-failed.json")
            mlflow.log_metrics(_flat_metrics(report, None, b.timings))
        raise ParityError(report_failures(report), str(kept))
    for a in [a for a in b.artifacts if f"{a['backend']}/{a['precision']}" in report["refused"]]:
        (b.tmp / a["file"]).unlink()  # what was not gated through is not shipped
        b.artifacts.remove(a)
        runners.pop(f"{a['backend']}/{a['precision']}")
    print(f"optimize: {fallback['why']}", file=sys.stderr)
    return fallback


def _time(b: Build, eager: Any, runners: dict[str, Any]) -> dict[str, Any]:
    """latency.json: PyTorch eager (`optimize.latency.eager`) and the runners parity gated, interleaved, at
    each batch size; written to `b.tmp` and returned."""
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.latency import EAGER, measure_latency

    opt = b.opt
    emit_progress("optimize", phase=f"latency at batch {', '.join(map(str, opt.latency.batch_sizes))}")
    t0 = time.perf_counter()
    timed = {EAGER: eager} if opt.latency.eager else {}
    timed.update(runners)  # what parity gated (minus what it refused), already loaded
    feeds_by_batch = {bs: _latency_feeds(b.held, b.data, opt, bs) for bs in opt.latency.batch_sizes}
    latency = measure_latency(
        timed, feeds_by_batch,
        opt.latency.warmup, opt.latency.iterations,
        config={"threads": b.threads, "device": b.torch_device, "end_to_end": "padded points in, decoded boxes out"},
    )  # fmt: skip
    b.timings["latency_s"] = time.perf_counter() - t0
    atomic_write_json(b.tmp / mf.LATENCY, latency)
    return latency


def _write_manifest(b: Build, primary: dict[str, str], selection: dict[str, Any]) -> dict[str, str]:
    """backend.json with the sha256 of every file in `b.tmp` (each artifact's too, and its size) and the
    stage's time split; the hashes."""
    from pfactory.detectors.io import WEIGHTS
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.export import OUTPUT_NAMES
    from pfactory.runtime.lineage import package_versions

    model, tmp = b.model, b.tmp
    hashes = mf.file_hashes(tmp)
    for a in b.artifacts:
        a["sha256"] = hashes[a["file"]]
        a["bytes"] = (tmp / a["file"]).stat().st_size
    b.timings["total_s"] = time.perf_counter() - b.t_start
    manifest = {
        "format": mf.FORMAT,
        "primary": primary,
        "selection": selection,
        "artifacts": b.artifacts,
        "onnx": {**b.exported.to_json(), "file": mf.ONNX_FILE, "sha256": hashes[mf.ONNX_FILE]},
        "model": {
            "dir": str(b.model_dir),
            "weights_sha256": sha256_file(b.model_dir / WEIGHTS),
            "arch": b.model_config["arch"],
            "plugin": b.model_config.get("plugin"),
            "classes": list(model.spec.classes),
            "image_size": list(model.spec.image_size),
            "cameras": b.cameras,
            "max_detections": model.max_detections,
            "inputs": list(model.deploy_inputs),
        },
        "outputs": {"names": list(OUTPUT_NAMES), "contract": mf.OUTPUT_CONTRACT},
        "files": hashes,
        "versions": package_versions(("torch", "onnx", "onnxruntime", "onnxscript", "tensorrt", "numpy")),
        "tensorrt": b.trt_meta,
        "timings_s": {k: round(v, 3) for k, v in b.timings.items()},
    }
    atomic_write_json(tmp / mf.MANIFEST, manifest)
    return hashes


def _finish(
    b: Build,
    report: dict[str, Any],
    latency: dict[str, Any],
    fallback: dict[str, Any] | None,
    primary: dict[str, str],
    selection: dict[str, Any],
    hashes: dict[str, str],
) -> dict[str, Any]:
    """The time split and the primary on stderr; the metrics (`_flat_metrics`), logged with the files and the
    shipped / fallback tags to the MLflow run `b.active` when there is one."""
    from pfactory.optimize import manifest as mf

    timings, out = b.timings, b.out
    split = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in timings.items() if k != "total_s")
    split = split.replace("export ", f"export [traced graph: {b.exported.cache}] ", 1)
    print(f"optimize: {timings['total_s']:.1f} s ({split}); primary {primary['backend']}/{primary['precision']}"
          + (f": {selection['why']}" if "why" in selection else ""), file=sys.stderr)  # fmt: skip
    metrics: dict[str, Any] = _flat_metrics(report, latency, timings)
    if b.active is not None:
        log_mlflow(out, metrics, {**hashes, mf.MANIFEST: sha256_file(out / mf.MANIFEST)})
        import mlflow

        shipped = f"{primary['backend']}/{primary['precision']}"
        why = selection["why"] if fallback else "none"
        mlflow.set_tags({"optimize.shipped": shipped, "optimize.fallback": why[:5000]})
        metrics["mlflow_run_id"] = b.active.info.run_id
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

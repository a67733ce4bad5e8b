"""The optimize stage's backends behind one interface (`pfactory.optimize.stage` runs them).

A `Backend` is a name, `wanted(b)` (does this run build it) and `build(b)`: it builds its artifact into the
stage's temporary output folder and appends its backend.json entry to `b.artifacts` and its step times to
`b.timings`, where `b` is the run's `Build` (the stage's inputs and what the steps so far produced).
`open_runners(b)` opens every artifact built, whatever its backend, through `runtime.open_runner` (one call
signature for every backend). `BACKENDS`, in build order (the order of backend.json "artifacts" and of the
ties of the fastest-artifact choice):
    onnxruntime/fp32  always: the export's own baseline, from the exactly-rewritten graph
    onnxruntime/int8  precision int8: calibration, the sensitivity profile, static INT8 QDQ from the same
                      rewritten graph; the profile is TensorRT INT8's too (the ORT model then is dropped)
    aoti/fp32         the AOTInductor package (backend aoti, or auto on a CPU with optimize.aoti.enabled)
    tensorrt          the engine of the stage's precision, self-checked on this GPU; refused if it failed
Intermediate files a backend leaves for the next (`b.scratch`) are removed once every backend is built.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.optimize.params import OptimizeParams
from pfactory.runtime.progress import emit as emit_progress
from pfactory.storage.fsutil import atomic_write_json


@dataclass
class Build:
    """One run of the optimize stage: what it was asked (`opt`, `backend`, `precision` resolved), what it
    loaded (`model`, `held`: the parity frames), and what its steps produced so far (`tmp`: the temporary
    output folder; `exported`, `artifacts`, `timings`, the INT8 calibration and sensitivity profile, the
    TensorRT metadata and an engine refused before parity)."""

    opt: OptimizeParams
    model_dir: Path
    data: Path
    out: Path
    active: Any
    backend: str
    precision: str
    choose_fastest: bool
    build_aoti: bool
    threads: int
    torch_device: str
    ort_device: str
    t_start: float
    cut: float  # the parity comparison's detection cut (`evaluate.score_threshold`)
    timings: dict[str, float] = field(default_factory=dict)
    model: Any = None
    model_config: dict[str, Any] = field(default_factory=dict)
    held: Any = None
    cameras: int = 0
    previous_timing: bytes | None = None
    tmp: Path = Path()
    exported: Any = None
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    scratch: list[Path] = field(default_factory=list)
    ort_src: Path = Path()
    rewrites: dict[str, Any] = field(default_factory=dict)
    calib: Any = None
    sensitivity: dict[str, Any] | None = None
    trt_meta: dict[str, Any] | None = None
    refused_early: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Backend:
    """One backend of the stage: `name`, `wanted(b)`: whether the run `b` builds it, `build(b)`: builds it."""

    name: str
    wanted: Callable[[Build], bool]
    build: Callable[[Build], None]


def build_ort_fp32(b: Build) -> None:
    """ONNX Runtime FP32, graph-optimized from the exactly-rewritten export (ScatterND rows, no size-1 sums:
    `graph_rewrite`), which it leaves at `b.ort_src` for INT8 (`b.scratch`: removed after every backend)."""
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.ort_backend import save_optimized_fp32, write_rewritten

    opt, tmp = b.opt, b.tmp
    emit_progress("optimize", phase="ONNX Runtime FP32 graph")
    t0 = time.perf_counter()
    ort_src = tmp / ".model.ort-rewritten.onnx"  # intermediate, removed once every backend is built
    rewrites = write_rewritten(tmp / mf.ONNX_FILE, ort_src)
    b.ort_src, b.rewrites = ort_src, rewrites
    b.scratch.append(ort_src)
    fp32_src, fp32_rewrites = ort_src, rewrites
    if opt.ort.affine_conv:  # FP32 only: INT8 would profile each new depthwise conv as a candidate
        fp32_src = tmp / ".model.ort-affine.onnx"
        fp32_rewrites = write_rewritten(tmp / mf.ONNX_FILE, fp32_src, affine_conv=True)
    fp32_path = save_optimized_fp32(fp32_src, tmp / mf.ORT_DIR / "model.fp32.onnx")
    if fp32_src != ort_src:
        fp32_src.unlink()
    b.timings["ort_optimize_s"] = time.perf_counter() - t0
    b.artifacts.append({"backend": "onnxruntime", "precision": "fp32", "file": f"{mf.ORT_DIR}/{fp32_path.name}",
                        "graph_rewrites": fp32_rewrites,
                        "graph_optimization": "ORT_ENABLE_EXTENDED (saved); ORT_ENABLE_ALL at load"})  # fmt: skip


def build_ort_int8(b: Build) -> None:
    """Static INT8 QDQ from `b.ort_src`: calibration method, per-layer sensitivity and the layers kept float,
    measured on the calibration frames (`sensitivity`), kept in `b.calib` / `b.sensitivity` for TensorRT's
    INT8; the ORT model is an artifact with backend onnxruntime, else only the profile's by-product."""
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.calibration import load_feeds
    from pfactory.optimize.sensitivity import REPORT as SENSITIVITY
    from pfactory.optimize.sensitivity import build_int8, format_report

    opt, tmp = b.opt, b.tmp
    t0 = time.perf_counter()
    calib = load_feeds(b.data, opt.int8.calibration_split, 1, opt.int8.calibration_frames, opt.num_threads)
    b.timings["calibration_data_s"] = time.perf_counter() - t0
    emit_progress("optimize", phase=f"INT8 quantization, {opt.int8.calibration_frames} frames")
    q, sensitivity = build_int8(
        b.ort_src, tmp / mf.ORT_DIR / "model.int8.onnx", calib.feeds, opt.int8,
        score_threshold=opt.parity.agreement_score_threshold,
        match_distance_m=opt.parity.match_distance_m, threads=b.threads,
        cache_dir=tmp / mf.ORT_DIR, work_dir=tmp, previous_cache_dir=b.out / mf.ORT_DIR,
    )  # fmt: skip
    sensitivity["calibration_frame_ids"] = calib.all_frame_ids()
    atomic_write_json(tmp / mf.ORT_DIR / SENSITIVITY, sensitivity)
    print(format_report(sensitivity), file=sys.stderr)
    b.timings["quantize_s"] = q.quantize_s
    b.timings.update({f"int8_{k}_s": v for k, v in sensitivity.get("timings_s", {}).items()})
    b.calib, b.sensitivity = calib, sensitivity
    if b.backend == "onnxruntime":
        b.artifacts.append({"backend": "onnxruntime", "precision": "int8", "file": f"{mf.ORT_DIR}/model.int8.onnx",
                            "graph_rewrites": b.rewrites, "quantization": q.to_json(),
                            "sensitivity": f"{mf.ORT_DIR}/{SENSITIVITY}",
                            "calibration_frame_ids": calib.all_frame_ids()})  # fmt: skip
    else:  # the engine is the INT8 artifact; the ORT model was only the profile's by-product
        (tmp / mf.ORT_DIR / "model.int8.onnx").unlink()


def build_aoti_package(b: Build) -> None:
    """The AOTInductor FP32 package (CPU): the export path traced by torch.export, compiled ahead of time."""
    from pfactory.optimize.aoti_backend import AOTI_DIR, BACKEND, build_aoti

    emit_progress("optimize", phase="AOTInductor FP32 package")
    aoti_file = f"{AOTI_DIR}/model.fp32.pt2"
    info = build_aoti(
        b.model, b.tmp / aoti_file, cameras=b.cameras, export_points=b.opt.export_points,
        dynamic_batch=b.exported.dynamic_batch, threads=b.threads,
        cache_dir=b.out.parent / ".cache" / "inductor",
    )  # fmt: skip
    b.timings["aoti_export_s"], b.timings["aoti_compile_s"] = info["export_s"], info["compile_s"]
    b.artifacts.append({"backend": BACKEND, "precision": "fp32", "file": aoti_file, "aoti": info})


def build_tensorrt(b: Build) -> None:
    """The TensorRT engine of the stage's precision (GPU machines), self-checked on two held-out frames: its
    metadata in `b.trt_meta`; an engine that failed its check is refused (`refuse_failed_engine`, into
    `b.refused_early`), not an artifact."""
    emit_progress("optimize", phase=f"building the TensorRT {b.precision} engine")
    entry = build_tensorrt_engine(
        b.opt, b.precision, b.tmp, b.exported, b.calib, b.previous_timing, b.sensitivity, b.held.feeds[:2]
    )
    b.timings["tensorrt_build_s"] = entry["build_s"]
    b.trt_meta = {**entry["metadata"], "selfcheck": entry["selfcheck"]}
    b.refused_early = refuse_failed_engine(entry, b.tmp)
    if not b.refused_early:
        b.artifacts.append(entry)


BACKENDS: tuple[Backend, ...] = (
    Backend("onnxruntime/fp32", lambda b: True, build_ort_fp32),
    Backend("onnxruntime/int8", lambda b: b.precision == "int8", build_ort_int8),
    Backend("aoti/fp32", lambda b: b.build_aoti, build_aoti_package),
    Backend("tensorrt", lambda b: b.backend == "tensorrt", build_tensorrt),
)


def build_artifacts(b: Build) -> None:
    """Every backend `b` wants, in `BACKENDS` order; then the intermediates they shared (`b.scratch`) go."""
    for backend in BACKENDS:
        if backend.wanted(b):
            backend.build(b)
    for path in b.scratch:  # not artifacts: model.fp32.onnx / model.int8.onnx are built from them
        path.unlink()


def open_runners(b: Build) -> dict[str, Any]:
    """ "<backend>/<precision>" -> a runner of each artifact of `b`, for parity and then latency (the timed
    session is the gated one). No spinning: ORT's idle threads would otherwise busy-wait into the next
    runner's turn when timed."""
    from pfactory.optimize.runtime import open_runner

    return {
        a["backend"] + "/" + a["precision"]: open_runner(
            b.tmp / a["file"], a["backend"], a["precision"], b.ort_device, b.threads, spin=False
        )
        for a in b.artifacts
    }


def refuse_failed_engine(entry: dict[str, Any], root: Path) -> dict[str, Any]:
    """A TensorRT engine whose self-check failed on this GPU (`entry`: `build_engine`'s manifest entry, its
    "file" relative to the optimized directory `root`) is not an artifact: its plan file is deleted and its
    parity.json "refused" entry returned, {"tensorrt/<precision>": {"precision", "failures": [why],
    "passed": False, "selfcheck"}}, for `stage._fallback`. {} (the file kept) when the engine verified or its
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


def build_tensorrt_engine(
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
    from pfactory.optimize.tensorrt_backend import (
        TIMING_CACHE,
        build_engine,
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
    source = _engine_source(opt, spec, tmp, calib, sensitivity)
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


def _engine_source(
    opt: OptimizeParams, spec: Any, tmp: Path, calib: Any, sensitivity: dict[str, Any] | None
) -> Path:
    """The ONNX file TensorRT builds `spec` from: the export itself, its FP16 cast, or (TensorRT >= 11, INT8)
    its explicit INT8 QDQ quantization with the float part cast to FP16."""
    from pfactory.optimize import manifest as mf
    from pfactory.optimize.ort_backend import quantize_int8
    from pfactory.optimize.tensorrt_backend import OnnxSource, cast_onnx_fp16

    trt_dir = tmp / mf.TRT_DIR
    onnx_path = tmp / mf.ONNX_FILE
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
    return source

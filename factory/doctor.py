"""`factory doctor`: every self-check of the fast paths on this machine, as a table or JSON.

    run_checks(rerun=True) -> list[dict]   one row per (path, device): path, device, status (verified /
                                           failed / skipped), reason, figures, seconds, recorded
    table(rows) -> str                     the rows for a terminal

The checks themselves live with the code they check (kernels/selfcheck.py has the mechanism and the store):
the Triton and C kernels (`kernels.*`), DALI's GPU decode (`pfactory.prepare.camera`), the DALI GPU loader
(`pfactory.prepare.loader`), a CUDA bf16 training step (`pfactory.train.runtime`). A TensorRT engine is
checked when it is built or first opened (`pfactory.optimize.tensorrt_backend.verify_engine`); here
`tensorrt.engine.fp32` / `.fp16` build the engine of a small detector (random weights, its heads spread
as after training) at that precision and run that check on it. Each runs on the devices it applies to
that this machine has (cuda:0 when CUDA is present, the CPU); a device type this machine lacks, or a
package a path needs (TensorRT, DALI), is a skipped row saying so. Each stage's MLflow run records the
verdicts it used as its param `selfcheck` (`pfactory.tracking.runs.stage_run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ENGINE_PROBES = ("fp32", "fp16")  # the precisions `tensorrt.engine.<precision>` builds


def _load_checks() -> dict[str, Any]:
    import kernels  # noqa: F401  (registers the kernels' checks)
    import pfactory.train.runtime  # noqa: F401  (registers the CUDA bf16 step)
    from kernels import selfcheck
    from pfactory.optimize.tensorrt_backend import ENGINE_PATH
    from pfactory.prepare import camera, loader

    camera.register_selfcheck()
    loader.register_selfcheck()
    for precision in ENGINE_PROBES:
        selfcheck.register(_engine_probe(precision))
    # `tensorrt.engine` itself is the check of one engine (the last one opened in this process): its probes
    # stand for it here
    return {path: check for path, check in selfcheck.checks().items() if path != ENGINE_PATH}


def _needs() -> dict[str, Callable[[], str | None]]:
    """Per path, what it needs besides its device: a function giving why it is missing (None: present)."""
    from pfactory.optimize.tensorrt_backend import tensorrt_missing
    from pfactory.prepare.camera import dali_available

    def dali() -> str | None:
        return None if dali_available() else "NVIDIA DALI is not installed (Linux x86_64 only)"

    return {
        "dali.gpu_loader": dali,
        **{f"tensorrt.engine.{p}": tensorrt_missing for p in ENGINE_PROBES},
    }


def _engine_probe(precision: str) -> Any:
    """The check `tensorrt.engine.<precision>`: build a small detector's engine on this GPU, then its
    self-check (the engine vs ONNX Runtime FP32 on two frames of plausible inputs)."""
    from kernels import selfcheck
    from pfactory.optimize import tensorrt_backend

    def run(device: Any) -> selfcheck.Figures:
        import tempfile
        from pathlib import Path

        import torch

        from pfactory.detectors import registry
        from pfactory.detectors.contract import DataSpec
        from pfactory.detectors.params import DEFAULT_ARCH
        from pfactory.optimize.export import INPUT_NAMES, example_inputs, export_onnx
        from pfactory.optimize.params import OptimizeParams

        why = tensorrt_backend.tensorrt_missing()
        if why:
            raise selfcheck.Skip(why)
        if not torch.cuda.is_available():
            raise selfcheck.Skip("no CUDA device")
        trt = tensorrt_backend.import_tensorrt()
        torch.manual_seed(0)
        section = {"pillar_size_m": 0.4, "image_channels": 8, "point_channels": 16, "bev_channels": [16, 16, 32],
                   "up_channels": 16, "head_channels": 16, "max_detections": 20}  # fmt: skip
        data = DataSpec(("Car", "Pedestrian", "Cyclist"), (0.0, -8.0, -3.0, 16.0, 8.0, 1.0), (64, 32))
        model = registry.build(DEFAULT_ARCH, section, data).eval()
        with torch.no_grad():  # distinct peaks, as after training (fresh 1x1 output convs nearly tie everywhere)
            for m in model.modules():
                if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1):
                    torch.nn.init.normal_(m.weight, std=0.3)
        feeds = [
            dict(zip(INPUT_NAMES, (t.numpy() for t in example_inputs(model, 1, 600, 1, seed))))
            for seed in (0, 1)
        ]
        opt = OptimizeParams()
        opt = opt.model_copy(
            update={"tensorrt": opt.tensorrt.model_copy(update={"opt_points": 600, "max_points": 2048})}
        )
        with tempfile.TemporaryDirectory(prefix="pfk-trt-probe-") as tmp:
            exported = export_onnx(model, Path(tmp) / "model.onnx", cameras=1, opset=opt.opset,
                                   dynamic_batch=False, export_points=600)  # fmt: skip
            spec = tensorrt_backend.engine_spec(opt, precision, trt.__version__, exported.inputs, 1)
            source = exported.path
            if spec.onnx_source == tensorrt_backend.OnnxSource.FP16_CAST.value:
                keep = opt.tensorrt.fp16_keep_fp32_op_types
                source = tensorrt_backend.cast_onnx_fp16(source, Path(tmp) / "model.fp16.onnx", keep)
            entry = tensorrt_backend.build_engine(source, spec, Path(tmp) / "tensorrt", check_feeds=feeds)
        verdict = entry["selfcheck"]
        if verdict["status"] == selfcheck.FAILED:
            raise selfcheck.Mismatch(verdict["reason"], verdict["figures"])
        if verdict["status"] == selfcheck.SKIPPED:
            raise selfcheck.Skip(verdict["reason"])
        return verdict["figures"]

    files = [tensorrt_backend.__file__, __file__]
    return selfcheck.Check(
        f"{tensorrt_backend.ENGINE_PATH}.{precision}",
        run,
        lambda: selfcheck.sources_hash(files, tensorrt_backend._trt_version()),
        ("cuda",),
        f"a small detector's {precision} TensorRT engine, built here, vs ONNX Runtime FP32",
    )


def run_checks(rerun: bool = True) -> list[dict[str, Any]]:
    """Run (with `rerun`, else read where recorded) every check on each device type it applies to here."""
    import torch

    from kernels import selfcheck

    present = {"cpu": "cpu", **({"cuda": "cuda:0"} if torch.cuda.is_available() else {})}
    needs = _needs()
    rows = []
    for path, check in sorted(_load_checks().items()):
        missing = needs[path]() if path in needs else None
        for kind in check.device_types:
            if kind not in present or missing:
                why = "; ".join(
                    w for w in (missing, None if kind in present else f"no {kind.upper()} device here") if w
                )
                rows.append({"path": path, "device": kind, "status": selfcheck.SKIPPED, "reason": why,
                             "figures": {}, "seconds": 0.0, "recorded": ""})  # fmt: skip
                continue
            v = selfcheck.verify(path, present[kind], rerun=rerun)
            rows.append({
                "path": path, "device": v.key.get("device", present[kind]), "status": v.status, "reason": v.reason,
                "figures": v.figures, "seconds": v.seconds, "recorded": v.recorded,
            })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """path | device | status | why / figures, one line each."""
    from kernels.selfcheck import format_figures

    lines = [f"{'path':<27} {'device':<28} {'status':<9} why / figures (max |err| vs tolerance)"]
    for r in rows:
        why = r["reason"] if r["status"] != "verified" else format_figures(r["figures"])
        lines.append(f"{r['path']:<27} {r['device'][:28]:<28} {r['status']:<9} {why}")
    return "\n".join(lines)
